"""Training assets: step_profile -> pretrain -> finetune, and restore_drill.

Each stage resolves and checks its experiment config in this process (a bad config, a missing
manifest version or an over-budget batch is refused before any process starts), writes a
launch manifest, and launches the trainer through the launcher resource (torchrun) with
Dagster Pipes: logs stream back, and the completed run reports its figures, lineage,
committed checkpoint and MLflow run as this asset's metadata. A stage run's folder is named by
its config and data, so a retry of the same run resumes its own checkpoint and is tagged
``retry_of`` in MLflow, while a new config is a new run.

Secrets never reach a record: a secret field (trainer/redact.py, e.g. ``data.storage_token``) gets
its value only from the environment, through ``secrets: {data.storage_token: {env: MY_TOKEN}}``
(``dg.EnvVar("MY_TOKEN")`` in Python) or an override ``data.storage_token=${env:MY_TOKEN}``. Both
reach the trainer as that ``${env:...}`` reference, which it resolves in its own environment. A
literal value is refused while Dagster processes the run config, before it stores the run, so
the literal lands in no run storage, launch manifest, log or MLflow run.
"""

import json
from pathlib import Path

import dagster as dg

from assets.metadata import lineage_metadata
from ops import checkpoint_store, drill
from ops import manifest as manifest_ops
from ops import shards as shards_ops
from ops.hashing import digest_json
from ops.lineage import TRAINING_CODE_MODULES, source_digest
from ops.paths import REPO_ROOT
from ops.storage import write_file_atomic
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher

GROUP = "training"
CHECKPOINT_CHECKS = ("checkpoint_committed", "checkpoint_integrity")
# The same digest the trainer records as each run's code_version (ops.lineage).
TRAINING_CODE_VERSION = source_digest(*TRAINING_CODE_MODULES)


class StageRunConfig(dg.Config):
    """Which experiment to run and how long; the data comes from the shard_index asset."""

    config_path: str = "configs/demo.yaml"
    """Experiment YAML, relative to the repository root (see trainer/config.py)."""
    steps: int = 20
    nproc: int = 0
    """Ranks to start; 0 means the launcher's default."""
    overrides: list[str] = []
    """Extra "a.b=c" overrides applied last; a secret field only as "a.b=${env:NAME}"."""
    secrets: dict[str, str] = {}
    """Secret field -> the environment variable that holds its value: dg.EnvVar("NAME") in Python,
    {env: NAME} in run config. A literal value is refused."""


class _StageOverride(dg.ScalarUnion):
    """A run config override: "a.b=c", or {env: NAME} holding one. A literal secret value is refused
    while Dagster processes the run config, before the run (and its config) is stored."""

    def __init__(self) -> None:
        super().__init__(scalar_type=str, non_scalar_schema=dg.Selector({"env": str}), _key="TrainyardStageOverride")

    def post_process(self, value):
        from trainer.config import check_no_literal_secrets

        if isinstance(value, dict):
            value = _environment_value(value["env"])
        # A plain ValueError, not Dagster's PostProcessingError: that one's message repeats the value.
        check_no_literal_secrets([value], where="run config overrides")
        return value


class _SecretFromEnv(dg.ScalarUnion):
    """A secret field's value in run config: only {env: NAME}; processed to NAME, which the trainer
    resolves in its own environment (the value itself never enters a record)."""

    def __init__(self) -> None:
        super().__init__(scalar_type=str, non_scalar_schema=dg.Selector({"env": str}), _key="TrainyardSecretFromEnv")

    def post_process(self, value):
        from trainer.config import LiteralSecretError, env_reference

        if not isinstance(value, dict):
            raise LiteralSecretError(
                "run config secrets: a secret was given as a literal value, which Dagster would store in clear "
                "text with the run. Give the name of an environment variable that holds it: "
                "`secrets: {data.storage_token: {env: MY_TOKEN}}` in run config, "
                "StageRunConfig(secrets={'data.storage_token': dg.EnvVar('MY_TOKEN')}) in Python; export MY_TOKEN "
                "where Dagster and the trainer run.")
        env_reference(value["env"])  # a valid name, or a ValueError that does not repeat it
        return value["env"]


