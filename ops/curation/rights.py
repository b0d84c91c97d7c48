"""Rights after validation: the revocation ledger, and where a revoked asset went.

**The ledger** (``<data_root>/rights/ledger.jsonl``) is a history of ``revoked`` and
``reinstated`` events per asset id (the content sha256), hash-chained like the quarantine ledger
(ops/curation/event_chain.py) so an entry removed or edited in place is refused, never read as "not
revoked"; its newest state is anchored outside the data root (ops/curation/ledger_anchor.py), so an older
copy restored, or the ledger deleted, is refused too (RightsLedgerRolledBack). Events come from
``trainyard rights revoke`` and from a manifest whose row states ``consent: revoked`` (the
dataset_manifest asset records them). An asset is revoked while its latest event is ``revoked``;
revoking it again records nothing and says when it was revoked.

**Where it went** (``where``): the data lineage is already on disk, so it is walked, not guessed:
clip plan (``shards/<plan>/plan.parquet``: asset id -> sample keys and shards) -> shard tars ->
shard index (``index.json`` beside the plan) -> training runs (``runs/*/launch.json`` and the
restore drills' run folders: the index version they read) -> their checkpoints; a run initialised
from such a checkpoint (finetune from pretrain) is listed too, as derived. A file that cannot be
read or verified is listed under ``problems``, never skipped.

What keeps a revoked asset out of training: validation quarantines it (``rights_revoked``), the
clip plan leaves it out, the ``no_revoked_assets`` check blocks a shard index that holds it, and
every training stage refuses such an index before launch (assets/training.py), as does the
trainer run by hand (``refuse_revoked_index``, trainer/train.py).
"""

from __future__ import annotations

import getpass
import hashlib
import hmac
import json
import os
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc

from ops.curation import ledger_anchor
from ops.curation.event_chain import chained, link, locked
from ops.publish.hashing import canonical_json
from ops.curation.ledger_anchor import LedgerRolledBack
from ops.publish.durable import write_file_atomic

REVOKED, REINSTATED, ERASED = "revoked", "reinstated", "erased"
"""An asset's events: revoked and reinstated change whether it may be trained on; erased records that an
erasure (ops.curation.erasure) deleted its copies, and which shard indexes it gave successors to."""
REASONS = ("consent_revoked", "license_withdrawn", "takedown", "other")
"""Why an asset is revoked (``trainyard rights revoke --reason``)."""
RIGHTS_REVOKED = "rights_revoked"
"""Validation's reason code for an asset the rights ledger revokes."""
LEDGER_FILE = "ledger.jsonl"
_ASSET_ID = re.compile(r"^[0-9a-f]{64}$")


class RightsLedgerError(RuntimeError):
    """The rights ledger was edited, truncated or reordered: it cannot be trusted as it stands."""


class RightsLedgerRolledBack(RightsLedgerError, LedgerRolledBack):
    """The rights ledger is missing or older than its anchor (ops.curation.ledger_anchor): revocations would be undone."""


class RightsAnchorError(RightsLedgerError, ledger_anchor.LedgerAnchorError):
    """The rights ledger's anchor cannot be trusted (edited, another key, another ledger's)."""


class IndexNotTrainable(ValueError):
    """A shard index holds an asset whose rights are withdrawn, or the ledger that says so cannot be trusted."""


def rights_dir(data_root: str | Path) -> Path:
    return Path(data_root) / "rights"


def ledger_path(data_root: str | Path) -> Path:
    return rights_dir(data_root) / LEDGER_FILE


def head_path(data_root: str | Path) -> Path:
    """The ledger's last seal, kept beside it: a deleted ledger is refused rather than read as empty."""
    return rights_dir(data_root) / "head.json"


def _who() -> str:
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for this uid (a container): the uid then
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _seal(events: list[dict], key: bytes) -> dict:
    body = {"seal": len(events), "chain": events[-1]["chain"] if events else ""}
    return {**body, "signature": hmac.new(key, canonical_json(body).encode(), hashlib.sha256).hexdigest()}


