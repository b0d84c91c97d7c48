"""Data work on the cluster: SLURM array jobs of ``ops.array_tasks`` tasks, submitted and followed for
a Dagster step (``SlurmLauncher.run_tasks``, the launcher resource the training stages use).

    ends = run_tasks(launcher, context, work_dir=..., num_tasks=40, name="clip_shards")

- One array job per round, ``--array=0-(k-1)%N``: N is ``SlurmLauncher.array_parallel``, the most
  tasks running at once. A round larger than the cluster's ``MaxArraySize`` (``scontrol show config``)
  or ``SlurmLauncher.array_max_size`` is split into several array jobs, each told where its tasks
  start (``--offset``).
- Each task runs ``python -m ops.array_tasks`` with the spec, under ``array_task_time``: a task that
  hangs is ended by SLURM at its time limit (TIMEOUT) and classified ``timeout``; one whose node
  fails under it ends NODE_FAIL, ``node_lost``; the caller resubmits only the failed items.
- The tasks' logs and progress come back through one Dagster Pipes session per job (a context file
  and a message file in the work folder, on the shared filesystem); each task also has its own log.
- Cancelling the Dagster step cancels every job and waits for it to leave the queue; then the
  staging files the jobs' tasks left (``.<shard>.tar.tmp-j<job>-*``) are removed. Nothing else
  touches a staging file: another backfill's writer of the same shard keeps its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from ops.publish import paths
from resources.launcher import raise_if_canceled
from resources.sbatch_script import NAME, TIME, check_path, check_script, check_setting, queue_options
from resources.slurm_commands import SlurmError, parse_records, run_slurm, seconds
from resources.slurm_nodes import lost_nodes

# The launcher is a resources.slurm.SlurmLauncher (its array_* fields, partition, exclude, poll_s):
# typed Any here, since resources.slurm imports this module.
SlurmLauncher = Any
# As resources.slurm.JOB_STATE_PATIENCE_S: how long a slurmctld that does not answer is asked again.
JOB_STATE_PATIENCE_S = 60.0

# How a task's SLURM state classes its items when the task left no result of its own.
TASK_STATE_CLASSES = {"TIMEOUT": "timeout", "NODE_FAIL": "node_lost", "BOOT_FAIL": "node_lost",
                      "OUT_OF_MEMORY": "out_of_memory", "CANCELLED": "cancelled", "PREEMPTED": "preempted",
                      "DEADLINE": "timeout", "FAILED": "task_failed", "COMPLETED": "no_result"}
TERMINAL = frozenset(TASK_STATE_CLASSES)
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True, slots=True)
class TaskEnd:
    """How one array task ended, as SLURM saw it."""

    index: int
    """The task's index in the round's spec (its array task id plus its job's offset)."""
    job_id: str
    """The array job's id."""
    array_task: int
    """Its id in that job ($SLURM_ARRAY_TASK_ID)."""
    state: str
    exit_code: int = 0
    node: str = ""
    submitted_at: float = 0.0
    """When its job was submitted (time.time() on this machine)."""

    @property
    def failure_class(self) -> str:
        return TASK_STATE_CLASSES.get(self.state, "task_failed")


def max_array_size(launcher: SlurmLauncher) -> int:
    """The most tasks one array job may have here: the cluster's MaxArraySize (task ids run 0 to
    MaxArraySize - 1), or ``array_max_size`` when that is smaller."""
    size = 1001
    for line in run_slurm("scontrol", "show", "config").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "MaxArraySize" and value.strip().isdigit():
            size = int(value.strip())
    if launcher.array_max_size > 0:
        size = min(size, launcher.array_max_size)
    if size < 1:
        raise SlurmError(f"MaxArraySize is {size} on this cluster: it runs no array job; raise it in slurm.conf")
    return size


def render(launcher: SlurmLauncher, *, name: str, spec_path: Path, offset: int, count: int, log_dir: Path,
           exclude: Sequence[str] = ()) -> str:
    """The sbatch script of one array job: ``count`` tasks of ``spec_path`` from task ``offset``."""
    check_setting("the array job's name", name, NAME, "e.g. 'clip_shards'")
    check_setting("SlurmLauncher.array_task_time", launcher.array_task_time, TIME, "e.g. '00:20:00'")
    queue = queue_options(launcher, exclude)
    for setting in ("array_parallel", "array_cpus_per_task"):
        value = getattr(launcher, setting)
        if type(value) is not int or value < 0:
            raise ValueError(f"SlurmLauncher.{setting} {value!r} is not a whole number >= 0")
    if count < 1:
        raise ValueError(f"an array job of {count} tasks")
    python = check_path("SlurmLauncher.python", launcher.python or sys.executable)
    spec = check_path("the task spec", str(spec_path))
    log = check_path("the task logs", str(log_dir / "task-%a-job-%A.log"), allow="%")
    throttle = f"%{launcher.array_parallel}" if launcher.array_parallel else ""
    options = [f"--job-name=trainyard-{name}"[:120], f"--array=0-{count - 1}{throttle}", "--nodes=1", "--ntasks=1",
               f"--cpus-per-task={max(1, launcher.array_cpus_per_task)}", f"--time={launcher.array_task_time}",
               "--no-requeue", f"--output={log}", "--open-mode=append", f"--chdir={paths.REPO_ROOT}", *queue]
    command = [shlex.quote(python), "-m", "ops.array_tasks", "--spec", shlex.quote(spec),
               '--task "$SLURM_ARRAY_TASK_ID"', f"--offset {int(offset)}"]
    lines = ["#!/bin/bash", f"# {name}: tasks {offset}..{offset + count - 1}, written by Trainyard (resources/slurm_array.py)",
             *(f"#SBATCH {option}" for option in options), "",
             "set -uo pipefail",
             # exec: scancel's SIGTERM and the time limit's reach the task itself, which removes its staging file.
             f"exec {' '.join(command)}", ""]
    return check_script("\n".join(lines), lines=lines, header=options)


def run_tasks(launcher: SlurmLauncher, context: dg.AssetExecutionContext, *, work_dir: Path, spec_path: Path,
              num_tasks: int, name: str, env: Mapping[str, str], exclude: Sequence[str] = (),
              out_dirs: Sequence[Path] = (), cancel: threading.Event | None = None) -> dict[int, TaskEnd]:
    """Run tasks 0..num_tasks-1 of ``spec_path`` as array jobs and wait for every one to end; how
    each ended. ``out_dirs``: where the tasks write shards (their jobs' staging files are removed)."""
    size = max_array_size(launcher)
    log_dir = work_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    jobs: dict[str, tuple[int, int, float]] = {}  # job id -> (offset, count, submitted at)
    ends: dict[int, TaskEnd] = {}
    sessions = contextlib.ExitStack()
    try:
        for offset in range(0, num_tasks, size):
            count = min(size, num_tasks - offset)
            script = work_dir / f"{name}-tasks-{offset}.sbatch"
            script.write_text(render(launcher, name=name, spec_path=spec_path, offset=offset, count=count,
                                     log_dir=log_dir, exclude=exclude))
            session = sessions.enter_context(dg.open_pipes_session(
                context=context,
                context_injector=dg.PipesFileContextInjector(str(work_dir / f"pipes-context-{offset}.json")),
                message_reader=TaskMessagesReader(work_dir / f"pipes-messages-{offset}", writers=count)))
            submitted_at = time.time()
            job_id = run_slurm("sbatch", "--parsable", str(script),
                               env={**env, **session.get_bootstrap_env_vars()}).strip().split(";")[0]
            jobs[job_id] = (offset, count, submitted_at)
            context.log.info(f"submitted SLURM array job {job_id}: {name} tasks {offset}..{offset + count - 1}"
                             f"{f' (at most {launcher.array_parallel} at once)' if launcher.array_parallel else ''};"
                             f" logs {log_dir}")
        _follow(launcher, context, jobs, ends, cancel)
    except dg.DagsterExecutionInterruptedError:
        _cancel(launcher, context, jobs)
        _sweep(context, jobs, out_dirs)
        raise
    except BaseException as error:
        if jobs:
            context.log.error(f"SLURM array job(s) {', '.join(jobs)}: no longer followed ({type(error).__name__}: "
                              f"{error}); cancelling them")
            try:
                _cancel(launcher, context, jobs)
                _sweep(context, jobs, out_dirs)
            except SlurmError as cancel_error:
                context.log.error(f"scancel failed: {cancel_error}; scancel {' '.join(jobs)} by hand")
        raise
    finally:
        sessions.close()  # the last messages the tasks wrote are read before the sessions end
    _sweep(context, jobs, out_dirs)
    return ends


def _follow(launcher: SlurmLauncher, context: dg.AssetExecutionContext, jobs: Mapping[str, tuple[int, int, float]],
            ends: dict[int, TaskEnd], cancel: threading.Event | None) -> None:
    """Until every task has ended. A task running past ``array_task_time`` is cancelled here and
    ends TIMEOUT: SLURM's own --time is whole minutes, checked every 30 s, so a limit of 20 s would
    hold a hung task for up to 90 s (SLURM's limit stays the backstop)."""
    unanswered_since: float | None = None
    total = sum(count for _, count, _ in jobs.values())
    said = time.monotonic()
    limit_s = _limit_s(launcher)
    running_since: dict[tuple[str, int], float] = {}
    ended_by: dict[tuple[str, int], str] = {}  # tasks this loop cancelled, and the state they count as
    while True:
        running = 0
        try:
            for job_id, (offset, count, submitted_at) in jobs.items():
                for task, (state, code, node) in _task_states(job_id).items():
                    key = (job_id, task)
                    if state == "RUNNING":
                        running += 1
                        since = running_since.setdefault(key, time.monotonic())
                        if limit_s is not None and key not in ended_by and time.monotonic() - since > limit_s:
                            # A task whose node is gone is not hung: its node is lost (SLURM says so only
                            # after SlurmdTimeout; slurmd not answering says so now).
                            lost = lost_nodes(_hostnames(node), run=run_slurm) if node else {}
                            ended_by[key] = "NODE_FAIL" if lost else "TIMEOUT"
                            context.log.warning(
                                f"array task {job_id}_{task} on {node}: running {limit_s:g} s, past "
                                f"SlurmLauncher.array_task_time ({launcher.array_task_time}): cancelling it "
                                + (f"(node_lost: {'; '.join(lost.values())})" if lost else "(timeout)"))
                            run_slurm("scancel", f"{job_id}_{task}")
                    if task < count and state in TERMINAL and offset + task not in ends:
                        ends[offset + task] = TaskEnd(index=offset + task, job_id=job_id, array_task=task,
                                                      state=ended_by.get(key, state),
                                                      exit_code=code, node=node, submitted_at=submitted_at)
            unanswered_since = None
        except SlurmError as error:  # a restarting slurmctld answers again within a minute
            unanswered_since = unanswered_since or time.monotonic()
            if time.monotonic() - unanswered_since > JOB_STATE_PATIENCE_S:
                raise
            context.log.warning(f"SLURM array job(s) {', '.join(jobs)}: no state ({error}); asking again")
        if len(ends) == total:
            return
        if time.monotonic() - said >= PROGRESS_EVERY_S:  # a backfill that waits in the queue says so
            said = time.monotonic()
            failed = sum(end.state != "COMPLETED" for end in ends.values())
            context.log.info(f"array job(s) {', '.join(jobs)}: {len(ends)}/{total} task(s) ended ({failed} not "
                             f"completed), {running} running, {total - len(ends) - running} waiting in the queue")
        time.sleep(launcher.poll_s)
        raise_if_canceled(cancel)


def _limit_s(launcher: SlurmLauncher) -> float | None:
    return seconds(launcher.array_task_time) or None


def _task_states(job_id: str) -> dict[int, tuple[str, int, str]]:
    """array task id -> (state, exit code, node) of the tasks of array job ``job_id`` that have a state
    of their own (pending ones still folded into the array's record are left out): from the
    controller while it knows the job, else from accounting."""
    try:
        records = parse_records(run_slurm("scontrol", "show", "job", "-o", job_id))
    except SlurmError as error:
        if "Invalid job id" not in str(error):
            raise
        records = []
    states = {}
    for record in records:
        task = record.get("ArrayTaskId", "")
        if record.get("ArrayJobId") != job_id or not task.isdigit():
            continue
        code = record.get("ExitCode", "0:0").partition(":")[0]
        states[int(task)] = (record.get("JobState", "PENDING").split()[0], int(code or 0), record.get("NodeList", ""))
    if records:
        return states
    # The controller forgot the job (MinJobAge): accounting keeps it.
    for line in run_slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode,NodeList").splitlines():
        parts = line.split("|")
        if len(parts) < 4 or "_" not in parts[0]:
            continue
        task = parts[0].split("_", 1)[1]
        if task.isdigit():
            states[int(task)] = (parts[1].split()[0] if parts[1] else "PENDING",
                                 int(parts[2].partition(":")[0] or 0), parts[3])
    return states


def _cancel(launcher: SlurmLauncher, context: dg.AssetExecutionContext,
            jobs: Mapping[str, tuple[int, int, float]]) -> None:
    """scancel every job (SIGTERM: each task removes its staging file), then wait until they left the queue."""
    if not jobs:
        return
    context.log.info(f"cancelling SLURM array job(s) {', '.join(jobs)}")
    run_slurm("scancel", *jobs)
    deadline = time.monotonic() + launcher.cancel_timeout_s
    while time.monotonic() < deadline:
        try:
            queued = run_slurm("squeue", "-h", "-j", ",".join(jobs), "-o", "%i").split()
        except SlurmError:
            queued = []  # the controller forgot the jobs: none is queued
        if not queued:
            return
        time.sleep(launcher.poll_s)
    context.log.warning(f"SLURM array job(s) {', '.join(jobs)} still queued {launcher.cancel_timeout_s:g} s "
                        f"after scancel")


def _sweep(context: dg.AssetExecutionContext, jobs: Mapping[str, Any], out_dirs: Sequence[Path]) -> None:
    """Remove the staging files the jobs' tasks left behind (a task SIGKILLed mid-shard)."""
    removed = []
    for out_dir in out_dirs:
        for job_id in jobs:
            for path in Path(out_dir).glob(f".*.tar.tmp-j{job_id}-*"):
                try:
                    path.unlink()
                    removed.append(path.name)
                except FileNotFoundError:
                    pass
    if removed:
        context.log.warning(f"removed {len(removed)} staging file(s) left by killed tasks: {removed[:5]}")


class TaskMessagesReader(dg.PipesMessageReader):
    """Dagster Pipes messages of the ``writers`` tasks of one array job, one file per task
    (``<folder>/task-<array task id>.jsonl``: no two nodes ever append to one file, which a network
    filesystem does not keep whole), all read by one thread.

    Why not dg.PipesCompositeMessageReader over one PipesFileMessageReader per task: each of those
    tails its file from its own thread, polling every 10 ms, and an array job has hundreds of tasks.
    The tasks (ops.array_tasks) fill ``{task}`` in the path they are given."""

    def __init__(self, folder: Path, *, writers: int, poll_s: float = 0.25) -> None:
        self.folder, self.writers, self.poll_s = Path(folder), writers, poll_s

    @property
    def expected_writer_count(self) -> int:
        return self.writers

    @contextlib.contextmanager
    def read_messages(self, handler: Any) -> Iterator[dict[str, Any]]:
        self.folder.mkdir(parents=True, exist_ok=True)
        done = threading.Event()
        thread = threading.Thread(target=self._read, args=(handler, done), daemon=True)
        thread.start()
        try:
            yield {"path": str(self.folder / "task-{task}.jsonl")}
        finally:
            done.set()
            thread.join()

    def _read(self, handler: Any, done: threading.Event) -> None:
        offsets: dict[Path, int] = {}
        while True:
            last = done.is_set()  # read once more after the session ends: the last lines written
            for path in sorted(self.folder.glob("task-*.jsonl")):
                try:
                    with open(path, "rb") as handle:
                        handle.seek(offsets.get(path, 0))
                        data = handle.read()
                except OSError:
                    continue
                complete = data[:data.rfind(b"\n") + 1]
                offsets[path] = offsets.get(path, 0) + len(complete)
                for line in complete.decode("utf-8", "replace").splitlines():
                    try:
                        handler.handle_message(json.loads(line))
                    except ValueError:
                        continue  # a torn line of a task killed mid-write
                    except Exception:  # noqa: BLE001 - as PipesFileMessageReader: reported, reading goes on
                        handler.report_pipes_framework_exception(type(self).__name__, sys.exc_info())
            if last:
                return
            done.wait(self.poll_s)

    def on_opened(self, opened_payload: Any) -> None:
        pass

    def on_launched(self, launched_payload: Any) -> None:
        pass

    def no_messages_debug_text(self) -> str:
        return f"Attempted to read messages from {self.folder}/task-*.jsonl."


def task_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment the tasks start with: this process's (the data pipeline's identity), unbuffered."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", **(extra or {})}


