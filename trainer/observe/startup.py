"""Where the time from a stage's request to its first optimizer step goes.

    clock = StartupClock()
    clock.mark("rendezvous")            # the end of a phase, in wall-clock seconds (first mark wins)
    clock.breakdown()                   # phases in order, request to first step, the largest part

A phase is named by the mark at its end and lasts from the latest earlier mark. The marks, in the
order a stage passes them (``MARKS``):

    requested         Dagster created the run (the UI click, a schedule, a sensor, a command)
    run_started       Dagster started it                                 (queue wait: apart)
    step_started      the stage's step began: run worker and step process start, code location load
    preflight         config, manifest, rights and plan checks in the Dagster process
    memory_estimate   the activation-memory measurement of that preflight
    launched          the run folder named and recorded, the launcher called
    job_started       SLURM started the batch job                        (SLURM queue wait: apart)
    process_started   rank 0's process exists: the launcher and torchrun spawned it
    imports           rank 0 imported the trainer (torch and the rest)
    rendezvous        the process group is up
    rank_preflight    rank 0's own checks (and its memory estimate)
    model_build       model built, initialized, parallelized; optimizer built
    loader_start      the data source built (shard index read, workers not yet asked for a batch)
    plugins           run lineage, checkpointer, MLflow run, Dagster Pipes
    checkpoint_load   the checkpoint restored (or none found)
    first_batch       the first batch decoded and handed over
    first_step        the first optimizer step done: the first valid step
    first_checkpoint  the first checkpoint committed (after the first step; not part of the goal)

The Dagster-side marks reach rank 0 through the Pipes session's extras (assets/stage_runs.py);
a run started by hand has only rank 0's. Marks from two machines (a SLURM node and the Dagster
host) compare only as well as their clocks agree.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

MARKS = ("requested", "run_started", "step_started", "preflight", "memory_estimate", "launched", "job_started",
         "process_started", "imports", "rendezvous", "rank_preflight", "model_build", "loader_start", "plugins",
         "checkpoint_load", "first_batch", "first_step", "first_checkpoint")
WAITS = {"run_started": "queue_wait", "job_started": "slurm_queue_wait"}
"""Phases that are waiting in a queue, reported apart from the start-up."""
_AFTER_FIRST_STEP = ("first_checkpoint",)
EXTRAS_KEY = "startup_marks"
"""The Pipes extra holding the Dagster process's marks."""
JOB_STARTED_ENV = "TRAINYARD_JOB_STARTED_AT"
"""Set by the SLURM batch script when the job starts (resources/sbatch_script.py): the end of the queue wait."""


class StartupClock:
    """Wall-clock marks of one start-up; the first mark of a name wins (a retry's second pass does not move it)."""

    def __init__(self, marks: Mapping[str, float] | None = None) -> None:
        self.marks: dict[str, float] = {}
        self.merge(marks or {})

    def mark(self, name: str, at: float | None = None) -> None:
        if name not in MARKS:
            raise ValueError(f"unknown start-up mark {name!r}; one of {MARKS}")
        self.marks.setdefault(name, time.time() if at is None else float(at))

    def merge(self, marks: Mapping[str, Any]) -> None:
        """Another process's marks (unknown names and non-numbers are dropped: they come over Pipes)."""
        for name, value in marks.items():
            if name in MARKS and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.mark(name, value)

    def breakdown(self) -> dict[str, Any]:
        """The phases in time order, each from the latest earlier mark, with the totals."""
        ordered = sorted(self.marks.items(), key=lambda item: (item[1], MARKS.index(item[0])))
        phases: dict[str, float] = {}
        waits: dict[str, float] = {}
        for (_, before), (name, at) in zip(ordered, ordered[1:]):
            seconds = round(at - before, 4)
            if name in WAITS:
                waits[WAITS[name]] = seconds
            else:
                phases[name] = seconds
        record: dict[str, Any] = {"marks": {name: round(at, 4) for name, at in ordered}, "phases": phases, **waits}
        first = self.marks.get("first_step")
        if first is not None and ordered:
            start = ordered[0][1]
            record["first_mark"] = ordered[0][0]
            record["to_first_step_s"] = round(first - start - sum(waits.values()), 4)
            record["to_first_step_with_queue_s"] = round(first - start, 4)
            before_first = {name: seconds for name, seconds in phases.items()
                            if name not in _AFTER_FIRST_STEP and self.marks[name] <= first}
            if before_first:
                record["largest_phase"] = max(before_first, key=before_first.__getitem__)
        return record


def process_start_time(pid: int | None = None) -> float | None:
    """When this process (or pid) was created, in wall-clock seconds (to 10 ms); None where /proc cannot say.
    From the process's age since boot (/proc/uptime), not /proc/stat's btime, which is whole seconds."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", "rb") as stat:
            started_ticks = int(stat.read().rsplit(b")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        now = time.time()
        with open("/proc/uptime", "rb") as uptime:
            since_boot = float(uptime.read().split()[0])
        return now - (since_boot - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, IndexError, ValueError):
        return None


def flat_metadata(breakdown: Mapping[str, Any], prefix: str = "startup/") -> dict[str, float | str]:
    """The breakdown as flat scalars: startup/<phase>_s, startup/to_first_step_s, ... (Dagster, MLflow)."""
    flat: dict[str, float | str] = {f"{prefix}{name}_s": seconds for name, seconds in breakdown.get("phases", {}).items()}
    for key in ("queue_wait", "slurm_queue_wait"):
        if key in breakdown:
            flat[f"{prefix}{key}_s"] = breakdown[key]
    for key in ("to_first_step_s", "to_first_step_with_queue_s"):
        if key in breakdown:
            flat[f"{prefix}{key}"] = breakdown[key]
    for key in ("largest_phase", "first_mark"):
        if key in breakdown:
            flat[f"{prefix}{key}"] = breakdown[key]
    return flat
