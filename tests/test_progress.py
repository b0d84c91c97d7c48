"""Progress on long work (ops/progress.py): the line a person reads, periodic lines under Dagster
and on a pipe, a bar on a terminal, and the real long operations that report through it
(scanning, probing, writing a shard, the CLI's manifest build)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
from helpers import write_clip

from ops import progress
from ops.curation import manifest as manifest_ops
from pipelines.definitions import all_assets
from resources.launcher import LocalTorchrunLauncher
from resources import LineageResource, StorageResource

TRAINYARD = Path(sys.executable).parent / "trainyard"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(("done", "total", "elapsed", "expected"), [
    (30, 120, 10.0, "probing: 30/120 objects (25%), 3.0 objects/s, about 30 s left"),
    (120, 120, 40.0, "probing: 120/120 objects (100%), 3.0 objects/s, done in 40 s"),
    (0, 120, 5.0, "probing: 0/120 objects (0%), 0.0 objects/s, time left unknown yet"),
    (7, None, 2.0, "probing: 7 objects, 3.5 objects/s"),
    (1, 3600, 2.0, "probing: 1/3600 objects (0%), 0.5 objects/s, about 2.0 h left"),
])
def test_a_progress_line_states_counts_rate_and_time_left(done, total, elapsed, expected) -> None:
    assert progress.describe("probing", done, total, "objects", elapsed) == expected


def test_under_a_log_a_line_comes_every_period_and_one_at_the_end() -> None:
    clock, lines = _Clock(), []
    with progress.reporting(log=lines.append, every_s=10.0):
        with progress.task("probing", 100, unit="objects", clock=clock) as bar:
            for _ in range(100):
                clock.now += 0.5
                bar.advance()
    assert lines[0] == "probing: 20/100 objects (20%), 2.0 objects/s, about 40 s left"
    assert len(lines) == 6 and lines[-1].endswith("done in 50 s"), lines


def test_without_reporting_a_task_is_silent(capsys) -> None:
    with progress.task("probing", 3) as bar:
        bar.advance(3)
    assert capsys.readouterr() == ("", "")


def test_on_a_terminal_the_console_shows_a_bar_with_rate_and_time_left() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    screen = Terminal()
    with progress.reporting(console=True, stream=screen):
        with progress.task("hashing", 4, unit="files") as bar:
            bar.advance(4)
    text = screen.getvalue()
    assert "hashing" in text and "4/4" in text and "files/s" in text and "100%" in text


def test_manifest_build_from_the_command_line_reports_scanning_and_probing(tmp_path: Path) -> None:
    media = tmp_path / "media"
    for number in range(3):
        write_clip(media / f"clip_{number}.mp4", num_frames=5)
    completed = subprocess.run([str(TRAINYARD), "manifest", "build", str(media), "--out", str(tmp_path / "out")],
                               capture_output=True, text=True, timeout=120, env={**os.environ})
    assert completed.returncode == 0, completed.stderr
    assert "scanning: 3/3 files (100%)" in completed.stderr
    assert "probing: 3/3 objects (100%)" in completed.stderr and "done in" in completed.stderr


def test_inside_dagster_the_media_stage_logs_its_progress(tmp_path: Path) -> None:
    media = tmp_path / "media"
    for number in range(2):
        write_clip(media / f"clip_{number}.mp4", num_frames=5)
    storage = StorageResource(media_root=str(media), data_root=str(tmp_path / "data"))
    selected = [asset for asset in all_assets if {"raw_media", "dataset_manifest"} & {k.to_user_string()
                                                                                       for k in asset.keys}]
    with dg.DagsterInstance.ephemeral() as instance:
        result = dg.materialize(selected, instance=instance,
                                resources={"storage": storage, "lineage": LineageResource(),
                                           "launcher": LocalTorchrunLauncher()})
        assert result.success
        messages = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert any(message.startswith("scanning: 2/2 files") for message in messages), messages
    assert any(message.startswith("probing: 2/2 objects") for message in messages), messages


def test_writing_a_shard_reports_its_clips(demo_validation, tmp_path: Path) -> None:
    import dataclasses

    from ops.clips import plan as clips, shards

    validation = dataclasses.replace(demo_validation, accepted=demo_validation.accepted.slice(0, 2))
    plan = clips.plan_clips(validation.accepted, clips.ShardConfig(clips_per_shard=100),
                            manifest_version=validation.manifest_version, validated_version=validation.version)
    clips.write_plan(plan, tmp_path)
    lines: list[str] = []
    with progress.reporting(log=lines.append):
        shards.write_shard(plan, plan.shards[0], validation.media_root, tmp_path)
    total = len(plan.rows_for(plan.shards[0]))
    assert lines == [line for line in lines if line.startswith(f"writing shard {plan.shards[0]}: ")]
    assert f": {total}/{total} clips (100%)" in lines[-1]


def test_a_manifest_build_is_the_same_with_or_without_progress(tmp_path: Path) -> None:
    media = tmp_path / "media"
    write_clip(media / "clip.mp4", num_frames=5)
    quiet = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig())
    with progress.reporting(log=lambda line: None, every_s=0.001):
        reported = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig())
    assert quiet.version == reported.version


def test_a_training_run_states_its_rate_and_time_left_from_the_steps_this_attempt_ran() -> None:
    from trainer.observe.hooks import StepProgress

    clock = _Clock()
    steps = StepProgress(100, clock=clock)
    clock.now = 2.0
    assert steps.text(41, step_time_s=2.0) == "(41%, 0.50 steps/s, about 2 min left)", "resumed at step 40"
    clock.now = 10.0
    assert steps.text(45, step_time_s=2.0) == "(45%, 0.50 steps/s, about 2 min left)"
    clock.now = 120.0
    assert steps.text(100, step_time_s=2.0) == "(100%, 0.50 steps/s)"
