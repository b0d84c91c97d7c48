"""Training assets: step_profile -> pretrain -> finetune, and restore_drill.

Each stage fills a ``StageLaunch`` (trainer/launch/stage_launch.py: config, shard index, steps, its own
and the user's overrides, parent checkpoint), resolves and checks the config it makes once in
this process (a bad config, a missing manifest version or an over-budget batch is refused before
any process starts), records it as the run's launch.json, and hands it to the launcher resource
(torchrun) with Dagster Pipes: logs stream back, and the completed run reports its figures,
lineage, committed checkpoint and MLflow run as this asset's metadata. A stage run's folder is
named by its config and data, so a retry of the same run resumes its own checkpoint and is
tagged ``retry_of`` in MLflow, while a new config is a new run. The restore drill reads the
original run's launch back and replays it on the same data.

Secrets never reach a record: a secret field (trainer/launch/redact.py, e.g. ``data.storage_token``) gets
its value only from the environment, through ``secrets: {data.storage_token: {env: MY_TOKEN}}``
(``dg.EnvVar("MY_TOKEN")`` in Python) or an override ``data.storage_token=${env:MY_TOKEN}``. Both
reach the trainer as that ``${env:...}`` reference, which it resolves in its own environment. A
literal value is refused while Dagster processes the run config, before it stores the run, so
the literal lands in no run storage, launch manifest, log or MLflow run.
"""

import contextlib
import dataclasses
import json
import threading
from pathlib import Path

import dagster as dg

from assets.metadata import lineage_metadata
from assets.inputs import SHARD_INDEX_IN
from ops.checkpoints import store
from ops.publish import store_root, objstore
from ops.curation import rights
from ops.clips import shard_cache
from ops.curation import manifest as manifest_ops
from ops.publish.hashing import digest_json
from ops.lineage import training_code_version
from ops.publish.paths import REPO_ROOT
from ops.clips.shard_ref import ShardIndexRef
from resources import LineageResource, StorageResource
from resources.launcher import RequeueFailure, TorchrunLauncher, attempts_metadata, retry_settings
from ops.checkpoints.mirror import CheckpointMirror
from trainer.launch.stage_launch import CheckpointRef, StageLaunch

GROUP = "training"
# Every asset that launches the trainer claims a slot of this Dagster pool. The cluster's instance
# gives each pool one slot (pipelines/instance.py), so one trains at a time and the next waits;
# the embedded instance sets no limit.
TRAINING_POOL = "training"
# Launches of one stage run Dagster may start again after a requeue-able end; the run's
# train.retry_budget (trainer/supervisor/policy.py) decides which ends are requeue-able at all. Not a
# RetryPolicy: Dagster retries an interrupted step under one, and a cancel must stay a cancel.
MAX_REQUEUES = 8
CHECKPOINT_CHECKS = ("checkpoint_committed", "checkpoint_integrity")
# The same value the trainer records as each run's code_version (ops.lineage).
TRAINING_CODE_VERSION = training_code_version()


class StageRunConfig(dg.Config):
    """Which experiment to run and how long; the data comes from the shard_index asset."""

    config_path: str = "configs/demo.yaml"
    """Experiment YAML, relative to the repository root (see trainer/launch/config.py)."""
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
        from trainer.launch.config import check_no_literal_secrets

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
        from trainer.launch.config import LiteralSecretError, env_reference

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
    from trainer.launch.config import env_reference, secret_field_paths

    known = secret_field_paths()
    unknown = sorted(set(run.secrets) - known)
    if unknown:
        raise ValueError(f"secrets: {', '.join(unknown)} is not a secret field (secret fields: {', '.join(sorted(known))}); "
                         f"give other fields in overrides")
    return [f"{path}={env_reference(name)}" for path, name in sorted(run.secrets.items())]


def _config_file(config_path: str) -> Path:
    return Path(config_path) if Path(config_path).is_absolute() else REPO_ROOT / config_path


