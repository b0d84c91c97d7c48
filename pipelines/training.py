"""Training automation: the nightly restore drill, and retraining when the data changes.

``retrain_sensor`` watches ``validated_manifest``. When it gets a new data version, the sensor
walks the chain a data engineer would click through, one step per tick, each a run with a
run key so nothing is requested twice: plan the clips (``clip_plan``), build every shard of the
new plan (``clip_shards`` partitions, a backfill), then ``retrain_job`` (shard index,
pretrain, finetune, with their blocking checkpoint checks).

What counts as done is read from Dagster's records on every tick, never remembered by the
sensor: a validated version is trained only when a ``retrain_job`` run for it succeeded, or
when pretrain's latest materialization came from a successful run whose shards trace back to
that very validated version (re-validating one manifest with other rules is new data). A
failed step is requested again under a new run key, up to ``MAX_ATTEMPTS`` runs per step;
then the sensor stops asking, says so in its skip reason and tags the last failed run.
"""

from __future__ import annotations

from dataclasses import dataclass

import dagster as dg

from assets.shards import SHARD_PARTITIONS

plan_job = dg.define_asset_job("plan_job", selection=dg.AssetSelection.assets("clip_plan"),
                               description="Plan clips and shard partitions for the current validated manifest.")
# Partitioned by clip_shards' own SHARD_PARTITIONS (inferred: passing it is deprecated in Dagster 1.13).
shards_job = dg.define_asset_job("shards_job", selection=dg.AssetSelection.assets("clip_shards"),
                                 description="Write clip shards (one per partition).")
retrain_job = dg.define_asset_job(
    "retrain_job", selection=dg.AssetSelection.assets("shard_index", "pretrain", "finetune"),
    description="Index the shards, pretrain and fine-tune on them (blocking checkpoint checks included).")
restore_drill_job = dg.define_asset_job(
    "restore_drill_job", selection=dg.AssetSelection.assets("restore_drill"),
    description="Restore pretrain's second-newest committed checkpoint, train to its newest and compare with it.")

nightly_restore_drill = dg.ScheduleDefinition(
    name="nightly_restore_drill", job=restore_drill_job, cron_schedule="0 3 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Recovery is proven by restoring and training on, every night.")

MAX_ATTEMPTS = 3
"""Runs the sensor requests for one step (plan, one shard, retrain) before it gives up on it."""
STEP_TAG = "trainyard/retrain_step"
VALIDATED_TAG = "trainyard/validated_version"
ATTEMPT_TAG = "trainyard/attempt"
BUDGET_TAG = "trainyard/retry_budget"
"""Set on the last failed run of a step whose budget is spent: why no further run follows."""
_LOOKBACK = 100  # materializations searched when tracing pretrain's data back to its validated version


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


def _pretrain_validated_version(instance: dg.DagsterInstance) -> str | None:
    """The validated version pretrain's latest materialization was trained on, if its run succeeded:
    pretrain -> its shard_index version -> that index's plan folder -> the plan's validated version."""
    event = instance.get_latest_materialization_event(dg.AssetKey("pretrain"))
    if event is None:
        return None
    run = instance.get_run_by_id(event.run_id)
    if run is None or run.status != dg.DagsterRunStatus.SUCCESS:
        return None  # e.g. pretrain materialized but finetune or a blocking check failed
    pretrain = _values(event.asset_materialization.metadata)
    index = _find_output(instance, "shard_index", "shard_index_version", pretrain.get("shard_index_version"))
    plan = _find_output(instance, "clip_plan", "data_path", (index or {}).get("data_path"))
    return (plan or {}).get("validated_version")


def _trained(instance: dg.DagsterInstance, validated: str) -> str | None:
    """Why ``validated`` counts as trained, or None."""
    succeeded = instance.get_runs(dg.RunsFilter(job_name="retrain_job", tags={VALIDATED_TAG: validated},
                                                statuses=[dg.DagsterRunStatus.SUCCESS]), limit=1)
    if succeeded:
        return f"already retrained on validated manifest {validated} (run {succeeded[0].run_id})"
    if _pretrain_validated_version(instance) == validated:
        # e.g. the first tick after `make demo`: the models already saw exactly this data.
        return f"pretrain already trained on validated manifest {validated}"
    return None


