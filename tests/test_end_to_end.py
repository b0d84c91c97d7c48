"""End to end: the `make demo` path (``trainyard demo``) on a fresh TRAINYARD_HOME.

Runs the real console script in a subprocess, exactly as the Makefile does, then reopens the
SQLite Dagster instance it wrote and checks what a user would look at in `make ui`.
"""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

REPO = Path(__file__).resolve().parent.parent
ASSETS = ("raw_media", "dataset_manifest", "validated_manifest", "quarantine", "clip_plan", "clip_shards",
          "shard_index", "data_profile", "loader_benchmark")
TRAINYARD = Path(sys.executable).parent / "trainyard"


@pytest.fixture(scope="module")
def demo_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("trainyard_home")
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TRAINYARD_", "DAGSTER_", "MLFLOW_"))}
    env["TRAINYARD_HOME"] = str(home)
    completed = subprocess.run([str(TRAINYARD), "demo"], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    assert "make ui" in completed.stdout
    return home


def test_demo_writes_everything_under_trainyard_home(demo_home: Path):
    assert (demo_home / "media" / "PROVENANCE.md").exists()
    assert (demo_home / "dagster_home" / "dagster.yaml").exists()
    assert len(list((demo_home / "data" / "manifests").iterdir())) == 1
    assert (demo_home / "data" / "quarantine" / "ledger.parquet").exists()


def test_demo_materialized_every_asset_with_passing_checks(demo_home: Path, monkeypatch):
    monkeypatch.setenv("DAGSTER_HOME", str(demo_home / "dagster_home"))
    with dg.DagsterInstance.get() as instance:
        for key in ASSETS:
            event = instance.get_latest_materialization_event(dg.AssetKey(key))
            assert event is not None, key
            metadata = event.asset_materialization.metadata
            assert metadata["git_commit"].value and metadata["env_digest"].value, key
        partitions = instance.get_dynamic_partitions("clip_shards")
        assert partitions, "clip_plan registered no shard partitions"
        assert instance.get_materialized_partitions(dg.AssetKey("clip_shards")) == set(partitions)
        index = instance.get_latest_materialization_event(dg.AssetKey("shard_index")).asset_materialization
        assert index.metadata["num_shards"].value == len(partitions)
        benchmark = instance.get_latest_materialization_event(dg.AssetKey("loader_benchmark")).asset_materialization
        assert benchmark.metadata["loader_frames_per_s"].value > 0
        quarantine = instance.get_latest_materialization_event(dg.AssetKey("quarantine"))
        # The demo set holds one file per bad input: all of them are quarantined.
        assert quarantine.asset_materialization.metadata["dagster/row_count"].value >= 17
        records = instance.get_run_records(dg.RunsFilter(statuses=[dg.DagsterRunStatus.SUCCESS]), limit=5)
        assert records, "no successful run recorded in the embedded instance"
