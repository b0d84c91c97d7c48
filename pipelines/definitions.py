"""The one Definitions object (``defs``) that workspace.yaml, ``dagster dev`` and tests load.

Resources are chosen by ``TRAINYARD_ENV``: ``local`` (default) uses the embedded locations
under ``.trainyard/`` or the paths named by the TRAINYARD_* environment variables; ``slurm`` keeps
that storage and submits the training stages to SLURM (resources/slurm.py, set up by the
TRAINYARD_SLURM_* variables; docs/slurm.md).
"""

from __future__ import annotations

import os

import dagster as dg

from assets import checks, faults, media, profile, shards, training
from pipelines.sensors import manifest_job, media_change_sensor
from pipelines.training import (
    nightly_restore_drill, plan_job, restore_drill_job, retrain_job, retrain_sensor, shards_job)
from ops import paths
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher

ENVIRONMENTS = ("local", "slurm")


def local_resources() -> dict:
    return {"storage": StorageResource.from_env(), "lineage": LineageResource(),
            "launcher": LocalTorchrunLauncher(mlflow_tracking_uri=paths.mlflow_tracking_uri())}


def resources_for(environment: str) -> dict:
    if environment == "local":
        return local_resources()
    if environment == "slurm":
        from resources.slurm import SlurmLauncher

        return {**local_resources(), "launcher": SlurmLauncher.from_env()}
    raise ValueError(f"TRAINYARD_ENV={environment!r} is not one of {ENVIRONMENTS}")


all_assets = [
    media.raw_media, media.dataset_manifest, media.validated_manifest_and_quarantine,
    shards.clip_plan, shards.clip_shards, shards.shard_index, profile.data_profile, profile.loader_benchmark,
    training.step_profile, training.pretrain, training.finetune, training.restore_drill, faults.fault_drill,
]

defs = dg.Definitions(
    assets=all_assets,
    asset_checks=checks.all_checks,
    jobs=[manifest_job, plan_job, shards_job, retrain_job, restore_drill_job, faults.fault_drill_job],
    schedules=[nightly_restore_drill, faults.nightly_fault_drill],
    sensors=[media_change_sensor, retrain_sensor],
    resources=resources_for(os.environ.get("TRAINYARD_ENV", "local")),
)