@dataclass(frozen=True, slots=True)
class Spent:
    """A step whose retry budget is spent."""

    step: str
    num_failed: int
    last_run_id: str

    def message(self) -> str:
        return (f"retry budget spent: step {self.step} failed {self.num_failed} of {MAX_ATTEMPTS} attempts "
                f"(last run {self.last_run_id}); fix the cause and run it by hand, the sensor will not retry it")


def _request(instance: dg.DagsterInstance, step: str, job_name: str, validated: str,
             **kwargs) -> dg.RunRequest | Spent:
    """A run request whose key changes after each failed run of the same step, so a failure is
    retried on the next tick instead of being swallowed by Dagster's run-key deduplication; or
    ``Spent`` once ``MAX_ATTEMPTS`` runs of the step failed (the last one tagged so)."""
    failed = instance.get_runs(dg.RunsFilter(tags={STEP_TAG: step}, statuses=[dg.DagsterRunStatus.FAILURE]))
    if len(failed) >= MAX_ATTEMPTS:
        last = failed[0]  # newest first
        spent = Spent(step=step, num_failed=len(failed), last_run_id=last.run_id)
        if BUDGET_TAG not in last.tags:
            instance.add_run_tags(last.run_id, {BUDGET_TAG: f"spent: {len(failed)} of {MAX_ATTEMPTS} attempts failed"})
        return spent
    tags = {STEP_TAG: step, VALIDATED_TAG: validated, ATTEMPT_TAG: f"{len(failed) + 1} of {MAX_ATTEMPTS}"}
    return dg.RunRequest(run_key=f"{step}-attempt{len(failed)}", job_name=job_name, tags=tags, **kwargs)


def _stale_shards(instance: dg.DagsterInstance, plan_version: str) -> list[str]:
    """Partitions whose latest materialization was not written for ``plan_version`` (partition
    keys repeat from plan to plan, so a shard of an older plan is stale, not fresh)."""
    stale = []
    for key in instance.get_dynamic_partitions(SHARD_PARTITIONS.name):
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("clip_shards"), asset_partitions=[key]), limit=1).records
        metadata = records[0].asset_materialization.metadata if records else {}
        written_for = getattr(metadata.get("plan_version"), "value", None)
        if written_for != plan_version:
            stale.append(key)
    return stale


def _shard_requests(instance: dg.DagsterInstance, plan_version: str, stale: list[str], validated: str):
    outcomes = [_request(instance, f"shard-{plan_version}-{key}", "shards_job", validated, partition_key=key)
                for key in stale]
    requests = [outcome for outcome in outcomes if isinstance(outcome, dg.RunRequest)]
    spent = [outcome for outcome in outcomes if isinstance(outcome, Spent)]
    if requests:
        return requests  # the spent shards wait: retrain_job needs every shard anyway
    return dg.SkipReason("; ".join(outcome.message() for outcome in spent))


def _outcome(result: dg.RunRequest | Spent) -> dg.RunRequest | dg.SkipReason:
    return dg.SkipReason(result.message()) if isinstance(result, Spent) else result


@dg.sensor(jobs=[plan_job, shards_job, retrain_job], minimum_interval_seconds=60,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Retrains when validated_manifest gets a new data version: plan, shards, then retrain_job.")
def retrain_sensor(context: dg.SensorEvaluationContext):
    instance = context.instance
    validated = _data_version(instance, "validated_manifest")
    if validated is None:
        return dg.SkipReason("validated_manifest has not been materialized")
    trained = _trained(instance, validated)
    if trained:
        return dg.SkipReason(trained)
    plan = _latest_output(instance, "clip_plan")
    if not plan or plan.get("validated_version") != validated:
        return _outcome(_request(instance, f"plan-{validated}", "plan_job", validated))
    stale = _stale_shards(instance, plan["plan_version"])
    if stale:
        return _shard_requests(instance, plan["plan_version"], stale, validated)
    return _outcome(_request(instance, f"retrain-{validated}", "retrain_job", validated))
