"""Launching a training stage from an asset: run config, the checks before launch, the run's
folder and records, and what Dagster retries.

Each stage fills a ``StageLaunch`` (trainer/launch/stage_launch.py: config, shard index, steps, its own
and the user's overrides, parent checkpoint) with ``stage_launch``. ``launch_stage`` resolves and
checks the config it makes once in this process (a bad config, a missing manifest version, a shard
index holding a revoked asset or an over-budget batch is refused before any process starts), names
the run's folder (trainer/launch/run_identity.py), records it as the run's launch.json, and hands it
to the launcher resource (torchrun) with Dagster Pipes. The training, fault drill and evaluation
assets share this.

Secrets never reach a record: a secret field (trainer/launch/redact.py, e.g. ``data.storage_token``) gets
its value only from the environment, through ``secrets: {data.storage_token: {env: MY_TOKEN}}``
(``dg.EnvVar("MY_TOKEN")`` in Python) or an override ``data.storage_token=${env:MY_TOKEN}``. Both
reach the trainer as that ``${env:...}`` reference, which it resolves in its own environment. A
literal value is refused while Dagster processes the run config, before it stores the run, so
the literal lands in no run storage, launch manifest, log or MLflow run.
"""

import contextlib
import dataclasses
import threading
import time
from pathlib import Path

import dagster as dg

from ops.clips import shard_cache
from ops.clips.shard_ref import ShardIndexRef
from ops.curation import manifest as manifest_ops
from ops.curation import erasure, rights
from ops.lineage import training_code_version
from ops.publish import objstore, store_root
from ops.publish.paths import REPO_ROOT
from resources import StorageResource
from resources.launcher import RequeueFailure, TorchrunLauncher, attempts_metadata, retry_settings
from trainer.launch.run_identity import previous_attempt, run_dir_for, with_run_fields
from trainer.observe import startup
from trainer.launch.stage_launch import CheckpointRef, StageLaunch

# Every asset that launches the trainer claims a slot of this Dagster pool. The cluster's instance
# gives each pool one slot (pipelines/instance.py), so one trains at a time and the next waits;
# the embedded instance sets no limit.
TRAINING_POOL = "training"
# Launches of one stage run Dagster may start again after a requeue-able end; the run's
# train.retry_budget (trainer/supervisor/elastic.py) decides which ends are requeue-able at all. Not a
# RetryPolicy: Dagster retries an interrupted step under one, and a cancel must stay a cancel.
MAX_REQUEUES = 8
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


def secret_overrides(run: StageRunConfig) -> list[str]:
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
                 defaults: tuple[str, ...], init_from: CheckpointRef | None = None,
                 storage: StorageResource | None = None, log=None) -> StageLaunch:
    """A stage's launch from its run config, not yet named (launch_stage names its run folder). With
    ``storage``, a shard index an erasure replaced is read through its successor from here on (its
    buckets too: the old set may be gone from the store), said through ``log``."""
    if storage is not None:
        data = _successor(storage, data, stage, log)
    return StageLaunch(stage=stage, config_path=str(_config_file(run.config_path)), data=data,
                       buckets=index_buckets(data), steps=run.steps, world_size=run.nproc or launcher.default_world_size,
                       defaults=defaults, init_from=init_from,
                       user_overrides=(*run.overrides, *secret_overrides(run)))


def _named(context: dg.AssetExecutionContext, launch: StageLaunch, resolved, storage: StorageResource,
           launcher: TorchrunLauncher) -> StageLaunch:
    """``launch`` in its run folder (named by the run's identity unless the caller chose one), as
    this Dagster run's attempt: a retry of an earlier attempt in the same folder says so."""
    run_dir = Path(launch.run_dir) if launch.run_dir else run_dir_for(storage.data, launch.stage, resolved)
    # The store the trainer logs to (the launcher's), not this process's default.
    # Only a folder an earlier attempt launched in (its launch.json) can have one: a new run skips the
    # MLflow lookup, whose import and store connection were a second of every launch's start-up.
    retry_of = (previous_attempt(run_dir.name, launcher.tracking_uri, resolved.stage.mlflow_experiment)
                if resolved.stage.mlflow and (run_dir / "launch.json").exists() else None)
    return launch.named(run_dir=run_dir, dagster_run_id=context.run.run_id, retry_of=retry_of)


def _successor(storage: StorageResource, data: ShardIndexRef, stage: str, log) -> ShardIndexRef:
    """The shard index an erasure replaced is read through its successor (ops.curation.erasure): the same
    shards less the erased assets' clips. Said in the log; the run's records name the successor."""
    successor = erasure.follow(storage.data, data.version)
    if successor is None:
        return data
    new = ShardIndexRef(path=successor["location"], version=successor["index"], manifest_version=data.manifest_version)
    if log is not None:
        log(f"{stage}: shard index {data.version} was replaced by erasure {successor['erasure_id']}; training on its "
            f"successor {new.version} ({new.path})")
    return new


