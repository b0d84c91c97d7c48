"""Asset tests of the training stage: step_profile -> pretrain -> finetune, restore_drill, and the
retrain sensor, materialized through Dagster on a temporary SQLite instance with real torchrun
launches (2 gloo ranks on CPU) of a tiny model (configs/test_tiny.yaml) on the demo's shards.

The module fixture builds the data once, the way ``make demo`` does (media -> validated manifest,
then clip_plan, then one run per clip_shards partition, then shard_index), evaluating the retrain
sensor between the stages, and then runs step_profile and pretrain once; the tests share them.
Later tests add runs (a retry, finetune, drills) on the same instance, so they run in file order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg
import pytest
from helpers import DEMO_MAX_QUARANTINE_FRACTION, captured_fds, copy_media
from mlflow.tracking import MlflowClient

from assets import checks, stage_runs, training
import pyarrow.compute as pc

from cli.main import main
from ops.checkpoints import store as checkpoint_store
from ops.curation import rights
from ops.clips.plan import read_plan
from ops.clips.shard_ref import ShardIndexRef
from ops.clips.shards import read_index
from pipelines.definitions import all_assets, defs
from pipelines.training import retrain_sensor
from resources import LineageResource, StorageResource
from resources.launcher import CANCEL_MARKER, LocalTorchrunLauncher
from ops.checkpoints import mirror
from trainer.launch.stage_launch import StageLaunch

CONFIG = "configs/test_tiny.yaml"
STEPS, CHECKPOINT_EVERY = 6, 3
SECRET_ENV, SECRET = "TRAINYARD_TEST_API_TOKEN", "tok-sekret-9f3a"
LINEAGE_FIELDS = ("git_commit", "git_dirty", "container_digest", "env_digest", "manifest_version", "config_hash",
                  "code_version")
CHECKPOINT_CHECKS = {"checkpoint_committed", "checkpoint_integrity"}
MEDIA_STAGE = [dg.AssetKey(key) for key in ("raw_media", "dataset_manifest", "validated_manifest", "quarantine")]
PLAN, SHARDS, INDEX = dg.AssetKey("clip_plan"), dg.AssetKey("clip_shards"), dg.AssetKey("shard_index")
PRETRAIN = dg.AssetKey("pretrain")
_QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


def _stage_config(op: str, **config) -> dict:
    return {**_QUIET, "ops": {op: {"config": {"config_path": CONFIG, **config}}}}


# The secret reaches the trainer's config the documented way (an ${env:...} reference), so the
# redaction is exercised in the config, the params and the checkpoint's lineage, not only in env.
PRETRAIN_CONFIG = _stage_config("pretrain", steps=STEPS, nproc=2,
                                overrides=[f"data.storage_token=${{env:{SECRET_ENV}}}"])


def _materializations(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetMaterialization]:
    return {event.asset_key.to_user_string(): event.materialization
            for event in result.get_asset_materialization_events()}


def _metadata(result: dg.ExecuteInProcessResult, key: str) -> dict:
    return {name: getattr(value, "value", value) for name, value in _materializations(result)[key].metadata.items()}


def _checks(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetCheckEvaluation]:
    return {evaluation.check_name: evaluation for evaluation in result.get_asset_check_evaluations()}


def _failure_messages(result: dg.ExecuteInProcessResult) -> list[str]:
    return [event.message or "" for event in result.all_events if event.is_failure]


@dataclass(kw_only=True)
class Lab:
    instance: dg.DagsterInstance
    job: dg.JobDefinition
    storage: StorageResource
    launcher: LocalTorchrunLauncher
    mlflow_uri: str
    shard_index: ShardIndexRef | None
    sensor: dict[str, object] = field(default_factory=dict)
    """Stage name -> what retrain_sensor returned right after it."""
    step_profile: dg.ExecuteInProcessResult | None = None
    pretrain: dg.ExecuteInProcessResult | None = None
    pretrain_output: Path | None = None
    """stdout and stderr of this process and its children while pretrain ran."""

    def run(self, selection: list[dg.AssetKey], *, ok: bool = True, **kwargs) -> dg.ExecuteInProcessResult:
        result = self.job.execute_in_process(instance=self.instance, asset_selection=selection,
                                             raise_on_error=False, **kwargs)
        if ok:
            assert result.success, _failure_messages(result)
        return result

    @property
    def mlflow(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.mlflow_uri)

    def run_dirs(self) -> set[str]:
        runs = self.storage.data / "runs"
        return {path.name for path in runs.iterdir()} if runs.exists() else set()


def _sensor_tick(lab: Lab, name: str, cursor: str | None) -> str | None:
    context = dg.build_sensor_context(instance=lab.instance, cursor=cursor)
    lab.sensor[name] = retrain_sensor(context)
    return context.cursor


@pytest.fixture(scope="module")
def lab(demo, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("training_assets")
    media_root = copy_media(demo.out_dir, base / "media")
    mlflow_uri = f"sqlite:///{base / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as patch:
        # Function-scoped fixtures (conftest's isolated_locations) come later; until then this
        # module's own locations, so nothing here reaches the checkout's .trainyard/.
        patch.setenv("TRAINYARD_HOME", str(base / "home"))
        patch.setenv("TRAINYARD_DATA_ROOT", str(base / "data"))
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
        patch.delenv("TRAINYARD_CONTAINER_DIGEST", raising=False)
        patch.setenv(SECRET_ENV, SECRET)
        # Records are signed by default with a key under TRAINYARD_HOME, which conftest moves per
        # test: the deployment way (the env var) keeps one key for this module's runs and checks.
        patch.setenv(checkpoint_store.HMAC_KEY_ENV, "training-assets-module-key")
        storage = StorageResource(media_root=str(media_root), data_root=str(base / "data"))
        # The cancel tests hold a cancelled launch to end before this, i.e. gracefully, never by the
        # SIGKILL after it: on a loaded 2-core machine the graceful end (the agreed stop, the policy's
        # records, MLflow tagged) has taken up to 20 s, so the kill is well beyond that.
        launcher = LocalTorchrunLauncher(mlflow_tracking_uri=mlflow_uri, termination_timeout_s=45.0)
        definitions = dg.Definitions(assets=all_assets, asset_checks=checks.all_checks,
                                     resources={"storage": storage, "lineage": LineageResource(),
                                                "launcher": launcher})
        job = definitions.resolve_implicit_global_asset_job_def()
        (base / "dagster").mkdir()
        with dg.DagsterInstance.local_temp(tempdir=str(base / "dagster")) as instance:
            lab = Lab(instance=instance, job=job, storage=storage, launcher=launcher, mlflow_uri=mlflow_uri,
                      shard_index=None)
            validation = {"ops": {"validated_manifest_and_quarantine": {"config": {
                "max_quarantine_fraction": DEMO_MAX_QUARANTINE_FRACTION}}}}
            lab.run(MEDIA_STAGE, run_config={**_QUIET, **validation})
            cursor = _sensor_tick(lab, "validated", None)
            cursor = _sensor_tick(lab, "validated_again", cursor)
            lab.run([PLAN], run_config=_QUIET)
            cursor = _sensor_tick(lab, "planned", cursor)
            first, *rest = instance.get_dynamic_partitions("clip_shards")
            lab.run([SHARDS], partition_key=first, run_config=_QUIET)
            cursor = _sensor_tick(lab, "partly_sharded", cursor)
            for partition in rest:
                lab.run([SHARDS], partition_key=partition, run_config=_QUIET)
            cursor = _sensor_tick(lab, "sharded", cursor)
            _sensor_tick(lab, "retrain_requested", cursor)
            index = lab.run([INDEX], run_config=_QUIET)
            lab.shard_index = index.output_for_node("shard_index")
            lab.step_profile = lab.run([dg.AssetKey("step_profile")],
                                       run_config=_stage_config("step_profile", steps=6))
            with captured_fds(base / "pretrain_output.log"):
                lab.pretrain = lab.run([PRETRAIN], run_config=PRETRAIN_CONFIG)
            lab.pretrain_output = base / "pretrain_output.log"
            yield lab


# ---------------------------------------------------------------------------------------------
# Definitions and the retrain sensor


def test_restore_drill_job_runs_nightly_at_three() -> None:
    schedule = defs.resolve_schedule_def("nightly_restore_drill")
    assert schedule.job_name == "restore_drill_job" and schedule.cron_schedule == "0 3 * * *"
    assert schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    job = defs.resolve_job_def("restore_drill_job")
    assert {key.to_user_string() for key in job.asset_layer.selected_asset_keys} == {"restore_drill"}
    sensor = defs.resolve_sensor_def("retrain_sensor")
    assert {target.job_name for target in sensor.targets} == {"revalidate_job", "plan_job", "shards_job", "retrain_job"}


def test_retrain_sensor_walks_plan_shards_retrain_then_skips(lab: Lab) -> None:
    validated = lab.instance.get_latest_materialization_event(dg.AssetKey("validated_manifest"))
    version = validated.asset_materialization.tags["dagster/data_version"]
    plan = lab.sensor["validated"]
    assert isinstance(plan, dg.RunRequest)
    assert (plan.job_name, plan.run_key) == ("plan_job", f"plan-{version}-attempt0")
    # Until clip_plan exists the same request is repeated: the run key makes it idempotent,
    # and a failed plan run would change the key (attempt1) so the step is retried.
    again = lab.sensor["validated_again"]
    assert isinstance(again, dg.RunRequest) and again.run_key == plan.run_key
    shards = lab.sensor["planned"]
    partitions = lab.instance.get_dynamic_partitions("clip_shards")
    assert isinstance(shards, list) and len(partitions) >= 2
    assert {request.job_name for request in shards} == {"shards_job"}
    assert sorted(request.partition_key for request in shards) == sorted(partitions)
    assert len({request.run_key for request in shards}) == len(partitions)
    rest = lab.sensor["partly_sharded"]  # one partition built since: only the others are requested
    assert sorted(request.partition_key for request in rest) == sorted(partitions[1:])
    assert {request.run_key for request in rest} < {request.run_key for request in shards}
    retrain = lab.sensor["sharded"]
    assert isinstance(retrain, dg.RunRequest)
    assert (retrain.job_name, retrain.run_key) == ("retrain_job", f"retrain-{version}-attempt0")
    # Requested is not trained: until a retrain_job run for this version succeeds, the same
    # (deduplicated) request is repeated; a failed one would be retried as attempt1.
    again = lab.sensor["retrain_requested"]
    assert isinstance(again, dg.RunRequest) and again.run_key == retrain.run_key
    assert retrain.tags["trainyard/validated_version"] == version


# ---------------------------------------------------------------------------------------------
# step_profile and pretrain


def test_step_profile_reports_phases_throughput_and_a_verdict(lab: Lab) -> None:
    metadata = _metadata(lab.step_profile, "step_profile")
    assert metadata["status"] == "completed" and metadata["world_size"] == 1
    for phase in ("data_wait", "host_to_device", "forward", "backward", "optimizer"):
        assert metadata[f"perf/phase_medians_s/{phase}"] >= 0, phase
    assert metadata["perf/phase_medians_s/forward"] > 0 and metadata["perf/phase_medians_s/backward"] > 0
    assert metadata["perf/samples_per_s"] > 0 and metadata["perf/tokens_per_s"] > 0
    assert metadata["perf/num_steady_steps"] >= 1
    assert metadata["perf/verdict"] in ("input-bound", "compute-bound", "communication-bound")
    assert (Path(metadata["run_dir"]) / "profile" / "trace_rank0.json").is_file()


def test_pretrain_reports_its_run_through_pipes(lab: Lab) -> None:
    metadata = _metadata(lab.pretrain, "pretrain")
    run_dir = Path(metadata["run_dir"])
    assert metadata["status"] == "completed" and metadata["final_step"] == STEPS
    assert metadata["world_size"] == 2 and metadata["run_id"] == run_dir.name
    assert metadata["checkpoint"] == str(run_dir / "checkpoints" / f"step_{STEPS:06d}")
    assert metadata["checkpoint_step"] == STEPS and metadata["retry_of"] == "none"
    assert metadata["mlflow_run_id"] and metadata["launch_manifest"] == str(run_dir / "launch.json")
    for name in LINEAGE_FIELDS:
        assert metadata[name] not in (None, ""), name
    manifest_version = read_index(lab.shard_index.path).manifest_version
    assert metadata["manifest_version"] == manifest_version
    assert {name: evaluation.passed for name, evaluation in _checks(lab.pretrain).items()} == dict.fromkeys(
        CHECKPOINT_CHECKS, True)
    assert checkpoint_store.verify(metadata["checkpoint"], expected_run_id=metadata["run_id"]).ok
    committed = [info.step for info in checkpoint_store.list_checkpoints(run_dir) if info.status == "committed"]
    assert committed == list(range(CHECKPOINT_EVERY, STEPS + 1, CHECKPOINT_EVERY))
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and len(final["losses"]) == STEPS
    assert metadata["final_loss"] == final["losses"][-1]
    # Where the start-up went (trainer/observe/startup.py), from the run's request to its first step: the
    # Dagster process's marks reach rank 0 through Pipes; final.json, the metadata and MLflow agree.
    startup = final["startup"]
    for phase in ("step_started", "preflight", "memory_estimate", "launched", "process_started", "imports", "rendezvous",
                  "rank_preflight", "model_build", "loader_start", "plugins", "checkpoint_load", "first_batch",
                  "first_step", "first_checkpoint"):
        assert startup["phases"][phase] >= 0, phase
    assert startup["first_mark"] == "requested" and list(startup["marks"])[-1] == "first_checkpoint"
    before_first = sum(seconds for name, seconds in startup["phases"].items() if name != "first_checkpoint")
    assert abs(before_first - startup["to_first_step_s"]) < 0.01 and 0 < startup["to_first_step_s"] < 120
    assert metadata["startup/to_first_step_s"] == startup["to_first_step_s"]
    assert metadata["startup/largest_phase"] == startup["largest_phase"]
    assert lab.mlflow.get_run(metadata["mlflow_run_id"]).data.metrics["startup/to_first_step_s"] == pytest.approx(
        startup["to_first_step_s"])
    # The launch report (trainer/launch/report.py): observed before the launch, then on the materialization.
    report = metadata["launch_report"]
    assert report.startswith(f"## pretrain: run {metadata['run_id']} on 2 rank(s)\n")
    assert "| world size | 2 rank(s), parallelism ddp |" in report and "| peak (estimate) |" in report
    assert f"| parameters | {final['num_params']:,} |" in report
    assert (run_dir / stage_runs.LAUNCH_REPORT_FILE).read_text() == report
    observed = [event.asset_observation_data.asset_observation.metadata["launch_report"].value
                for event in lab.pretrain.get_asset_observation_events() if event.asset_key == PRETRAIN]
    assert observed == [report]
    # The environment it ran in, with its lineage: final.json, the metadata and the MLflow params.
    import platform
    import socket

    assert final["environment"]["host"] == metadata["env/host"] == socket.gethostname()
    assert metadata["env/python"] == platform.python_version() and metadata["env/node_count"] == 1
    assert lab.mlflow.get_run(metadata["mlflow_run_id"]).data.params["environment.torch"] == final["environment"]["torch"]
    # Progress in the Dagster run's log (trainer/observe/pipes.py): counts, rate and time left.
    logs = [entry.user_message for entry in lab.instance.all_logs(lab.pretrain.run_id)]
    assert any(message.startswith(f"step {STEPS}/{STEPS} (100%, ") and "steps/s" in message for message in logs), logs
    assert any(f"/{STEPS} (" in message and " left) loss " in message for message in logs), logs


def test_pretrain_mlflow_run_holds_lineage_params_and_per_step_loss(lab: Lab) -> None:
    metadata = _metadata(lab.pretrain, "pretrain")
    run = lab.mlflow.get_run(metadata["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    for name in ("git_commit", "container_digest", "manifest_version", "config_hash", "code_version"):
        assert tags[name] == str(metadata[name]), name
    assert (tags["world_size"], tags["precision"], tags["precision_requested"]) == ("2", "fp32", "auto")
    assert tags["parent_checkpoint"] == "none" and tags["dagster_run_id"] == lab.pretrain.run_id
    assert tags["run_id"] == metadata["run_id"] and "retry_of" not in tags
    params = run.data.params
    assert params["train.steps"] == str(STEPS) and params["train.parallelism"] == "ddp"
    assert params["data.manifest_version"] == metadata["manifest_version"]
    assert params["model.dim"] == "32" and params["data.storage_token"] == "***"
    history = lab.mlflow.get_metric_history(run.info.run_id, "loss")
    assert sorted(metric.step for metric in history) == list(range(1, STEPS + 1))
    final = json.loads((Path(metadata["run_dir"]) / "final.json").read_text())
    assert [metric.value for metric in sorted(history, key=lambda m: m.step)] == pytest.approx(final["losses"])


def test_pretrain_launch_manifest_records_the_resolved_run(lab: Lab) -> None:
    metadata = _metadata(lab.pretrain, "pretrain")
    launch = json.loads(Path(metadata["launch_manifest"]).read_text())
    final = json.loads((Path(metadata["run_dir"]) / "final.json").read_text())
    assert (launch["world_size"], launch["precision"], launch["seed"]) == (2, "auto", 0)  # as configured
    assert final["precision"]["policy"] == "fp32" and final["launch_plan"]["precision"] == "fp32"  # what ran, on CPU
    assert launch["run_id"] == metadata["run_id"] and launch["dagster_run_id"] == lab.pretrain.run_id
    assert launch["config"]["train"]["steps"] == STEPS and launch["config"]["model"]["dim"] == 32
    assert launch["config"] == final["config"], "the launch manifest must record the config the ranks ran"
    assert launch["manifest_version"] == metadata["manifest_version"]
    assert (Path(metadata["run_dir"]) / "launch" / f"{lab.pretrain.run_id}.json").is_file()
    read = StageLaunch.read(metadata["launch_manifest"])
    assert read.data == lab.shard_index and read.overrides() == launch["overrides"]
    keys = [override.partition("=")[0] for override in launch["overrides"]]
    assert len(keys) == len(set(keys)), "each override key once"


def _strings(value) -> list[str]:
    if isinstance(value, dict):
        return [text for key, item in value.items() for text in (str(key), *_strings(item))]
    if isinstance(value, (list, tuple)):
        return [text for item in value for text in _strings(item)]
    return [str(value)]


def test_pretrain_secret_reaches_no_record(lab: Lab) -> None:
    metadata = _metadata(lab.pretrain, "pretrain")
    run_dir, run_id = Path(metadata["run_dir"]), lab.pretrain.run_id
    run = lab.mlflow.get_run(metadata["mlflow_run_id"])
    assert run.data.params["data.storage_token"] == "***", "the secret did not reach the config: no test"
    records = {
        "mlflow params": _strings(run.data.params), "mlflow tags": _strings(run.data.tags),
        "mlflow metric keys": list(run.data.metrics),
        "materialization metadata": _strings(metadata),
        "check metadata": [text for evaluation in lab.pretrain.get_asset_check_evaluations()
                           for text in _strings({k: getattr(v, "value", v) for k, v in evaluation.metadata.items()})],
        "dagster run config": _strings(lab.instance.get_run_by_id(run_id).run_config),
        "dagster event log": [entry.message or "" for entry in lab.instance.all_logs(run_id)]
                             + [str(entry.dagster_event) for entry in lab.instance.all_logs(run_id)],
    }
    for name, texts in records.items():
        assert not [text for text in texts if SECRET in text], name
    files = [path for path in run_dir.rglob("*") if path.is_file()]
    compute_logs = [path for path in (Path(lab.instance.root_directory) / "storage" / run_id).rglob("*")
                    if path.is_file()]
    assert {"launch.json", "final.json"} <= {path.name for path in files}
    captured = lab.pretrain_output.read_bytes()
    assert b"step 6/6" in captured and b'"storage_token": "***"' in captured, "the ranks' output was not captured"
    for path in [*files, *compute_logs, lab.pretrain_output]:
        assert SECRET.encode() not in path.read_bytes(), path


# ---------------------------------------------------------------------------------------------
# Retry, next stage, restore drill


def test_rematerializing_pretrain_is_a_retry_that_resumes_its_checkpoint(lab: Lab) -> None:
    first = _metadata(lab.pretrain, "pretrain")
    retry = lab.run([PRETRAIN], run_config=PRETRAIN_CONFIG)
    metadata = _metadata(retry, "pretrain")
    assert metadata["run_id"] == first["run_id"] and metadata["retry_of"] == first["mlflow_run_id"]
    assert metadata["final_step"] == STEPS and metadata["checkpoint"] == first["checkpoint"]
    assert {name: evaluation.passed for name, evaluation in _checks(retry).items()} == dict.fromkeys(
        CHECKPOINT_CHECKS, True)
    run = lab.mlflow.get_run(metadata["mlflow_run_id"])
    assert metadata["mlflow_run_id"] != first["mlflow_run_id"]
    assert run.data.tags["retry_of"] == first["mlflow_run_id"] and run.info.status == "FINISHED"
    assert lab.mlflow.get_metric_history(run.info.run_id, "loss") == [], "a finished run must not train again"
    startup = json.loads((Path(metadata["run_dir"]) / "samples" / "rank_0.json").read_text())["startup"]
    assert startup["restored_step"] == STEPS


def test_finetune_starts_from_pretrains_checkpoint(lab: Lab) -> None:
    parent = lab.instance.get_latest_materialization_event(PRETRAIN).asset_materialization.metadata
    result = lab.run([dg.AssetKey("finetune")], run_config=_stage_config("finetune", steps=3, nproc=2))
    metadata = _metadata(result, "finetune")
    assert metadata["parent_checkpoint"] == parent["checkpoint"].value
    assert metadata["status"] == "completed" and metadata["final_step"] == 3
    assert metadata["run_id"] != parent["run_id"].value
    assert {name: evaluation.passed for name, evaluation in _checks(result).items()} == dict.fromkeys(
        CHECKPOINT_CHECKS, True)
    run = lab.mlflow.get_run(metadata["mlflow_run_id"])
    assert run.data.tags["parent_checkpoint"] == parent["checkpoint"].value
    assert run.data.tags["stage"] == "finetune" and run.data.params["stage.init_from"] == parent["checkpoint"].value


# ---------------------------------------------------------------------------------------------
# Evaluation of a stage's checkpoint (assets/evaluation.py)

EVALUATION = dg.AssetKey(["evaluation", "pretrain"])


def _evaluation_config(**config) -> dict:
    return {**_QUIET, "ops": {"evaluation__pretrain": {"config": config}}}


def test_evaluation_records_test_loss_samples_and_the_checkpoint_with_its_lineage(lab: Lab,
                                                                               monkeypatch) -> None:
    import base64

    import av

    # The latest pretrain (an earlier test rematerialized it: a retry with its own MLflow run), as the asset reads it.
    latest = lab.instance.get_latest_materialization_event(PRETRAIN).asset_materialization
    parent = {name: getattr(value, "value", value) for name, value in latest.metadata.items()}
    first = lab.run([EVALUATION], run_config=_evaluation_config(nproc=2))
    metadata = _metadata(first, "evaluation/pretrain")
    assert metadata["status"] == "ok" and metadata["split"] == "test" and metadata["world_size"] == 2
    assert metadata["checkpoint"] == parent["checkpoint"] and metadata["checkpoint_step"] == STEPS
    assert metadata["checkpoint_lineage/run_id"] == parent["run_id"]
    # The checkpoint's own lineage: the attempt that wrote it (the first pretrain), not the retry.
    assert metadata["checkpoint_lineage/config_hash"] == _metadata(lab.pretrain, "pretrain")["config_hash"]
    assert all(metadata[name] not in (None, "") for name in LINEAGE_FIELDS)
    assert metadata["test/loss"] > 0 and metadata["num_samples"] > 0
    assert len([name for name in metadata if name.startswith("test/loss_t")]) == 8
    assert metadata["previous_loss"].startswith("none")
    sheet = metadata["contact_sheet"].split("base64,", 1)[1].rstrip(")")
    assert base64.b64decode(sheet).startswith(b"\x89PNG\r\n\x1a\n")
    with av.open(metadata["samples/0"]) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert frames and frames[0].shape[2] == 3
    assert _checks(first)["no_regression"].passed
    # The figures and samples went to pretrain's own MLflow run, at the checkpoint's step.
    history = lab.mlflow.get_metric_history(parent["mlflow_run_id"], "test/loss")
    assert [(point.step, point.value) for point in history] == [(STEPS, metadata["test/loss"])]
    logged = [item.path for item in lab.mlflow.list_artifacts(parent["mlflow_run_id"], f"evaluation/step_{STEPS}")]
    assert any(path.endswith(".mp4") for path in logged) and any(path.endswith("evaluation.json") for path in logged)
    # Again on one rank: the same checkpoint gives the same figure, and the change is recorded against it.
    # At one intra-op thread, as torchrun gives each of 2 ranks (it leaves a lone rank every core): on
    # Intel CPUs the matmul kernels block by thread count, which moves the last bits (docs/training.md).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    second = _metadata(lab.run([EVALUATION], run_config=_evaluation_config(nproc=1, regression_tolerance=0.0)),
                       "evaluation/pretrain")
    assert second["test/loss"] == metadata["test/loss"] and second["world_size"] == 1
    assert second["previous_loss"] == metadata["test/loss"] and second["loss_change"] == 0.0
    # Other fixed times measure another figure: it is not compared with the last one.
    third = _metadata(lab.run([EVALUATION], run_config=_evaluation_config(overrides=["eval.timesteps=4",
                                                                                   "eval.samples=0"])),
                      "evaluation/pretrain")
    assert third["previous_loss"].startswith("none (the previous evaluation measured other settings")
    assert "loss_change" not in third and len([name for name in third if name.startswith("test/loss_t")]) == 4


def test_evaluation_on_shards_leaves_every_rng_and_the_training_order_as_they_were(lab: Lab, tmp_path: Path) -> None:
    """The held-out loader (with a worker process, which draws its base seed from torch's generator)
    must leave the generators and the training loader's position exactly as they were."""
    import random

    import numpy as np
    import torch

    from trainer.launch.config import load_config
    from trainer.loop import Trainer

    ref = lab.shard_index
    buckets = stage_runs.index_buckets(ref)
    config = load_config(CONFIG, ["data.source=shards", f"data.shard_index={ref.path}",
                                  f"data.manifest_version={ref.manifest_version}",
                                  *([f"data.buckets={json.dumps([list(b) for b in buckets])}"] if buckets else []),
                                  "data.num_workers=1", "train.parallelism=none", "train.eval_every=1", "eval.split=test",
                                  f"train.run_dir={tmp_path / 'run'}", "stage.mlflow=false"])
    trainer = Trainer(config)
    try:
        trainer.data.next_batch()
        before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(), trainer.data.state_dict())
        result = trainer.evaluator.validation_loss()
        after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate(), trainer.data.state_dict())
    finally:
        trainer.close()
    assert result["status"] == "ok" and result["num_samples"] > 0, result
    assert torch.equal(before[0], after[0]) and (before[1] == after[1]).all()
    assert before[2] == after[2] and before[3] == after[3]


