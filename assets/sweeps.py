"""Sweep assets: ``sweep_trial`` (one dynamic partition per trial) and ``sweep_report`` (one per sweep).

A sweep (trainer/launch/sweep.py, docs/training.md "Sweeps") is registered by ``trainyard sweep run``
(pipelines/sweeps.py): its study in Optuna's RDB storage holds the planned trials in order, their ids
are added as ``sweep_trials`` partitions and its name as a ``sweeps`` partition, and the ``sweep`` pool's
limit is set to the sweep's concurrency. Each trial partition is launched through the same stage launch,
launcher resource and checks as pretrain, with the trial's parameters and the sweep section (its study,
its number, the early-stopping rule: trainer/pruning.py). Dagster enforces the concurrency: every trial
step holds a slot of the ``sweep`` pool while it trains, and a step without a slot waits for one, however
the runs were started (``sweep run``, a backfill from the UI, the daemon's queue in the team deployment).

A trial's step tells the study its outcome: the objective (validation loss at the objective's step) of a
completed trial, PRUNED for one the rule stopped (its decision is on the materialization), and for a
failed launch the run's class in the trial's ``attempts``. A trial the study already holds as finished
is not launched again: its recorded result is reported. One trial trains in one process at a time
(a lock under the Trainyard home): a second launch of a running trial is refused, naming the holder.
"""

import base64
import contextlib
import fcntl
import json
import os
from pathlib import Path

import dagster as dg

from assets.checkpoint_checks import CHECKPOINT_CHECKS, checkpoint_checks
from assets.inputs import SHARD_INDEX_IN
from assets.metadata import lineage_metadata, markdown_table
from assets.stage_runs import (
    TRAINING_CODE_VERSION, StageRunConfig, launch_stage, only_requeues_retry, stage_launch, stage_result)
from assets.training import PRETRAIN_DEFAULTS
from ops.clips.shard_ref import ShardIndexRef
from ops.drills import reports
from ops.publish import paths
from ops.publish.hashing import digest_json
from resources import LineageResource, StorageResource
from resources.launcher import TorchrunLauncher

GROUP = "sweeps"
SWEEP_POOL = "sweep"
"""Every trial step holds one slot of this pool; pipelines/sweeps.py sets its limit to the sweep's concurrency."""
SWEEP_TRIALS = dg.DynamicPartitionsDefinition(name="sweep_trials")
SWEEPS = dg.DynamicPartitionsDefinition(name="sweeps")
MAX_INLINE_PLOT_BYTES = 512 * 1024