def read_events(data_root: str | Path) -> list[dict]:
    """Every event, oldest first, sequence, hash chain, seal and anchor checked (RightsLedgerError if broken).

    The chain catches an event edited in place, the sequence one removed or reordered; the last line
    is a seal signed with the deployment's signing key (ops.checkpoints.keys) over the number of events
    and the chain's head, so dropping the newest event (a revocation undone by deleting a line) is
    caught too. The whole file is rewritten atomically on each append, so a crash never splits them.
    An older copy restored with its older seal, or the ledger deleted with its head, is caught by the
    anchor outside the data root (ops.curation.ledger_anchor): RightsLedgerRolledBack.
    """
    path = ledger_path(data_root)
    anchor = ledger_anchor.load(path, error=RightsAnchorError)  # first: the ledger is never older than it
    _synced(data_root)
    events = _read_sealed(path, head_path(data_root))
    ledger_anchor.check(path, anchor, events, error=RightsLedgerRolledBack)
    return events


def _read_sealed(path: Path, head: Path | None) -> list[dict]:
    """The events of the ledger file ``path``, sequence, hash chain and seal checked (not the anchor:
    read_events does). ``head``: the seal's copy beside it (None for a snapshot fetched from a store)."""
    from ops.checkpoints.keys import HMAC_KEY_ENV, configured_key

    if not path.exists():
        if head is not None and head.exists():  # a ledger that existed and is gone would read as "nothing revoked"
            raise RightsLedgerRolledBack(f"{path} is missing, but {head.name} says it held events (sealed "
                                         f"{head.read_text()[:200]}); restore the ledger from a backup")
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise RightsLedgerError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start}); restore the "
                                "ledger from a backup") from error
    events = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as error:
            raise RightsLedgerError(f"{path}: line {number} is not JSON ({error}); restore the ledger from a "
                                    "backup") from error
        if not isinstance(event, dict):
            raise RightsLedgerError(f"{path}: line {number} is not an event object; restore the ledger from a backup")
        events.append(event)
    seal = events.pop() if events and "seal" in events[-1] else None
    if [event.get("sequence") for event in events] != list(range(len(events))):
        raise RightsLedgerError(f"{path}: event sequence numbers are not 0..{len(events) - 1}: events were removed "
                                "or reordered; restore the ledger from a backup")
    previous = ""
    for event in events:
        previous = link(previous, event)
        if event.get("chain") != previous:
            raise RightsLedgerError(f"{path}: event {event['sequence']} ({event.get('event')} "
                                    f"{str(event.get('asset_id'))[:12]}) does not match the hash chain: it was "
                                    "edited in place; restore the ledger from a backup")
    if seal is None:
        raise RightsLedgerError(f"{path}: the ledger has no seal (its last line): it was cut short or written by "
                                "hand; restore the ledger from a backup")
    key = configured_key()
    if key is None:
        raise RightsLedgerError(f"{path}: the seal cannot be checked without the signing key: set {HMAC_KEY_ENV} "
                                "as the deployment does, or restore the Trainyard home's key file")
    if not hmac.compare_digest(_seal(events, key)["signature"], str(seal.get("signature"))) \
            or seal.get("seal") != len(events):
        raise RightsLedgerError(f"{path}: the seal does not match the {len(events)} events before it (newest events "
                                "removed, or the ledger sealed with another key); restore the ledger from a backup")
    return events


def _snapshot_name(events: list[dict]) -> str:
    return f"{len(events):08d}-{events[-1]['chain']}"