def _previous_attempt(run_id: str, tracking_uri: str, experiment_name: str) -> str | None:
    """MLflow id of the latest earlier attempt of this stage run, if any. An MLflow error is raised
    with the store's credentials redacted (its message holds the URI; Dagster stores the message)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from trainer.launch.redact import redact_uri

    try:
        client = MlflowClient(tracking_uri=tracking_uri)
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            return None
        runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.run_id = '{run_id}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
    except MlflowException as error:
        raise MlflowException(redact_uri(str(error))) from None  # not chained: the original holds the URI
    return runs[0].info.run_id if runs else None


def index_buckets(data: ShardIndexRef) -> tuple[tuple[int, int, int], ...]:
    """``data.buckets`` of a multi-shape shard index, as the shard path and manifest come from it.

    The index is the truth about which clip shapes exist; the trainer checks the config against it
    anyway, and a user's own ``data.buckets`` override (applied later) still wins.
    """
    shapes = shard_cache.read_any_index_info(data.path).bucket_shapes
    if len(shapes) < 2:
        return ()
    return tuple((shape.num_frames, shape.height, shape.width) for shape in shapes.values())


def stage_launch(stage: str, run: StageRunConfig, data: ShardIndexRef, launcher: TorchrunLauncher, *,
                 defaults: tuple[str, ...], init_from: CheckpointRef | None = None) -> StageLaunch:
    """A stage's launch from its run config, not yet named (launch_stage names its run folder)."""
    return StageLaunch(stage=stage, config_path=str(_config_file(run.config_path)), data=data,
                       buckets=index_buckets(data), steps=run.steps, world_size=run.nproc or launcher.default_world_size,
                       defaults=defaults, init_from=init_from,
                       user_overrides=(*run.overrides, *_secret_overrides(run)))


# How a run is watched, retried and stopped, not what it computes: changing one resumes the same
# run folder.
_POLICY_FIELDS = ("run_dir", "watchdog_s", "retry_budget", "max_bad_samples", "preempt_signals", "preempt_grace_s",
                  "eval_every")
# Fields that came after runs were named: at their defaults, a folder keeps the name it had.
_LATER_TRAIN_DEFAULTS = {"loss_spike_factor": 0.0, "loss_spike_window": 8}
_LATER_FAULT_DEFAULTS = {"stall_in": "step", "exit_in": "step", "sigterm_at_step": 0, "sigterm_rank": 0,
                         "sigterm_count": 1, "preempt_with": "SIGTERM", "raise_on_sample": "",
                         "corrupt_checkpoint_at_step": 0, "attempt": 0,
                         "spike_loss_at_steps": [], "oom_at_step": 0, "disk_full_at_step": 0}


def run_identity(resolved) -> dict:
    """What names a stage run's folder: its redacted config and data, less train.run_dir. Configs
    resolve from an unnamed launch, which leaves stage.dagster_run_id and stage.retry_of unset."""
    from trainer.launch.redact import redacted_dict

    identity = redacted_dict(resolved)
    identity["train"] = {k: v for k, v in identity["train"].items()
                         if k not in _POLICY_FIELDS and not (k in _LATER_TRAIN_DEFAULTS and v == _LATER_TRAIN_DEFAULTS[k])}
    identity["faults"] = {k: v for k, v in identity.get("faults", {}).items()
                          if not (k in _LATER_FAULT_DEFAULTS and v == _LATER_FAULT_DEFAULTS[k])}
    # start_over says what to do with this run's own failed checkpoints, so it must name the same
    # run folder; pinned to its default (not dropped) so existing runs keep their folder names.
    identity["stage"] = {**identity["stage"], "start_over": False}
    identity.pop("eval", None)  # what a run measures of itself, not what it trains (trainer/launch/config_sections.py:EvalConfig)
    if not identity["model"].get("factory"):  # the built-in model keeps the names its runs had
        identity["model"].pop("factory", None)
    # stage.mirror says where copies of the checkpoints go, not what the run is (and came later).
    identity["stage"].pop("mirror", None)
    # checkpoint_io names another run where it is not the default: a run resumes only the checkpoints
    # of its own kind, so a change of place must not resume as the same run (and start from step 0).
    if identity["stage"].get("checkpoint_io") == "local":
        identity["stage"].pop("checkpoint_io")
    return identity