def _follow_erasures(context: dg.AssetExecutionContext, launch: StageLaunch, storage: StorageResource) -> StageLaunch:
    """A launch built without ``storage`` (a replayed one) follows erasures here too."""
    data = _successor(storage, launch.data, launch.stage, context.log.warning)
    return launch if data is launch.data else dataclasses.replace(launch, data=data, buckets=index_buckets(data))


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
    from trainer.launch.preflight import check_parent, preflight
    from trainer.launch.redact import Redactor, redacted_dict
    from trainer.launch.refusal import Refusal

    clock = dagster_startup_clock(context)
    # Also here: a StageRunConfig built in Python, or a replayed launch, skips the run config schema.
    check_no_literal_secrets([*launch.defaults, *launch.user_overrides], where=f"{launch.stage} overrides")
    manifest_ops.read_manifest(launch.data.manifest_version, storage.data)  # ManifestNotFound if absent
    launch = _follow_erasures(context, launch, storage)
    _refuse_revoked(launch, storage)
    try:
        resolved = load_config(launch.config_path, launch.overrides())
        plan = preflight(resolved, world_size=launch.world_size)  # batch division, precision, memory budget: before launch
    except Refusal as refusal:  # one line with its category and fix, never the raw exception (a config mistake)
        raise dg.Failure(description=f"{launch.stage}: {refusal.cli_line()}", allow_retries=False,
                         metadata=refusal.metadata()) from None
    checked = time.time()
    clock.mark("preflight", checked - plan.memory_estimate_s)  # the estimate is preflight's last part
    clock.mark("memory_estimate", checked)
    launch = _named(context, launch, resolved, storage, launcher)
    resolved = with_run_fields(resolved, launch)
    try:  # a parent trained on a revoked or erased asset: refused unless rights.accept_tainted says why and who
        taint = check_parent(resolved, storage.data)
    except Refusal as refusal:
        raise dg.Failure(description=f"{launch.stage}: {refusal.cli_line()}", allow_retries=False,
                         metadata=refusal.metadata()) from None
    if taint:
        context.log.warning(f"{launch.stage}: starting from a tainted parent ({taint['how']}), accepted by "
                            f"{taint['accepted']['approver']}: {taint['accepted']['reason']}")
    redactor = Redactor.for_config(resolved)  # the secrets' values, resolved here only to be scrubbed
    launch = dataclasses.replace(launch, config=redacted_dict(resolved))
    launch.write(Path(launch.run_dir) / "launch.json", redactor=redactor)
    _record_launch_report(context, launch, resolved, plan, redactor=redactor, observe=report)
    retry = f", retry of {launch.retry_of}" if launch.retry_of else ""
    context.log.info(f"{launch.stage}: run {launch.run_id} on {launch.world_size} rank(s){retry}; "
                     f"overrides {redactor.value(launch.overrides())}")
    clock.mark("launched")
    try:
        invocation = launcher.launch(context, launch, extras={"report_materialization": report,
                                                              startup.EXTRAS_KEY: clock.marks}, cancel=cancel)
    except BaseException:  # Dagster's interrupt too; always re-raised
        _publish_run_records(context, launch, required=False)  # what a failed run left is evidence as well
        raise
    _publish_run_records(context, launch, required=True)
    return launch, invocation


def dagster_startup_clock(context: dg.AssetExecutionContext) -> startup.StartupClock:
    """The start-up marks Dagster knows for this step: the run's request (created), its start, and now
    (the step's body begins). A run record without a time leaves that mark out; a retried step (a requeue)
    starts its breakdown at its own start, not at the run's request, which its earlier attempts follow."""
    clock = startup.StartupClock()
    record = context.instance.get_run_record_by_id(context.run.run_id) if not context.retry_number else None
    if record is not None:
        clock.mark("requested", record.create_timestamp.timestamp())
        if record.start_time:
            clock.mark("run_started", record.start_time)
    clock.mark("step_started")
    return clock


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


def stage_result(launch: StageLaunch, invocation: dg.PipesClientCompletedInvocation) -> dg.MaterializeResult:
    result = invocation.get_materialize_result()
    extra = {"launch_manifest": str(Path(launch.run_dir) / "launch.json"), "retry_of": launch.retry_of or "none",
             "run_store_url": store_root.url_for(launch.run_dir) or "none",  # where its records were published
             "shard_index_version": launch.data.version,
             "launch_report": dg.MetadataValue.md((Path(launch.run_dir) / LAUNCH_REPORT_FILE).read_text()),
             **attempts_metadata(launch.run_dir, retry_settings(launch)[0])}
    return dg.MaterializeResult(metadata={**result.metadata, **extra}, data_version=result.data_version)


LAUNCH_REPORT_FILE = "launch_report.md"


def _record_launch_report(context: dg.AssetExecutionContext, launch: StageLaunch, config, plan, *, redactor,
                          observe: bool) -> None:
    """The launch report (trainer/launch/report.py) as Markdown in the run folder, which ``stage_result``
    attaches to the materialization; for a stage's own launch (``observe``) also an observation of its
    asset now, so the Dagster UI shows it while the run trains. Built from the preflight's plan alone
    (a few ms): no batch decoded and no model built in this process."""
    from trainer.launch.report import markdown, stage_report

    title = f"{launch.stage}: run {launch.run_id} on {launch.world_size} rank(s)"
    text = redactor.text(markdown(stage_report(config, plan, title=title, shard_index_version=launch.data.version)))
    (Path(launch.run_dir) / LAUNCH_REPORT_FILE).write_text(text)
    if observe:
        context.log_event(dg.AssetObservation(asset_key=context.asset_key,
                                              metadata={"launch_report": dg.MetadataValue.md(text)}))


def latest_metadata(context: dg.AssetExecutionContext, asset: str) -> dict:
    event = context.instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None:
        raise dg.Failure(f"{asset} has never been materialized")
    return {key: getattr(value, "value", value) for key, value in event.asset_materialization.metadata.items()}