def _synced(data_root: str | Path) -> None:
    """Where the data root is an object store, bring this machine's ledger up to the store's newest
    snapshot (each append publishes one, named ``<events>-<chain head>``), so a machine that lost its
    working copy, or never had one, reads every revocation. Every snapshot must lie on this machine's
    history; one that does not is a second history (two machines appended at once): RightsLedgerError."""
    from ops.publish import paths

    if paths.data_store_url() is None:
        return
    from ops.publish import store_root  # fsspec: only where the data root is in a store

    path = ledger_path(data_root)
    listing = store_root.snapshots(path)
    if listing is None or not listing.committed:
        return
    heads = []
    for name in listing.committed:
        length, _, chain = name.partition("-")
        if not (length.isdigit() and int(length) >= 1 and chain):
            raise RightsLedgerError(f"{name!r} in the store is not a rights ledger snapshot (<events>-<chain head>)")
        heads.append((int(length), chain, name))
    before = path.read_bytes() if path.exists() else None
    events = local = _read_sealed(path, head_path(data_root))
    longest = max(heads)
    fetched_bytes = None
    if longest[0] > len(local):
        import tempfile

        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".ledger-fetch-") as scratch:
            fetched = store_root.fetch_snapshot(path, longest[2], Path(scratch))
            events = _read_sealed(fetched, None)  # sequence, chain and seal checked
            fetched_bytes = fetched.read_bytes()
    rivals = sorted(name for length, chain, name in heads
                    if length > len(events) or events[length - 1]["chain"] != chain)
    if rivals or events[:len(local)] != local:
        raise RightsLedgerError(f"the store holds rights ledger snapshots ({', '.join(rivals) or longest[2]}) on "
                                f"another history than {path}'s {len(local)} events: two machines revoked at once, "
                                "or a copy diverged; keep one history before revoking or training again")
    # A reader holds no lock: a writer on this machine that appended meanwhile keeps its newer ledger.
    if fetched_bytes is not None and (path.read_bytes() if path.exists() else None) == before:
        write_file_atomic(path, fetched_bytes)
        seal = json.loads(fetched_bytes.decode("utf-8").splitlines()[-1])
        write_file_atomic(head_path(data_root), json.dumps(seal, sort_keys=True).encode())


def _publish(data_root: str | Path, events: list[dict]) -> None:
    """Publish the ledger as it stands where the data root is an object store (after an append: a new
    name, as it holds the new chain head; an intact version already there is left alone)."""
    from ops.publish import store_root

    store_root.publish_snapshot(ledger_path(data_root), _snapshot_name(events))


def current(events: Iterable[dict]) -> dict[str, dict]:
    """asset id -> its revocation event, for every asset whose latest event is a revocation."""
    state: dict[str, dict] = {}
    for event in events:
        if event["event"] == REVOKED:
            state[event["asset_id"]] = event
        elif event["event"] == REINSTATED:
            state.pop(event["asset_id"], None)
    return state


def erasures(events: Iterable[dict], asset_id: str | None = None) -> list[dict]:
    """The ``erased`` events, oldest first (of ``asset_id`` alone when given)."""
    return [event for event in events
            if event["event"] == ERASED and (asset_id is None or event["asset_id"] == asset_id)]


def successor_map(events: Iterable[dict]) -> dict[str, dict]:
    """old shard index version -> its successor (``index``, ``plan``, ``path`` under the data root,
    ``published_to``, ``erasure_id``), from every ``erased`` event (ops.curation.erasure made them)."""
    found: dict[str, dict] = {}
    for event in erasures(events):
        for successor in event.get("successors") or []:
            if successor.get("from_index"):
                found[successor["from_index"]] = {**successor, "erasure_id": event["erasure_id"]}
    return found


def follow(data_root: str | Path, index_version: str, *, events: list[dict] | None = None) -> dict | None:
    """The newest successor of shard index ``index_version`` after erasures (following a chain of
    them), with ``location``: its published copy where the set was published, else its folder; None
    when no erasure replaced it."""
    data_root = Path(data_root)
    mapping = successor_map(events if events is not None else read_events(data_root))
    found, seen = None, {index_version}
    while index_version in mapping:
        found = mapping[index_version]
        index_version = found["index"]
        if index_version in seen:  # a cycle can only be a forged ledger; the ledger's chain would catch it first
            raise RightsLedgerError(f"the erasures' successor map loops at shard index {index_version}")
        seen.add(index_version)
    if found is None:
        return None
    return {**found, "location": found.get("published_to") or str(data_root / found["path"])}