def _named(context: dg.AssetExecutionContext, launch: StageLaunch, resolved, storage: StorageResource,
           launcher: TorchrunLauncher) -> StageLaunch:
    """``launch`` in its run folder (named by the run's identity unless the caller chose one), as
    this Dagster run's attempt: a retry of an earlier attempt in the same folder says so."""
    run_dir = Path(launch.run_dir or storage.data / "runs" / f"{launch.stage}-{digest_json(run_identity(resolved))[:12]}")
    # The store the trainer logs to (the launcher's), not this process's default.
    retry_of = (_previous_attempt(run_dir.name, launcher.tracking_uri, resolved.stage.mlflow_experiment)
                if resolved.stage.mlflow else None)
    return launch.named(run_dir=run_dir, dagster_run_id=context.run.run_id, retry_of=retry_of)


def _with_run_fields(resolved, launch: StageLaunch):
    """The config the trainer resolves from the named launch's overrides: the unnamed one's, plus
    the run fields they add last (plain strings), so the YAML is read and checked once."""
    stage = {"dagster_run_id": launch.dagster_run_id} | ({"retry_of": launch.retry_of} if launch.retry_of else {})
    return dataclasses.replace(resolved, train=dataclasses.replace(resolved.train, run_dir=launch.run_dir),
                               stage=dataclasses.replace(resolved.stage, **stage))


def _refuse_revoked(launch: StageLaunch, storage: StorageResource) -> None:
    """No stage trains on a shard index holding an asset the rights ledger revokes (ops.curation.rights): the
    index was built before the revocation, so a new one must be planned without it."""
    if not rights.revoked(storage.data):  # nothing revoked: the index's plan need not be read
        return
    held = rights.index_assets(storage.data, launch.data.path, launch.data.version)
    found = rights.refusals(storage.data, held)
    if found:
        listed = "; ".join(f"{asset_id[:12]}: {why}" for asset_id, why in list(found.items())[:5])
        raise dg.Failure(f"{launch.stage}: shard index {launch.data.version} holds {len(found)} revoked asset(s) "
                         f"({listed}); materialize validated_manifest, clip_plan, clip_shards and shard_index "
                         "again (the retrain sensor does) so the new index leaves them out",
                         metadata={"refused_assets": sorted(found)})


def launch_stage(context: dg.AssetExecutionContext, launch: StageLaunch, *, storage: StorageResource,
                 launcher: TorchrunLauncher, report: bool = True,
                 cancel: threading.Event | None = None) -> tuple[StageLaunch, dg.PipesClientCompletedInvocation]:
    """Check, name, record and launch one stage run; returns the named launch and its invocation.
    ``cancel``: see ``TorchrunLauncher.launch`` (a launch from a worker thread)."""
    from trainer.launch.config import check_no_literal_secrets, load_config
    from trainer.launch.preflight import preflight
    from trainer.launch.redact import Redactor, redacted_dict

    # Also here: a StageRunConfig built in Python, or a replayed launch, skips the run config schema.
    check_no_literal_secrets([*launch.defaults, *launch.user_overrides], where=f"{launch.stage} overrides")
    manifest_ops.read_manifest(launch.data.manifest_version, storage.data)  # ManifestNotFound if absent
    _refuse_revoked(launch, storage)
    resolved = load_config(launch.config_path, launch.overrides())
    preflight(resolved, world_size=launch.world_size)  # batch division, precision, memory budget: before launch
    launch = _named(context, launch, resolved, storage, launcher)
    resolved = _with_run_fields(resolved, launch)
    redactor = Redactor.for_config(resolved)  # the secrets' values, resolved here only to be scrubbed
    launch = dataclasses.replace(launch, config=redacted_dict(resolved))
    launch.write(Path(launch.run_dir) / "launch.json", redactor=redactor)
    retry = f", retry of {launch.retry_of}" if launch.retry_of else ""
    context.log.info(f"{launch.stage}: run {launch.run_id} on {launch.world_size} rank(s){retry}; "
                     f"overrides {redactor.value(launch.overrides())}")
    try:
        invocation = launcher.launch(context, launch, extras={"report_materialization": report}, cancel=cancel)
    except BaseException:  # Dagster's interrupt too; always re-raised
        _publish_run_records(context, launch, required=False)  # what a failed run left is evidence as well
        raise
    _publish_run_records(context, launch, required=True)
    return launch, invocation


