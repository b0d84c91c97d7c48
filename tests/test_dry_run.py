"""`trainyard dry-run`: config, plan, memory, data checks and a few real batches, no training; the
readable report by default (trainer/launch/report.py), one JSON object with --json."""

import json
from pathlib import Path

import pytest
from test_trainer_data import SHARD_BUCKETS, write_bucketed_shards

from cli.main import main
from ops.clips.plan import ShardConfig
from tests.helpers import write_shards
from trainer.launch.report import build_report, markdown

CONFIG = str(Path(__file__).resolve().parent.parent / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def index(demo_validation, tmp_path_factory):
    _, shard_index = write_shards(demo_validation, ShardConfig(encoding="decoded"), tmp_path_factory.mktemp("dry"))
    return shard_index


def _data(index, manifest_version=None):
    return ["--set", "data.source=shards", "--set", f"data.shard_index={index.directory}",
            "--set", f"data.manifest_version={manifest_version or index.manifest_version}", "--set", "data.num_workers=0"]


def test_dry_run_decodes_batches_and_reports_the_plan(index, capsys):
    assert main(["dry-run", CONFIG, "--json", *_data(index), "--world-size", "2", "--batches", "2"]) == 0
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
    assert main(["dry-run", CONFIG, "--json", *_data(index), *clips, "--world-size", "2", "--batches", "4"]) == 0
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


# ---------------------------------------------------------------------------------------------
# The readable report (generated clips: no shard index needed, and counts known by hand)

# 21 generated clips alternate between 2 buckets (sample i in bucket i % 2): 11 and 10. A global
# batch of 4 makes 2 full steps of each; drop_last (always on for generated clips) leaves out
# 11 - 8 = 3 and 10 - 8 = 2.
TWO_BUCKETS = ["--set", "data.num_samples=21", "--set", "data.batch_size=4", "--set", "data.num_workers=0",
               "--set", "data.buckets=[[8,64,64],[16,64,64]]", "--batches", "1"]
SECTIONS = ["Config against the defaults", "Parallel plan", "Memory per rank", "Data", "Buckets", "Decoded batches"]


def _row(out: str, first: str) -> list[str]:
    (line,) = [line for line in out.splitlines() if line.split()[:1] == [first]]
    return line.split()


def test_the_report_puts_warnings_first_then_each_section_with_hand_counted_drops(capsys):
    assert main(["dry-run", CONFIG, *TWO_BUCKETS]) == 0
    out = capsys.readouterr().out
    lines = [line.rstrip() for line in out.splitlines()]
    assert "\x1b[" not in out, "no terminal codes on a pipe"
    assert lines[0] == f"trainyard dry-run {CONFIG}: demo_cpu on 1 rank(s)"
    warning = next(number for number, line in enumerate(lines) if line.startswith("WARNING: data: drop_last"))
    assert "leaves out 5 of 21 samples every epoch (8x64x64 3, 16x64x64 2)" in " ".join(lines[warning:warning + 2])
    titles = [lines.index(title) for title in SECTIONS]
    assert warning < titles[0] and titles == sorted(titles), "warnings first, then the sections in order"
    assert _row(out, "8x64x64")[-3:] == ["11", "2", "3"] and _row(out, "16x64x64")[-3:] == ["10", "2", "2"]
    assert _row(out, "all")[-3:] == ["21", "4", "5"]
    assert _row(out, "1")[1:3] == ["8x64x64", "4"] or _row(out, "1")[1:3] == ["16x64x64", "4"]


def test_the_config_diff_names_each_change_with_its_default_and_leaves_out_the_rest(capsys):
    assert main(["dry-run", CONFIG, *TWO_BUCKETS, "--set", "optim.grad_clip_norm=0.5"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "optim.grad_clip_norm") == ["optim.grad_clip_norm", "1.0", "0.5"]
    assert _row(out, "data.num_samples") == ["data.num_samples", "4096", "21"]
    assert _row(out, "data.batch_size") == ["data.batch_size", "(required)", "4"]
    for unchanged in ("optim.eps", "model.pos_embed", "train.grad_accum", "data.storage_token"):
        assert unchanged not in out, unchanged


def test_the_memory_headroom_is_the_budget_less_the_estimate_of_the_json(capsys):
    budget = 200 * 2**20
    args = ["dry-run", CONFIG, *TWO_BUCKETS, "--set", f"train.max_memory_bytes={budget}"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    out = capsys.readouterr().out
    total = result["plan"]["memory"]["total_bytes"]
    headroom = [f"{(budget - total) / 2**20:.1f}", "MiB", f"{(budget - total) / budget:.1%}", "of", "the", "budget"]
    assert _row(out, "headroom")[1:] == headroom
    assert _row(out, "budget")[1:] == ["200.0", "MiB"]
    assert "WARNING: memory" not in out, "57% headroom is no warning"
    # The stage's Markdown is the same model: the same figures.
    report = markdown(build_report(result, title="t"))
    assert f"| headroom | {headroom[0]} MiB | {headroom[2]} of the budget |" in report
    assert "| 8x64x64 | 8 x 64 x 64 | 11 | 2 | 3 |" in report


def test_a_secret_in_the_config_shows_as_stars_and_never_in_clear(capsys, monkeypatch):
    secret = "dry-run-secret-7c1e9b"
    monkeypatch.setenv("TRAINYARD_DRY_RUN_STORE", secret)  # a name redaction cannot guess: the field's mark must
    assert main(["dry-run", CONFIG, *TWO_BUCKETS, "--set", "data.storage_token=${env:TRAINYARD_DRY_RUN_STORE}"]) == 0
    out, err = capsys.readouterr()
    assert _row(out, "data.storage_token") == ["data.storage_token", '""', "***"]
    assert secret not in out + err


def test_slurm_prints_the_report_then_the_script(capsys, monkeypatch):
    from resources.slurm import SlurmLauncher

    # No controller here: the cluster's answer is stood in for (tests/test_slurm.py asks a real one).
    monkeypatch.setattr(SlurmLauncher, "check", lambda self, launch: [])
    monkeypatch.setenv("TRAINYARD_SLURM_PARTITION", "debug")
    assert main(["dry-run", CONFIG, *TWO_BUCKETS, "--slurm"]) == 0
    out, err = capsys.readouterr()
    lines = [line.rstrip() for line in out.splitlines()]
    assert lines[0].startswith("trainyard dry-run ") and "#SBATCH --partition=debug" in lines
    assert lines.index("Decoded batches") < lines.index("#SBATCH --partition=debug")
    assert "the checks before submission pass" in err
    assert main(["dry-run", CONFIG, *TWO_BUCKETS, "--slurm", "--json"]) == 0
    assert capsys.readouterr().out.startswith("#!"), "--slurm --json: the script alone, as before the report"
