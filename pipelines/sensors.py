"""Sensors: new or changed media produce a new manifest version with no human in the loop."""


import dagster as dg

from ops.media import roots
from resources import StorageResource

IN_PROGRESS = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING]


def runs_materializing(instance: dg.DagsterInstance, keys: list[str]) -> list[str]:
    """Ids of queued or running runs that materialize any of ``keys``.

    A sensor skips while one exists: on a shared instance (TRAINYARD_ENV=cluster) somebody's
    `make demo`, a UI launch or a backfill may be producing the very version it would request.
    """
    wanted = {dg.AssetKey(key) for key in keys}
    runs = instance.get_runs(filters=dg.RunsFilter(statuses=IN_PROGRESS), limit=100)
    return [run.run_id for run in runs if run.asset_selection and wanted & set(run.asset_selection)]


def _instance_of(context: dg.SensorEvaluationContext) -> dg.DagsterInstance | None:
    """The context's instance; None where there is none (a context built without one, in a unit test)."""
    try:
        return context.instance
    except dg.DagsterInvariantViolationError:
        return None


MANIFEST_JOB_SELECTION = ["raw_media", "dataset_manifest", "validated_manifest", "quarantine"]
manifest_job = dg.define_asset_job(
    "manifest_job", selection=dg.AssetSelection.assets(*MANIFEST_JOB_SELECTION),
    description="Scan the media root, build a manifest version, validate it and record quarantine.",
)


@dg.sensor(job=manifest_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Requests manifest_job when files under the media root are added, removed or changed.")
def media_change_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
    # (path, size, mtime or ETag) from one listing: cheap enough for every tick; raw_media then hashes contents.
    fingerprint = roots.open_root(storage.media_root).fingerprint()
    if fingerprint is None:
        return dg.SkipReason(f"media root {storage.media_root} does not exist")
    if fingerprint == context.cursor:
        return dg.SkipReason("media root unchanged")
    instance = _instance_of(context)
    busy = runs_materializing(instance, ["raw_media"]) if instance is not None else []
    if busy:  # that run scans the media as they are now; the next tick compares again after it
        return dg.SkipReason(f"raw_media is being materialized by run {busy[0]}")
    context.update_cursor(fingerprint)
    return dg.RunRequest(run_key=f"media-{fingerprint}", tags={"trainyard/media_fingerprint": fingerprint})
