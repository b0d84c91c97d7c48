"""The one Definitions object (``defs``) that workspace.yaml, ``dagster dev`` and tests load.

Resources are chosen by ``TRAINYARD_ENV``: ``local`` (default) uses the embedded locations
under ``.trainyard/`` or the paths named by the TRAINYARD_* environment variables; ``slurm`` keeps
that storage and submits the training stages to SLURM (resources/slurm.py, set up by the
TRAINYARD_SLURM_* variables; docs/slurm.md); ``cluster`` (and ``cluster+slurm``) keeps Dagster on
PostgreSQL and MLflow on a tracking server, from the variables in pipelines/environment.py
(docs/cluster.md).
"""

from __future__ import annotations

import dagster as dg

from assets import checks, clips, data, evaluation, health, reports, reproduction, sweeps, training, training_faults
from pipelines.nodes import node_check_job
from pipelines.sensors import manifest_job, media_change_sensor
from pipelines.training import (
    fault_drill_job, nightly_fault_drill, nightly_restore_drill, plan_job, reproduction_job, restore_drill_job, retrain_job,
    retrain_sensor, revalidate_job, shards_job, erasure_job, weekly_reproduction)
from ops.publish import paths
from pipelines import environment
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher


def local_resources() -> dict:
    return {"storage": StorageResource.from_env(), "lineage": LineageResource(),
            "launcher": LocalTorchrunLauncher(mlflow_tracking_uri=paths.mlflow_tracking_uri())}


def cluster_resources() -> dict:
    """The team deployment: Dagster's storage is dagster.yaml's (PostgreSQL); MLflow is the tracking server.

    The server's address is read when a run starts (``EnvVar``), like every credential.
    """
    environment.load_cluster_env()
    return {**local_resources(),
            "launcher": LocalTorchrunLauncher(mlflow_tracking_uri=dg.EnvVar("MLFLOW_TRACKING_URI"))}


def resources_for(name: str) -> dict:
    deployment = environment.parse(name)
    resources = cluster_resources() if deployment.cluster else local_resources()
    if deployment.slurm:
        from resources.slurm import SlurmLauncher

        resources["launcher"] = SlurmLauncher.from_env()
    return resources


all_assets = [
    data.raw_media, data.dataset_manifest, data.validated_manifest_and_quarantine, data.rights_report,
    clips.clip_plan, clips.clip_shards, clips.shard_index, clips.data_profile, clips.loader_benchmark,
    training.step_profile, training.pretrain, training.finetune, training.restore_drill, training_faults.fault_drill,
    reproduction.reproduction,
    *evaluation.evaluation_assets, *reports.report_assets, *sweeps.sweep_assets,
]

# A sweep's trials and its report (pipelines/sweeps.py starts them; the UI can backfill sweep_trial_job).
sweep_trial_job = dg.define_asset_job("sweep_trial_job", selection=dg.AssetSelection.assets("sweep_trial"))
sweep_report_job = dg.define_asset_job("sweep_report_job", selection=dg.AssetSelection.assets("sweep_report"))

defs = dg.Definitions(
    assets=all_assets,
    asset_checks=[*checks.all_checks, *health.health_checks, *reports.report_checks],
    jobs=[manifest_job, revalidate_job, plan_job, shards_job, retrain_job, restore_drill_job, fault_drill_job,
          node_check_job, erasure_job, sweep_trial_job, sweep_report_job, reproduction_job],
    schedules=[nightly_restore_drill, nightly_fault_drill, weekly_reproduction],
    sensors=[media_change_sensor, retrain_sensor],
    resources=resources_for(environment.current().name),
)
