"""Ledger anchors: each ledger's newest state, kept where a writer of the data root cannot roll it back.

A hash chain and a signed seal inside the data root (ops/curation/event_chain.py, ops/curation/rights.py) catch an
event edited, removed or reordered, but not an older copy of the whole ledger restored together
with its older, validly signed seal, nor the ledger deleted together with its head: both read as
"nothing revoked". So every ledger also has an anchor outside the data root, under the Trainyard
home next to the signing key (``$TRAINYARD_HOME/state/ledger_anchors/<digest of the ledger's
path>.json``, mode 0600 in a 0700 folder): the number of events and the chain value of the newest
one, HMAC-signed with the checkpoint signing key (ops.checkpoints.keys) over the ledger's path too,
so an anchor copied from another ledger, or edited, is refused.

Order, and what each reader concludes:

- A writer writes the ledger first, then advances the anchor. A reader loads the anchor first,
  then reads the ledger, so a ledger read after its anchor is never legitimately older.
- No anchor yet (first use, or a ledger from before anchors): the ledger is trusted as it stands
  and anchored.
- The ledger holds the anchored event at the anchored position: accepted; when it holds more (an
  append whose anchor write was cut short, or one made by a machine with another home), the
  anchor is advanced. It never moves back.
- Fewer events than anchored, the ledger missing, or another event at the anchored position:
  ``LedgerRolledBack`` (each ledger raises its own subclass), naming the ledger and the anchor.

What it does not cover: whoever can write the Trainyard home can replace the anchor and the key
too; that is the deployment's boundary, as it is for checkpoints.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ops.curation.event_chain import locked
from ops.publish.hashing import canonical_json
from ops.publish.paths import trainyard_home
from ops.publish.durable import write_file_atomic


class LedgerRolledBack(RuntimeError):
    """A ledger is missing, older than its anchor, or not an extension of the anchored history."""


class LedgerAnchorError(RuntimeError):
    """A ledger's anchor cannot be trusted: unreadable, edited, signed with another key, or another ledger's."""


@dataclass(frozen=True, slots=True)
class Anchor:
    count: int
    """Events the ledger held when anchored."""
    head: str
    """The chain value of its newest event."""
    path: Path
    """The anchor file."""


def anchor_dir() -> Path:
    return trainyard_home() / "state" / "ledger_anchors"


def _identity(ledger: Path) -> str:
    return str(Path(ledger).resolve())


def anchor_file(ledger: Path) -> Path:
    """Where the anchor of the ledger at ``ledger`` lives (outside its data root)."""
    return anchor_dir() / f"{hashlib.sha256(_identity(ledger).encode()).hexdigest()[:32]}.json"


def _signature(key: bytes, body: dict) -> str:
    return hmac.new(key, canonical_json(body).encode(), hashlib.sha256).hexdigest()


def load(ledger: Path, *, error: type[LedgerAnchorError] = LedgerAnchorError) -> Anchor | None:
    """The anchor of ``ledger``, its signature checked; None before the ledger was first anchored.
    Load it before reading the ledger (the module docstring says why). ``error``: what an anchor that
    cannot be trusted raises (each ledger names its own subclass)."""
    from ops.checkpoints.keys import HMAC_KEY_ENV, configured_key

    path = anchor_file(ledger)
    try:
        raw = json.loads(path.read_bytes())
        body = {"ledger": raw["ledger"], "count": raw["count"], "head": raw["head"]}
        signature = str(raw["signature"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as cause:
        raise error(f"{path}: the anchor of {ledger} cannot be read ({type(cause).__name__}: {cause}); it was "
                    "damaged outside Trainyard") from cause
    key = configured_key()
    if key is None:
        raise error(f"{path}: the anchor of {ledger} cannot be checked without the signing key: set "
                                f"{HMAC_KEY_ENV} as the deployment does, or restore the Trainyard home's key file")
    if not hmac.compare_digest(_signature(key, body), signature):
        raise error(f"{path}: the anchor of {ledger} does not match its signature (edited, or signed with "
                    "another key); restore the Trainyard home's key, or the ledger and its anchor from a backup")
    if body["ledger"] != _identity(ledger) or not isinstance(body["count"], int) or body["count"] < 1:
        raise error(f"{path}: this anchor is for {body['ledger']!r}, not for {ledger}")
    return Anchor(count=body["count"], head=str(body["head"]), path=path)


def check(ledger: Path, anchor: Anchor | None, events: list[dict], *, error: type[LedgerRolledBack],
          exists: bool | None = None) -> None:
    """Refuse ``events`` (what ``ledger`` holds now) unless they extend the anchored history; advance the
    anchor when they hold more. ``exists``: whether the ledger file is there (default: looked up)."""
    if anchor is not None:
        undo = (f"restore the newest ledger from a backup. Only if this data root was discarded on purpose, "
                f"delete the anchor {anchor.path}")
        if not (Path(ledger).exists() if exists is None else exists):
            raise error(f"{ledger} is missing, but its anchor {anchor.path} records {anchor.count} event(s) "
                        f"(newest {anchor.head[:12]}): it was deleted, and reading it as empty would undo them; "
                        f"{undo}")
        if len(events) < anchor.count:
            raise error(f"{ledger} holds {len(events)} event(s), but its anchor {anchor.path} records "
                        f"{anchor.count}: an older copy was restored or the newest events removed, which would "
                        f"undo them; {undo}")
        if events[anchor.count - 1].get("chain") != anchor.head:
            raise error(f"{ledger}: event {anchor.count - 1} is not the anchored one (chain {anchor.head[:12]}, "
                        f"anchor {anchor.path}): the ledger was replaced by another history; {undo}")
        if len(events) == anchor.count:
            return
    advance(ledger, events)


def advance(ledger: Path, events: list[dict]) -> None:
    """Anchor ``events`` as ``ledger``'s newest state (call after the ledger is written); never moves back."""
    from ops.checkpoints.keys import signing_key

    if not events:
        return
    path = anchor_file(ledger)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with locked(path):
        current = load(ledger)
        if current is not None and current.count >= len(events):
            return  # another process anchored as much or more since this one read the ledger
        body = {"ledger": _identity(ledger), "count": len(events), "head": events[-1]["chain"]}
        text = json.dumps({**body, "signature": _signature(signing_key(), body)}, sort_keys=True)
        write_file_atomic(path, text.encode())
        os.chmod(path, 0o600)
