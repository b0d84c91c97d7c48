"""Which rank died first, and how: the launch's failure report, and each rank's error file.

When the job fails and ``$TRAINYARD_FAILURE_REPORT`` names a path, the launch
(trainer/supervisor/elastic.py) writes there, as JSON, the failures torchelastic collected, with
the root cause picked out (``failure_report``). Each rank that is still alive to see its own
failure writes a torchelastic error file first (``record_rank_error``).

Why not torchrun's own "Root Cause" line: torchelastic orders failures by a whole-second
timestamp, so a rank that was SIGKILLed and a survivor that failed a moment later on the broken
collective (or lost a DataLoader worker to the shutdown) tie, and the survivor can be named. The
rule here, in order (``root_cause``):

1. A rank that torchrun itself stopped (the SIGTERM/SIGINT it sends survivors, or the trainer's
   exit 143 after one) is a consequence, never the cause while another rank failed on its own;
   torchrun's stop leaves no error file, so "no file" alone must not put it first.
2. Among the rest, a rank without a torchelastic error file (``errors.record``) first: a rank that
   was still alive to see its failure writes one (``record_rank_error``), a rank that was killed
   or exited without cleanup cannot.
3. Then the earliest, by the nanosecond timestamp ``record_rank_error`` writes next to
   torchelastic's whole seconds (two ranks failing within one second do not tie); then the lowest rank.

It imports nothing else of the supervisor: the ranks (trainer/train.py, trainer/loop.py) record
their errors through it, and the launch builds its report with it.
"""

from __future__ import annotations

import json
import os
import signal
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ops.publish.durable import write_file_atomic, write_json_atomic

FAILURE_REPORT_ENV = "TRAINYARD_FAILURE_REPORT"
# torchelastic gives every rank its own error file path through this variable.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_NOT_AVAILABLE = "<N/A>"  # torchelastic's marker of "this rank wrote no error file"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what torchrun sends survivors when a rank fails
_CANCELED_EXIT = 143  # the trainer's exit after a SIGTERM stop (trainer/train.py)
TIMESTAMP_NS_FIELD = "timestamp_ns"  # in the error file's extraInfo, next to torchelastic's "timestamp"


def record_rank_error(error: BaseException, redact) -> None:
    """This rank's failure as a torchelastic error file (redacted): proof that it was alive to see it.

    The format is torchelastic's ``ErrorHandler.record_exception`` (torchrun prints it and reads its
    timestamp); ``redact`` (str -> str) scrubs secrets first, since torchrun prints the file.
    Without torchrun (no ``TORCHELASTIC_ERROR_FILE``) this does nothing.
    """
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return
    callstack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    now_ns = time.time_ns()
    # "timestamp" stays whole seconds: torchrun reads it with datetime.fromtimestamp, which
    # nanoseconds would overflow. "timestamp_ns" is ours, so ranks failing in one second do not tie.
    extra = {"py_callstack": redact(callstack), "timestamp": str(now_ns // 1_000_000_000),
             TIMESTAMP_NS_FIELD: str(now_ns)}
    data = {"message": {"message": redact(f"{type(error).__name__}: {error}"), "extraInfo": extra}}
    write_file_atomic(Path(path), json.dumps(data).encode())


def describe_exit(exitcode: int) -> str:
    """'killed by signal SIGKILL (exit -9)' or 'exited with code 17'."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by signal {name} (exit {exitcode})"
    return f"exited with code {exitcode}"


def _timestamp_ns(failure: Any) -> int:
    """The failure's time in ns: ours from its error file, else torchelastic's whole seconds (an
    unrecorded death, stamped when torchrun noticed it, or a file from an older trainer)."""
    message = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
    if TIMESTAMP_NS_FIELD in extra:
        return int(extra[TIMESTAMP_NS_FIELD])
    return int(failure.timestamp) * 1_000_000_000


def failure_entries(failures: Mapping[int, Any]) -> list[dict[str, Any]]:
    """torchelastic ProcessFailures (global rank -> failure) as plain records, by rank."""
    entries = []
    for rank, failure in sorted(failures.items()):
        recorded = failure.error_file != _NOT_AVAILABLE
        message = failure.message if isinstance(failure.message, str) else failure.message.get("message", "")
        entries.append({"rank": int(rank), "local_rank": int(failure.local_rank), "pid": int(failure.pid),
                        "exitcode": int(failure.exitcode), "exit": describe_exit(int(failure.exitcode)),
                        "recorded_error": message if recorded else None, "timestamp": int(failure.timestamp),
                        "timestamp_ns": _timestamp_ns(failure)})
    return entries


def _stopped_by_torchrun(entry: Mapping[str, Any]) -> bool:
    return -entry["exitcode"] in [int(sig) for sig in _STOP_SIGNALS] or entry["exitcode"] == _CANCELED_EXIT


def root_cause(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The failure that started it (module docstring): ranks torchrun stopped last; then deaths
    without an error file; then the earliest in ns; then the lowest rank."""
    def order(entry: Mapping[str, Any]) -> tuple[bool, bool, int, int]:
        timestamp_ns = entry.get("timestamp_ns", int(entry["timestamp"]) * 1_000_000_000)
        return (_stopped_by_torchrun(entry), entry["recorded_error"] is not None, timestamp_ns, entry["rank"])

    return dict(min(entries, key=order))


def summary(cause: Mapping[str, Any]) -> str:
    """One line that names the rank, its exit and, if it recorded one, its error."""
    text = f"rank {cause['rank']} (local rank {cause['local_rank']}, pid {cause['pid']}) {cause['exit']}"
    if cause["recorded_error"]:
        return f"{text}: {cause['recorded_error']}"
    return f"{text} without recording an error (killed, or exited without cleanup)"


def failure_report(failures: Mapping[int, Any]) -> dict[str, Any]:
    """The report of torchelastic's failures: every rank's entry, the root cause and its summary line."""
    entries = failure_entries(failures)
    cause = root_cause(entries)
    return {"root_cause": cause, "summary": summary(cause), "failures": entries}


def write_failure_report(report: Mapping[str, Any]) -> None:
    """``report`` to the file ``$TRAINYARD_FAILURE_REPORT`` names (the launchers read it); without it, nothing."""
    path = os.environ.get(FAILURE_REPORT_ENV)
    if path:
        write_json_atomic(Path(path), report)