# ---- rounds: run the items, then again only the failed ones ----

RETRYABLE = frozenset({"error", "timeout", "node_lost", "out_of_memory", "preempted", "task_failed", "no_result",
                       "cancelled"})
"""Item failures worth another round; ``refused`` (the task's environment lacks a setting) is not."""


@dataclass(slots=True)
class ItemOutcome:
    """Where one item (a partition, a probe chunk) ended after every round."""

    item: str
    result: dict[str, Any] | None = None
    """Its task's result record (class ok, or the failure it recorded); None when it left none."""
    failure_class: str = ""
    """"" when done; else why the last round did not finish it."""
    reason: str = ""
    attempts: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """One line per round that ran it: round, job, task, node, class, reason."""

    @property
    def ok(self) -> bool:
        return not self.failure_class


def run_rounds(launcher: SlurmLauncher, context: dg.AssetExecutionContext, *, work_dir: Path, name: str,
               items: Sequence[str], per_task: int, spec_for: Callable[[int, list[list[str]]], dict[str, Any]],
               result_of: Callable[[str], dict[str, Any] | None], env: Mapping[str, str],
               out_dirs: Sequence[Path] = (), cancel: threading.Event | None = None) -> dict[str, ItemOutcome]:
    """Every item through array tasks of ``per_task`` items, in up to 1 + ``array_retries`` rounds:
    each round runs only what is not yet done and may be retried, on the nodes not lost so far.

    ``spec_for(round, groups)`` is the round's spec (ops.array_tasks); ``result_of(item)`` reads the
    item's result record (with its ``round``), or None."""
    from ops.array_tasks import write_spec

    outcomes = {item: ItemOutcome(item) for item in items}
    lost_nodes: list[str] = []
    remaining = list(items)
    for round_number in range(1, 2 + max(0, launcher.array_retries)):
        groups = [remaining[start:start + per_task] for start in range(0, len(remaining), max(1, per_task))]
        round_dir = work_dir / f"round-{round_number}"
        spec_path = write_spec(round_dir / "spec.json", {**spec_for(round_number, groups), "round": round_number})
        ends = run_tasks(launcher, context, work_dir=round_dir, spec_path=spec_path, num_tasks=len(groups), name=name,
                         env=env, exclude=lost_nodes, out_dirs=out_dirs, cancel=cancel)
        for index, group in enumerate(groups):
            end = ends.get(index)
            for item in group:
                outcome = outcomes[item]
                record = result_of(item)
                if record is not None and record.get("round") != round_number:
                    record = None  # an earlier round's: says nothing of this one
                if record is not None and record.get("class") == "ok":
                    outcome.result, outcome.failure_class, outcome.reason = record, "", ""
                elif record is not None:
                    outcome.result, outcome.failure_class = record, str(record.get("class"))
                    outcome.reason = str(record.get("reason", ""))
                else:
                    outcome.failure_class = end.failure_class if end else "no_result"
                    outcome.reason = _task_reason(end, round_dir)
                outcome.attempts.append({"round": round_number, "job_id": end.job_id if end else "",
                                         "task": index, "node": (record or {}).get("node") or (end.node if end else ""),
                                         "slurm_state": end.state if end else "", "class": outcome.failure_class or "ok",
                                         "submitted_at": end.submitted_at if end else None,
                                         "reason": outcome.reason})
            if end is not None and end.failure_class == "node_lost":
                lost_nodes += [node for node in _hostnames(end.node) if node not in lost_nodes]
        failed = [item for item in remaining if not outcomes[item].ok]
        retry = [item for item in failed if outcomes[item].failure_class in RETRYABLE]
        if failed:
            context.log.warning(f"{name}: round {round_number}: {len(failed)} of {len(remaining)} failed: " + "; ".join(
                f"{item}: {outcomes[item].failure_class} ({outcomes[item].reason[:200]})" for item in failed[:10]))
        if not retry or round_number > launcher.array_retries:
            break
        try:
            usable = [node for node in launcher.usable_nodes_for(launcher.array_cpus_per_task) if node not in lost_nodes]
        except SlurmError as error:
            usable, why = [], f"the nodes could not be listed: {error}"
        else:
            why = (f"no node of partition {launcher.partition or '(the default)'} is left in service"
                   + (f" (lost in this run: {', '.join(lost_nodes)})" if lost_nodes else ""))
        if not usable:  # a round that could only wait in the queue forever is not submitted
            for item in retry:
                outcomes[item].reason += f"; not run again: {why}"
            context.log.error(f"{name}: {len(retry)} failed item(s) not run again: {why}")
            break
        context.log.warning(f"{name}: resubmitting {len(retry)} failed item(s)"
                            + (f" without lost node(s) {', '.join(lost_nodes)}" if lost_nodes else "")
                            + f" (round {round_number + 1} of at most {1 + launcher.array_retries})")
        remaining = retry
    return outcomes


