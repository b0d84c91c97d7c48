"""``stage.start_over=true`` works through Dagster (review finding 4).

The pretrain asset names its run folder from the resolved config. ``stage.start_over`` says what
to do with that run's own failed checkpoints, so it must not change the folder: otherwise the
override starts a new run from step 0 beside the broken one, which is never quarantined.

Real components: the pretrain asset materialized with ``dg.materialize`` on a DagsterInstance with
SQLite storage in a temporary folder, launching the trainer under torchrun (1 rank, the tiny test
model on shards written from the demo media, 2 steps, a checkpoint each), MLflow in SQLite.

Run: python -m pytest tests/test_checkpoint_start_over_assets.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
from helpers import write_shards

from assets import training
from ops.checkpoints import store as store
from ops.curation import manifest as manifest_ops
from ops.clips.plan import ShardConfig
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher

CONFIG = "configs/test_tiny.yaml"
OVERRIDES = ["train.checkpoint_every=1"]
_QUIET = {"console": {"config": {"log_level": "WARNING"}}}


def _run_config(overrides: list[str]) -> dict:
    return {"loggers": _QUIET, "ops": {"pretrain": {"config": {"config_path": CONFIG, "steps": 2, "nproc": 1,
                                                               "overrides": overrides}}}}


def _metadata(result: dg.ExecuteInProcessResult) -> dict:
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key.to_user_string() == "pretrain"]
    return {name: getattr(value, "value", value) for name, value in event.materialization.metadata.items()}


def test_start_over_through_dagster_resumes_the_same_run_folder_and_quarantines(
        demo_manifest, demo_validation, tmp_path: Path, monkeypatch) -> None:
    data = tmp_path / "data"
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(data))
    _, index = write_shards(demo_validation, ShardConfig(splits=("train",), clips_per_shard=8), data / "shards")
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(data))
    mlflow_uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    shard_index = {"path": str(data / "shards"), "manifest_version": index.manifest_version, "version": index.version}

    @dg.asset(name="shard_index")
    def fixed_shard_index() -> dict:
        return shard_index

    resources = {"storage": StorageResource(media_root=str(tmp_path / "media"), data_root=str(data)),
                 "launcher": LocalTorchrunLauncher(mlflow_tracking_uri=mlflow_uri), "lineage": LineageResource()}
    (tmp_path / "dagster").mkdir()
    with dg.DagsterInstance.local_temp(tempdir=str(tmp_path / "dagster")) as instance:
        def materialize(overrides: list[str]) -> dg.ExecuteInProcessResult:
            return dg.materialize([fixed_shard_index, training.pretrain], instance=instance, resources=resources,
                                  run_config=_run_config(overrides), raise_on_error=False)

        first = materialize(OVERRIDES)
        assert first.success, [event.message for event in first.all_events if event.is_failure]
        run_dir = Path(_metadata(first)["run_dir"])
        checkpoints = store.checkpoints_dir(run_dir)
        names = ["step_000001", "step_000002"]
        assert [info.name for info in store.list_checkpoints(run_dir)] == names
        for name in names:  # every commit record unreadable; the DCP data intact
            record = checkpoints / name / store.RECORD_NAME
            record.write_bytes(record.read_bytes()[:100])

        refused = materialize(OVERRIDES)
        assert not refused.success
        final = json.loads((run_dir / "final.json").read_text())
        assert final["status"] == "failed" and "none verifies" in final["error"], final
        # Deterministic: one attempt, not the retry budget spent on files that fail the same way each time.
        attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines() if line]
        refused_attempts = [a for a in attempts if a.get("failure_class") == "checkpoint_unverifiable"]
        assert len(refused_attempts) == 1 and "not retried" in refused_attempts[0]["why"], attempts
        assert not (checkpoints / store.QUARANTINE_NAME).exists()

        restarted = materialize([*OVERRIDES, "stage.start_over=true"])
        assert restarted.success, [event.message for event in restarted.all_events if event.is_failure]
        metadata = _metadata(restarted)
        assert Path(metadata["run_dir"]) == run_dir  # the same run, not a new folder trained from step 0
        assert metadata["final_step"] == 2
    for name in names:
        reason = json.loads((checkpoints / store.QUARANTINE_NAME / name / store.REASON_NAME).read_text())
        assert reason["by"] == "start_over" and "truncated or invalid JSON" in reason["reason"]
    assert [info.name for info in store.list_checkpoints(run_dir)] == names
    assert all(store.verify(checkpoints / name).ok for name in names)
    assert sorted(path.name for path in (run_dir.parent).iterdir()) == [run_dir.name]
