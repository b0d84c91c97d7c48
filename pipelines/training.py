"""Training automation: the nightly restore and fault drills, and retraining when the data changes.

``retrain_sensor`` watches ``validated_manifest``. When it gets a new data version, the sensor
walks the chain a data engineer would click through, one step per tick, each a run with a
run key so nothing is requested twice: plan the clips (``clip_plan``), build every shard of the
new plan (``clip_shards`` partitions, a backfill), then ``retrain_job`` (shard index,
pretrain, finetune, with their blocking checkpoint checks).

What counts as done is read from Dagster's records on every tick, never remembered by the
sensor: a validated version is trained only when a ``retrain_job`` run for it succeeded, or
when pretrain's and finetune's latest materializations both came from successful runs whose
shards trace back to that very validated version (the first tick after `make demo`, which
materializes everything in one run without ``retrain_job``; a pretrain-only run by hand is not
a retrain, and re-validating one manifest with other rules is new data). A failed or canceled
step is requested again under a new run key, up to ``MAX_ATTEMPTS`` runs per step; then the
sensor stops asking, says so in its skip reason and tags the last of those runs. While a run of
the step is queued or running, the sensor requests nothing and names that run in its skip
reason (a stuck one is there for a person to cancel; the sensor then retries it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from assets import data
from assets.clips import SHARD_PARTITIONS
from pipelines.sensors import runs_materializing

# What the retrain sensor requests, step by step, and what it waits for while another run produces it.
RETRAIN_CHAIN = ["validated_manifest", "clip_plan", "clip_shards", "shard_index", "pretrain", "finetune"]
plan_job = dg.define_asset_job("plan_job", selection=dg.AssetSelection.assets("clip_plan"),
                               description="Plan clips and shard partitions for the current validated manifest.")
# Partitioned by clip_shards' own SHARD_PARTITIONS (inferred: passing it is deprecated in Dagster 1.13).
shards_job = dg.define_asset_job("shards_job", selection=dg.AssetSelection.assets("clip_shards"),
                                 description="Write clip shards (one per partition).")
retrain_job = dg.define_asset_job(
    "retrain_job", selection=dg.AssetSelection.assets("shard_index", "pretrain", "finetune"),
    description="Index the shards, pretrain and fine-tune on them (blocking checkpoint checks included).")
revalidate_job = dg.define_asset_job(
    "revalidate_job", selection=dg.AssetSelection.assets("validated_manifest", "quarantine"),
    description="Validate the current manifest again, with the rights ledger as it is now (ops/curation/rights.py).")


@dg.job(description="Erase a revoked asset from every copy Trainyard made; a signed certificate (docs/rights.md).")
def erasure_job() -> None:
    data.erasure()


restore_drill_job = dg.define_asset_job(
    "restore_drill_job", selection=dg.AssetSelection.assets("restore_drill"),
    description="Restore pretrain's second-newest committed checkpoint, train to its newest and compare with it.")

nightly_restore_drill = dg.ScheduleDefinition(
    name="nightly_restore_drill", job=restore_drill_job, cron_schedule="0 3 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Recovery is proven by restoring and training on, every night.")
reproduction_job = dg.define_asset_job(
    "reproduction_job", selection=dg.AssetSelection.assets("reproduction"),
    description="Rebuild the stages' pinned checkpoints from their signed records and compare (ops/drills/replay.py).")

weekly_reproduction = dg.ScheduleDefinition(
    name="weekly_reproduction", job=reproduction_job, cron_schedule="0 4 * * 0",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Lineage is proven by replaying it: every Sunday, each stage's known-good checkpoint is rebuilt "
                "from its record alone.")
fault_drill_job = dg.define_asset_job(
    "fault_drill_job", selection=dg.AssetSelection.assets("fault_drill"),
    description="Inject every fault on a short 2-rank run and prove each is classified and recovered or stopped.")

nightly_fault_drill = dg.ScheduleDefinition(
    name="nightly_fault_drill", job=fault_drill_job, cron_schedule="30 3 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Fault handling is proven by injecting every fault, every night.")

MAX_ATTEMPTS = 3
"""Runs the sensor requests for one step (plan, one shard, retrain) before it gives up on it."""
STEP_TAG = "trainyard/retrain_step"
VALIDATED_TAG = "trainyard/validated_version"
ATTEMPT_TAG = "trainyard/attempt"
BUDGET_TAG = "trainyard/retry_budget"
"""Set on the last failed or canceled run of a step whose budget is spent: why no further run follows."""
_LOOKBACK = 100  # materializations searched when tracing a stage's data back to its validated version
TRAINED_STAGES = ("pretrain", "finetune")
"""Both must trace to a validated version for it to count as trained without a retrain_job run."""
# A canceled attempt left the step as undone as a failed one: both spend budget and change the
# run key (else Dagster drops the repeated key and nothing ever retries).
_ENDED_UNDONE = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
_IN_FLIGHT = (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.MANAGED,
              dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.SUSPENDED,
              dg.DagsterRunStatus.CANCELING)


def _data_version(instance: dg.DagsterInstance, key: str) -> str | None:
    record = instance.get_latest_data_version_record(dg.AssetKey(key))
    event = record.asset_event if record else None  # an EventLogRecord: the version is a tag of its event
    return (event.tags or {}).get("dagster/data_version") if event else None


def _values(metadata) -> dict:
    return {name: getattr(value, "value", value) for name, value in metadata.items()}


def _latest_output(instance: dg.DagsterInstance, key: str) -> dict:
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    return _values(event.asset_materialization.metadata) if event else {}


def _find_output(instance: dg.DagsterInstance, key: str, field: str, value) -> dict | None:
    """The newest materialization of ``key`` whose metadata ``field`` equals ``value``."""
    if value is None:
        return None
    records = instance.fetch_materializations(dg.AssetKey(key), limit=_LOOKBACK, ascending=False).records
    for record in records:
        metadata = _values(record.asset_materialization.metadata)
        if metadata.get(field) == value:
            return metadata
    return None


def _stage_validated_version(instance: dg.DagsterInstance, stage: str) -> str | None:
    """The validated version ``stage``'s latest materialization was trained on, if its run succeeded:
    the stage -> its shard_index version -> that index's plan folder -> the plan's validated version."""
    event = instance.get_latest_materialization_event(dg.AssetKey(stage))
    if event is None:
        return None
    run = instance.get_run_by_id(event.run_id)
    if run is None or run.status != dg.DagsterRunStatus.SUCCESS:
        return None  # e.g. pretrain materialized but finetune or a blocking check failed
    metadata = _values(event.asset_materialization.metadata)
    index = _find_output(instance, "shard_index", "shard_index_version", metadata.get("shard_index_version"))
    plan = _find_output(instance, "clip_plan", "data_path", (index or {}).get("data_path"))
    return (plan or {}).get("validated_version")


def _trained(instance: dg.DagsterInstance, validated: str) -> str | None:
    """Why ``validated`` counts as trained, or None."""
    succeeded = instance.get_runs(dg.RunsFilter(job_name="retrain_job", tags={VALIDATED_TAG: validated},
                                                statuses=[dg.DagsterRunStatus.SUCCESS]), limit=1)
    if succeeded:
        return f"already retrained on validated manifest {validated} (run {succeeded[0].run_id})"
    # The first tick after `make demo` (one run, no retrain_job): both stages saw exactly this
    # data. Pretrain alone is not enough: a pretrain-only run by hand leaves finetune behind.
    if all(_stage_validated_version(instance, stage) == validated for stage in TRAINED_STAGES):
        return (f"pretrain already trained on validated manifest {validated}, "
                f"and finetune on the same data (successful runs)")
    return None


@dataclass(frozen=True, slots=True)
class StepRuns:
    """Dagster's records of one step's runs, newest first."""

    undone: tuple[dg.DagsterRun, ...] = ()
    """Runs that ended failed or canceled."""
    in_flight: tuple[dg.DagsterRun, ...] = ()
    """Runs queued, starting, running or being canceled."""


def _step_runs(instance: dg.DagsterInstance, steps: list[str]) -> dict[str, StepRuns]:
    """Every step's undone and in-flight runs, in one query however many steps (shards) there are."""
    runs = instance.get_runs(dg.RunsFilter(tags={STEP_TAG: steps}, statuses=[*_ENDED_UNDONE, *_IN_FLIGHT]))
    found: dict[str, StepRuns] = {step: StepRuns() for step in steps}
    for run in runs:  # newest first
        step = run.tags.get(STEP_TAG)
        if step not in found:
            continue
        before = found[step]
        if run.status in _ENDED_UNDONE:
            found[step] = StepRuns(undone=(*before.undone, run), in_flight=before.in_flight)
        else:
            found[step] = StepRuns(undone=before.undone, in_flight=(*before.in_flight, run))
    return found


