"""What plugs into a built Trainer: the checkpointer, what it starts from, MLflow and Dagster Pipes.

    with contextlib.ExitStack() as plugins:
        attach_plugins(trainer, config, plugins)   # every rank: checkpointer, metrics; rank 0: hooks
        trainer.train()

What a run starts from, when stage.checkpoint is on (every rank decides alike, from the folder):

    own checkpoint in run_dir/checkpoints   resume it in full (a retry), whatever the stage says
    stage.resume_from                       else: another run's checkpoint in full (restore drills)
    stage.init_from                         else: a parent's model weights only (fine-tuning); the
                                            per-rank generators are re-seeded as at a fresh start
    none of these                           step 0

Rank 0 adds the MLflow hook (stage.mlflow) and, when launched through Dagster Pipes, the Pipes
hook, which reports the run's summary (run_summary) as the asset's metadata.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ops.checkpoints import store as store
from ops.publish import objstore, paths
from ops.publish.hashing import digest_json
from ops.lineage import collect, training_code_version
from trainer.observe import prometheus, startup
from trainer.checkpointing.checkpointer import Checkpointer as DcpCheckpointer, LoadReport
from trainer.launch.config import ExperimentConfig
from trainer.faults import current_attempt
from trainer.observe.hooks import Checkpointer
from trainer.loop import Trainer
from ops.checkpoints.mirror import CheckpointMirror
from trainer.parallel import seed_everything
from trainer.observe.pipes import PipesHook, pipes_requested
from trainer.launch.redact import redacted_dict
from trainer.state import RunResult, Stateful
from trainer.observe.tracking import MlflowHook, recorded_tracking_uri

log = logging.getLogger("trainer")


def run_lineage(config: ExperimentConfig, *, as_tags: bool = True) -> dict[str, Any]:
    """The lineage fields (ops.lineage) of this run, plus its run id (the run folder's name).

    ``as_tags``: every value a string (MLflow tags, commit records); otherwise typed, as every other
    asset's Dagster metadata has them (``git_dirty`` a bool, not "false").
    """
    record = collect(manifest_version=config.data.manifest_version or "none", config=redacted_dict(config),
                     code_version=training_code_version())  # the stage assets' code_version
    fields = record.as_tags() if as_tags else record.as_metadata()
    return {**fields, "run_id": Path(config.train.run_dir).name, "stage": config.stage.stage}


class Warmup:
    """Rank 0's slow start-up work that needs nothing from the trainer, begun in a thread when the program
    starts: the run's lineage (code digests, git, installed distributions) and MLflow's import and store
    connection (about two seconds together, measured by benchmarks/first_step.py). It runs while the main
    thread imports torch, builds the model and waits at the rendezvous; attach_plugins takes its results.
    A failure here is not reported: the same work is done again where it is needed, and fails there."""

    def __init__(self, config: ExperimentConfig) -> None:
        import threading

        self._lineage: dict[str, Any] | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="trainyard-warmup", daemon=True)
        self._thread.start()

    def _run(self, config: ExperimentConfig) -> None:
        try:
            self._lineage = run_lineage(config)
            if config.stage.mlflow:
                from mlflow.tracking import MlflowClient

                from trainer.observe.tracking import resolve_tracking_uri

                # MLflow keeps one store per URI: the hook's client finds it connected.
                MlflowClient(tracking_uri=resolve_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", ""))
                             ).get_experiment_by_name(config.stage.mlflow_experiment)
        except Exception:  # noqa: BLE001 (said above: the work is done again where it is needed)
            log.debug("start-up warm-up failed; done again where needed", exc_info=True)

    def lineage(self, config: ExperimentConfig) -> dict[str, Any]:
        self._thread.join()
        return dict(self._lineage) if self._lineage is not None else run_lineage(config)


def _from_rank_0(trainer: Trainer, compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0, the same value on every rank (one broadcast). The run's lineage reads
    every code module's source and every installed distribution (about a second of CPU): one rank
    does it for all, and all of them record the same run."""
    import torch.distributed as dist

    if trainer.world.world_size <= 1 or not dist.is_initialized():
        return compute()
    box: list[Any] = [None]
    if trainer.world.is_main:
        try:
            box = [("ok", compute())]
        except Exception as error:  # the others must not wait in the broadcast for a value never sent
            box = [("error", f"{type(error).__name__}: {error}")]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise RuntimeError(f"rank 0 could not compute what every rank records: {value}")
    return value


def attach_plugins(trainer: Trainer, config: ExperimentConfig, plugins: contextlib.ExitStack, *,
                   warmup: Warmup | None = None) -> None:
    """Checkpointer (every rank), parent weights, and the rank-0 hooks: MLflow and Dagster Pipes."""
    lineage = _from_rank_0(trainer, lambda: warmup.lineage(config) if warmup is not None else run_lineage(config))
    trainer.lineage = dict(lineage)  # final.json records it: `trainyard compare` names code and data that differ
    if config.stage.checkpoint:
        start = json.loads(json.dumps(trainer.data.state_dict()))  # before any restore: the order from step 0
        index = getattr(getattr(trainer.data, "loader", None), "index", None)  # the loader read it: not again
        block = _from_rank_0(trainer, lambda: reproduction_inputs(config, sampler_at_start=start, index=index))
        trainer.checkpointer = build_checkpointer(trainer, config, lineage, reproduction=block)
    if prometheus.enabled():  # every rank its own file: <run_dir>/metrics/rank-<r>.prom
        trainer.rank_hooks.append(prometheus.PrometheusExporter(
            config.train.run_dir, stage=config.stage.stage, rank=trainer.world.rank, device=trainer.device))
    if not trainer.world.is_main:
        return
    mlflow_hook = build_mlflow_hook(trainer, config, lineage) if config.stage.mlflow else None
    if mlflow_hook is not None:
        trainer.hooks.append(mlflow_hook)
        mlflow_hook.startup = trainer.startup_clock.breakdown
        # For the launch's policy (trainer/supervisor/elastic.py): it tags this attempt's run with the run's
        # class once the attempt is over, also when this process does not live to do it.
        from ops.publish.durable import write_json_atomic

        record = Path(config.train.run_dir) / "ranks" / "mlflow.json"
        record.parent.mkdir(parents=True, exist_ok=True)
        # The store without its credentials: the policy reconnects with its own MLFLOW_TRACKING_URI.
        mlflow_hook.record_path, mlflow_hook.record = record, {
            "run_id": mlflow_hook.run_id, "tracking_uri": recorded_tracking_uri(mlflow_hook.tracking_uri)}
        write_json_atomic(record, mlflow_hook.record)
    if pipes_requested():  # launched by a Dagster asset through Pipes
        from dagster_pipes import open_dagster_pipes

        pipes = plugins.enter_context(open_dagster_pipes())
        # The Dagster process's start-up marks (request, run start, preflight, launch): the breakdown
        # in final.json then runs from the request, not from this process's start.
        marks = pipes.extras.get(startup.EXTRAS_KEY)
        if isinstance(marks, Mapping):
            trainer.startup_clock.merge(marks)
        trainer.hooks.append(PipesHook(pipes, log_every=config.train.log_every, total_steps=config.train.steps,
                                       summary=lambda result: run_summary(trainer, config, result, mlflow_hook)))


# ---------------------------------------------------------------------------------------------
# The checkpointer and what the run starts from


def reproduction_inputs(config: ExperimentConfig, *, sampler_at_start: Any, index: Any = None) -> dict[str, Any]:
    """What every checkpoint of this run records so that it can be rebuilt from its record alone
    (ops/drills/reproduce.py): the redacted config, the environment's exact freeze, the shard set by
    version with every shard's digest, the parent checkpoint's data digest, the sample order at step 0."""
    from ops.drills.reproduce import parent_record, reproduction_block, shard_set_record
    from ops.lineage import environment_pins

    stage, data = config.stage, config.data
    parent_dir, parent_run = ((stage.init_from, stage.init_from_run_id) if stage.init_from else
                              (stage.resume_from, stage.resume_run_id))
    parent = None
    if parent_dir:
        try:
            parent = parent_record(parent_dir, parent_run)
        except Exception as error:  # noqa: BLE001 - a retry resumes its own checkpoint even when the parent is gone
            parent = {"path": str(parent_dir), "run_id": parent_run, "unreadable": f"{type(error).__name__}: {error}"}
    shard_set = shard_set_record(data.shard_index, index) if data.source == "shards" and data.shard_index else None
    return reproduction_block(config=redacted_dict(config), pins=environment_pins(), shard_set=shard_set,
                              parent=parent, sampler_at_start=sampler_at_start)


def build_checkpointer(trainer: Trainer, config: ExperimentConfig, lineage: Mapping[str, Any], *,
                       reproduction: Mapping[str, Any] | None = None) -> Checkpointer:
    """The run's DCP checkpointer; wrapped to resume another run's checkpoint, or loaded with a parent's weights."""
    checkpointer = _dcp_checkpointer(trainer, config, lineage)
    checkpointer.reproduction = dict(reproduction) if reproduction is not None else None
    try:
        return _starting_point(trainer, checkpointer, config)
    except BaseException:  # e.g. a parent checkpoint that fails verification: its threads and group go too
        checkpointer.close()
        raise


def _starting_point(trainer: Trainer, checkpointer: DcpCheckpointer, config: ExperimentConfig) -> Checkpointer:
    stage = config.stage
    if checkpointer.mirror is not None:  # a new machine or a lost disk: the bucket's newest checkpoint
        checkpointer.restore_from_mirror()
    if stage.start_over:  # quarantined first, so a parent's weights still start a run whose own all failed
        checkpointer.start_over_if_none_verifies()
    if checkpointer.has_own_checkpoint():
        return checkpointer  # a retry resumes its own checkpoint, whatever the stage starts from
    if stage.resume_from:
        return ResumeFrom(checkpointer, stage.resume_from, stage.resume_run_id,
                          drop_optimizer=config.faults.drop_optimizer_state_on_restore)
    if stage.init_from:
        _init_weights_from(trainer, checkpointer, config)
    return checkpointer


def _dcp_checkpointer(trainer: Trainer, config: ExperimentConfig, lineage: Mapping[str, Any]) -> DcpCheckpointer:
    stage = config.stage
    checkpointer = DcpCheckpointer(
        config.train.run_dir, world=trainer.world, keep_last_k=stage.keep_last_k, keep_every_m=stage.keep_every_m,
        async_mode="async" if stage.async_checkpoint else "off", hmac_key=store.configured_key(), lineage=lineage,
        seed=config.train.seed, start_over=stage.start_over, model_fingerprint=model_fingerprint(config),
        numerics={"device_type": trainer.device.type, "precision": trainer.precision.policy,
                  "deterministic": trainer.deterministic},
        mirror=CheckpointMirror.for_run(Path(config.train.run_dir).name, keep_last_k=stage.keep_last_k,
                                        keep_every_m=stage.keep_every_m)
        if stage.mirror and stage.checkpoint_io == "local" else None,
        store_url=store_checkpoint_url(config) if stage.checkpoint_io == "store" else None)
    checkpointer.fault_hooks = trainer.faults
    return checkpointer


def model_fingerprint(config: ExperimentConfig) -> str:
    """What a checkpoint's weights must have been saved for: the model config and the reference clip.

    The reference clip shape, not the data's set of shapes (data.buckets): no weight depends on the
    clip shapes (sincos tables are computed per grid; learned embeddings allow the reference shape
    only), so a checkpoint serves any bucket set, and the data state guards the sample order on its
    own (bucketed layout, dataset version).
    """
    model = redacted_dict(config.model)
    if not model.get("factory"):  # the built-in model: fingerprints as before model.factory existed
        model.pop("factory", None)
    return digest_json({"model": model, "video": config.data.video_shape})


def store_checkpoint_url(config: ExperimentConfig) -> str:
    """``<checkpoint root>/<run name>`` for stage.checkpoint_io=store; ValueError naming the variable without a root."""
    root = paths.checkpoint_store_root()
    if root is None:
        raise ValueError(f"stage.checkpoint_io=store writes checkpoints to the object store, but neither "
                         f"{paths.CHECKPOINT_ROOT_VARIABLE} nor a data root URL (TRAINYARD_DATA_ROOT) names one")
    return objstore.join(root, Path(config.train.run_dir).name)


def _init_weights_from(trainer: Trainer, checkpointer: DcpCheckpointer, config: ExperimentConfig) -> None:
    """A fresh stage starts from its parent's weights only, with its own generators as at step 0."""
    stage, train = config.stage, config.train
    checkpointer.load({"model": trainer.app_state()["model"]}, checkpoint_dir=stage.init_from,
                      expected_run_id=stage.init_from_run_id)
    # Loading restored the parent's per-rank generators: seed them again, as a fresh run has them.
    seed_everything(train.seed, trainer.world.rank, deterministic=trainer.deterministic,
                    device_type=trainer.device.type)
    log.info("initialized model weights from %s (run %s)", stage.init_from, stage.init_from_run_id)


class ResumeFrom:
    """A checkpointer whose load restores another run's checkpoint in full (restore drills).

    Saves go to this run's own folder, through ``inner``; so does everything the protocol reports.
    """

    def __init__(self, inner: DcpCheckpointer, checkpoint_dir: str, run_id: str, *, drop_optimizer: bool = False) -> None:
        self.inner, self.checkpoint_dir, self.run_id = inner, checkpoint_dir, run_id
        self.drop_optimizer = drop_optimizer  # faults.drop_optimizer_state_on_restore: drills must catch it

    def load(self, app_state: Mapping[str, Stateful]) -> int | None:
        if self.drop_optimizer:
            log.warning("fault injection: restoring %s without its optimizer state", self.checkpoint_dir)
            app_state = {name: part for name, part in app_state.items() if name != "optimizer"}
        return self.inner.load(app_state, checkpoint_dir=self.checkpoint_dir, expected_run_id=self.run_id)

    def save(self, step: int, app_state: Mapping[str, Stateful]) -> None:
        self.inner.save(step, app_state)

    def wait(self) -> None:
        self.inner.wait()

    def close(self) -> None:
        self.inner.close()

    @property
    def last_record(self) -> Mapping[str, Any] | None:
        return self.inner.last_record

    @property
    def last_load(self) -> LoadReport | None:
        return self.inner.last_load

    def location(self, step: int) -> str:
        return self.inner.location(step)


# ---------------------------------------------------------------------------------------------
# Rank 0: MLflow and what a completed run reports to Dagster


def build_mlflow_hook(trainer: Trainer, config: ExperimentConfig, lineage: Mapping[str, Any]) -> MlflowHook:
    stage = config.stage
    # precision: the policy that runs on this device ("auto" resolved); precision_requested: as configured.
    tags = {**lineage, "world_size": str(trainer.world.world_size), "precision": trainer.precision.policy,
            "precision_requested": config.train.precision,
            "parallelism": config.train.parallelism, "parent_checkpoint": stage.init_from or "none",
            "dagster_run_id": stage.dagster_run_id or "none"}
    if stage.retry_of:
        tags["retry_of"] = stage.retry_of
    tags["trainyard.attempt"] = str(current_attempt())
    if config.sweep.study:  # a sweep's trial: a child of the sweep's parent run, with its sweep, params and seed
        tags |= {"trainyard.sweep": config.sweep.study, "trainyard.sweep.id": config.sweep.sweep_id,
                 "trainyard.sweep.trial": str(config.sweep.trial), "trainyard.sweep.seed": str(config.sweep.seed)}
        if config.sweep.mlflow_parent:
            tags["mlflow.parentRunId"] = config.sweep.mlflow_parent
    return MlflowHook(tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", ""),
                      experiment=stage.mlflow_experiment, run_name=f"{stage.stage}/{lineage['run_id']}",
                      params={**redacted_dict(config), "data_source": trainer.data.describe(),
                              "environment": trainer.environment or {}},
                      tags=tags, redactor=trainer.redactor, divergence_path=Path(config.train.run_dir) / "divergence.json")


def committed_step(checkpointer: Checkpointer | None, *, final_step: int, run_dir: str | Path) -> int | None:
    """The step of this run's own committed checkpoint that holds ``final_step``'s state, or None."""
    if checkpointer is None:
        return None
    if checkpointer.last_record is not None:
        return checkpointer.last_record["step"]
    loaded = checkpointer.last_load
    # A retry that resumed at its last step saves nothing: its checkpoint is the one it loaded.
    if loaded is not None and loaded.step == final_step and loaded.checkpoint_dir is not None \
            and str(loaded.checkpoint_dir) == _location(checkpointer, loaded.step, run_dir):
        return loaded.step
    return None


def _location(checkpointer: Checkpointer, step: int, run_dir: str | Path) -> str:
    """Where the run's checkpoint of ``step`` lives: the store (stage.checkpoint_io=store) or its folder."""
    if hasattr(checkpointer, "location"):
        return checkpointer.location(step)
    return str(store.checkpoints_dir(run_dir) / store.step_dir_name(step))  # a checkpointer of the protocol only


def run_summary(trainer: Trainer, config: ExperimentConfig, result: RunResult,
                mlflow_hook: MlflowHook | None) -> dict[str, Any]:
    """What a completed run reports back to Dagster (scalars only)."""
    run_dir = config.train.run_dir
    final = json.loads((Path(run_dir) / "final.json").read_text())
    step = committed_step(trainer.checkpointer, final_step=result.final_step, run_dir=run_dir)
    committed = _location(trainer.checkpointer, step, run_dir) if step is not None else None
    return {**run_lineage(config, as_tags=False), "status": result.status, "final_step": result.final_step,
            "final_loss": result.losses[-1] if result.losses else None,
            "first_loss": result.losses[0] if result.losses else None,
            "num_skipped_steps": result.num_skipped_steps, "run_dir": run_dir,
            "checkpoint": str(committed) if committed else None,
            "checkpoint_step": step, "mlflow_run_id": mlflow_hook.run_id if mlflow_hook else None,
            "world_size": trainer.world.world_size, "precision": trainer.precision.policy,
            "precision_requested": config.train.precision, "failure_class": final["failure_class"],
            **{f"kernels/{name}": value for name, value in final["kernels"].items() if value is not None},
            "batching": final["data"]["batching"], "clip_shapes": ",".join(final["data"]["clip_shapes_trained"]),
            "data_version": f"{Path(run_dir).name}-step{result.final_step}", **_performance_metadata(final),
            **_evaluation_metadata(final), **startup.flat_metadata(final.get("startup") or {}),
            **{f"env/{name}": value for name, value in (final.get("environment") or {}).items() if value is not None}}


def _evaluation_metadata(final: Mapping[str, Any]) -> dict[str, Any]:
    """The last validation loss and the end-of-run samples, as flat scalars (none without evaluation)."""
    metadata: dict[str, Any] = {}
    measured = [item for item in final.get("evaluations") or [] if item.get("status") == "ok"]
    if measured:
        last = measured[-1]
        metadata |= {f"{last['split']}/loss": last["loss"], f"{last['split']}/loss_step": last["step"],
                     f"{last['split']}/num_samples": last["num_samples"]}
    elif final.get("evaluations"):
        last = final["evaluations"][-1]
        metadata |= {"eval/status": last.get("status"), "eval/reason": last.get("reason")}
    generated = final.get("generated") or {}
    if generated.get("dir"):
        metadata |= {"samples/dir": generated["dir"], "samples/status": generated.get("status")}
        if generated.get("contact_sheet"):
            metadata["samples/contact_sheet"] = str(Path(generated["dir"]) / generated["contact_sheet"])
    return metadata


def _performance_metadata(final: Mapping[str, Any]) -> dict[str, Any]:
    """final.json's performance summary as flat scalars: perf/<key>, perf/phase_medians_s/<phase>, ..."""
    performance = {}
    for key, value in final.get("performance", {}).items():
        if isinstance(value, Mapping):
            performance |= {f"perf/{key}/{name}": item for name, item in value.items()
                            if isinstance(item, (int, float, str, bool))}
        elif isinstance(value, (int, float, str, bool)):
            performance[f"perf/{key}"] = value
    return performance