def _publish_run_records(context: dg.AssetExecutionContext, launch: StageLaunch, *, required: bool) -> None:
    """Where the data root is an object store, publish the run folder's records there (ops.publish.store_root):
    a restore drill on another machine, or after this one is lost, reads pretrain's launch.json, losses
    and sample order from the store. A stage that succeeded but whose records could not be published
    fails, naming the URL; after a failed run the original error stands and this one is logged."""
    try:
        url = store_root.publish_run_records(launch.run_dir)
    except (objstore.ObjectStoreError, OSError) as error:
        if required:
            raise dg.Failure(f"{launch.stage}: publishing the run's records from {launch.run_dir} to the data "
                             f"store failed: {error}") from error
        context.log.error(f"{launch.stage}: the run's records were not published to the data store: {error}")
        return
    if url is not None:
        context.log.info(f"{launch.stage}: run records published to {url}")


@contextlib.contextmanager
def only_requeues_retry():
    """Inside a stage: a RequeueFailure (preempted, budget left) asks Dagster to run the step again,
    which resumes the run from its last committed checkpoint; every other failure is final."""
    try:
        yield
    except RequeueFailure as failure:
        raise dg.RetryRequested(max_retries=MAX_REQUEUES, seconds_to_wait=0) from failure


def _result(launch: StageLaunch, invocation: dg.PipesClientCompletedInvocation) -> dg.MaterializeResult:
    result = invocation.get_materialize_result()
    extra = {"launch_manifest": str(Path(launch.run_dir) / "launch.json"), "retry_of": launch.retry_of or "none",
             "run_store_url": store_root.url_for(launch.run_dir) or "none",  # where its records were published
             "shard_index_version": launch.data.version,
             **attempts_metadata(launch.run_dir, retry_settings(launch)[0])}
    return dg.MaterializeResult(metadata={**result.metadata, **extra}, data_version=result.data_version)


STEP_PROFILE_DEFAULTS = ("train.parallelism=none", "train.profile=true", "stage.checkpoint=false", "stage.mlflow=true",
                         "train.eval_every=0")  # a performance baseline: no evaluation beside it
PRETRAIN_DEFAULTS = ("stage.mlflow=true",)
FINETUNE_DEFAULTS = ("stage.mlflow=true", "optim.lr=3e-4", "optim.warmup_steps=0")


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["loader_benchmark"], kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA, ins={"shard_index": SHARD_INDEX_IN},
          description="Single-device performance baseline: phase times, throughput, bound verdict, profiler trace.")
def step_profile(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict,
                 storage: StorageResource, launcher: TorchrunLauncher) -> dg.MaterializeResult:
    with only_requeues_retry():
        config = stage_config(context)
        run = StageRunConfig(config_path=config.config_path, steps=min(config.steps, 12), nproc=1,
                             overrides=config.overrides, secrets=config.secrets)
        launch = stage_launch("step_profile", run, ShardIndexRef.of(shard_index), launcher,
                              defaults=STEP_PROFILE_DEFAULTS)
        return _result(*launch_stage(context, launch, storage=storage, launcher=launcher))


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["step_profile"], kinds={"torch", "mlflow"},
          code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA, ins={"shard_index": SHARD_INDEX_IN},
          check_specs=[dg.AssetCheckSpec(name, asset="pretrain", blocking=True) for name in CHECKPOINT_CHECKS],
          description="Distributed pretraining under torchrun (DDP/FSDP), committed DCP checkpoints, MLflow run.")