def locks_dir(name: str) -> Path:
    folder = paths.trainyard_home() / "sweeps" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def held_lock(path: Path, what: str):
    """An exclusive, non-blocking flock on ``path`` (the holder's pid written in it) for the block; a lock
    another process holds is refused, naming it. The kernel drops it when the holder dies, however it dies."""
    handle = open(path, "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise LockHeld(f"{what} is running in another process ({holder}); it is not started twice") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


class LockHeld(RuntimeError):
    pass


def lock_is_held(path: Path) -> bool:
    if not path.exists():
        return False
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def trial_lock_path(trial_id: str) -> Path:
    from trainer.launch.sweep import parse_trial_id

    return locks_dir(parse_trial_id(trial_id)[0]) / f"{trial_id}.lock"


def load_registered(name: str):
    """(spec, study) of a registered sweep: the file its study was declared from, checked against it."""
    import optuna

    from trainer.launch.refusal import Refusal
    from trainer.launch.sweep import load_sweep, open_study, study_storage_url

    url = study_storage_url()
    try:
        declared = optuna.load_study(study_name=name, storage=url)
    except KeyError:
        raise dg.Failure(f"sweep {name!r} is not registered in the study storage; run `trainyard sweep run "
                         f"configs/sweeps/{name}.yaml`", allow_retries=False) from None
    try:
        spec = load_sweep(declared.user_attrs["sweep_file"])
        return spec, open_study(spec, url)
    except Refusal as refusal:
        raise dg.Failure(f"sweep {name}: {refusal.cli_line()}", allow_retries=False,
                         metadata=refusal.metadata()) from None


def _set_attr(study, number: int, key: str, value) -> None:
    storage = study._storage  # noqa: SLF001 (Optuna's public Study has no per-trial attribute setter by number)
    storage.set_trial_user_attr(storage.get_trial_id_from_study_id_trial_number(study._study_id, number), key, value)  # noqa: SLF001


def _start(study, number: int) -> None:
    from optuna.trial import TrialState

    storage = study._storage  # noqa: SLF001
    trial_id = storage.get_trial_id_from_study_id_trial_number(study._study_id, number)  # noqa: SLF001
    storage.set_trial_state_values(trial_id, TrialState.RUNNING)


@dg.asset(group_name=GROUP, pool=SWEEP_POOL, partitions_def=SWEEP_TRIALS, kinds={"torch", "optuna"},
          code_version=TRAINING_CODE_VERSION, ins={"shard_index": SHARD_INDEX_IN},
          check_specs=[dg.AssetCheckSpec(name, asset="sweep_trial", blocking=True) for name in CHECKPOINT_CHECKS],
          description="One trial of a declared sweep (configs/sweeps/): a stage launch with the trial's parameters, "
                      "reporting to the sweep's Optuna study and stopped early by its stated rule.")
def sweep_trial(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict,
                storage: StorageResource, launcher: TorchrunLauncher):
    """The trial's materialization, then pretrain's blocking checks on the checkpoint it committed (a pruned
    trial's too: the step it stopped at)."""
    result = _trial(context, shard_index, storage, launcher)
    yield result
    yield from checkpoint_checks("sweep_trial", result.metadata)


def _trial(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict, storage: StorageResource,
           launcher: TorchrunLauncher) -> dg.MaterializeResult:
    from optuna.trial import TrialState

    from trainer.launch.sweep import Trial, objective_value, parse_trial_id, study_storage_url, trial_overrides

    trial_id = context.partition_key
    try:
        name, number = parse_trial_id(trial_id)
    except ValueError as error:
        raise dg.Failure(str(error), allow_retries=False) from None
    spec, study = load_registered(name)
    frozen = {t.number: t for t in study.get_trials(deepcopy=False)}.get(number)
    if frozen is None:
        raise dg.Failure(f"trial {trial_id} is not in study {name} (budget {spec.budget})", allow_retries=False)
    sweep_lineage = {"sweep": name, "sweep_id": spec.digest, "sampler": spec.sampler, "sampler_seed": spec.seed,
                     "trial_id": trial_id, "trial_number": number,
                     "params": dg.MetadataValue.json(frozen.user_attrs.get("params", {}))}
    if frozen.state in (TrialState.COMPLETE, TrialState.PRUNED):  # finished: reported, never trained twice
        result = frozen.user_attrs.get("result", {})
        context.log.info(f"{trial_id}: already {frozen.state.name.lower()} in study {name}; not launched again")
        return dg.MaterializeResult(metadata={**sweep_lineage, "state": frozen.state.name.lower(),
                                              "objective": frozen.value if frozen.value is not None else "none",
                                              "relaunched": False, **_result_metadata(result)})
    if frozen.state == TrialState.FAIL:
        raise dg.Failure(f"{trial_id} failed ({frozen.user_attrs.get('failure_class', 'unknown')}) and the sweep went "
                         "on without it: the study keeps it failed", allow_retries=False)
    try:
        with held_lock(trial_lock_path(trial_id), f"trial {trial_id}"):
            if frozen.state == TrialState.WAITING:
                _start(study, number)
            _set_attr(study, number, "dagster_run_id", context.run.run_id)
            trial = Trial(number=number, trial_id=trial_id, params=frozen.user_attrs["params"])
            parent = study.user_attrs.get("mlflow_parent_run", "")
            run = StageRunConfig(config_path=spec.base, steps=spec.steps, nproc=spec.world_size,
                                 overrides=trial_overrides(spec, trial, storage_url=study_storage_url(),
                                                           mlflow_parent=parent))
            with only_requeues_retry():
                launch = stage_launch(spec.stage, run, ShardIndexRef.of(shard_index), launcher,
                                      defaults=PRETRAIN_DEFAULTS, storage=storage, log=context.log.warning)
                _refuse_if_ranks_run(study, number, trial_id, launch, storage)
                try:
                    named, invocation = launch_stage(context, launch, storage=storage, launcher=launcher)
                except Exception as error:  # a failed run (its class), or a launch that never started ("error")
                    _record_attempt(study, number, context, error)
                    raise
            result = stage_result(named, invocation)
            final = json.loads((Path(named.run_dir) / "final.json").read_text())
            outcome = _tell(study, spec, number, final, result.metadata, objective_value(spec, final))
    except LockHeld as held:
        raise dg.Failure(str(held), allow_retries=False) from None
    context.log.info(f"{trial_id}: {outcome['state']}" + (f", objective {outcome['objective']:.6f}"
                                                         if outcome["objective"] is not None else ""))
    metadata = {**result.metadata, **sweep_lineage, "state": outcome["state"],
                "objective": outcome["objective"] if outcome["objective"] is not None else "none", "relaunched": True}
    if final.get("pruning"):
        from trainer.launch.pruning import describe

        metadata |= {"pruning": dg.MetadataValue.json(final["pruning"]), "pruned": describe(final["pruning"])}
    return dg.MaterializeResult(metadata=metadata, data_version=result.data_version)


def ranks_lock(run_dir: str | Path) -> Path:
    """trainer.train.hold_ranks_lock's file: every rank of a launch holds it shared while it lives."""
    return Path(run_dir) / "launch" / "ranks.lock"


def _refuse_if_ranks_run(study, number: int, trial_id: str, launch, storage: StorageResource) -> None:
    """The trial's run folder (kept in the study, where the driver looks too) must have no rank of an earlier
    launch still training: its Dagster process may have died and left them (each rank is in a session of its
    own). A second trainer in the folder is never started beside them."""
    from trainer.launch.config import load_config
    from trainer.launch.run_identity import run_dir_for

    try:
        run_dir = run_dir_for(storage.data, launch.stage, load_config(launch.config_path, launch.overrides()))
    except Exception:  # noqa: BLE001 (a config the launch refuses: launch_stage names it)
        return
    _set_attr(study, number, "run_dir", str(run_dir))
    if lock_is_held(ranks_lock(run_dir)):
        raise LockHeld(f"ranks of an earlier launch of trial {trial_id} still train in {run_dir}; it is not "
                       "started twice (wait for them, or stop them)")


def _curve(final: dict) -> list[list[float]]:
    """[consumed samples, step, validation loss] per evaluation (consumed samples from the step log)."""
    consumed = {int(row[0]): int(row[1]) for row in final.get("step_log") or []}
    return [[consumed.get(int(item["step"]), 0), int(item["step"]), float(item["loss"])]
            for item in final.get("evaluations") or [] if item.get("status") == "ok"]


def _tell(study, spec, number: int, final: dict, metadata: dict, value: float | None) -> dict:
    """Tell the study how the trial ended; what the report reads back (user attribute ``result``)."""
    from optuna.trial import TrialState

    def plain(key):
        item = metadata.get(key)
        return getattr(item, "value", item)

    result = {"status": final["status"], "run_id": plain("run_id"), "run_dir": plain("run_dir"),
              "checkpoint": plain("checkpoint"), "checkpoint_step": plain("checkpoint_step"),
              "mlflow_run_id": plain("mlflow_run_id"), "final_step": final.get("final_step"), "curve": _curve(final)}
    _set_attr(study, number, "result", result)
    if final["status"] == "pruned":
        study.tell(number, state=TrialState.PRUNED)
        return {"state": "pruned", "objective": None}
    if value is None:  # completed without the objective's evaluation: a failed measurement, said so
        _set_attr(study, number, "failure_class", "no_objective")
        study.tell(number, state=TrialState.FAIL)
        return {"state": "fail", "objective": None}
    study.tell(number, value)
    return {"state": "complete", "objective": value}


def _record_attempt(study, number: int, context: dg.AssetExecutionContext, error: Exception) -> None:
    """A failed launch's class in the trial's attempts: pipelines/sweeps.py retries or gives up on it. A launch
    that failed before its run (a missing manifest, a refused config) is ``error`` or ``config_error``."""
    from trainer.launch.redact import redact_uri

    item = getattr(error, "metadata", {}).get("failure_class") if isinstance(error, dg.Failure) else None
    failure_class = str(getattr(item, "value", item) or ("config_error" if "refused" in str(error) else "error"))
    description = error.description if isinstance(error, dg.Failure) else f"{type(error).__name__}: {error}"
    attempts = [*{t.number: t for t in study.get_trials(deepcopy=False)}[number].user_attrs.get("attempts", []),
                {"dagster_run_id": context.run.run_id, "failure_class": failure_class,
                 "description": redact_uri(description or "")[:500]}]
    _set_attr(study, number, "attempts", attempts)
    _set_attr(study, number, "failure_class", failure_class)


def _result_metadata(result: dict) -> dict:
    return {key: result[key] for key in ("run_id", "run_dir", "checkpoint", "checkpoint_step", "mlflow_run_id")
            if result.get(key) is not None}


@dg.asset(group_name=GROUP, partitions_def=SWEEPS, kinds={"optuna"},
          deps=[dg.AssetDep("sweep_trial", partition_mapping=dg.AllPartitionMapping())],
          description="A sweep's trials side by side: objective and validation loss against consumed samples, the "
                      "pruned ones marked with their rule's decision, the best trial and its config diff.")
def sweep_report(context: dg.AssetExecutionContext, storage: StorageResource,
                 lineage: LineageResource) -> dg.MaterializeResult:
    from trainer.launch.sweep import sweep_report as build

    name = context.partition_key
    spec, study = load_registered(name)
    report = build(spec, study)
    version = digest_json(report)[:16]
    png = reports.plot_sweep(report) if any(row["curve"] for row in report["trials"]) else None
    path = reports.write_report(storage.data / "reports" / "sweeps" / name / version, report, png)
    rows = [{"trial": row["trial_id"], "state": row["state"],
             "objective": f"{row['objective']:.6f}" if row["objective"] is not None else "",
             "params": ", ".join(f"{k}={v}" for k, v in row["params"].items()),
             "stopped": (f"step {row['pruning']['step']}: {row['pruning']['value']:.4f} vs median "
                         f"{row['pruning']['completed_median']:.4f}" if row["pruning"] and
                         row["pruning"].get("completed_median") is not None else
                         f"step {row['pruning']['step']}" if row["pruning"] else ""),
             "run": row["run_id"] or ""} for row in report["trials"]]
    metadata = {"status": report["status"], "report_path": str(path), "report_version": version,
                "sweep_id": spec.digest, "sampler": spec.sampler, "sampler_seed": spec.seed,
                **{f"num_{state}": count for state, count in report["counts"].items()},
                "table": markdown_table(rows, ["trial", "state", "objective", "params", "stopped", "run"])}
    if png is not None and len(png) <= MAX_INLINE_PLOT_BYTES:
        metadata["plot"] = dg.MetadataValue.md(f"![sweep {name}](data:image/png;base64,{base64.b64encode(png).decode()})")
    if report["best"]:
        best = report["best"]
        metadata |= {"best_trial": best["trial_id"], "best_objective": best["objective"],
                     "best_checkpoint": best["checkpoint"] or "none",
                     "best_config_diff": dg.MetadataValue.json(best["config_diff"])}
    else:
        metadata["empty_reason"] = report["empty_reason"]
    record = lineage.collect(manifest_version="none", config={"sweep": name, "sweep_id": spec.digest},
                             code_version=TRAINING_CODE_VERSION)
    return dg.MaterializeResult(metadata={**metadata, **lineage_metadata(record)}, data_version=dg.DataVersion(version))


sweep_assets = [sweep_trial, sweep_report]
