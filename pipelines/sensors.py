"""Sensors: new or changed media produce a new manifest version with no human in the loop."""


import dagster as dg

from ops import scan
from resources import StorageResource

MANIFEST_JOB_SELECTION = ["raw_media", "dataset_manifest", "validated_manifest", "quarantine"]
manifest_job = dg.define_asset_job(
    "manifest_job", selection=dg.AssetSelection.assets(*MANIFEST_JOB_SELECTION),
    description="Scan the media root, build a manifest version, validate it and record quarantine.",
)


@dg.sensor(job=manifest_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
           description="Requests manifest_job when files under the media root are added, removed or changed.")
def media_change_sensor(context: dg.SensorEvaluationContext, storage: StorageResource):
    if not storage.media.is_dir():
        return dg.SkipReason(f"media root {storage.media_root} does not exist")
    # (path, size, mtime) only: cheap enough for every tick; raw_media then hashes contents.
    fingerprint = scan.quick_fingerprint(storage.media)
    if fingerprint == context.cursor:
        return dg.SkipReason("media root unchanged")
    context.update_cursor(fingerprint)
    return dg.RunRequest(run_key=f"media-{fingerprint}", tags={"trainyard/media_fingerprint": fingerprint})
