"""A watchdog per rank: a hang anywhere ends the run as ``hang``, with every thread's stack.

Anywhere means also where no collective timeout reaches: a stuck data fetch, a stuck
checkpoint save, a peer that stopped between collectives. The loop beats (``Watchdog.beat``)
at the start of the run, around every data fetch and checkpoint save, and at every step's end.
A daemon thread looks every ``poll_s``. When the newest beat is older than ``train.watchdog_s``:

1. every thread's stack of this process goes to ``run_dir/ranks/rank_<R>.stacks.txt`` and to
   stderr. ``faulthandler`` is the standard library's, needs no ptrace permission, and dumps from
   inside the process even while the main thread is blocked in C (a collective, a read). py-spy
   would add a native dependency for the same picture.
2. This rank's end is recorded as ``hang`` (trainer/endings.py), naming what it was doing, at
   which step and for how long. The torchelastic error file is written too, so torchrun names it.
3. The process exits with ``HANG_EXIT_CODE``, through ``os._exit``: the main thread is the one
   that is stuck, so nothing may wait for it.

The rank that fires first also writes ``run_dir/ranks/hang.json`` and waits three polls before it
exits: every other rank's watchdog sees the marker within a poll and does the same (dump, record,
exit), so each rank's stacks are taken while it is still where it stopped, not after its peer's
exit has turned its wait into a lost-peer error. The dumps show which rank hung and where the
others waited. A marker older than this watchdog (an earlier attempt in the same run folder) is
ignored. Slow progress is left alone, because any beat resets the clock. ``watchdog_s`` must exceed the longest step, data
fetch and checkpoint save of the run (the first step's compile included). 0 turns it off.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ops.publish.durable import write_file_atomic

HANG_EXIT_CODE = 124  # as timeout(1)


class HangDetected(RuntimeError):
    """No progress for longer than train.watchdog_s (classified ``hang``)."""


def stacks_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank_{rank}.stacks.txt"


def marker_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ranks" / "hang.json"


class Watchdog:
    """Beats from the training loop; a thread that acts when they stop (module docstring).

    ``on_hang(error, step)`` replaces the default action (record, then ``os._exit``) in tests of
    the timing alone.
    """

    def __init__(self, *, limit_s: float, rank: int, run_dir: str | Path,
                 record_end: Callable[[HangDetected, int], None] | None = None,
                 on_hang: Callable[[HangDetected, int], None] | None = None, poll_s: float | None = None):
        if limit_s <= 0:
            raise ValueError(f"watchdog limit must be > 0 s, got {limit_s}")
        self.limit_s, self.rank, self.run_dir = limit_s, rank, Path(run_dir)
        self.poll_s = poll_s if poll_s is not None else min(1.0, limit_s / 4)
        self._record_end, self._on_hang = record_end, on_hang
        self._lock = threading.Lock()
        self._last = (time.monotonic(), 0, "start")  # (when, step, what it was doing)
        self._started_at = time.time()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    def beat(self, step: int, doing: str) -> None:
        """Progress: ``doing`` (e.g. "data fetch") begins or ended at ``step``."""
        with self._lock:
            self._last = (time.monotonic(), step, doing)

    def start(self) -> Watchdog:
        self.beat(self._last[1], "start")
        self._started_at = time.time()
        self._thread = threading.Thread(target=self._watch, name=f"trainyard-watchdog-rank{self.rank}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s + 1)

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def hold_if_fired(self) -> None:
        """In the training thread: when the watchdog has fired, wait for it to end the process.

        The hang record must stand: once a rank's watchdog fires, its peers exit too, and the
        collective this thread was blocked in then fails as a lost peer, an error that must not
        overwrite the record of the hang that caused it. A bounded wait, then the same exit.
        """
        if self.fired and self._on_hang is None:
            time.sleep(30 + 4 * self.poll_s)
            os._exit(HANG_EXIT_CODE)

    def _watch(self) -> None:
        while not self._stopped.wait(self.poll_s):
            with self._lock:
                when, step, doing = self._last
            idle = time.monotonic() - when
            detail = f"last progress: {doing} at step {step}, {idle:.1f} s ago"
            if idle > self.limit_s:
                error = HangDetected(f"rank {self.rank}: no progress for {idle:.1f} s (limit train.watchdog_s="
                                     f"{self.limit_s:g}); {detail}")
            elif (peer := self._peer_hang()) is not None:
                error = HangDetected(f"rank {self.rank}: stopped with rank {peer['rank']}, which detected a hang "
                                     f"({peer['error']}); here, {detail}")
            else:
                continue
            self.fired = True
            (self._on_hang or self._act)(error, step)
            return

    def _peer_hang(self) -> dict | None:
        """The marker another rank wrote during this attempt, if any."""
        path = marker_path(self.run_dir)
        try:
            if path.stat().st_mtime < self._started_at:
                return None
            marker = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return marker if marker.get("rank") != self.rank else None

    def _act(self, error: HangDetected, step: int) -> None:
        """Dump every stack, record the hang, tell the peers, end the process (never returns)."""
        try:
            marker = marker_path(self.run_dir)
            first = self._peer_hang() is None
            if first:
                write_file_atomic(marker, json.dumps({"rank": self.rank, "step": step, "error": str(error)}).encode())
            print(f"[rank {self.rank}] watchdog: {error}; dumping every thread's stack", file=sys.stderr, flush=True)
            path = stacks_path(self.run_dir, self.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as handle:
                handle.write(f"{error}\n\n")
                handle.flush()
                faulthandler.dump_traceback(file=handle, all_threads=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            if self._record_end is not None:
                self._record_end(error, step)
            if first:  # the peers' watchdogs poll the marker: give them time to dump where they stand
                time.sleep(3 * self.poll_s + 1.0)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(HANG_EXIT_CODE)
