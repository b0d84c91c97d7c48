"""How a run ended: one class per rank (``classify``), and one for the whole run (``run_ending``).

    run_dir/ranks/rank_<R>.json   each rank's own end: {"rank", "world_size", "host", "pid", "status",
                                  "failure_class", "step", "sample_ids", "error", "ended_at"}
    run_dir/ending.json           the run's end, written by the launch (trainer/supervisor/elastic.py) from the
                                  ranks' records and torchelastic's error files: one class, the rank
                                  and host it came from, step, sample ids, software versions and the
                                  last log lines of that rank

Run classes (``RUN_CLASSES``), exactly one per end:

- ``completed``
- ``pruned``: a sweep's early-stopping rule stopped the trial at a step boundary, its checkpoint
  committed (trainer/launch/pruning.py); exit 0, never retried
- ``preempted``: SIGTERM or the configured warning signal (train.preempt_signals) stopped every
  rank at a step boundary with a checkpoint (exit ``PREEMPTED_EXIT``, which launchers requeue)
- ``rank_crash``: a rank was killed (SIGKILL, a segfault) or exited without recording an error
- ``out_of_memory``: torch.OutOfMemoryError or an allocator's message
- ``bad_sample``: a sample made the step raise (``BadSampleError``, naming its ids)
- ``collective_timeout``: a peer stopped answering within train.collective_timeout_s
- ``hang``: no progress for train.watchdog_s (trainer/watchdog.py), or a rank that stopped
  answering (frozen by SIGSTOP, a stalled host): its peers' collective timeouts and torchrun's
  SIGKILL of it are what the hang caused, so the ending names the rank that stopped
  (``_rank_that_stopped``), never the healthy peer that timed out waiting on it
- ``node_lost``: a node of a multi-node job was lost under it (its processes killed, its link
  down, the machine gone): the SLURM launcher classifies it from the cluster's view (the node DOWN or
  not responding, its slurmd not answering), since the surviving ranks only see a peer disappear;
  the ending names the host, the ranks that ran there and the step, and keeps the survivors' first
  error (resources/slurm.py)
- ``diverged``: non-finite losses past train.max_consecutive_nonfinite, or a loss spike over
  train.loss_spike_factor
- ``storage_error``: reading or writing the run's files or checkpoints failed (OSError, a
  checkpoint save or load that failed)
- ``store_full``: the object store has no room left (``ops.publish.objstore.StoreFull``, asked of the
  store's master): every retry would fail the same way until someone frees or adds space. (A full
  local disk stays ``storage_error``: the drill's transient one clears.)
- ``checkpoint_unverifiable``: the run has checkpoints of its own and none verifies
  (``NoVerifiedCheckpoint``): the same files fail the same way on every attempt, so it waits for
  ``stage.start_over=true`` or a person instead of spending the retry budget
- ``record_corrupt``: a record the run reads (KNOWN_GOOD.json, the ``latest`` pointer file) is
  truncated, not JSON or not the shape it must be (``CheckpointRecordCorrupt``): corruption, which
  fails the same way on every attempt, so it waits for a person instead of spending the retry budget
- ``config_error``: the config was refused (exit ``CONFIG_ERROR_EXIT``)
- ``error``: none of these (a bug, most likely): reported as it is, never retried

A rank's own record may also say ``peer_lost`` (its peer's connection closed): that is what a
survivor sees of a crash, never the run's class, which comes from the root cause.

The policy (``RETRYABLE``): transient infrastructure failures are retried from the last committed
checkpoint within the run's budget; a bad sample is quarantined and the run continues; diverged,
out of memory, unverifiable checkpoints, config and unknown errors are not retried, since the same
config (and the same files) fail the same way.
"""

from __future__ import annotations

import errno
import json
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from ops.publish.durable import iso_time, write_json_atomic
from trainer.watchdog import marker_path

AGREED_ENDINGS = ("completed", "canceled", "diverged", "pruned")
# pruned: a sweep's stated early-stopping rule stopped the trial at a step boundary with a committed checkpoint
# (trainer/launch/pruning.py): a decision, not a failure; never retried, resumable later.
RUN_CLASSES = ("completed", "pruned", "preempted", "rank_crash", "out_of_memory", "bad_sample", "collective_timeout",
               "hang", "node_lost", "diverged", "storage_error", "store_full", "checkpoint_unverifiable", "record_corrupt",
               "config_error", "error")