def test_evaluation_of_an_empty_split_records_why_and_flags_the_check(lab: Lab) -> None:
    result = lab.run([EVALUATION], run_config=_evaluation_config(split="holdout", overrides=["eval.samples=0"]))
    metadata = _metadata(result, "evaluation/pretrain")
    assert metadata["status"] == "skipped" and "split 'holdout' has no samples" in metadata["reason"]
    assert "test/loss" not in metadata and metadata["samples/status"] == "skipped"
    check = _checks(result)["no_regression"]
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN


def test_evaluation_refuses_a_checkpoint_that_fails_verification(lab: Lab) -> None:
    parent = _metadata(lab.pretrain, "pretrain")
    data_file = max(Path(parent["checkpoint"]).glob("*.distcp"), key=lambda path: path.stat().st_size)
    original = data_file.read_bytes()
    try:
        data_file.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
        result = lab.run([EVALUATION], ok=False, run_config=_evaluation_config())
        assert not result.success
        errors = " ".join(str(event.step_failure_data.error) for event in result.all_events if event.is_step_failure)
        assert "evaluation refused" in errors and data_file.name in errors, errors
        assert not _materializations(result), "a refused checkpoint must not be evaluated"
    finally:
        data_file.write_bytes(original)


def test_a_regression_beyond_the_tolerance_fails_the_non_blocking_check() -> None:
    from assets.evaluation import regression_check

    base = {"status": "ok", "loss": 1.1, "previous_loss": 1.0, "loss_change_fraction": 0.1}
    worse = regression_check(EVALUATION, base, tolerance=0.05)
    assert not worse.passed and worse.severity == dg.AssetCheckSeverity.WARN
    assert "+10.00%" in worse.metadata["reason"].value and "beyond" in worse.metadata["reason"].value
    assert regression_check(EVALUATION, base, tolerance=0.1).passed
    assert regression_check(EVALUATION, {**base, "loss_change_fraction": -0.2}, tolerance=0.0).passed


