"""Append-only event histories: an exclusive file lock and a hash chain over the events.

The quarantine ledger (ops/curation/quarantine.py) and the rights ledger (ops/curation/rights.py) are both
histories that must only grow. Each event carries ``chain``, the digest of the previous chain
value and the event itself, so an event edited in place breaks every later link; a sequence
number per event catches one removed or reordered.
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path

from ops.publish.hashing import canonical_json, digest_text


@contextlib.contextmanager
def locked(path: Path):
    """Exclusive lock (``<path>.lock``) so two writers never interleave their updates of ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def link(previous: str, event: dict) -> str:
    """The chain value of ``event`` after the chain value ``previous`` (its own ``chain`` left out)."""
    return digest_text(previous + canonical_json({k: v for k, v in event.items() if k != "chain"}))


def chained(events: list[dict], previous: str = "") -> list[dict]:
    """``events`` with their hash chain, continuing from the chain value ``previous``."""
    result = []
    for event in events:
        previous = link(previous, event)
        result.append({**event, "chain": previous})
    return result