FAILURE_CLASSES = (*RUN_CLASSES[2:], "peer_lost")
RETRYABLE = frozenset({"preempted", "rank_crash", "collective_timeout", "hang", "node_lost", "storage_error"})
"""Classes retried from the last committed checkpoint within the budget (bad_sample continues
after quarantine, outside the budget, up to train.max_bad_samples)."""

PREEMPTED_EXIT = 143  # 128 + SIGTERM: the requeue-able exit (the SLURM launcher requeues on it)
CONFIG_ERROR_EXIT = 2
DIVERGED_EXIT = 3
HANG_EXIT = 124  # trainer/watchdog.py
INJECTED_EXIT = 17  # trainer/faults.py
LOG_TAIL_LINES = 40
# What a rank records when its end was caused elsewhere: never the run's class while another rank has one.
_CONSEQUENCES = ("preempted", "completed", "peer_lost", None)

# Lower-cased fragments of the messages torch's backends raise, per class; the first match wins.
_MESSAGE_CLASSES = (
    ("collective_timeout", ("timed out", "timeout", "communicator was aborted", "watchdog")),
    ("peer_lost", ("connection closed", "connection reset", "broken pipe", "socket closed")),
    ("out_of_memory", ("out of memory",)),
)
# Exception type names (checked along the chain of causes) that name a storage failure.
_STORAGE_ERRORS = ("CheckpointSaveError", "CheckpointCorrupt", "PublishedFileCorrupt")
# Damaged run records: corruption, never retried (named here: no ops import): ops.checkpoints.store's
# KNOWN_GOOD.json or `latest`, trainer.supervisor.elastic's quarantine list (quarantine/bad_samples.json), and a
# published data record (ops.publish.storage) that is unsigned or whose signature does not match: a forgery or
# a folder from before signing, which a retry reads the same way.
_RECORD_CORRUPT = ("CheckpointRecordCorrupt", "RunRecordCorrupt", "PublishedSignatureInvalid", "PublishedRecordUnsigned")
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EIO, errno.EROFS, errno.EDQUOT, errno.ENOENT, errno.EACCES, errno.ESTALE}


class BadSampleError(RuntimeError):
    """A sample made the step fail; ``sample_ids`` names it (them) so a restart can quarantine it."""

    def __init__(self, sample_ids: Sequence[str], reason: str) -> None:
        self.sample_ids = [str(key) for key in sample_ids]
        super().__init__(f"bad sample {', '.join(self.sample_ids)}: {reason}")


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    return seen


def classify(status: str, error: BaseException | None) -> str:
    """The class of one rank's end: the agreed status when there is no error, else from the error."""
    if status == "canceled":  # the SIGTERM stop every rank agreed on, or this rank was interrupted
        return "preempted"
    if error is None:
        if status not in AGREED_ENDINGS:
            raise ValueError(f"status {status!r} without an error is not one of {AGREED_ENDINGS}")
        return status
    chain = _chain(error)
    names = [type(link).__name__ for link in chain]
    # By name, without importing torch or the checkpointer (this module stays torch-free).
    if "OutOfMemoryError" in names:
        return "out_of_memory"
    if "HangDetected" in names:
        return "hang"
    if "BadSampleError" in names:
        return "bad_sample"
    if "NoVerifiedCheckpoint" in names:  # before the storage errors: it is a CheckpointCorrupt too
        return "checkpoint_unverifiable"
    if any(name in _RECORD_CORRUPT for name in names) or any(
            f"{name}:" in str(link) for name in _RECORD_CORRUPT for link in chain):
        # Before the storage errors, which wrap it: rank 0's error reaches the other ranks (and the
        # CheckpointCorrupt or CheckpointSaveError every rank raises) as "<type name>: <message>".
        return "record_corrupt"
    if "StoreFull" in names or any("store_full:" in str(link) for link in chain):
        # By its message too: rank 0's error reaches the others (and CheckpointSaveError) as text.
        return "store_full"
    message = str(error).lower()
    for name, fragments in _MESSAGE_CLASSES:
        if any(fragment in message for fragment in fragments):
            return name
    if any(name in _STORAGE_ERRORS for name in names) or any(
            isinstance(link, OSError) and link.errno in _STORAGE_ERRNOS for link in chain):
        return "storage_error"
    return "error"