DRILL_CONFIG = {**_QUIET, "ops": {"restore_drill": {"config": {"other_world_size": 1}}}}


def _drill_config(**config) -> dict:
    return {**_QUIET, "ops": {"restore_drill": {"config": {"other_world_size": 1, **config}}}}


def test_restore_drill_reproduces_the_original_run_and_pins_the_restored_checkpoint(lab: Lab) -> None:
    """Restore step 3, train to step 6 on 2 ranks (as saved) and on 1: each continuation must match
    what pretrain itself recorded at step 6: bit-identical on 2 ranks, within tolerance on 1."""
    parent = _metadata(lab.pretrain, "pretrain")
    result = lab.run([dg.AssetKey("restore_drill")], run_config=_drill_config())
    metadata = _metadata(result, "restore_drill")
    assert metadata["passed"] is True, metadata["reason"]
    assert metadata["checkpoint_step"] == CHECKPOINT_EVERY and metadata["target_step"] == STEPS
    assert metadata["target_checkpoint"] == parent["checkpoint"]
    assert (metadata["saved_world_size"], metadata["other_world_size"]) == (2, 1)
    assert metadata["num_steps_compared"] == STEPS - CHECKPOINT_EVERY
    assert metadata["same_world/losses_identical"] is True and metadata["same_world/params_identical"] is True
    assert metadata["same_world/num_steps_compared"] == STEPS - CHECKPOINT_EVERY
    # The rule came from how pretrain computed, signed into its checkpoint record.
    numerics = checkpoint_store.read_record(parent["checkpoint"])["content"]["numerics"]
    assert numerics == {"device_type": "cpu", "precision": "fp32", "deterministic": True}
    assert (metadata["same_world/rule"], metadata["other_world/rule"]) == ("bit_identical", "reassociation")
    assert metadata["other_world/passed"] is True and metadata["other_world/order_identical"] is True
    assert metadata["other_world/max_loss_rel_diff"] <= metadata["loss_rtol"]
    assert metadata["other_world/max_param_abs_diff"] <= metadata["param_atol"]
    assert metadata["restore_s"] > 0 and metadata["time_to_first_step_s"] > 0
    # The truth is the original: its losses, and its own checkpoint at step 6.
    original = json.loads((Path(parent["run_dir"]) / "final.json").read_text())["losses"]
    drilled = json.loads((Path(metadata["drill_dir"]) / "same_world" / "final.json").read_text())["losses"]
    # The continuations replay the original's data reference (and buckets), not shard_index's latest.
    original_launch = StageLaunch.read(Path(parent["run_dir"]) / "launch.json")
    for name in ("same_world", "other_world"):
        replay = StageLaunch.read(Path(metadata["drill_dir"]) / name / "launch.json")
        assert (replay.data, replay.buckets, replay.stage) == (original_launch.data, original_launch.buckets,
                                                               "restore_drill")
    assert drilled[CHECKPOINT_EVERY:] == original[CHECKPOINT_EVERY:STEPS]
    assert _checks(result)["drill_passed"].passed
    pin = checkpoint_store.read_known_good(parent["run_dir"])
    assert pin["step"] == CHECKPOINT_EVERY and pin["checkpoint"] == f"step_{CHECKPOINT_EVERY:06d}"
    assert pin["evidence"]["dagster_run_id"] == result.run_id and pin["evidence"]["passed"] is True
    assert pin["evidence"]["target_step"] == STEPS