def revoked(data_root: str | Path) -> dict[str, dict]:
    """The assets revoked now: asset id -> the event that revoked it."""
    return current(read_events(data_root))


def describe(event: Mapping) -> str:
    """One line for a revocation: why, when, by whom, from where."""
    note = f": {event['note']}" if event.get("note") else ""
    return f"{event['reason']} since {event['at']} by {event['by']} ({event['source']}){note}"


def check_asset_id(asset_id: str) -> str:
    value = asset_id.strip().lower() if isinstance(asset_id, str) else ""
    if not _ASSET_ID.match(value):
        raise ValueError(f"{asset_id!r} is not an asset id (the content's sha256: 64 hex characters)")
    return value


def _append(data_root: str | Path, wanted: list[dict]) -> list[dict]:
    """Append the events of ``wanted`` that change an asset's state; return those appended."""
    path = ledger_path(data_root)
    with locked(path):
        events = read_events(data_root)
        state = current(events)
        added = []
        for event in wanted:
            if event["event"] == ERASED:  # a record of work done, not a change of state: always appended
                added.append({"sequence": len(events) + len(added), **event})
                continue
            is_revoked = event["asset_id"] in state
            if (event["event"] == REVOKED) == is_revoked:
                continue  # revoked twice, or reinstating what is not revoked: nothing to record
            added.append({"sequence": len(events) + len(added), **event})
            if event["event"] == REVOKED:
                state[event["asset_id"]] = event
            else:
                state.pop(event["asset_id"])
        if added:
            added = chained(added, events[-1]["chain"] if events else "")
            from ops.checkpoints.keys import signing_key

            lines = [*events, *added, _seal([*events, *added], signing_key())]
            text = "".join(json.dumps(event, sort_keys=True) + "\n" for event in lines)
            write_file_atomic(path, text.encode("utf-8"))
            write_file_atomic(head_path(data_root), json.dumps(lines[-1], sort_keys=True).encode())
            ledger_anchor.advance(path, [*events, *added])  # after the ledger: a crash between leaves it ahead
            _publish(data_root, [*events, *added])
    return added


def revoke(data_root: str | Path, asset_id: str, *, reason: str, note: str = "", by: str = "",
           source: str = "trainyard rights revoke") -> tuple[dict, bool]:
    """Revoke ``asset_id``; (the revocation in force, whether this call recorded it)."""
    asset_id = check_asset_id(asset_id)
    if reason not in REASONS:
        raise ValueError(f"reason must be one of {list(REASONS)}, got {reason!r}")
    event = {"event": REVOKED, "asset_id": asset_id, "reason": reason, "note": note, "by": by or _who(),
             "at": _now(), "source": source}
    added = _append(data_root, [event])
    return (added[0], True) if added else (revoked(data_root)[asset_id], False)


def record_erasure(data_root: str | Path, event: dict) -> dict:
    """Append an ``erased`` event (ops.curation.erasure builds it); the event as recorded (sequence, chain)."""
    asset_id = check_asset_id(event["asset_id"])
    return _append(data_root, [{**event, "event": ERASED, "asset_id": asset_id}])[0]


def reinstate(data_root: str | Path, asset_id: str, *, note: str = "", by: str = "") -> dict | None:
    """End the revocation of ``asset_id`` (consent given again); the event, or None when it was not revoked."""
    asset_id = check_asset_id(asset_id)
    added = _append(data_root, [{"event": REINSTATED, "asset_id": asset_id, "reason": "", "note": note,
                                 "by": by or _who(), "at": _now(), "source": "trainyard rights reinstate"}])
    return added[0] if added else None