def pretrain(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict,
             storage: StorageResource, launcher: TorchrunLauncher):
    with only_requeues_retry():
        launch = stage_launch("pretrain", stage_config(context), ShardIndexRef.of(shard_index), launcher,
                              defaults=PRETRAIN_DEFAULTS)
        result = _result(*launch_stage(context, launch, storage=storage, launcher=launcher))
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
    if objstore.is_remote(checkpoint):  # stage.checkpoint_io=store: committed means the store's records
        yield _store_committed_check(asset, checkpoint)
    else:
        infos = {info.path.name: info for info in store.list_checkpoints(run_dir)}
        info = infos.get(Path(checkpoint).name)
        latest = store.read_latest(run_dir)
        committed = info is not None and info.status == "committed"
        yield dg.AssetCheckResult(
            asset_key=asset, check_name="checkpoint_committed", passed=committed and latest is not None,
            metadata={"checkpoint": checkpoint, "status": info.status if info else "missing", "latest": latest or "none",
                      "num_incomplete": sum(i.status == "incomplete" for i in infos.values())})
    report = verify_checkpoint(checkpoint, expected_run_id=run_id)
    yield dg.AssetCheckResult(
        asset_key=asset, check_name="checkpoint_integrity", passed=report.ok,
        metadata={"checkpoint": checkpoint, "num_files": len((report.record or {}).get("files", {})),
                  "problems": "; ".join(f"{file}: {problem}" for file, problem in report.problems) or "none"})


def verify_checkpoint(checkpoint: str, *, expected_run_id: str | None) -> store.VerifyReport:
    """Every file re-hashed against the signed record, in a run folder or in the store (stage.checkpoint_io=store)."""
    if objstore.is_remote(checkpoint):
        from trainer.checkpointing import object_store  # torch: only where a checkpoint is in the store

        return object_store.check_version(checkpoint, store.configured_key(), expected_run_id,
                                              rehash=True)
    return store.verify(checkpoint, store.configured_key(), expected_run_id=expected_run_id)


def _store_committed_check(asset: str, checkpoint: str) -> dg.AssetCheckResult:
    run_url, name = checkpoint.rstrip("/").rsplit("/", 1)
    try:
        listing = objstore.list_versions(run_url, accept=lambda entry: store.checkpoint_step(entry) is not None)
    except objstore.ObjectStoreError as error:
        return dg.AssetCheckResult(asset_key=asset, check_name="checkpoint_committed", passed=False,
                                   metadata={"checkpoint": checkpoint, "reason": str(error)})
    return dg.AssetCheckResult(
        asset_key=asset, check_name="checkpoint_committed", passed=name in listing.committed,
        metadata={"checkpoint": checkpoint, "status": "committed" if name in listing.committed else "missing",
                  "latest": listing.latest or "none", "num_incomplete": len(listing.ignored)})


def _latest_metadata(context: dg.AssetExecutionContext, asset: str) -> dict:
    event = context.instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None:
        raise dg.Failure(f"{asset} has never been materialized")
    return {key: getattr(value, "value", value) for key, value in event.asset_materialization.metadata.items()}


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["pretrain"], kinds={"torch", "mlflow"}, code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA, ins={"shard_index": SHARD_INDEX_IN},
          check_specs=[dg.AssetCheckSpec(name, asset="finetune", blocking=True) for name in CHECKPOINT_CHECKS],
          description="Next stage: starts from pretrain's verified committed checkpoint (weights), trains further.")