def test_restore_drill_fails_when_the_restore_drops_the_optimizer_state(lab: Lab) -> None:
    """Both continuations share the broken restore, so they agree with each other; only the
    comparison with the original run catches it. The original's final.json is edited to claim a
    CUDA run with nondeterministic kernels (which would loosen the rule to 1e-2): the rule comes
    from the signed checkpoint record, so the drill still demands bit identity."""
    parent = _metadata(lab.pretrain, "pretrain")
    pinned = checkpoint_store.read_known_good(parent["run_dir"])
    config = _drill_config(overrides=["faults.drop_optimizer_state_on_restore=true"])
    final_path = Path(parent["run_dir"]) / "final.json"
    original = final_path.read_text()
    forged = json.loads(original)
    forged["precision"]["device_type"], forged["kernels"]["deterministic"] = "cuda", False
    final_path.write_text(json.dumps(forged))
    try:
        result = lab.run([dg.AssetKey("restore_drill")], ok=False, run_config=config)
    finally:
        final_path.write_text(original)
    metadata = _metadata(result, "restore_drill")
    assert metadata["passed"] is False and not result.success
    assert metadata["same_world/passed"] is False and metadata["same_world/losses_identical"] is False
    assert "same_world: same world size with deterministic kernels must be bit-identical" in metadata["reason"]
    assert metadata["same_world/rule"] == "bit_identical" and metadata["other_world/rule"] == "reassociation"
    assert metadata["other_world/passed"] is False, "lost optimizer state must exceed the tolerance too"
    assert metadata["other_world/max_loss_rel_diff"] > metadata["loss_rtol"]  # measured ~1e-3 after 3 steps
    assert not _checks(result)["drill_passed"].passed
    assert checkpoint_store.read_known_good(parent["run_dir"]) == pinned, "a failed drill must not pin"