def record_manifest_revocations(data_root: str | Path, manifest) -> list[dict]:
    """Record every asset a manifest states as ``consent: revoked`` that the ledger does not revoke yet."""
    table = manifest.table.select(["asset_id", "uri", "consent", "provenance"])
    rows = table.filter(pc.equal(table.column("consent"), "revoked")).to_pylist()
    wanted = [{"event": REVOKED, "asset_id": row["asset_id"], "reason": "consent_revoked",
               "note": f"{row['uri']} states consent: revoked", "by": f"manifest {manifest.version}",
               "at": _now(), "source": f"manifest {manifest.version}"}
              for row in rows if row["asset_id"]]
    return _append(data_root, wanted) if wanted else []


def withdrawn(manifest, allowed: tuple[str, ...]) -> dict[str, str]:
    """asset id -> why, for each asset a manifest now states as ``consent: revoked`` or whose license
    the allow-list ``allowed`` no longer admits (ops.curation.licenses): what the rights report adds to the ledger."""
    from ops.curation import licenses

    found: dict[str, str] = {}
    rows = manifest.table.select(["asset_id", "uri", "consent", "license"]).to_pylist()
    kept: set[str] = set()
    for row in rows:  # in uri order, as the manifest is sorted
        if not row["asset_id"]:
            continue
        if row["consent"] == "revoked":  # on any copy: the ledger records it so, and validation follows the ledger
            found[row["asset_id"]] = f"manifest {manifest.version}: {row['uri']} states consent: revoked"
            continue
        # The license of the copy validation keeps (the first uri; ops.curation.validation._duplicate_reasons):
        # judging a rejected duplicate's would block an index that validation rightly accepted.
        if row["asset_id"] in kept:
            continue
        kept.add(row["asset_id"])
        verdict = licenses.judge(row["license"], tuple(allowed))
        # A stated license the allow-list does not admit; stating none is validation's missing_license.
        if verdict.code in (licenses.UNKNOWN_LICENSE, licenses.LICENSE_NOT_ALLOWED):
            found.setdefault(row["asset_id"], f"manifest {manifest.version}: {row['uri']}: {verdict.code}: "
                                              f"{verdict.detail}")
    return found


def refusals(data_root: str | Path, held: Iterable[str], *, manifest=None,
             allowed: tuple[str, ...] | None = None) -> dict[str, str]:
    """asset id -> why it may not be trained on, for the ``held`` assets (a shard index's): revoked
    in the ledger, or (given the newest manifest and allow-list) withdrawn by it."""
    held = set(held)
    found = {asset_id: f"revoked in the rights ledger: {describe(event)}"
             for asset_id, event in revoked(data_root).items() if asset_id in held}
    if manifest is not None and allowed is not None:
        for asset_id, why in withdrawn(manifest, allowed).items():
            if asset_id in held:
                found.setdefault(asset_id, why)
    return dict(sorted(found.items()))


def data_root_of_index(location: str | Path) -> Path:
    """The data root of the shard index at ``location``: ``ROOT`` of a plan folder ``ROOT/shards/PLAN``,
    else the configured one (ops.publish.paths.data_root: an index in a bucket, or one copied elsewhere)."""
    from ops.publish import paths

    if "://" not in str(location):
        folder = Path(location)
        if folder.parent.name == "shards":
            return folder.parent.parent
    return paths.data_root()


