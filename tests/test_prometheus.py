"""Prometheus textfiles from training (trainer/observe/prometheus.py): one file per rank, bounded labels,
atomic replacement, and the restart counter across a resume.

Real runs: a 2-rank torchrun job of the tiny_cpu preset (about 6 s) and an in-process resume.
Run: .venv/bin/python -m pytest tests/test_prometheus.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import train_wired
from prometheus_client.parser import text_string_to_metric_families

from ops.publish.paths import REPO_ROOT
from trainer.observe import prometheus
from trainer.launch.config import load_config
from trainer.faults import ATTEMPT_ENV

ALLOWED_LABELS = {"run", "stage", "rank"}
EXPECTED = {"trainyard_step", "trainyard_step_seconds", "trainyard_samples_per_second", "trainyard_data_wait_seconds",
            "trainyard_memory_bytes", "trainyard_memory_peak_bytes", "trainyard_checkpoint_seconds", "trainyard_loss",
            "trainyard_last_step_timestamp_seconds", "trainyard_restarts", "trainyard_nonfinite_events",
            # prometheus_client's creation time of each counter (a gauge family of its own in the text format)
            "trainyard_restarts_created", "trainyard_nonfinite_events_created"}
CHECKPOINTED = ("stage.checkpoint=true", "train.checkpoint_every=3", "stage.mlflow=false")


def parse(path: Path) -> dict[str, dict[tuple, float]]:
    """Family name -> {(sample name, sorted labels): value}."""
    return {family.name: {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                          for sample in family.samples}
            for family in text_string_to_metric_families(path.read_text())}


def value(families: dict, name: str) -> float:
    (found,) = families[name].values()
    return found


def step_metrics(step: int, *, skipped: int = 0) -> dict[str, float]:
    return {"loss": 1.0 / step, "num_samples": 8.0, "num_skipped_steps": float(skipped)}


def timings(step_s: float, *, checkpoint_s: float = 0.0) -> dict[str, float]:
    return {"step_time_s": step_s, "time_data_wait_s": step_s / 10, "time_checkpoint_s": checkpoint_s}


def test_series_stay_bounded_however_many_steps_and_runs(tmp_path: Path) -> None:
    """Labels are run, stage and rank only; steps add no series, and two runs keep their own registries."""
    exporters = [prometheus.PrometheusExporter(tmp_path / name, stage="pretrain", rank=0, device=torch.device("cpu"),
                                               attempt=0) for name in ("run-a", "run-b")]
    counts = []
    for step in range(1, 401):
        for exporter in exporters:
            exporter.on_step_end(step, step_metrics(step, skipped=step // 100),
                                 timings(0.01 * (step % 7 + 1), checkpoint_s=0.5 if step % 50 == 0 else 0.0))
        if step in (10, 400):
            families = parse(prometheus.rank_file(tmp_path / "run-a", 0))
            counts.append(sum(len(samples) for samples in families.values()))
            labels = {name for samples in families.values() for _, pairs in samples for name, _ in pairs}
            assert labels <= ALLOWED_LABELS, labels
            assert set(families) == EXPECTED
    assert counts[0] == counts[1]  # 400 steps: not one series more than after 10
    for name in ("run-a", "run-b"):  # each run's file holds its own run label only
        families = parse(prometheus.rank_file(tmp_path / name, 0))
        assert {dict(pairs)["run"] for samples in families.values() for _, pairs in samples} == {name}
        assert value(families, "trainyard_step") == 400
        assert value(families, "trainyard_nonfinite_events") == 4  # the run's count, not the number of calls
        assert value(families, "trainyard_checkpoint_seconds") == 0.5


def test_an_attempt_that_ran_no_step_leaves_the_last_figures_alone(tmp_path: Path) -> None:
    """A relaunch that fails before its first step (a restore error, a run already complete) must not
    replace the previous attempt's figures with unset gauges: step 0 and a last step in 1970."""
    first = prometheus.PrometheusExporter(tmp_path, stage="pretrain", rank=0, device=torch.device("cpu"), attempt=0)
    first.on_step_end(50, step_metrics(50), timings(0.1))
    first.close()
    again = prometheus.PrometheusExporter(tmp_path, stage="pretrain", rank=0, device=torch.device("cpu"), attempt=1)
    again.close()
    families = parse(prometheus.rank_file(tmp_path, 0))
    assert value(families, "trainyard_step") == 50 and value(families, "trainyard_last_step_timestamp_seconds") > 1e9


