"""The watchdog (trainer/watchdog.py): a hang anywhere is detected within the configured time,
every thread's stack is dumped on every rank, the end is classified ``hang``; slow but moving
progress is left alone.

The timing runs on the Watchdog itself; the whole path under real torchrun (2 ranks, gloo, CPU,
tiny preset), with a rank stalled inside its data fetch.

Run: python -m pytest tests/test_watchdog.py -q
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from test_trainer_distributed import torchrun

from trainer.launch.config import TrainConfig
from trainer.endings import classify
from trainer.launch.config_sections import FaultConfig
from trainer.watchdog import HANG_EXIT_CODE, HangDetected, Watchdog, stacks_path


def _fired(watchdog_kwargs: dict, *, beat_every_s: float | None, run_s: float) -> tuple[list, float]:
    fired, started = [], time.monotonic()
    hung = threading.Event()

    def on_hang(error: HangDetected, step: int) -> None:
        fired.append((error, step, time.monotonic() - started))
        hung.set()

    watchdog = Watchdog(on_hang=on_hang, rank=3, **{"run_dir": "unused", **watchdog_kwargs}).start()
    try:
        step = 0
        while time.monotonic() - started < run_s and not hung.is_set():
            if beat_every_s is not None:
                step += 1
                watchdog.beat(step, "data fetch")
            time.sleep(beat_every_s or 0.05)
    finally:
        watchdog.stop()
    return fired, time.monotonic() - started


def test_no_progress_is_detected_within_the_limit_and_names_what_stopped() -> None:
    fired, _ = _fired({"limit_s": 1.0, "poll_s": 0.05}, beat_every_s=None, run_s=4.0)
    ((error, step, after_s),) = fired
    assert 1.0 <= after_s < 1.5, after_s  # the limit, plus a poll and scheduling
    assert classify("failed", error) == "hang" and "rank 3" in str(error) and "last progress: start" in str(error)


def test_slow_but_moving_progress_is_left_alone() -> None:
    fired, elapsed = _fired({"limit_s": 0.5, "poll_s": 0.05}, beat_every_s=0.3, run_s=2.5)
    assert fired == [] and elapsed >= 2.5  # five times the limit, every gap shorter than it


def test_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="watchdog_s"):
        TrainConfig(steps=1, run_dir="x", watchdog_s=-1)
    with pytest.raises(ValueError, match="stall_in"):
        FaultConfig(stall_in="loss")
    with pytest.raises(ValueError, match="limit"):
        Watchdog(limit_s=0, rank=0, run_dir="x")


def _rank_end(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / "ranks" / f"rank_{rank}.json").read_text())


@pytest.mark.parametrize("stuck_rank", [1, 0])
def test_a_rank_stuck_in_its_data_fetch_is_a_hang_on_every_rank_with_their_stacks(tmp_path: Path,
                                                                                  stuck_rank: int) -> None:
    """One rank stalls inside the data fetch of step 2 for a minute; the collective timeout (30 s)
    would catch it only at the other's next collective. The 3 s watchdog catches it on both ranks:
    the stuck one in its fetch, the other waiting for it in the step's first collective. Either
    may fire first (their polls are not in phase): whichever does, the other's exit must not turn
    the waiting rank's record into a lost peer (CI once saw exactly that)."""
    waiting_rank = 1 - stuck_rank
    job = torchrun(tmp_path / "hang", "train.parallelism=ddp", "train.steps=6", "train.collective_timeout_s=30",
                   "train.watchdog_s=3", f"faults.stall_rank={stuck_rank}", "faults.stall_at_step=2",
                   "faults.stall_in=data", "faults.stall_s=60", timeout_s=90)
    assert job.returncode != 0, job.output
    assert job.elapsed_s < 30, job.elapsed_s  # not the stall (60 s), not the collective timeout (30 s)
    stuck, waiting = _rank_end(job.run_dir, stuck_rank), _rank_end(job.run_dir, waiting_rank)
    assert stuck["failure_class"] == waiting["failure_class"] == "hang", (stuck, waiting)
    assert stuck["step"] == waiting["step"] == 1
    assert "data fetch at step 2" in stuck["error"] or "data fetch at step 2" in waiting["error"]
    stacks = {rank: stacks_path(job.run_dir, rank).read_text() for rank in (0, 1)}
    assert "in_data_fetch" in stacks[stuck_rank] and "train_step" in stacks[stuck_rank]
    assert "all_reduce" in stacks[waiting_rank] and "in_data_fetch" not in stacks[waiting_rank]
    assert "HangDetected" in job.output and f"exitcode  : {HANG_EXIT_CODE}" in job.output


def test_a_stall_shorter_than_the_watchdog_limit_is_not_killed(tmp_path: Path) -> None:
    job = torchrun(tmp_path / "slow", "train.parallelism=ddp", "train.steps=4", "train.watchdog_s=6",
                   "faults.stall_rank=1", "faults.stall_at_step=2", "faults.stall_s=2.5", timeout_s=90)
    assert job.returncode == 0, job.output
    assert job.final["status"] == "completed"
    assert not list((job.run_dir / "ranks").glob("*.stacks.txt"))


def test_a_peers_marker_stops_this_rank_too_but_an_earlier_attempts_marker_does_not(tmp_path: Path) -> None:
    from trainer.watchdog import marker_path

    marker = marker_path(tmp_path)
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"rank": 1, "step": 4, "error": "rank 1: no progress for 9.0 s"}))
    time.sleep(0.05)
    fired, _ = _fired({"limit_s": 5.0, "poll_s": 0.05, "run_dir": tmp_path}, beat_every_s=0.05, run_s=0.6)
    assert fired == []  # written before this watchdog started: another attempt's
    fired, started = [], time.monotonic()
    watchdog = Watchdog(limit_s=5.0, poll_s=0.05, rank=0, run_dir=tmp_path,
                        on_hang=lambda error, step: fired.append(error)).start()
    try:
        time.sleep(0.2)
        marker.write_text(json.dumps({"rank": 1, "step": 4, "error": "rank 1: no progress for 9.0 s"}))
        while not fired and time.monotonic() - started < 3:
            watchdog.beat(4, "step end")  # this rank still moves: the peer's hang stops it anyway
            time.sleep(0.05)
    finally:
        watchdog.stop()
    (error,) = fired
    assert classify("failed", error) == "hang" and "stopped with rank 1" in str(error)