def finetune(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict,
             storage: StorageResource, launcher: TorchrunLauncher):
    with only_requeues_retry():
        config = stage_config(context)
        parent = _latest_metadata(context, "pretrain")
        if not parent.get("checkpoint"):
            raise dg.Failure("pretrain's latest materialization reports no committed checkpoint to start from")
        report = verify_checkpoint(parent["checkpoint"], expected_run_id=parent["run_id"])
        if not report.ok:  # never start a stage from a checkpoint that fails integrity
            raise dg.Failure(f"pretrain checkpoint {parent['checkpoint']} failed verification: {report.problems}")
        launch = stage_launch("finetune", config, ShardIndexRef.of(shard_index), launcher, defaults=FINETUNE_DEFAULTS,
                              init_from=CheckpointRef(path=parent["checkpoint"], run_id=parent["run_id"]))
        result = _result(*launch_stage(context, launch, storage=storage, launcher=launcher))
    yield dg.MaterializeResult(metadata={**result.metadata, "parent_checkpoint": parent["checkpoint"]},
                               data_version=result.data_version)
    yield from checkpoint_checks("finetune", result.metadata)


class DrillConfig(dg.Config):
    other_world_size: int = 1
    """World size of the resharded continuation (the other one runs at the saved world size)."""
    overrides: list[str] = []
    """Extra "a.b=c" trainer overrides for both continuations, e.g. an injected fault in tests
    (faults.drop_optimizer_state_on_restore=true must make the drill fail)."""


# The drill's overrides reach run storage like a stage's: the same literal-secret refusal applies.
DRILL_CONFIG_SCHEMA = {**DrillConfig.to_fields_dict(), "overrides": STAGE_CONFIG_SCHEMA["overrides"]}


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["pretrain"], kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          config_schema=DRILL_CONFIG_SCHEMA,
          check_specs=[dg.AssetCheckSpec("drill_passed", asset="restore_drill", blocking=True)],
          description="Restores pretrain's second-newest committed checkpoint, trains to its newest one at the "
                      "saved and at another world size, and compares with what pretrain itself recorded there.")
def restore_drill(context: dg.AssetExecutionContext,
                  storage: StorageResource, launcher: TorchrunLauncher, lineage: LineageResource):
    config = DrillConfig(**context.op_execution_context.op_config)
    parent = _latest_metadata(context, "pretrain")
    run_dir = Path(parent["run_dir"])
    # Where the deployment mirrors checkpoints (TRAINYARD_CHECKPOINT_ROOT), the drill restores from
    # the store: what a new machine would have after this one is lost, not the run folder's copy.
    mirror = CheckpointMirror.for_run(run_dir.name, keep_last_k=1, keep_every_m=0)
    source = mirror.url if mirror is not None else str(run_dir)
    try:
        committed = (mirror.committed() if mirror is not None else
                     [info for info in store.list_checkpoints(run_dir) if info.status == "committed"])
    except objstore.ObjectStoreError as error:
        raise dg.Failure(f"restore drill: the checkpoint store {source} failed: {error}") from error
    if len(committed) < 2:
        raise dg.Failure(
            f"{source} has {len(committed)} committed checkpoint(s); the drill restores the second-newest and "
            f"compares with the original run at the newest, so it needs two: set train.checkpoint_every below "
            f"train.steps and keep stage.keep_last_k >= 2")
    restored, target = committed[-2], committed[-1]
    drill_root = storage.data / "drills" / f"{parent['run_id']}-step{restored.step:06d}-{context.run.run_id[:8]}"
    outcome: dict = {"checkpoint_source": source, "checkpoint_step": restored.step, "target_step": target.step,
                     "checkpoint": str(restored.path), "target_checkpoint": str(target.path)}
    problems = ""
    if mirror is not None:
        outcome |= {"checkpoint": mirror.source_of(restored.name), "target_checkpoint": mirror.source_of(target.name)}
        try:  # each copy re-hashed against its commit record in the store, then verified as any checkpoint
            restored, target = [mirror.fetch(info.name, drill_root / "from_store") for info in (restored, target)]
        except objstore.VersionRefused as refused:
            problems = f"the store's copy was refused: {refused}"
        except objstore.ObjectStoreError as error:
            raise dg.Failure(f"restore drill: the checkpoint store {source} failed: {error}") from error
        outcome["fetched_to"] = str(restored.path.parent)
    problems = problems or _verification_problems(parent["run_id"], restored, target)
    if problems:
        outcome |= {"passed": False, "reason": "checkpoint failed verification: " + problems}
    else:
        outcome |= _drill(context, config, parent, restored, target, drill_root, storage, launcher)
    if outcome["passed"]:  # the restored checkpoint is the one proven to bring the run back
        _pin_known_good(context, run_dir, mirror, restored.step, outcome)
    context.log.info(f"restore drill {'PASSED' if outcome['passed'] else 'FAILED'}: {outcome.get('reason')}")
    record = lineage.collect(manifest_version=str(parent.get("manifest_version") or "none"), code_version=TRAINING_CODE_VERSION,
                             config={"drill": config.model_dump(), "pretrain_run_id": parent["run_id"]})
    yield dg.MaterializeResult(metadata={**outcome, **lineage_metadata(record)},
                               data_version=dg.DataVersion(digest_json(outcome)[:20]))
    yield dg.AssetCheckResult(check_name="drill_passed", passed=bool(outcome["passed"]),
                              metadata={"reason": outcome.get("reason", "none")})