@dataclass(frozen=True, slots=True)
class Spent:
    """A step whose retry budget is spent."""

    step: str
    num_undone: int
    last_run_id: str

    def message(self) -> str:
        return (f"retry budget spent: step {self.step} failed {self.num_undone} of {MAX_ATTEMPTS} attempts "
                f"(failed or canceled; last run {self.last_run_id}); fix the cause and run it by hand, "
                f"the sensor will not retry it")


@dataclass(frozen=True, slots=True)
class InFlight:
    """A step with a run that has not ended: requesting another would run the step twice."""

    step: str
    run_id: str
    status: str

    def message(self) -> str:
        return (f"step {self.step} is in flight: run {self.run_id} is {self.status}; the sensor waits for it "
                f"to end (if it is stuck, cancel it and the sensor retries the step)")


def _request(instance: dg.DagsterInstance, step: str, job_name: str, validated: str, runs: StepRuns,
             **kwargs) -> dg.RunRequest | Spent | InFlight:
    """A run request whose key changes after each failed or canceled run of the same step, so such
    a run is retried on the next tick instead of being swallowed by Dagster's run-key deduplication;
    ``InFlight`` while a run of the step has not ended; or ``Spent`` once ``MAX_ATTEMPTS`` runs of the
    step failed or were canceled (the last one tagged so)."""
    if runs.in_flight:
        newest = runs.in_flight[0]
        return InFlight(step=step, run_id=newest.run_id, status=newest.status.value)
    num_undone = len(runs.undone)
    if num_undone >= MAX_ATTEMPTS:
        last = runs.undone[0]
        if BUDGET_TAG not in last.tags:
            instance.add_run_tags(last.run_id, {
                BUDGET_TAG: f"spent: {num_undone} of {MAX_ATTEMPTS} attempts failed or were canceled"})
        return Spent(step=step, num_undone=num_undone, last_run_id=last.run_id)
    tags = {STEP_TAG: step, VALIDATED_TAG: validated, ATTEMPT_TAG: f"{num_undone + 1} of {MAX_ATTEMPTS}"}
    return dg.RunRequest(run_key=f"{step}-attempt{num_undone}", job_name=job_name, tags=tags, **kwargs)