def _environment_value(name: str) -> str:
    import os

    if name not in os.environ:
        raise ValueError(f"run config reads environment variable {name}, which is not set")
    return os.environ[name]


def _stage_config_schema() -> dict[str, dg.Field]:
    """StageRunConfig's fields, with overrides and secrets checked for literal secrets."""
    fields = dict(StageRunConfig.to_fields_dict())
    fields["overrides"] = dg.Field([_StageOverride()], default_value=[], is_required=False,
                                   description='Extra "a.b=c" overrides applied last; a secret field only as '
                                               '"a.b=${env:NAME}"')
    fields["secrets"] = dg.Field({str: _SecretFromEnv()}, default_value={}, is_required=False,
                                 description="Secret field -> {env: NAME} (dg.EnvVar): the variable that holds it")
    return fields


STAGE_CONFIG_SCHEMA = _stage_config_schema()


def stage_config(context: dg.AssetExecutionContext) -> StageRunConfig:
    return StageRunConfig(**context.op_execution_context.op_config)


def _secret_overrides(run: StageRunConfig) -> list[str]:
    """run.secrets as "field=${env:NAME}" overrides; refuses a field that is not secret."""
    from trainer.config import env_reference, secret_field_paths

    known = secret_field_paths()
    unknown = sorted(set(run.secrets) - known)
    if unknown:
        raise ValueError(f"secrets: {', '.join(unknown)} is not a secret field (secret fields: {', '.join(sorted(known))}); "
                         f"give other fields in overrides")
    return [f"{path}={env_reference(name)}" for path, name in sorted(run.secrets.items())]


def _resolve(config_path: str, overrides: list[str]):
    from trainer.config import load_config

    path = Path(config_path) if Path(config_path).is_absolute() else REPO_ROOT / config_path
    return path, load_config(path, overrides)