def _pin_known_good(context, run_dir: Path, mirror: CheckpointMirror | None, step: int, outcome: dict) -> None:
    """Pin the proven step where it lives: the run folder (when it still has that checkpoint) and the store."""
    evidence = {**outcome, "dagster_run_id": context.run.run_id}
    local = store.checkpoints_dir(run_dir) / store.step_dir_name(step)
    if mirror is None or (local / store.RECORD_NAME).exists():
        store.pin_known_good(run_dir, step, evidence)
    if mirror is not None:
        context.log.info(f"known good: pinned {mirror.pin_known_good(step, evidence)}")


def _verification_problems(run_id: str, *checkpoints) -> str:
    key = store.configured_key()
    reports = [store.verify(info.path, key, expected_run_id=run_id) for info in checkpoints]
    return "; ".join(f"{report.checkpoint_dir.name}/{file}: {problem}"
                     for report in reports for file, problem in report.problems)


def _drill(context, config: DrillConfig, parent: dict, restored, target, drill_root: Path,
           storage: StorageResource, launcher: TorchrunLauncher) -> dict:
    """Continue ``restored`` to ``target``'s step at the saved and the other world size; judge each
    against the original run's losses, its parameters in ``target`` and its sample order."""
    from ops.drills import restore  # torch (DCP): imported by the run that drills, not by the Definitions
    original_dir = _original_records(Path(parent["run_dir"]), parent.get("run_store_url"), drill_root)
    original = StageLaunch.read(original_dir / "launch.json")
    saved_world = int(store.read_record(restored.path)["world_size"])
    from_step, to_step = restored.step, target.step
    summary = {"records_source": str(original_dir), "saved_world_size": saved_world,
               "other_world_size": config.other_world_size,
               "loss_rtol": restore.LOSS_RTOL, "param_atol": restore.PARAM_ATOL, "drill_dir": str(drill_root)}
    try:
        configured_steps = int(original.config["train"]["steps"])
        if to_step != configured_steps:  # the cosine schedule depends on train.steps: train to the same end
            raise restore.DrillError(f"the original's newest committed checkpoint is at step {to_step}, but it was "
                                   f"configured for {configured_steps} steps; drill a run that completed")
        truth = restore.RunRecord(
            name="original", losses=restore.recorded_losses(original_dir, require_completed=False),
            params=restore.checkpoint_params(target.path, hmac_key=store.configured_key(),
                                           expected_run_id=parent["run_id"]),
            params_step=to_step, order=restore.recorded_order(original_dir, range(from_step + 1, to_step + 1)))
        worlds = {"same_world": saved_world, "other_world": config.other_world_size}
        if config.other_world_size == saved_world:
            del worlds["other_world"]
        runs = {name: _continue(context, config, original, parent, restored, to_step, world, drill_root / name,
                                storage, launcher) for name, world in worlds.items()}
        records = {name: restore.continuation_record(path, name=name) for name, path in runs.items()}
    except restore.DrillError as error:
        return {**summary, "passed": False, "reason": str(error)}
    summary["order_reference"] = "original run" if truth.order is not None else "same_world continuation"
    numerics = store.read_record(restored.path)["content"].get("numerics", {})  # signed
    rules = {name: restore.comparison_rule(numerics, same_world=name == "same_world") for name in records}
    summary |= {f"{name}/rule_why": rule.why for name, rule in rules.items()}
    comparisons = {"same_world": restore.compare(truth, records["same_world"], from_step=from_step, to_step=to_step,
                                               same_world=True, rule=rules["same_world"])}
    if truth.order is None and comparisons["same_world"].passed:
        # The original's last process resumed after these steps and logged none of them; the
        # continuation just proven bit-identical to it stands in for its order.
        truth.order = records["same_world"].order
    if "other_world" in records:
        comparisons["other_world"] = restore.compare(truth, records["other_world"], from_step=from_step,
                                                   to_step=to_step, same_world=False, rule=rules["other_world"])
    reasons = [f"{name}: {reason}" for name, result in comparisons.items() for reason in result.reasons]
    startup = json.loads((runs[list(runs)[-1]] / "samples" / "rank_0.json").read_text())["startup"]
    metadata = {key: value for name, result in comparisons.items() for key, value in
                result.as_metadata(f"{name}/").items()}
    return {**summary, **metadata, "passed": all(result.passed for result in comparisons.values()),
            "reason": "; ".join(reasons) or "both continuations reproduce the original run",
            "num_steps_compared": to_step - from_step,
            "restore_s": startup.get("restore_s"), "time_to_first_step_s": startup.get("time_to_first_step_s")}