def _request_step(instance: dg.DagsterInstance, step: str, job_name: str,
                  validated: str) -> dg.RunRequest | dg.SkipReason:
    outcome = _request(instance, step, job_name, validated, _step_runs(instance, [step])[step])
    return outcome if isinstance(outcome, dg.RunRequest) else dg.SkipReason(outcome.message())


def _stale_shards(instance: dg.DagsterInstance, plan_version: str) -> list[str]:
    """Partitions whose latest materialization was not written for ``plan_version`` (partition
    keys repeat from plan to plan, so a shard of an older plan is stale, not fresh). Two queries
    however many partitions: the latest record id of each, then those records."""
    partitions = instance.get_dynamic_partitions(SHARD_PARTITIONS.name)
    shards = dg.AssetKey("clip_shards")
    latest = instance.get_latest_storage_id_by_partition(shards, dg.DagsterEventType.ASSET_MATERIALIZATION,
                                                         partitions=set(partitions))
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=shards, storage_ids=list(latest.values())),
        limit=len(latest)).records if latest else []
    written_for = {record.asset_materialization.partition:
                   getattr(record.asset_materialization.metadata.get("plan_version"), "value", None)
                   for record in records}
    return [key for key in partitions if written_for.get(key) != plan_version]


def _revoked_in_validated(instance: dg.DagsterInstance, validated: str) -> tuple[list[str], dict, str]:
    """(assets of the current validated set the rights ledger now revokes, that set's rules, the
    ledger's head): a revocation changes no file under the media root, so it must make the sensor
    validate again itself, or the chain would never leave the revoked asset out."""
    from ops.curation import quarantine, rights

    output = _latest_output(instance, "validated_manifest")
    path = output.get("data_path")
    if not path or not (Path(path) / quarantine.VALIDATED_FILE).exists():
        return [], {}, ""
    data_root = quarantine.data_root_of_validated(path)
    events = rights.read_events(data_root)
    revoked = rights.current(events)
    if not revoked:
        return [], {}, ""
    accepted = set(pq.read_table(Path(path) / quarantine.VALIDATED_FILE, columns=["asset_id"])
                   .column("asset_id").to_pylist())
    found = sorted(accepted & set(revoked))
    report = json.loads((Path(path) / quarantine.REPORT_FILE).read_text())
    return found, report.get("config", {}), events[-1]["chain"][:12]