def refuse_revoked_index(location: str | Path, version: str | None = None,
                         data_root: str | Path | None = None) -> None:
    """Refuse (IndexNotTrainable) a shard index holding an asset the rights ledger revokes, or whose ledger
    cannot be trusted (rolled back, edited): what every stage checks before launch, for a trainer run by hand.
    ``version``: the index's (read from its info when not given); ``data_root``: see data_root_of_index."""
    root = Path(data_root) if data_root is not None else data_root_of_index(location)
    ledger = ledger_path(root)
    try:
        if not revoked(root):  # nothing revoked: the index's plan need not be read
            return
        if version is None:
            from ops.clips.shard_cache import read_any_index_info

            version = read_any_index_info(str(location)).version
        found = refusals(root, index_assets(root, str(location), version))
    except (RightsLedgerError, ledger_anchor.LedgerAnchorError) as error:
        raise IndexNotTrainable(f"shard index {location} is refused: the rights ledger {ledger} cannot be trusted: "
                                f"{error}") from error
    except (OSError, ValueError) as error:  # the index's plan (published files, verified) cannot be read
        raise IndexNotTrainable(f"shard index {location} is refused: the assets it holds cannot be read to check "
                                f"them against the rights ledger {ledger}: {error}") from error
    if found:
        listed = "; ".join(f"asset {asset_id}: {why}" for asset_id, why in list(found.items())[:5])
        successor = follow(root, version)
        hint = (f"; an erasure replaced it: set data.shard_index={successor['location']} (index "
                f"{successor['index']}), " if successor else "; ")
        raise IndexNotTrainable(f"shard index {version} ({location}) holds {len(found)} asset(s) revoked in the "
                                f"rights ledger {ledger} ({listed}){hint}validate, plan and shard again so a new index "
                                "leaves them out (docs/rights.md)")


# ---------------------------------------------------------------------------------------------
# Where an asset went

@dataclass(kw_only=True)
class Reach:
    """Everything under the data root that holds (or was trained on) one asset."""

    asset_id: str
    uris: list[str] = field(default_factory=list)
    plans: list[dict] = field(default_factory=list)
    shards: list[dict] = field(default_factory=list)
    shard_indexes: list[dict] = field(default_factory=list)
    runs: list[dict] = field(default_factory=list)
    checkpoints: list[dict] = field(default_factory=list)

    @property
    def trained_on(self) -> bool:
        return bool(self.runs)

    def as_dict(self) -> dict:
        return {"asset_id": self.asset_id, "uris": self.uris, "plans": self.plans, "shards": self.shards,
                "shard_indexes": self.shard_indexes, "runs": self.runs, "checkpoints": self.checkpoints}


@dataclass(kw_only=True)
class Lineage:
    reach: dict[str, Reach]
    problems: list[str]
    """Files that could not be read or verified (their contents are unknown, so say so)."""


def _plan_dirs(data_root: Path) -> list[Path]:
    from ops.clips.plan import PLAN_FILE

    root = data_root / "shards"
    return sorted(path.parent for path in root.glob(f"*/{PLAN_FILE}")) if root.is_dir() else []


def _run_dirs(data_root: Path) -> list[Path]:
    found = list((data_root / "runs").glob("*/launch.json")) + list((data_root / "drills").glob("**/launch.json"))
    # A drill's copy of the original run's records is that run again (ops/drills/restore_drill.py, original_records).
    return sorted(path.parent for path in found if not {"original_records", "from_store"} & set(path.parts))