def _previous_attempt(run_id: str, tracking_uri: str, experiment_name: str) -> str | None:
    """MLflow id of the latest earlier attempt of this stage run, if any."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    if experiment is None:
        return None
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.run_id = '{run_id}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def _bucket_overrides(shard_index: dict) -> list[str]:
    """``data.buckets`` from a multi-shape shard index, as the shard path and manifest come from it.

    The index is the truth about which clip shapes exist; the trainer checks the config against it
    anyway, and a user's own ``data.buckets`` override (applied later) still wins.
    """
    shapes = shards_ops.read_index_info(shard_index["path"]).bucket_shapes
    if len(shapes) < 2:
        return []
    buckets = [[shape.num_frames, shape.height, shape.width] for shape in shapes.values()]
    return [f"data.buckets={json.dumps(buckets)}"]


def launch_stage(context: dg.AssetExecutionContext, *, stage: str, run: StageRunConfig, shard_index: dict,
                 storage: StorageResource, launcher: LocalTorchrunLauncher, extra: list[str],
                 report: bool = True, run_dir: Path | None = None, nproc: int | None = None) -> dict:
    """Check, record and launch one stage run; returns its launch manifest."""
    from trainer.config import check_no_literal_secrets, preflight
    from trainer.redact import Redactor, redacted_dict

    # Also here: a StageRunConfig built in Python, or a replayed launch, skips the run config schema.
    check_no_literal_secrets([*extra, *run.overrides], where=f"{stage} overrides")
    manifest_ops.read_manifest(shard_index["manifest_version"], storage.data)  # ManifestNotFound if absent
    nproc = nproc or run.nproc or launcher.nproc_per_node
    overrides = ["data.source=shards", f"data.shard_index={shard_index['path']}",
                 f"data.manifest_version={shard_index['manifest_version']}", *_bucket_overrides(shard_index),
                 f"train.steps={run.steps}", "stage.checkpoint=true", f"stage.stage={stage}", *extra, *run.overrides,
                 *_secret_overrides(run)]
    _, resolved = _resolve(run.config_path, overrides)
    preflight(resolved, world_size=nproc)  # batch division, precision, memory budget: before launch
    identity = {key: value for key, value in redacted_dict(resolved).items() if key != "train"}
    identity["train"] = {k: v for k, v in redacted_dict(resolved)["train"].items() if k != "run_dir"}
    run_dir = run_dir or storage.data / "runs" / f"{stage}-{digest_json(identity)[:12]}"
    overrides += [f"train.run_dir={run_dir}", f"stage.dagster_run_id={context.run.run_id}"]
    # The store the trainer logs to (the launcher's), not this process's default.
    retry_of = (_previous_attempt(run_dir.name, launcher.tracking_uri, resolved.stage.mlflow_experiment)
                if resolved.stage.mlflow else None)
    if retry_of:
        overrides.append(f"stage.retry_of={retry_of}")
    config_file, resolved = _resolve(run.config_path, overrides)
    redactor = Redactor.for_config(resolved)  # the secrets' values, resolved here only to be scrubbed
    launch = {"stage": stage, "run_id": run_dir.name, "run_dir": str(run_dir), "world_size": nproc,
              "precision": resolved.train.precision, "seed": resolved.train.seed, "retry_of": retry_of,
              "manifest_version": shard_index["manifest_version"], "shard_index_version": shard_index["version"],
              "config_path": str(config_file), "overrides": overrides, "config": redacted_dict(resolved),
              "dagster_run_id": context.run.run_id}
    record = json.dumps(redactor.value(launch), indent=2, sort_keys=True, default=str).encode()
    write_file_atomic(run_dir / "launch" / f"{context.run.run_id}.json", record)
    write_file_atomic(run_dir / "launch.json", record)
    context.log.info(f"{stage}: run {run_dir.name} on {nproc} rank(s){f', retry of {retry_of}' if retry_of else ''}; "
                     f"overrides {redactor.value(overrides)}")
    launch["invocation"] = launcher.launch(context, config_path=config_file, overrides=overrides, nproc=nproc,
                                           extras={"report_materialization": report}, record_dir=run_dir / "launch")
    return launch


def _result(launch: dict) -> dg.MaterializeResult:
    result = launch["invocation"].get_materialize_result()
    extra = {"launch_manifest": str(Path(launch["run_dir"]) / "launch.json"), "retry_of": launch["retry_of"] or "none",
             "shard_index_version": launch["shard_index_version"]}
    return dg.MaterializeResult(metadata={**result.metadata, **extra}, data_version=result.data_version)


@dg.asset(group_name=GROUP, deps=["loader_benchmark"], kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA,
          description="Single-device performance baseline: phase times, throughput, bound verdict, profiler trace.")
def step_profile(context: dg.AssetExecutionContext, shard_index: dict,
                 storage: StorageResource, launcher: LocalTorchrunLauncher) -> dg.MaterializeResult:
    config = stage_config(context)
    run = StageRunConfig(config_path=config.config_path, steps=min(config.steps, 12), nproc=1,
                         overrides=config.overrides, secrets=config.secrets)
    launch = launch_stage(context, stage="step_profile", run=run, shard_index=shard_index, storage=storage,
                          launcher=launcher, nproc=1,
                          extra=["train.parallelism=none", "train.profile=true", "stage.checkpoint=false",
                                 "stage.mlflow=true"])
    return _result(launch)


@dg.asset(group_name=GROUP, deps=["step_profile"], kinds={"torch", "mlflow"}, code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA,
          check_specs=[dg.AssetCheckSpec(name, asset="pretrain", blocking=True) for name in CHECKPOINT_CHECKS],
          description="Distributed pretraining under torchrun (DDP/FSDP), committed DCP checkpoints, MLflow run.")
def pretrain(context: dg.AssetExecutionContext, shard_index: dict,
             storage: StorageResource, launcher: LocalTorchrunLauncher):
    config = stage_config(context)
    launch = launch_stage(context, stage="pretrain", run=config, shard_index=shard_index, storage=storage,
                          launcher=launcher, extra=["stage.mlflow=true"])
    result = _result(launch)
    yield result
    yield from checkpoint_checks("pretrain", result.metadata)


def _metadata_value(metadata: dict, key: str):
    value = metadata.get(key)
    return getattr(value, "value", value)


def checkpoint_checks(asset: str, metadata: dict):
    """The two blocking checks of a training stage, on the checkpoint it reported."""
    checkpoint = _metadata_value(metadata, "checkpoint")
    run_dir, run_id = _metadata_value(metadata, "run_dir"), _metadata_value(metadata, "run_id")
    if not checkpoint:
        for name in CHECKPOINT_CHECKS:
            yield dg.AssetCheckResult(asset_key=asset, check_name=name, passed=False,
                                      metadata={"reason": "the run reported no committed checkpoint"})
        return
    infos = {info.path.name: info for info in checkpoint_store.list_checkpoints(run_dir)}
    info = infos.get(Path(checkpoint).name)
    latest = checkpoint_store.read_latest(run_dir)
    committed = info is not None and info.status == "committed"
    yield dg.AssetCheckResult(
        asset_key=asset, check_name="checkpoint_committed", passed=committed and latest is not None,
        metadata={"checkpoint": checkpoint, "status": info.status if info else "missing",
                  "latest": latest or "none", "num_incomplete": sum(i.status == "incomplete" for i in infos.values())})
    report = checkpoint_store.verify(checkpoint, checkpoint_store.hmac_key_from_env(), expected_run_id=run_id)
    yield dg.AssetCheckResult(
        asset_key=asset, check_name="checkpoint_integrity", passed=report.ok,
        metadata={"checkpoint": checkpoint, "num_files": len((report.record or {}).get("files", {})),
                  "problems": "; ".join(f"{file}: {problem}" for file, problem in report.problems) or "none"})


def _latest_metadata(context: dg.AssetExecutionContext, asset: str) -> dict:
    event = context.instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None:
        raise dg.Failure(f"{asset} has never been materialized")
    return {key: getattr(value, "value", value) for key, value in event.asset_materialization.metadata.items()}


@dg.asset(group_name=GROUP, deps=["pretrain"], kinds={"torch", "mlflow"}, code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA,
          check_specs=[dg.AssetCheckSpec(name, asset="finetune", blocking=True) for name in CHECKPOINT_CHECKS],
          description="Next stage: starts from pretrain's verified committed checkpoint (weights), trains further.")
def finetune(context: dg.AssetExecutionContext, shard_index: dict,
             storage: StorageResource, launcher: LocalTorchrunLauncher):
    config = stage_config(context)
    parent = _latest_metadata(context, "pretrain")
    if not parent.get("checkpoint"):
        raise dg.Failure("pretrain's latest materialization reports no committed checkpoint to start from")
    report = checkpoint_store.verify(parent["checkpoint"], checkpoint_store.hmac_key_from_env(),
                                     expected_run_id=parent["run_id"])
    if not report.ok:  # never start a stage from a checkpoint that fails integrity
        raise dg.Failure(f"pretrain checkpoint {parent['checkpoint']} failed verification: {report.problems}")
    launch = launch_stage(context, stage="finetune", run=config, shard_index=shard_index, storage=storage,
                          launcher=launcher, extra=["stage.mlflow=true", "optim.lr=3e-4", "optim.warmup_steps=0",
                                                    f"stage.init_from={parent['checkpoint']}",
                                                    f"stage.init_from_run_id={parent['run_id']}"])
    result = _result(launch)
    yield dg.MaterializeResult(metadata={**result.metadata, "parent_checkpoint": parent["checkpoint"]},
                               data_version=result.data_version)
    yield from checkpoint_checks("finetune", result.metadata)


class DrillConfig(dg.Config):
    extra_steps: int = 6
    """Steps trained after the restore in each continuation."""
    other_world_size: int = 1
    """World size of the resharded restore (the reference uses the saved world size)."""


@dg.asset(group_name=GROUP, deps=["pretrain"], kinds={"torch"},
          check_specs=[dg.AssetCheckSpec("drill_passed", asset="restore_drill", blocking=True)],
          description="Restores pretrain's newest committed checkpoint at another world size, trains on and compares.")
def restore_drill(context: dg.AssetExecutionContext, config: DrillConfig,
                  storage: StorageResource, launcher: LocalTorchrunLauncher):
    parent = _latest_metadata(context, "pretrain")
    run_dir = Path(parent["run_dir"])
    committed = [info for info in checkpoint_store.list_checkpoints(run_dir) if info.status == "committed"]
    if not committed:
        raise dg.Failure(f"{run_dir} has no committed checkpoint to drill")
    newest = committed[-1]
    report = checkpoint_store.verify(newest.path, checkpoint_store.hmac_key_from_env(), expected_run_id=parent["run_id"])
    outcome: dict = {"checkpoint": str(newest.path), "checkpoint_step": newest.step}
    if not report.ok:
        outcome |= {"passed": False, "reason": "checkpoint failed verification: "
                    + "; ".join(f"{file}: {problem}" for file, problem in report.problems)}
    else:
        outcome |= _drill(context, config, parent, newest, report.record, storage, launcher)
    if outcome["passed"]:
        checkpoint_store.pin_known_good(run_dir, newest.step, {**outcome, "dagster_run_id": context.run.run_id})
    context.log.info(f"restore drill {'PASSED' if outcome['passed'] else 'FAILED'}: {outcome.get('reason')}")
    yield dg.MaterializeResult(metadata=outcome, data_version=dg.DataVersion(digest_json(outcome)[:20]))
    yield dg.AssetCheckResult(check_name="drill_passed", passed=bool(outcome["passed"]),
                              metadata={"reason": outcome.get("reason", "none")})


def _drill(context, config: DrillConfig, parent: dict, newest, record: dict,
           storage: StorageResource, launcher: LocalTorchrunLauncher) -> dict:
    original = json.loads((Path(parent["run_dir"]) / "launch.json").read_text())
    saved_world = int(record["world_size"])
    steps = newest.step + config.extra_steps
    keep = [o for o in original["overrides"] if not o.startswith(("train.run_dir=", "train.steps=", "stage."))]
    base = StageRunConfig(config_path=original["config_path"], steps=steps, overrides=keep)
    drill_root = storage.data / "drills" / f"{parent['run_id']}-step{newest.step:06d}-{context.run.run_id[:8]}"
    # The drill replays the original run's data, whatever shard_index has become since.
    original_index = {"path": next(o.split("=", 1)[1] for o in original["overrides"] if o.startswith("data.shard_index=")),
                      "manifest_version": original["manifest_version"], "version": original["shard_index_version"]}
    runs = {}
    for name, world in (("reference", saved_world), ("resharded", config.other_world_size)):
        extra = ["stage.checkpoint=true", "stage.mlflow=false", "train.dump_final_params=true",
                 f"stage.resume_from={newest.path}", f"stage.resume_run_id={parent['run_id']}"]
        if world == 1:
            extra.append("train.parallelism=none")
        launch_stage(context, stage="restore_drill", run=base, shard_index=original_index, storage=storage,
                     launcher=launcher, extra=extra, report=False, run_dir=drill_root / name, nproc=world)
        runs[name] = drill_root / name
    comparison = drill.compare(runs["reference"], runs["resharded"], from_step=newest.step,
                               same_world=saved_world == config.other_world_size)
    startup = json.loads((runs["resharded"] / "samples" / "rank_0.json").read_text())["startup"]
    return {**comparison.as_metadata(), "reason": "; ".join(comparison.reasons) or "continuations agree",
            "saved_world_size": saved_world, "restored_world_size": config.other_world_size,
            "restore_s": startup.get("restore_s"), "time_to_first_step_s": startup.get("time_to_first_step_s"),
            "loss_rtol": drill.LOSS_RTOL, "param_atol": drill.PARAM_ATOL, "drill_dir": str(drill_root)}