def sample_ids_of(error: BaseException | None) -> list[str]:
    for link in _chain(error) if error is not None else []:
        if isinstance(link, BadSampleError):
            return link.sample_ids
    return []


def rank_end_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank_{rank}.json"


def ending_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ending.json"


def write_rank_end(run_dir: str | Path, *, rank: int, world_size: int, status: str, step: int,
                   error: BaseException | None, redact: Callable[[str], str],
                   failure_class: str | None = None) -> dict[str, Any]:
    """Write this rank's classified end (error text through ``redact``); the record written.
    ``failure_class`` overrides the class ``classify`` gives (a refused config, say)."""
    record = {
        "rank": rank, "world_size": world_size, "host": socket.gethostname(), "pid": os.getpid(),
        "status": status, "failure_class": failure_class or classify(status, error), "step": step,
        "sample_ids": sample_ids_of(error),
        "error": None if error is None else redact(f"{type(error).__name__}: {error}"),
        "ended_at": iso_time(time.time()),
    }
    path = rank_end_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return record


def read_rank_ends(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    import json

    records = {}
    for path in sorted((Path(run_dir) / "ranks").glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            records[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a record cut short by a kill says nothing; the exit code still does
    return records


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("torch", "numpy", "pyarrow", "av", "webdataset", "mlflow", "dagster"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    torch = sys.modules.get("torch")  # already imported by the launch: CUDA and NCCL as it sees them
    if torch is not None:
        versions["cuda"] = str(torch.version.cuda or "none")
        try:
            versions["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "none"
        except Exception:  # noqa: BLE001 - a build without NCCL
            versions["nccl"] = "none"
    return versions


def log_tail(paths: Sequence[Path], lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of the files (a rank's stdout, then stderr), in that order."""
    tail: list[str] = []
    for path in paths:
        try:
            with open(path, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                handle.seek(max(0, handle.tell() - 64 * 1024))
                tail += handle.read().decode("utf-8", "replace").splitlines()
        except OSError:
            continue
    return tail[-lines:]


def _class_from_exit(exitcode: int, record: Mapping[str, Any] | None) -> str:
    """A root-cause rank's class from its exit code and its own record (if it lived to write one)."""
    if exitcode == CONFIG_ERROR_EXIT:
        return "config_error"
    if exitcode == HANG_EXIT:
        return "hang"
    if exitcode == DIVERGED_EXIT:
        return "diverged"
    if exitcode == PREEMPTED_EXIT or exitcode in (-15, -2):
        return "preempted"
    if record is not None and record.get("failure_class") not in (None, "peer_lost", "completed"):
        return str(record["failure_class"])
    return "rank_crash"  # killed by a signal, or exited (17, 1 ...) without recording an error


def _rank_that_stopped(run_dir: str | Path, ranks: Mapping[int, Mapping[str, Any]], report: Mapping[str, Any],
                       rank: int, failure_class: str) -> tuple[int, str, str] | None:
    """(rank, exit, why) of a rank that stopped answering, when the cause found so far is only what
    its peers saw of it; None otherwise. A peer's collective timeout (or lost connection) is what a
    healthy rank sees of a hung one, and torchrun's SIGKILL is what a frozen one gets:

    1. a rank killed by SIGKILL without a record of its own, noticed no earlier than a peer recorded
       timing out on it (collective_timeout, or its watchdog's hang): the rank was frozen (SIGSTOP, a
       stalled host). torchrun SIGTERMs the others when that peer fails and SIGKILLs what does not
       exit, so the kill is its escalation, not a crash (a crashed rank is noticed before its peers
       time out, and they see its connection close: peer_lost);
    2. a rank whose own watchdog fired first (ranks/hang.json names it) while the cause found so far
       is a peer that timed out or lost its connection waiting on it.
    """
    entries = {int(entry["rank"]): entry for entry in report.get("failures", [])}
    entry = entries.get(rank, report["root_cause"])
    if int(entry["exitcode"]) == -int(signal.SIGKILL) and rank not in ranks:
        for peer, seen in sorted(ranks.items()):
            peer_entry = entries.get(peer)
            if peer == rank or seen.get("failure_class") not in ("collective_timeout", "hang") or peer_entry is None:
                continue
            peer_s = int(peer_entry.get("timestamp_ns", int(peer_entry["timestamp"]) * 10**9)) // 10**9
            if int(entry["timestamp"]) >= peer_s:
                return rank, str(entry["exit"]), (
                    f"rank {rank} stopped answering (frozen: SIGSTOP, or a stalled host): rank {peer} waited on it "
                    f"until {seen['failure_class']} ({seen.get('error')}); torchrun then killed rank {rank} with "
                    "SIGKILL, its escalation for a rank that does not exit on SIGTERM, not a crash")
    if failure_class in ("collective_timeout", "peer_lost"):
        try:
            hung = int(json.loads(marker_path(run_dir).read_text())["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # no watchdog fired in this attempt (or its marker was cut short)
        if hung != rank and (ranks.get(hung) or {}).get("failure_class") == "hang":
            hung_entry = entries.get(hung)
            return hung, str(hung_entry["exit"]) if hung_entry else "recorded a hang", (
                f"rank {hung} hung: {ranks[hung].get('error')}; rank {rank} only waited on it ({failure_class})")
    return None


def run_ending(run_dir: str | Path, report: Mapping[str, Any] | None, *, attempt: int,
               logs: Callable[[int], Sequence[Path]] | None = None,
               redact: Callable[[str], str] = lambda text: text, write: bool = True) -> dict[str, Any]:
    """The run's one class after an attempt (module docstring).

    ``report`` is trainer.supervisor.failure_report's report (None when every rank exited 0); ``logs(rank)``
    the rank's stdout and stderr files, when the launch kept them. ``write``: write it to ending.json
    (False on every node of a multi-node job but the first, which keeps the run's records: a later
    node's view, written without the policy's decision, would replace the first node's record).
    """
    import json

    ranks = read_rank_ends(run_dir)
    final_path = Path(run_dir) / "final.json"
    try:
        final = json.loads(final_path.read_text())
    except (OSError, ValueError):
        final = None
    steps = [int(record.get("step", 0)) for record in ranks.values()]
    if report is None:
        rank, exit_text = 0, "every rank exited 0"
        record = ranks.get(0)
        failure_class = (record or {}).get("failure_class") or (final or {}).get("failure_class") or "completed"
        error = None
    else:
        cause = report["root_cause"]
        rank, exit_text = int(cause["rank"]), str(cause["exit"])
        record = ranks.get(rank)
        failure_class = _class_from_exit(int(cause["exitcode"]), record)
        own = {r: v.get("failure_class") for r, v in ranks.items() if v.get("failure_class") not in _CONSEQUENCES}
        if failure_class == "preempted" and own:
            # torchrun stopped the survivors after a real failure elsewhere: that one is the class
            rank, failure_class = next(iter(own.items()))
            record = ranks[rank]
        elif (record or {}).get("failure_class") == "peer_lost" and not own:
            # The root cause lived to see its peer go: a peer that left preempted (its grace ran out) or
            # without a trace (killed) is what happened.
            preempted = [r for r, v in ranks.items() if v.get("failure_class") == "preempted"]
            if preempted:
                rank, failure_class, record = preempted[0], "preempted", ranks[preempted[0]]
        error = cause.get("recorded_error") or (record or {}).get("error") or report.get("summary")
        if (stopped := _rank_that_stopped(run_dir, ranks, report, rank, failure_class)) is not None:
            rank, exit_text, error = stopped
            failure_class, record = "hang", ranks.get(rank)
    sample_ids = sorted({key for r in ranks.values() for key in r.get("sample_ids", [])})
    host = (record or {}).get("host") or socket.gethostname()
    tail = [redact(line) for line in log_tail(logs(rank))] if logs is not None else []
    ending = {
        "failure_class": failure_class, "attempt": attempt, "rank": rank, "host": host, "exit": exit_text,
        "step": max(steps) if steps else int((final or {}).get("final_step", 0)),
        "sample_ids": sample_ids, "error": redact(str(error)) if error else None,
        "retryable": failure_class in RETRYABLE, "versions": software_versions(),
        "log_tail": tail, "ranks": {str(r): {"failure_class": v.get("failure_class"), "step": v.get("step"),
                                             "host": v.get("host")} for r, v in sorted(ranks.items())},
        "ended_at": iso_time(time.time()),
    }
    if write:
        write_json_atomic(ending_path(run_dir), ending)
    return ending