def where(data_root: str | Path, asset_ids: Iterable[str]) -> Lineage:
    """Walk plan -> shard -> index -> run -> checkpoint under ``data_root`` for ``asset_ids``."""
    from ops.checkpoints import store
    from ops.clips import plan as clips, shards
    from ops.publish import paths

    data_root = Path(data_root)
    wanted = sorted(set(asset_ids))
    reach = {asset_id: Reach(asset_id=asset_id) for asset_id in wanted}
    problems: list[str] = []
    index_assets: dict[str, set[str]] = {}  # index version -> wanted assets it holds
    for directory in _plan_dirs(data_root):
        try:
            plan = clips.read_plan(directory)
        except (OSError, ValueError, RuntimeError) as error:
            problems.append(f"{directory}: the clip plan cannot be read or verified ({error})")
            continue
        table = plan.table.filter(pc.is_in(plan.table.column("asset_id"), value_set=_array(wanted)))
        if not table.num_rows:
            continue
        held: dict[str, dict[str, list[str]]] = {}
        for row in table.select(["asset_id", "uri", "shard", "sample_key"]).to_pylist():
            per_asset = held.setdefault(row["asset_id"], {})
            per_asset.setdefault(row["shard"], []).append(row["sample_key"])
            if row["uri"] not in reach[row["asset_id"]].uris:
                reach[row["asset_id"]].uris.append(row["uri"])
        index = None
        if (directory / shards.INDEX_INFO_FILE).exists() or (directory / shards.INDEX_RECORD_FILE).exists():
            try:
                index = shards.read_index_info(directory)
            except (OSError, ValueError, RuntimeError) as error:
                problems.append(f"{directory}: the shard index cannot be read or verified ({error})")
        for asset_id, per_shard in held.items():
            entry = reach[asset_id]
            entry.plans.append({"plan_version": plan.version, "path": str(directory),
                                "num_clips": sum(map(len, per_shard.values()))})
            for shard, keys in sorted(per_shard.items()):
                tar = directory / f"{shard}.tar"
                entry.shards.append({"plan_version": plan.version, "shard": shard, "path": str(tar),
                                     "written": tar.exists(), "sample_keys": sorted(keys)})
            if index is not None:
                published = paths.shard_store_root()
                entry.shard_indexes.append({"version": index.version, "plan_version": plan.version,
                                            "path": str(directory),
                                            "published_to": f"{published.rstrip('/')}/{index.version}"
                                            if published else None})
                index_assets.setdefault(index.version, set()).add(asset_id)
    launches: dict[str, tuple[Path, dict]] = {}
    for run_dir in _run_dirs(data_root):
        launch = _launch_record(run_dir / "launch.json")
        if isinstance(launch, str):
            problems.append(launch)
        else:
            launches[str(run_dir)] = (run_dir, launch)
    # Runs that read a holding index, then (to a fixed point) runs initialised from their checkpoints.
    tainted: dict[str, tuple[set[str], str]] = {}  # run dir -> (assets, how)
    for key, (_, launch) in launches.items():
        if launch["index"] in index_assets:
            tainted[key] = (index_assets[launch["index"]], f"trained on shard index {launch['index']}")
    changed = True
    while changed:
        changed = False
        by_run_id = {launches[key][1]["run_id"]: key for key in tainted}
        for key, (_, launch) in launches.items():
            if launch["parent"] in by_run_id and key not in tainted:
                tainted[key] = (tainted[by_run_id[launch["parent"]]][0],
                                f"initialised from run {launch['parent']}'s checkpoint")
                changed = True
    for key, (assets, how) in sorted(tainted.items()):
        run_dir, launch = launches[key]
        checkpoints = [{"run_dir": str(run_dir), "step": info.step, "status": info.status, "path": str(info.path)}
                       for info in store.list_checkpoints(run_dir)]
        for asset_id in sorted(assets):
            reach[asset_id].runs.append({"run_dir": str(run_dir), "stage": launch["stage"], "run_id": launch["run_id"],
                                         "shard_index_version": launch["index"], "how": how})
            reach[asset_id].checkpoints.extend(checkpoints)
    return Lineage(reach=reach, problems=problems)


def _launch_record(path: Path) -> dict | str:
    """The lineage fields of a run's launch.json (trainer/launch/stage_launch.py writes it; read here as plain
    JSON, since ops/ sits below the trainer): stage, run id, shard index version, parent run; or why not."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        index = raw.get("shard_index_version") or (raw.get("shard_index") or {}).get("version")
        parent = (raw.get("init_from") or {}).get("run_id")
        if not isinstance(index, str) or not index:
            return f"{path}: the run's launch record names no shard index version"
        return {"stage": str(raw.get("stage")), "run_id": str(raw.get("run_id") or path.parent.name),
                "index": index, "parent": parent}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        return f"{path}: the run's launch record cannot be read ({error})"


def _array(values: list[str]):
    import pyarrow as pa

    return pa.array(values, type=pa.string())


def index_asset_ids(directory: str | Path) -> set[str]:
    """The asset ids a shard index's clips come from (read from the verified plan beside it)."""
    from ops.clips import plan as clips

    return set(clips.read_plan(Path(directory)).table.column("asset_id").to_pylist())