def test_restore_drill_fails_on_a_corrupted_checkpoint(lab: Lab) -> None:
    parent = _metadata(lab.pretrain, "pretrain")
    pinned = checkpoint_store.read_known_good(parent["run_dir"])
    shard = sorted(Path(parent["checkpoint"]).glob("*.distcp"))[0]
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:100] + bytes([original[100] ^ 0xFF]) + original[101:])
        result = lab.run([dg.AssetKey("restore_drill")], ok=False, run_config=DRILL_CONFIG)
    finally:
        shard.write_bytes(original)
    metadata = _metadata(result, "restore_drill")
    assert metadata["passed"] is False
    assert shard.name in metadata["reason"] and "sha256 mismatch" in metadata["reason"]
    check = _checks(result)["drill_passed"]
    assert not check.passed and shard.name in check.metadata["reason"].value
    assert not result.success, "a failed blocking check must fail the run"
    assert checkpoint_store.read_known_good(parent["run_dir"]) == pinned, "a failed drill must not pin"


def test_restore_drill_refuses_a_run_with_one_committed_checkpoint(lab: Lab, tmp_path: Path) -> None:
    parent = _metadata(lab.pretrain, "pretrain")
    run_dir = tmp_path / parent["run_id"]
    shutil.copytree(parent["run_dir"], run_dir, symlinks=True)
    shutil.rmtree(run_dir / "checkpoints" / f"step_{CHECKPOINT_EVERY:06d}")
    (run_dir / "checkpoints" / "KNOWN_GOOD.json").unlink(missing_ok=True)

    @dg.asset(name="pretrain")
    def pretrain_with_one_checkpoint() -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata={**parent, "run_dir": str(run_dir)})

    resources = {"storage": lab.storage, "launcher": lab.launcher, "lineage": LineageResource()}
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([pretrain_with_one_checkpoint, training.restore_drill], instance=instance,
                                resources=resources, run_config=DRILL_CONFIG, raise_on_error=False)
    assert not result.success
    errors = " ".join(str(event.step_failure_data.error) for event in result.all_events if event.is_step_failure)
    assert "has 1 committed checkpoint(s)" in errors and "needs two" in errors, errors


