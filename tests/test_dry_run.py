"""`trainyard dry-run`: config, plan, memory, data checks and a few real batches, no training."""

import json
from pathlib import Path

import pytest
from test_trainer_data import SHARD_BUCKETS, write_bucketed_shards

from cli.main import main
from ops.clips.plan import ShardConfig
from tests.helpers import write_shards

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def index(demo_validation, tmp_path_factory):
    _, shard_index = write_shards(demo_validation, ShardConfig(encoding="decoded"), tmp_path_factory.mktemp("dry"))
    return shard_index


def _data(index, manifest_version=None):
    return ["--set", "data.source=shards", "--set", f"data.shard_index={index.directory}",
            "--set", f"data.manifest_version={manifest_version or index.manifest_version}", "--set", "data.num_workers=0"]


def test_dry_run_decodes_batches_and_reports_the_plan(index, capsys):
    assert main(["dry-run", CONFIG, *_data(index), "--world-size", "2", "--batches", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plan"]["world_size"] == 2 and report["plan"]["local_batch_size"] == 4
    assert report["plan"]["memory"]["total_bytes"] > report["plan"]["memory"]["params_bytes"] > 0
    assert report["num_params"] > 0 and report["tokens_per_sample"] == 256
    assert [batch["video"] for batch in report["batches"]] == [[4, 8, 64, 64, 3]] * 2
    assert report["batches"][0]["first_key"] != report["batches"][1]["first_key"]


def test_dry_run_reports_each_batch_bucket_of_bucketed_shards(tmp_path, capsys):
    index = write_bucketed_shards(tmp_path)
    clips = ["--set", "data.clip_frames=4", "--set", "data.height=16", "--set", "data.width=16", "--set",
             "data.audio_samples=8000", "--set", f"data.buckets={SHARD_BUCKETS}", "--set", "data.batch_size=4"]
    assert main(["dry-run", CONFIG, *_data(index), *clips, "--world-size", "2", "--batches", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data"]["batching"] == "bucketed" and report["data"]["global_batch"] == 4
    tokens = {"4x16x16": 8, "8x16x16": 16, "4x16x24": 12}  # patches of 2 x 8 x 8
    for batch in report["batches"]:  # one epoch: every bucket shows up
        frames, height, width = map(int, batch["bucket"].split("x"))
        assert batch["video"] == [2, frames, height, width, 3] and batch["audio"] == [2, 2000 * frames]
        assert batch["tokens_per_sample"] == tokens[batch["bucket"]]
    assert {batch["bucket"] for batch in report["batches"]} == set(tokens)


@pytest.mark.parametrize("extra, message", [
    (["--world-size", "3"], "not divisible by world_size 3"),
    (["--set", "train.max_memory_bytes=1000"], "memory"),
    (["--set", "data.height=32"], "clip shape"),
    (["--set", "data.bogus=1"], "unknown config keys"),
])
def test_dry_run_refuses_bad_configs_with_a_clear_message(index, capsys, extra, message):
    assert main(["dry-run", CONFIG, *_data(index), *extra]) == 2
    assert message in capsys.readouterr().err


def test_dry_run_refuses_a_manifest_version_the_shards_were_not_built_from(index, capsys):
    assert main(["dry-run", CONFIG, *_data(index, manifest_version="0" * 20)]) == 2
    assert "manifest_version" in capsys.readouterr().err