def plan_dir_of_index(data_root: str | Path, index_version: str) -> Path | None:
    """The local plan folder whose shard index has ``index_version`` (a bucket-published set's origin)."""
    from ops.clips import shards

    for directory in _plan_dirs(Path(data_root)):
        if (directory / shards.INDEX_INFO_FILE).exists():
            try:  # verified (signed record): an index.json written into another plan's folder names nothing
                if shards.read_index_info(directory).version == index_version:
                    return directory
            except (OSError, ValueError):  # PublishedFileError is a ValueError
                continue
    return None


def index_assets(data_root: str | Path, location: str, index_version: str) -> set[str]:
    """Asset ids of the shard index at ``location`` (a folder, or a bucket URL whose plan folder is
    found locally by version, else fetched through the shard cache)."""
    if "://" not in str(location):
        return index_asset_ids(location)
    local = plan_dir_of_index(data_root, index_version)
    if local is not None:
        return index_asset_ids(local)
    from ops.clips import shard_cache

    return index_asset_ids(shard_cache.read_any_index(location).directory)



# ---------------------------------------------------------------------------------------------
# Naming an asset: an id, a unique id prefix, or a uri

_HEX = re.compile(r"^[0-9a-f]{8,64}$")


def known_assets(data_root: str | Path) -> tuple[dict[str, set[str]], list[str]]:
    """(asset id -> the uris it has under every published manifest of the data root, the manifests
    that cannot be verified): read through ops.curation.manifest.read_manifest, so a manifest.parquet whose
    uri was pointed at another asset id is never what resolves a uri."""
    from ops.curation.manifest import MANIFEST_FILE, manifests_dir, read_manifest
    from ops.publish.storage import PublishedFileError

    known: dict[str, set[str]] = {}
    unverified: list[str] = []
    for path in sorted(manifests_dir(data_root).glob(f"*/{MANIFEST_FILE}")):
        try:
            table = read_manifest(path.parent).table.select(["asset_id", "uri"])
        except PublishedFileError as error:
            unverified.append(str(error))
            continue
        table = table.filter(pc.not_equal(table.column("asset_id"), ""))
        for asset_id, uri in zip(table.column("asset_id").to_pylist(), table.column("uri").to_pylist()):
            known.setdefault(asset_id, set()).add(uri)
    return known, unverified


def resolve_asset(data_root: str | Path, asset: str, *, allow_unknown: bool = False,
                  known: tuple[dict[str, set[str]], list[str]] | None = None) -> tuple[str, set[str]]:
    """(asset id, its uris) for an id, a unique id prefix or a uri; ValueError naming what is wrong."""
    known, unverified = known if known is not None else known_assets(data_root)
    value = asset.strip()
    if value.lower() in known:
        return value.lower(), known[value.lower()]
    by_uri = sorted(asset_id for asset_id, uris in known.items() if value in uris)
    if len(by_uri) == 1:
        return by_uri[0], known[by_uri[0]]
    if len(by_uri) > 1:
        raise ValueError(f"{value!r} named {len(by_uri)} contents over time ({', '.join(i[:12] for i in by_uri)}); "
                         "give the asset id")
    if _HEX.match(value.lower()):
        matches = sorted(asset_id for asset_id in known if asset_id.startswith(value.lower()))
        if len(matches) == 1:
            return matches[0], known[matches[0]]
        if len(matches) > 1:
            raise ValueError(f"{value!r} is the prefix of {len(matches)} asset ids ({', '.join(matches[:10])}"
                             f"{', ...' if len(matches) > 10 else ''}); give more characters")
        if len(value) == 64 and allow_unknown:
            return value.lower(), set()
    raise ValueError(f"{value!r} is no asset id, id prefix or uri of any manifest under {data_root} "
                     + ("(--allow-unknown records a full 64-character id not ingested yet)" if len(value) == 64
                        else "")
                     + (f"; {len(unverified)} manifest(s) could not be verified and were not searched: "
                        + " | ".join(unverified) if unverified else ""))
