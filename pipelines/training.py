"""Training automation: the nightly restore drill, and retraining when the data changes.

``retrain_sensor`` watches ``validated_manifest``. When it gets a new data version, the sensor
walks the chain a data engineer would click through, one step per tick, each a run with a
run key so nothing is requested twice: plan the clips (``clip_plan``), build every shard of the
new plan (``clip_shards`` partitions, a backfill), then ``retrain_job`` (shard index,
pretrain, finetune, with their blocking checkpoint checks).
"""

import json

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
    description="Restore pretrain's newest committed checkpoint at another world size and compare.")

nightly_restore_drill = dg.ScheduleDefinition(
    name="nightly_restore_drill", job=restore_drill_job, cron_schedule="0 3 * * *",
    default_status=dg.DefaultScheduleStatus.RUNNING,
    description="Recovery is proven by restoring and training on, every night.")


def _data_version(instance: dg.DagsterInstance, key: str) -> str | None:
    record = instance.get_latest_data_version_record(dg.AssetKey(key))
    event = record.asset_event if record else None  # an EventLogRecord: the version is a tag of its event
    return (event.tags or {}).get("dagster/data_version") if event else None


def _latest_output(instance: dg.DagsterInstance, key: str) -> dict:
    event = instance.get_latest_materialization_event(dg.AssetKey(key))
    if event is None:
        return {}
    return {name: getattr(value, "value", value) for name, value in event.asset_materialization.metadata.items()}


def _request(instance: dg.DagsterInstance, step: str, job_name: str, **kwargs) -> dg.RunRequest:
    """A run request whose key changes after each failed run of the same step, so a failure is
    retried on the next tick instead of being swallowed by Dagster's run-key deduplication."""
    failed = instance.get_runs_count(dg.RunsFilter(tags={"trainyard/retrain_step": step},
                                                   statuses=[dg.DagsterRunStatus.FAILURE]))
    return dg.RunRequest(run_key=f"{step}-attempt{failed}", job_name=job_name,
                         tags={"trainyard/retrain_step": step}, **kwargs)


def _stale_shards(instance: dg.DagsterInstance, plan_version: str) -> list[str]:
    """Partitions whose latest materialization was not written for ``plan_version``."""
    stale = []
    for key in instance.get_dynamic_partitions(SHARD_PARTITIONS.name):
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("clip_shards"), asset_partitions=[key]), limit=1).records
        metadata = records[0].asset_materialization.metadata if records else {}
        written_for = getattr(metadata.get("plan_version"), "value", None)
        if written_for != plan_version:
            stale.append(key)
    return stale


@dg.sensor(jobs=[plan_job, shards_job, retrain_job], minimum_interval_seconds=60,
           default_status=dg.DefaultSensorStatus.RUNNING,
           description="Retrains when validated_manifest gets a new data version: plan, shards, then retrain_job.")
def retrain_sensor(context: dg.SensorEvaluationContext):
    instance = context.instance
    state = json.loads(context.cursor) if context.cursor else {}
    validated = _data_version(instance, "validated_manifest")
    if validated is None:
        return dg.SkipReason("validated_manifest has not been materialized")
    if state.get("trained") == validated:
        return dg.SkipReason(f"already retrained on validated manifest {validated}")
    manifest_version = _latest_output(instance, "validated_manifest").get("manifest_version")
    trained_on = _latest_output(instance, "pretrain").get("manifest_version")
    if manifest_version and trained_on == manifest_version:
        # e.g. the first tick after `make demo`: the models already saw this data.
        context.update_cursor(json.dumps({**state, "trained": validated}))
        return dg.SkipReason(f"pretrain already trained on manifest {manifest_version}")
    plan = _latest_output(instance, "clip_plan")
    if not plan or plan.get("validated_version") != validated:
        return _request(instance, f"plan-{validated}", "plan_job")
    stale = _stale_shards(instance, plan["plan_version"])
    if stale:
        return [_request(instance, f"shard-{plan['plan_version']}-{key}", "shards_job", partition_key=key)
                for key in stale]
    context.update_cursor(json.dumps({**state, "trained": validated}))
    return _request(instance, f"retrain-{validated}", "retrain_job")