def _hostnames(nodes: str) -> list[str]:
    if not nodes or nodes in ("(null)", "None assigned"):
        return []
    try:
        return run_slurm("scontrol", "show", "hostnames", nodes).split()
    except SlurmError:
        return [nodes]


def _task_reason(end: TaskEnd | None, round_dir: Path) -> str:
    """Why a task left no result: its SLURM state, and the last lines of its log."""
    if end is None:
        return "the task never got a state from SLURM"
    why = {"timeout": "it ran past its time limit (SlurmLauncher.array_task_time) and was ended: it hung or ran "
                      "too long",
           "node_lost": f"its node {end.node} failed under it",
           "out_of_memory": "it ran out of memory (SlurmLauncher.mem)",
           "cancelled": "it was cancelled outside this run (scancel)"}.get(
        end.failure_class, f"it ended {end.state} (exit {end.exit_code}) without recording a result")
    tail = ""
    for log in sorted((round_dir / "logs").glob(f"task-{end.array_task}-job-{end.job_id}.log")):
        try:
            lines = log.read_text(errors="replace").strip().splitlines()
        except OSError:
            continue
        tail = " | ".join(lines[-3:])
    return f"task {end.index} (SLURM job {end.job_id}, {end.state} on {end.node or 'no node'}): {why}" + (
        f"; its log ends: {tail[:400]}" if tail else "")