def _drill_from_store(lab: Lab, tmp_path: Path, monkeypatch, *, tamper=None) -> tuple[dg.ExecuteInProcessResult, str]:
    """pretrain's checkpoints published to a store (as its mirror does), then its run folder lost
    them (a new machine): the drill must take both from the store. The store is a folder here;
    tests/test_cluster.py drills from the deployment's S3 bucket."""
    parent = _metadata(lab.pretrain, "pretrain")
    store_root = tmp_path / "store"
    monkeypatch.setenv(mirror.ROOT_VARIABLE, str(store_root))
    published = mirror.CheckpointMirror.for_run(parent["run_id"], keep_last_k=8, keep_every_m=0)
    assert published.catch_up(parent["run_dir"]) == [f"step_{CHECKPOINT_EVERY:06d}", f"step_{STEPS:06d}"]
    if tamper is not None:
        tamper(store_root / parent["run_id"])
    run_dir = tmp_path / parent["run_id"]
    shutil.copytree(parent["run_dir"], run_dir, symlinks=True, ignore=shutil.ignore_patterns("checkpoints"))

    @dg.asset(name="pretrain")
    def pretrain_on_a_lost_machine() -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata={**parent, "run_dir": str(run_dir)})

    resources = {"storage": lab.storage, "launcher": lab.launcher, "lineage": LineageResource()}
    with dg.DagsterInstance.ephemeral() as instance:  # the saved world size only: one continuation
        result = dg.materialize([pretrain_on_a_lost_machine, training.restore_drill], instance=instance,
                                resources=resources, run_config=_drill_config(other_world_size=2),
                                raise_on_error=False)
    return result, str(store_root / parent["run_id"])


def test_restore_drill_restores_from_the_checkpoint_store_when_one_is_configured(lab: Lab, tmp_path: Path,
                                                                                 monkeypatch) -> None:
    result, store_url = _drill_from_store(lab, tmp_path, monkeypatch)
    metadata = _metadata(result, "restore_drill")
    assert result.success and metadata["passed"] is True, metadata["reason"]
    assert metadata["checkpoint_source"] == store_url
    assert metadata["checkpoint"] == f"{store_url}/step_{CHECKPOINT_EVERY:06d}"
    assert metadata["target_checkpoint"] == f"{store_url}/step_{STEPS:06d}"
    assert metadata["same_world/params_identical"] is True and "other_world/passed" not in metadata
    assert Path(metadata["fetched_to"], f"step_{CHECKPOINT_EVERY:06d}", checkpoint_store.RECORD_NAME).is_file()
    # The proven step is pinned in the store, so the store's retention keeps it from now on.
    store = mirror.CheckpointMirror(store_url, keep_last_k=1, keep_every_m=0)
    pin = store.read_known_good()
    assert pin["step"] == CHECKPOINT_EVERY and pin["evidence"]["passed"] is True
    store.apply_retention(tmp_path / "no_such_run")
    assert [info.step for info in store.committed()] == [CHECKPOINT_EVERY, STEPS]
    # The drill's own continuation was not mirrored (stage.mirror=false): only pretrain's run is there.
    assert sorted(path.name for path in Path(store_url).parent.iterdir()) == [Path(store_url).name]


def test_restore_drill_with_a_store_that_does_not_answer_fails_naming_it(lab: Lab, monkeypatch) -> None:
    monkeypatch.setenv(mirror.ROOT_VARIABLE, "s3://trainyard/checkpoints")
    monkeypatch.setenv("TRAINYARD_S3_ENDPOINT_URL", "http://127.0.0.1:1")  # nothing listens there
    result = lab.run([dg.AssetKey("restore_drill")], ok=False, run_config=DRILL_CONFIG)
    errors = " ".join(str(event.step_failure_data.error) for event in result.all_events if event.is_step_failure)
    assert "the checkpoint store s3://trainyard/checkpoints/" in errors and "failed" in errors, errors


def test_restore_drill_refuses_a_store_copy_that_differs_from_its_commit_record(lab: Lab, tmp_path: Path,
                                                                                monkeypatch) -> None:
    def flip(run_store: Path) -> None:
        shard = sorted((run_store / f"step_{CHECKPOINT_EVERY:06d}").glob("*.distcp"))[0]
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))

    result, store_url = _drill_from_store(lab, tmp_path, monkeypatch, tamper=flip)
    metadata = _metadata(result, "restore_drill")
    assert not result.success and metadata["passed"] is False
    assert "the store's copy was refused" in metadata["reason"] and ".distcp" in metadata["reason"]
    assert mirror.CheckpointMirror(store_url, keep_last_k=1, keep_every_m=0).read_known_good() is None
    assert not _checks(result)["drill_passed"].passed


# ---------------------------------------------------------------------------------------------
# Refused before launch


def test_contradictory_config_is_refused_before_any_process_starts(lab: Lab) -> None:
    before = lab.run_dirs()
    config = _stage_config("pretrain", steps=4, nproc=2, overrides=["data.batch_size=6", "train.grad_accum=2"])
    result = lab.run([PRETRAIN], ok=False, run_config=config)
    assert not result.success
    messages = " ".join(_failure_messages(result))
    errors = " ".join(str(event.step_failure_data.error) for event in result.all_events
                      if event.is_step_failure)
    assert "not divisible by world_size 2 x train.grad_accum 2" in errors, messages
    assert lab.run_dirs() == before
    logs = [entry.message or "" for entry in lab.instance.all_logs(result.run_id)]
    assert not [message for message in logs if "launching" in message or "[pipes]" in message]


def test_unknown_manifest_version_is_refused_before_launch(lab: Lab) -> None:
    @dg.asset(name="shard_index")
    def bogus_shard_index() -> ShardIndexRef:
        return dataclasses.replace(lab.shard_index, manifest_version="0" * 20, version="bogus")

    before = lab.run_dirs()
    resources = {"storage": lab.storage, "launcher": lab.launcher}
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize([bogus_shard_index, training.pretrain], instance=instance, resources=resources,
                                run_config=_stage_config("pretrain", steps=4, nproc=2), raise_on_error=False)
        logs = [entry.message or "" for entry in instance.all_logs(result.run_id)]
    assert not result.success
    errors = " ".join(str(event.step_failure_data.error) for event in result.all_events if event.is_step_failure)
    assert "ManifestNotFound" in errors and "0" * 20 in errors
    assert lab.run_dirs() == before
    assert not [message for message in logs if "launching" in message or "[pipes]" in message]