def _original_records(run_dir: Path, run_url: str | None, drill_root: Path) -> Path:
    """The folder holding the original run's records (launch.json, final.json, sample order): its run
    folder on this machine, or, where that is gone and the data root is an object store, the newest
    records the run published there, fetched and re-hashed (ops.publish.store_root)."""
    if (run_dir / "launch.json").is_file():
        return run_dir
    if not run_url or run_url == "none":
        raise dg.Failure(f"restore drill: {run_dir / 'launch.json'} is missing, and the run published no records "
                         "to a data store (its data root was a folder): nothing says what the original run did")
    try:
        fetched = store_root.fetch_run_records(run_url, drill_root / "original_records")
    except objstore.ObjectStoreError as error:  # VersionRefused too: the store's copy is not the run's record
        raise dg.Failure(f"restore drill: the original run's records could not be read from the data store: "
                         f"{error}") from error
    if fetched is None:
        raise dg.Failure(f"restore drill: {run_dir / 'launch.json'} is missing and {run_url} holds no committed "
                         "records of that run: nothing says what the original run did")
    return fetched


# No evaluation in the continuations: it never changes training (trainer/heldout.py), so it proves nothing here.
DRILL_DEFAULTS = ("stage.checkpoint=true", "stage.mlflow=false", "stage.mirror=false", "train.dump_final_params=true",
                  "train.eval_every=0")


def _continue(context, config: DrillConfig, original: StageLaunch, parent: dict, restored, to_step: int, world: int,
              run_dir: Path, storage: StorageResource, launcher: TorchrunLauncher) -> Path:
    """One fresh continuation of ``restored`` to ``to_step`` on ``world`` ranks, on the original's data
    (its shard index and buckets, whatever shard_index has become since) and config."""
    launch = StageLaunch(
        stage="restore_drill", config_path=original.config_path, data=original.data, buckets=original.buckets,
        steps=to_step, world_size=world, run_dir=str(run_dir),
        defaults=DRILL_DEFAULTS + (("train.parallelism=none",) if world == 1 else ()),
        resume_from=CheckpointRef(path=str(restored.path), run_id=parent["run_id"]),
        user_overrides=(*original.replay_overrides(), *config.overrides))
    launch_stage(context, launch, storage=storage, launcher=launcher, report=False)
    return run_dir