def _revalidation_request(instance: dg.DagsterInstance, validated: str) -> dg.RunRequest | dg.SkipReason | None:
    from assets.data import ValidationRunConfig

    found, rules, head = _revoked_in_validated(instance, validated)
    if not found:
        return None
    # The same rules as the set being replaced: only the ledger changed.
    config = {name: value for name, value in rules.items() if name in ValidationRunConfig.model_fields}
    outcome = _request(instance, f"revalidate-{validated}-{head}", "revalidate_job", validated,
                       _step_runs(instance, [f"revalidate-{validated}-{head}"])[f"revalidate-{validated}-{head}"],
                       run_config={"ops": {"validated_manifest_and_quarantine": {"config": config}}})
    if isinstance(outcome, dg.RunRequest):
        return outcome
    return dg.SkipReason(f"{len(found)} asset(s) of validated manifest {validated} are revoked in the rights "
                         f"ledger; {outcome.message()}")


def _shard_requests(instance: dg.DagsterInstance, plan_version: str, stale: list[str], validated: str):
    steps = {key: f"shard-{plan_version}-{key}" for key in stale}
    runs = _step_runs(instance, list(steps.values()))
    outcomes = [_request(instance, step, "shards_job", validated, runs[step], partition_key=key)
                for key, step in steps.items()]
    requests = [outcome for outcome in outcomes if isinstance(outcome, dg.RunRequest)]
    if requests:
        return requests  # the spent shards wait: retrain_job needs every shard anyway
    return dg.SkipReason("; ".join(outcome.message() for outcome in outcomes))


@dg.sensor(jobs=[revalidate_job, plan_job, shards_job, retrain_job], minimum_interval_seconds=60,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Retrains when validated_manifest gets a new data version: plan, shards, then retrain_job.")
def retrain_sensor(context: dg.SensorEvaluationContext):
    instance = context.instance
    busy = runs_materializing(instance, RETRAIN_CHAIN)
    if busy:  # whatever that run produces is seen by the next tick
        return dg.SkipReason(f"run {busy[0]} is materializing the training chain now")
    validated = _data_version(instance, "validated_manifest")
    if validated is None:
        return dg.SkipReason("validated_manifest has not been materialized")
    revalidate = _revalidation_request(instance, validated)
    if revalidate is not None:  # a revoked asset is in the current set: a new set first, then plan without it
        return revalidate
    trained = _trained(instance, validated)
    if trained:
        return dg.SkipReason(trained)
    plan = _latest_output(instance, "clip_plan")
    if not plan or plan.get("validated_version") != validated:
        return _request_step(instance, f"plan-{validated}", "plan_job", validated)
    stale = _stale_shards(instance, plan["plan_version"])
    if stale:
        return _shard_requests(instance, plan["plan_version"], stale, validated)
    return _request_step(instance, f"retrain-{validated}", "retrain_job", validated)
