"""A sweep's trials as one SLURM array job (pipelines/sweeps.py with ``TRAINYARD_ENV=slurm``).

    job_id = submit(launcher, name="demo_lr", numbers=[0, 1, 2, 3], concurrency=2, cpus=1, work_dir=...)

- One array job per round of ``sweep run``: ``--array=<trial numbers>%<concurrency>``, so SLURM itself never
  runs more than the sweep's concurrency at once (the Dagster pool still holds too: a trial's step claims a
  slot of the ``sweep`` pool in the shared Dagster instance). The array task id is the trial's number.
- Each task runs ``python -m pipelines.sweeps slurm-trial <name>``: the trial's Dagster run on the task's
  node, its ranks started inside the task's allocation (the task's ``TRAINYARD_ENV`` is the deployment
  without ``slurm``: the launcher there is torchrun on that node, not another sbatch).
- ``live_numbers`` lists the tasks SLURM still holds (pending or running, ``squeue -r``): a second
  ``sweep run`` after the first was killed waits for them instead of submitting them again.

The script is rendered through resources/sbatch_script.py's checks, like every script Trainyard submits:
a setting with a newline or a shell metacharacter is refused before sbatch sees it.
"""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ops.publish import paths
from resources.sbatch_script import NAME, TIME, check_path, check_script, check_setting, queue_options
from resources.slurm_commands import SlurmError, run_slurm

SlurmLauncher = Any  # resources.slurm.SlurmLauncher (typed Any: resources.slurm imports the array machinery)
LIVE_STATES = frozenset({"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"})


def render(launcher: SlurmLauncher, *, name: str, numbers: Sequence[int], concurrency: int, cpus: int,
           log_dir: Path, task_env: str) -> str:
    """The sbatch script of one round of a sweep's trials (module docstring)."""
    check_setting("the sweep's name", name, NAME, "e.g. 'demo_lr'")
    check_setting("the trials' TRAINYARD_ENV", task_env, NAME, "local or cluster")
    check_setting("SlurmLauncher.time_limit", launcher.time_limit, TIME, "e.g. '00:30:00'")
    queue = queue_options(launcher)
    if not numbers or any(type(n) is not int or n < 0 for n in numbers):
        raise ValueError(f"an array of trial numbers {list(numbers)!r}")
    if type(concurrency) is not int or concurrency < 1 or type(cpus) is not int or cpus < 1:
        raise ValueError(f"concurrency {concurrency!r} and cpus {cpus!r} must be whole numbers >= 1")
    python = check_path("SlurmLauncher.python", launcher.python or sys.executable)
    log = check_path("the trial logs", str(log_dir / f"{name}-trial-%a-job-%A.log"), allow="%")
    options = [f"--job-name=trainyard-sweep-{name}"[:120], f"--array={','.join(map(str, sorted(numbers)))}%{concurrency}",
               "--nodes=1", "--ntasks=1", f"--cpus-per-task={cpus}", f"--time={launcher.time_limit}", "--no-requeue",
               f"--output={log}", "--open-mode=append", f"--chdir={paths.REPO_ROOT}", *queue]
    lines = ["#!/bin/bash", f"# sweep {name}: trials {', '.join(map(str, sorted(numbers)))}, written by Trainyard "
             "(resources/sweep_array.py)", *(f"#SBATCH {option}" for option in options), "",
             "set -uo pipefail", f"export TRAINYARD_ENV={task_env}",
             # exec: scancel's SIGTERM and the time limit's reach the trial's process, which stops its ranks.
             f"exec {shlex.quote(python)} -m pipelines.sweeps slurm-trial {name}", ""]
    return check_script("\n".join(lines), lines=lines, header=options)


def submit(launcher: SlurmLauncher, *, name: str, numbers: Sequence[int], concurrency: int, cpus: int,
           work_dir: Path, task_env: str, env: Mapping[str, str]) -> str:
    """Write the round's script under ``work_dir`` and submit it; the array job's id."""
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    script = work_dir / f"{name}-{int(time.time() * 1000)}.sbatch"
    script.write_text(render(launcher, name=name, numbers=numbers, concurrency=concurrency, cpus=cpus,
                             log_dir=log_dir, task_env=task_env))
    return run_slurm("sbatch", "--parsable", str(script), env=dict(env)).strip().split(";")[0]


def live_numbers(job_id: str) -> set[int]:
    """The array's task ids SLURM still holds, pending ones included (an unknown job: none)."""
    try:
        out = run_slurm("squeue", "-h", "-r", "-j", str(job_id), "-o", "%K %T")
    except SlurmError as error:
        if "invalid job id" in str(error).lower():
            return set()
        raise
    live = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1] in LIVE_STATES:
            live.add(int(parts[0]))
    return live


def wait(job_id: str, *, poll_s: float, log: Callable[[str], None], patience_s: float = 60.0) -> None:
    """Until SLURM holds no task of the array job; a controller that does not answer is asked again for
    ``patience_s`` (a restarting slurmctld), then the error stands."""
    unanswered: float | None = None
    said = time.monotonic()
    while True:
        try:
            live = live_numbers(job_id)
            unanswered = None
        except SlurmError as error:
            unanswered = unanswered or time.monotonic()
            if time.monotonic() - unanswered > patience_s:
                raise
            log(f"SLURM array job {job_id}: no state ({error}); asking again")
            live = {-1}
        if not live:
            return
        if time.monotonic() - said >= 30:
            said = time.monotonic()
            log(f"SLURM array job {job_id}: trials {sorted(live)} pending or running")
        time.sleep(poll_s)