# ---------------------------------------------------------------------------------------------
# Cancellation


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains text (the run dir names every rank's run)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue  # exited while listed
    return found


def test_sigterm_to_torchrun_stops_every_rank_at_a_step_boundary(lab: Lab, tmp_path: Path) -> None:
    launch = json.loads(Path(_metadata(lab.pretrain, "pretrain")["launch_manifest"]).read_text())
    run_dir = tmp_path / "canceled"
    overrides = [o for o in launch["overrides"] if not o.startswith(("train.run_dir=", "train.steps=", "stage."))]
    overrides += [f"train.run_dir={run_dir}", "train.steps=500", "stage.checkpoint=true", "stage.mlflow=false"]
    command = lab.launcher.command(Path(launch["config_path"]), overrides, nproc=2)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
    ranks: list[str] = []
    watchdog = threading.Timer(120, os.killpg, (process.pid, signal.SIGKILL))  # never hang the suite
    watchdog.start()
    try:
        for line in process.stdout:
            if "step 1/500" in line:
                ranks = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
                process.send_signal(signal.SIGTERM)
                break
        else:
            pytest.fail("the run ended before its first step")
        process.stdout.read()
        returncode = process.wait(timeout=lab.launcher.termination_timeout_s)
    finally:
        watchdog.cancel()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert len(ranks) == 2 and not [pid for pid in ranks if Path(f"/proc/{pid}").exists()]
    assert returncode != 0  # torchrun re-raises the signal as an error; the ranks themselves exit 143
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "canceled" and 1 <= final["final_step"] < 500
    # Both ranks stopped after the same step, where the checkpointer saved (a collective).
    assert checkpoint_store.read_latest(run_dir) == f"step_{final['final_step']:06d}"
    assert checkpoint_store.verify(run_dir / "checkpoints" / f"step_{final['final_step']:06d}").ok


@contextlib.contextmanager
def _interrupt_when(lab: Lab, run_id: str, ready, *, within_s: float):
    """SIGINT this process (as `dagster` does on termination) once ``ready`` holds for the Dagster
    run's log messages; yields a dict whose ``at`` is when it was sent."""
    signalled: dict[str, float] = {}
    finished = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and not finished.is_set():
            if ready([entry.message or "" for entry in lab.instance.all_logs(run_id)]):
                signalled["at"] = time.monotonic()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield signalled
    finally:
        finished.set()
        watcher.join()


def test_cancelling_the_dagster_run_stops_the_ranks(lab: Lab) -> None:
    """The run worker is interrupted (as `dagster` does on termination) while the ranks train."""
    before, run_id = lab.run_dirs(), str(uuid.uuid4())
    # No periodic checkpoint: the one checkpoint is the one the ranks save where they agree to stop.
    config = _stage_config("pretrain", steps=500, nproc=2, overrides=["train.checkpoint_every=0"])
    with _interrupt_when(lab, run_id, lambda messages: any(m.startswith(("step 1 ", "step 1/")) for m in messages),
                         within_s=120) as signalled:
        result = lab.run([PRETRAIN], ok=False, run_config=config, run_id=run_id)
    assert "at" in signalled, "the run never reported its first step"
    returned_s = time.monotonic() - signalled["at"]
    assert not result.success and returned_s < lab.launcher.termination_timeout_s
    (name,) = lab.run_dirs() - before
    run_dir = lab.storage.data / "runs" / name
    assert not _processes_mentioning(str(run_dir)), "ranks outlived the cancelled run"
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "canceled" and 1 <= final["final_step"] < 500
    assert checkpoint_store.read_latest(run_dir) == f"step_{final['final_step']:06d}", \
        "the ranks must stop together and checkpoint where they stopped"
    (run,) = lab.mlflow.search_runs([lab.mlflow.get_experiment_by_name("trainyard").experiment_id],
                                    filter_string=f"tags.run_id = '{name}'")
    assert run.info.status == "KILLED" and run.data.tags["trainyard.status"] == "canceled"
    logs = " ".join(entry.message or "" for entry in lab.instance.all_logs(run_id))
    assert "SIGTERM to torchrun" in logs and "s after SIGTERM: SIGKILL" not in logs and "torchrun exited" in logs


def test_cancelling_the_fault_drill_stops_the_faults_running_at_once_and_starts_no_more(lab: Lab) -> None:
    """The drill runs two faults at a time from worker threads, which never see Dagster's
    interrupt: the step's own thread stops both launches and the queued fault never starts."""
    run_id = str(uuid.uuid4())
    config = {**_QUIET, "ops": {"fault_drill": {"config": {
        "faults": ["rank_killed", "disk_full_in_save", "out_of_memory"], "parallel": 2}}}}
    # The reference run's launch, then the two faults'.
    with _interrupt_when(lab, run_id, lambda messages: sum(m.startswith("launching 2 rank(s)") for m in messages) >= 3,
                         within_s=180) as signalled:
        result = lab.run([dg.AssetKey("fault_drill")], ok=False, run_config=config, run_id=run_id)
    assert "at" in signalled, "the drill never launched two faults"
    assert not result.success and time.monotonic() - signalled["at"] < lab.launcher.termination_timeout_s
    root = lab.storage.data / "fault_drills" / run_id
    assert not _processes_mentioning(str(root)), "ranks outlived the cancelled drill"
    assert sorted(path.name for path in root.iterdir()) == ["disk_full_in_save", "rank_killed", "uninterrupted"]
    for name in ("disk_full_in_save", "rank_killed"):
        assert (root / name / "launch" / CANCEL_MARKER).is_file(), f"{name} was not stopped as a cancel"


def test_retrain_sensor_skips_data_the_current_pretrain_already_saw(lab: Lab) -> None:
    """A fresh sensor (no cursor, e.g. the first `make ui` after `make demo`) does not retrain
    when pretrain's latest run was trained on the current manifest version."""
    assert lab.instance.get_latest_materialization_event(dg.AssetKey("pretrain")) is not None
    result = retrain_sensor(dg.build_sensor_context(instance=lab.instance, cursor=None))
    version = lab.instance.get_latest_materialization_event(
        dg.AssetKey("validated_manifest")).asset_materialization.tags["dagster/data_version"]
    assert isinstance(result, dg.SkipReason)
    assert f"pretrain already trained on validated manifest {version}" in result.skip_message


def test_a_revoked_clip_is_followed_to_its_runs_and_checkpoints_and_the_next_pretrain_trains_without_it(
        lab: Lab, capsys) -> None:
    """Issue 17: revoke one demo clip pretrain trained on. `trainyard rights where` and rights_report
    find its plan, shards, index, the pretrain and finetune runs and their checkpoints; pretrain refuses
    the old index; the sensor validates again with the set's own rules, then plans without it; the
    new index passes no_revoked_assets and pretrain trains on it. (Changes the data: after the tests
    that use the first pretrain, before the stricter revalidation.)"""
    data = lab.storage.data
    old = lab.shard_index
    plan = read_plan(Path(old.path))
    train = plan.table.filter(pc.equal(plan.table.column("split"), "train"))
    asset_id = train.column("asset_id")[0].as_py()
    assert main(["rights", "revoke", asset_id[:16], "--reason", "consent_revoked", "--note", "request 41",
                 "--data-root", str(data)]) == 0
    capsys.readouterr()
    assert main(["rights", "where", asset_id, "--json", "--data-root", str(data)]) == 0
    reach = json.loads(capsys.readouterr().out)
    assert reach["revocation"]["note"] == "request 41"
    assert [index["version"] for index in reach["shard_indexes"]] == [old.version]
    assert {shard["shard"] for shard in reach["shards"]} == set(train.filter(
        pc.equal(train.column("asset_id"), asset_id)).column("shard").to_pylist())
    stages = {run["stage"] for run in reach["runs"]}
    assert {"pretrain", "finetune"} <= stages, reach["runs"]
    committed = [point for point in reach["checkpoints"] if point["status"] == "committed"]
    assert committed and all(Path(point["path"]).is_dir() for point in committed)
    report = lab.run([dg.AssetKey("rights_report")], run_config=_QUIET)
    metadata = _metadata(report, "rights_report")
    assert metadata["num_trained_on"] >= 1 and metadata["num_checkpoints_affected"] >= len(committed)
    assert asset_id[:16] in metadata["withdrawn"]

    blocked = lab.run([INDEX, PRETRAIN], ok=False, run_config=PRETRAIN_CONFIG)  # the old plan, indexed again
    assert not _checks(blocked)["no_revoked_assets"].passed
    assert "pretrain" not in _materializations(blocked), "the blocking check keeps pretrain from starting"
    refused = lab.run([PRETRAIN], ok=False, run_config=PRETRAIN_CONFIG)
    assert not refused.success
    errors = " ".join(str(event.step_failure_data.error) for event in refused.all_events if event.is_step_failure)
    assert "revoked asset" in errors and asset_id[:12] in errors and "request 41" in errors

    # A plan of the set validated before the revocation already leaves the asset out, and says so.
    replanned = _metadata(lab.run([PLAN], run_config=_QUIET), "clip_plan")
    assert replanned["num_revoked_left_out"] == 1 and asset_id[:12] not in str(replanned["clips_per_shard"])
    assert asset_id not in set(read_plan(Path(replanned["data_path"])).table.column("asset_id").to_pylist())
    request = retrain_sensor(dg.build_sensor_context(instance=lab.instance))
    assert isinstance(request, dg.RunRequest) and request.job_name == "revalidate_job", request
    rules = request.run_config["ops"]["validated_manifest_and_quarantine"]["config"]
    assert rules["max_quarantine_fraction"] == DEMO_MAX_QUARANTINE_FRACTION, "the set's own rules, not defaults"
    revalidated = lab.run([dg.AssetKey("validated_manifest"), dg.AssetKey("quarantine")],
                          run_config={**_QUIET, **request.run_config})
    assert "rights_revoked" in str(_metadata(revalidated, "quarantine")["quarantined"])
    request = retrain_sensor(dg.build_sensor_context(instance=lab.instance))
    assert isinstance(request, dg.RunRequest) and request.job_name == "plan_job", request
    lab.run([PLAN], run_config=_QUIET)
    for partition in lab.instance.get_dynamic_partitions("clip_shards"):
        lab.run([SHARDS], partition_key=partition, run_config=_QUIET)
    index = lab.run([INDEX], run_config=_QUIET)
    assert _checks(index)["no_revoked_assets"].passed
    new = index.output_for_node("shard_index")
    assert new.version != old.version and asset_id not in rights.index_asset_ids(new.path)
    retrained = lab.run([PRETRAIN], run_config=PRETRAIN_CONFIG)
    assert _metadata(retrained, "pretrain")["shard_index_version"] == new.version
    assert not [run for run in rights.where(data, [asset_id]).reach[asset_id].runs
                if run["shard_index_version"] == new.version]


def test_revalidation_with_stricter_rules_retrains_on_fresh_shards(lab: Lab) -> None:
    """Same manifest, stricter rules: a new validated version that pretrain never saw, so the
    sensor plans again; the new plan reuses the shard partition keys, and every shard written
    for the old plan is stale. (Changes validated_manifest and clip_plan: keep this test last.)"""
    before = lab.instance.get_latest_materialization_event(dg.AssetKey("validated_manifest"))
    stricter = {"ops": {"validated_manifest_and_quarantine": {"config": {
        "max_quarantine_fraction": DEMO_MAX_QUARANTINE_FRACTION, "min_duration_s": 0.6}}}}
    lab.run([dg.AssetKey("validated_manifest"), dg.AssetKey("quarantine")], run_config={**_QUIET, **stricter})
    after = lab.instance.get_latest_materialization_event(dg.AssetKey("validated_manifest"))
    old_version = before.asset_materialization.tags["dagster/data_version"]
    version = after.asset_materialization.tags["dagster/data_version"]
    assert version != old_version
    assert (after.asset_materialization.metadata["manifest_version"].value
            == before.asset_materialization.metadata["manifest_version"].value), "same manifest, other rules"
    plan = retrain_sensor(dg.build_sensor_context(instance=lab.instance))
    assert isinstance(plan, dg.RunRequest), getattr(plan, "skip_message", plan)
    assert (plan.job_name, plan.run_key) == ("plan_job", f"plan-{version}-attempt0")
    old_shards = set(lab.instance.get_dynamic_partitions("clip_shards"))
    lab.run([PLAN], run_config=_QUIET)
    new_shards = lab.instance.get_dynamic_partitions("clip_shards")
    assert set(new_shards) & old_shards, "the new plan reuses partition keys: the case under test"
    shards = retrain_sensor(dg.build_sensor_context(instance=lab.instance))
    assert isinstance(shards, list) and sorted(r.partition_key for r in shards) == sorted(new_shards)


# ---------------------------------------------------------------------------------------------
# The fault drill (issue 11): every injection, with real torchrun launches, judged from the runs' records


def test_fault_drill_job_runs_nightly() -> None:
    schedule = defs.resolve_schedule_def("nightly_fault_drill")
    assert schedule.job_name == "fault_drill_job" and schedule.default_status == dg.DefaultScheduleStatus.RUNNING
    job = defs.resolve_job_def("fault_drill_job")
    assert {key.to_user_string() for key in job.asset_layer.selected_asset_keys} == {"fault_drill"}


# ---------------------------------------------------------------------------------------------
# Your own model: examples/image_model.py through the same stages (last: it replaces pretrain)


def test_the_example_model_goes_through_pretrain_restore_drill_and_evaluation(lab: Lab) -> None:
    config = _stage_config("pretrain", steps=STEPS, nproc=2)
    config["ops"]["pretrain"]["config"]["config_path"] = "configs/example_image.yaml"
    pretrain = lab.run([PRETRAIN], run_config=config)
    metadata = _metadata(pretrain, "pretrain")
    assert metadata["status"] == "completed" and metadata["checkpoint_step"] == STEPS
    assert {name: check.passed for name, check in _checks(pretrain).items()} == dict.fromkeys(CHECKPOINT_CHECKS, True)
    launch = json.loads((Path(metadata["run_dir"]) / "launch.json").read_text())
    assert launch["config"]["model"]["factory"] == "examples.image_model:build"
    drill = _metadata(lab.run([dg.AssetKey("restore_drill")], run_config=_drill_config()), "restore_drill")
    assert drill["passed"] is True, drill["reason"]
    assert drill["same_world/losses_identical"] is True and drill["same_world/params_identical"] is True
    evaluation = _metadata(lab.run([EVALUATION], run_config=_evaluation_config()), "evaluation/pretrain")
    assert evaluation["status"] == "ok" and evaluation["checkpoint"] == metadata["checkpoint"]
    assert evaluation["samples/status"] == "ok" and evaluation["test/loss"] > 0