def test_a_scrape_during_writes_never_reads_a_partial_file(tmp_path: Path) -> None:
    """A writer rewrites the file as fast as it can; every read parses to every metric with one series each."""
    exporter = prometheus.PrometheusExporter(tmp_path / "run", stage="pretrain", rank=0, device=torch.device("cpu"),
                                             attempt=0)
    exporter.on_step_end(1, step_metrics(1), timings(0.1))
    stop = threading.Event()

    def write_forever() -> None:
        step = 1
        while not stop.is_set():
            step += 1
            exporter.on_step_end(step, step_metrics(step), timings(0.1))

    writer = threading.Thread(target=write_forever)
    writer.start()
    try:
        steps = []
        deadline = time.monotonic() + 60  # on a loaded machine the writer may need more than 400 reads' time
        while len(steps) < 400 or (len(set(steps)) < 3 and time.monotonic() < deadline):
            families = parse(exporter.path)
            assert set(families) == EXPECTED
            steps.append(value(families, "trainyard_step"))
    finally:
        stop.set()
        writer.join()
    assert len(set(steps)) > 1  # the reads did overlap the writes
    assert not [path for path in exporter.path.parent.iterdir() if path != exporter.path]  # no temporary left over


def wired_run(run_dir: Path, *overrides: str) -> None:
    """What `python -m trainer.train` does, in this process."""
    train_wired(load_config(None, ["preset=tiny_cpu", f"train.run_dir={run_dir}", *CHECKPOINTED, *overrides]))


def test_a_resumed_run_counts_one_restart_more(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The policy tells each attempt its number ($TRAINYARD_ATTEMPT, from attempts.jsonl); the resume
    continues the step, and the non-finite count comes back with the checkpoint."""
    run_dir = tmp_path / "pretrain-x"
    monkeypatch.setenv(ATTEMPT_ENV, "0")
    wired_run(run_dir, "train.steps=3", "faults.nan_loss_at_steps=[2]", "train.max_consecutive_nonfinite=3")
    first = parse(prometheus.rank_file(run_dir, 0))
    monkeypatch.setenv(ATTEMPT_ENV, "1")
    wired_run(run_dir, "train.steps=5")
    second = parse(prometheus.rank_file(run_dir, 0))
    assert value(first, "trainyard_restarts") == 0 and value(second, "trainyard_restarts") == 1
    assert value(first, "trainyard_step") == 3 and value(second, "trainyard_step") == 5
    assert value(first, "trainyard_nonfinite_events") == value(second, "trainyard_nonfinite_events") == 1
    assert math.isfinite(value(second, "trainyard_loss"))


def test_every_rank_of_a_torchrun_job_writes_its_own_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "pretrain-ddp"
    run_dir.mkdir()
    (run_dir / "exp.yaml").write_text("preset: tiny_cpu\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "-m", "trainer.train",
               "--config", str(run_dir / "exp.yaml"), *(arg for override in (
                   f"train.run_dir={run_dir}", "train.parallelism=ddp", "train.steps=4", *CHECKPOINTED)
                   for arg in ("--set", override))]
    job = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, ATTEMPT_ENV: "0"})
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    final = json.loads((run_dir / "final.json").read_text())
    assert sorted(path.name for path in prometheus.metrics_dir(run_dir).iterdir()) == ["rank-0.prom", "rank-1.prom"]
    for rank in (0, 1):
        families = parse(prometheus.rank_file(run_dir, rank))
        assert set(families) == EXPECTED
        assert {dict(pairs)["rank"] for samples in families.values() for _, pairs in samples} == {str(rank)}
        assert value(families, "trainyard_step") == final["final_step"] == 4
        assert value(families, "trainyard_loss") == pytest.approx(final["losses"][-1])  # the global loss, every rank
        assert value(families, "trainyard_checkpoint_seconds") > 0
        assert value(families, "trainyard_memory_peak_bytes") >= value(families, "trainyard_memory_bytes") > 0
