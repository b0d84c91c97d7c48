"""How one rank's run ended, classified, in a record every rank that sees its end writes.

    run_dir/ranks/rank_<R>.json   {"rank", "world_size", "host", "pid", "status", "failure_class",
                                   "step", "error", "ended_at"}

Rank 0's final.json carries the same ``failure_class``. The per-rank records matter when rank 0
is the rank that hung or died: its peers then fail at the collective timeout, and their records
are what says so. (torchelastic's error files, trainer/elastic.py, name the rank that failed
first; these say how each survivor's run ended.)

Classes (``classify``): the agreed endings ``completed``, ``canceled``, ``diverged``; and for a
failure, from the exception: ``collective_timeout`` (a peer stopped answering within
train.collective_timeout_s: gloo's "Timed out", NCCL's watchdog timeout and the aborted
communicator it leaves), ``peer_lost`` (a peer's connection closed: it died),
``out_of_memory`` (torch.OutOfMemoryError or an allocator's message), ``hang`` (no progress for
train.watchdog_s, trainer/watchdog.py), ``error`` (anything else).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.jsonio import iso_time, write_json_atomic

AGREED_ENDINGS = ("completed", "canceled", "diverged")
FAILURE_CLASSES = ("collective_timeout", "peer_lost", "out_of_memory", "hang", "error")
# Lower-cased fragments of the messages torch's backends raise, per class; the first match wins.
_MESSAGE_CLASSES = (
    ("collective_timeout", ("timed out", "timeout", "communicator was aborted", "watchdog")),
    ("peer_lost", ("connection closed", "connection reset", "broken pipe", "socket closed")),
    ("out_of_memory", ("out of memory",)),
)


def classify(status: str, error: BaseException | None) -> str:
    """The class of an ending: the status itself when the ranks agreed on it (or it was
    interrupted: 'canceled' carries the KeyboardInterrupt that did it), else from the error."""
    if status == "canceled":
        return status
    if error is None:
        if status not in AGREED_ENDINGS:
            raise ValueError(f"status {status!r} without an error is not one of {AGREED_ENDINGS}")
        return status
    if type(error).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch
        return "out_of_memory"
    if type(error).__name__ == "HangDetected":  # trainer.watchdog's, whatever its message says
        return "hang"
    message = str(error).lower()
    for name, fragments in _MESSAGE_CLASSES:
        if any(fragment in message for fragment in fragments):
            return name
    return "error"


def rank_end_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank_{rank}.json"


def write_rank_end(run_dir: str | Path, *, rank: int, world_size: int, status: str, step: int,
                   error: BaseException | None, redact: Callable[[str], str]) -> dict[str, Any]:
    """Write this rank's classified end (error text through ``redact``); the record written."""
    record = {
        "rank": rank, "world_size": world_size, "host": socket.gethostname(), "pid": os.getpid(),
        "status": status, "failure_class": classify(status, error), "step": step,
        "error": None if error is None else redact(f"{type(error).__name__}: {error}"),
        "ended_at": iso_time(time.time()),
    }
    path = rank_end_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    return record
