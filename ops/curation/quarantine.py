"""Quarantine: the rejected rows of each validated manifest, and their history across versions.

The ledger (``<data_root>/quarantine/ledger.parquet``) is append-only history: one event per
change of an entry (uri, asset_id, reason), "quarantined" or "resolved", with the manifest
version it was seen in and a sequence number. Recording never edits or drops an earlier event
(``record`` refuses to write a ledger that is not the old one plus new events), so validating
an older manifest again adds an event instead of rewriting when an entry was resolved.
`ledger_entries` folds the events into one row per entry: first and last version it was
quarantined in, and the version in which it left quarantine (None while it is in). A rerun on
the same inputs adds no event, so the quarantine it publishes is identical.

Where the data root is an object store (ops.publish.store_root), each change of the ledger is also
published as a committed snapshot named by its length and chain head, and `record` first brings
this machine's copy up to the store's newest one. A snapshot must extend what this machine holds,
and two snapshots of the same length must not differ: otherwise two writers appended at once
(the fcntl lock serializes one machine only), and `record` refuses with LedgerRewriteError
rather than pick one history. The ledger's newest state is also anchored outside the data root
(ops/curation/ledger_anchor.py): an older copy restored, or the ledger deleted, is refused by name
(QuarantineLedgerRolledBack) rather than read as a shorter history.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ops.curation import manifest as manifest_ops
from ops.publish import paths
from ops.curation import ledger_anchor
from ops.curation.event_chain import chained, link, locked
from ops.curation.ledger_anchor import LedgerRolledBack
from ops.publish.durable import write_file_atomic
from ops.publish.storage import PublishedFileCorrupt, publish_dir, read_verified
from ops.curation.validation import Validation, ValidationConfig, decisions_digest, validation_version

QUARANTINE_SCHEMA = pa.schema([
    ("asset_id", pa.string()),
    ("uri", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("first_seen_version", pa.string()),
    ("manifest_version", pa.string()),
])
LEDGER_SCHEMA = pa.schema([
    ("sequence", pa.int64()),
    ("uri", pa.string()),
    ("asset_id", pa.string()),
    ("reason", pa.string()),
    ("event", pa.string()),          # VALIDATED, QUARANTINED or RESOLVED
    ("manifest_version", pa.string()),
    ("detail", pa.string()),
    ("chain", pa.string()),          # sha256(previous event's chain + this event): edits in place break it
])
_UNCHAINED_SCHEMA = pa.schema([field for field in LEDGER_SCHEMA if field.name != "chain"])
# The fold of the events per entry (what the ledger held before it became a history).
ENTRY_FIELDS = ("uri", "asset_id", "reason", "detail", "first_seen_version", "last_seen_version",
                "resolved_in_version")
QUARANTINED, RESOLVED = "quarantined", "resolved"
VALIDATED = "validated"
"""Marks the first time a manifest version is recorded (empty uri): the versions' order, oldest first."""
_KEY = ["uri", "asset_id", "reason"]

VALIDATED_FILE = "validated.parquet"
QUARANTINE_FILE = "quarantine.parquet"
REPORT_FILE = "report.json"


class LedgerRewriteError(RuntimeError):
    """An update would change or drop events already in the ledger (history must only grow)."""


class QuarantineLedgerRolledBack(LedgerRewriteError, LedgerRolledBack):
    """The quarantine ledger is missing or older than its anchor (ops.curation.ledger_anchor): history would be lost."""


class QuarantineAnchorError(LedgerRewriteError, ledger_anchor.LedgerAnchorError):
    """The quarantine ledger's anchor cannot be trusted (edited, another key, another ledger's)."""


def ledger_path(data_root: str | Path) -> Path:
    return Path(data_root) / "quarantine" / "ledger.parquet"


def _events_from_entries(entries: list[dict]) -> list[dict]:
    """Shim for a ledger written before it was a history (one mutable row per entry): the events it implies."""
    events = []
    for entry in sorted(entries, key=lambda e: tuple(e[k] for k in _KEY)):
        key = {k: entry[k] for k in _KEY}
        seen = dict.fromkeys([entry["first_seen_version"], entry["last_seen_version"]])
        events.extend({**key, "event": QUARANTINED, "manifest_version": version, "detail": entry["detail"]}
                      for version in seen)
        if entry["resolved_in_version"] is not None:
            events.append({**key, "event": RESOLVED, "manifest_version": entry["resolved_in_version"],
                           "detail": entry["detail"]})
    return chained([{"sequence": number, **event} for number, event in enumerate(events)])


def read_ledger(path: Path) -> list[dict]:
    """Every event of the ledger, in the order they were recorded, its sequence and hash chain checked.

    The chain catches an event edited in place by anything that does not recompute every later
    link; the sequence numbers catch removed or reordered events.
    """
    if not path.exists():
        return []
    names = pq.read_schema(path).names
    if "resolved_in_version" in names and "event" not in names:
        return _events_from_entries(pq.read_table(path).to_pylist())
    if "chain" not in names:  # shim: a history written before events were chained; chained on the next record
        events = chained(pq.read_table(path, schema=_UNCHAINED_SCHEMA).to_pylist())
    else:
        events = pq.read_table(path, schema=LEDGER_SCHEMA).to_pylist()
    if [event["sequence"] for event in events] != list(range(len(events))):
        raise LedgerRewriteError(f"{path}: event sequence numbers are not 0..{len(events) - 1}: events were removed "
                                 "or reordered; restore the ledger from a backup")
    previous = ""
    for event in events:
        previous = link(previous, event)
        if event["chain"] != previous:
            raise LedgerRewriteError(f"{path}: event {event['sequence']} ({event['event']} {event['uri']!r} in "
                                     f"{event['manifest_version']}) does not match the hash chain: it was edited "
                                     "in place; restore the ledger from a backup")
    return events


def _version_order(events: list[dict]) -> dict[str, int]:
    """Manifest version -> when the ledger first recorded it (0 = oldest)."""
    order: dict[str, int] = {}
    for event in events:
        order.setdefault(event["manifest_version"], len(order))
    return order


def _states(events: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Per entry, per manifest version: the last event recorded for it in that version."""
    states: dict[tuple, dict[str, dict]] = {}
    for event in events:
        if event["event"] != VALIDATED:
            states.setdefault(tuple(event[k] for k in _KEY), {})[event["manifest_version"]] = event
    return states


def _fold(key: tuple, per_version: dict[str, dict], order: dict[str, int]) -> dict:
    """One entry from its per-version states, ordered by when each version was first recorded.

    Validating an older manifest again never moves an entry back: the entry is read off the
    versions in their order, not off the last event appended.
    """
    versions = sorted(per_version, key=order.__getitem__)
    quarantined = [v for v in versions if per_version[v]["event"] == QUARANTINED]
    last_seen = quarantined[-1] if quarantined else versions[0]
    later_resolved = [v for v in versions if order[v] > order[last_seen] and per_version[v]["event"] == RESOLVED]
    return {**dict(zip(_KEY, key)), "detail": per_version[last_seen]["detail"],
            "first_seen_version": quarantined[0] if quarantined else versions[0], "last_seen_version": last_seen,
            "resolved_in_version": later_resolved[0] if later_resolved else None}


def ledger_entries(events: list[dict]) -> dict[tuple, dict]:
    """Fold events into one entry per (uri, asset_id, reason), with ENTRY_FIELDS."""
    order = _version_order(events)
    return {key: _fold(key, per_version, order) for key, per_version in _states(events).items()}


def _new_events(events: list[dict], rejected: list[dict], version: str) -> list[dict]:
    """Events that seeing ``rejected`` in manifest ``version`` adds: only changes, so a rerun adds none.

    An entry is resolved in ``version`` only if it stood quarantined as of that version (in it,
    or in the latest version recorded before it): an older manifest validated again never
    resolves an entry first seen later, and repeats nothing already recorded for it.
    """
    order = _version_order(events)
    added: list[dict] = []
    if version not in order:
        added.append({"uri": "", "asset_id": "", "reason": "", "event": VALIDATED, "manifest_version": version,
                      "detail": ""})
    position = order.get(version, len(order))
    order = {**order, version: position}
    states = _states(events)
    current = {tuple(row[k] for k in _KEY): row for row in rejected}
    for key in sorted(current):
        if states.get(key, {}).get(version, {}).get("event") != QUARANTINED:
            added.append({**dict(zip(_KEY, key)), "event": QUARANTINED, "manifest_version": version,
                          "detail": current[key]["detail"]})
    for key in sorted(set(states) - set(current)):
        as_of = [(order[v], state) for v, state in states[key].items() if order[v] <= position]
        if as_of and max(as_of, key=lambda item: item[0])[1]["event"] == QUARANTINED:
            added.append({**dict(zip(_KEY, key)), "event": RESOLVED, "manifest_version": version,
                          "detail": max(as_of, key=lambda item: item[0])[1]["detail"]})
    numbered = [{"sequence": len(events) + number, **event} for number, event in enumerate(added)]
    return chained(numbered, events[-1]["chain"] if events else "")


def _append(ledger_file: Path, events: list[dict], added: list[dict]) -> None:
    """Write the ledger as ``events`` + ``added``, after checking the file still holds exactly ``events``."""
    if read_ledger(ledger_file) != events:
        raise LedgerRewriteError(f"{ledger_file} changed while it was locked; nothing was recorded")
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([*events, *added], schema=LEDGER_SCHEMA), buffer)
    write_file_atomic(ledger_file, buffer.getvalue())


def record(validation: Validation, ledger_file: Path) -> pd.DataFrame:
    """Append what ``validation`` changes to the ledger; return its quarantine with first-seen versions."""
    version = validation.manifest_version
    rejected = validation.rejected.to_dict("records")
    with locked(ledger_file):
        events = read_anchored(ledger_file)
        added = _new_events(events, rejected, version)
        if added or (ledger_file.exists() and "chain" not in pq.read_schema(ledger_file).names):
            _append(ledger_file, events, added)
            ledger_anchor.advance(ledger_file, [*events, *added])  # after the ledger: never ahead of it
        _publish_snapshot(ledger_file, [*events, *added])
        entries = ledger_entries([*events, *added])
    quarantine = [{**row, "first_seen_version": entries[tuple(row[k] for k in _KEY)]["first_seen_version"],
                   "manifest_version": version} for row in rejected]
    quarantine.sort(key=lambda row: (row["uri"], row["reason"]))
    return pd.DataFrame(quarantine, columns=QUARANTINE_SCHEMA.names)


def read_anchored(ledger_file: Path) -> list[dict]:
    """The ledger's events (brought up to the store's newest snapshot where the data root is a store),
    checked against its anchor outside the data root (ops.curation.ledger_anchor): an older copy restored, or the
    ledger deleted, raises QuarantineLedgerRolledBack instead of rewriting quarantine history."""
    anchor = ledger_anchor.load(ledger_file, error=QuarantineAnchorError)  # first: the ledger is never older
    events = _synced(ledger_file)
    ledger_anchor.check(ledger_file, anchor, events, error=QuarantineLedgerRolledBack)
    return events


def _snapshot_name(events: list[dict]) -> str:
    return f"{len(events):08d}-{events[-1]['chain']}"


def _synced(ledger_file: Path) -> list[dict]:
    """The ledger's events, first brought up to the store's longest snapshot where the data root is one.

    Every committed snapshot is named ``<events>-<chain head>``; all of them must lie on one
    history, the one this machine then holds: a snapshot whose head is not that history's event
    at its length is a second history (two machines appended at once), refused rather than dropped.
    """
    local = read_ledger(ledger_file)
    if paths.data_store_url() is None:
        return local
    from ops.publish import store_root  # fsspec: only where the data root is in a store

    listing = store_root.snapshots(ledger_file)
    if listing is None or not listing.committed:
        return local
    heads = []
    for name in listing.committed:
        length, _, chain = name.partition("-")
        if not (length.isdigit() and chain):
            raise LedgerRewriteError(f"{name!r} in the store is not a ledger snapshot (<events>-<chain head>); "
                                     "remove it before validating again")
        heads.append((int(length), chain, name))
    events, fetched_bytes = local, None
    longest = max(heads)
    if longest[0] > len(local):
        import tempfile

        with tempfile.TemporaryDirectory(dir=ledger_file.parent, prefix=".ledger-fetch-") as scratch:
            fetched = store_root.fetch_snapshot(ledger_file, longest[2], Path(scratch) / "snapshot")
            events = read_ledger(fetched)  # sequence and chain checked
            if len(events) != longest[0] or events[-1]["chain"] != longest[1] or events[:len(local)] != local:
                raise LedgerRewriteError(f"{ledger_file}: the store's longest snapshot {longest[2]} does not extend "
                                         "this machine's ledger (or its name does not match its events); keep one "
                                         "history")
            fetched_bytes = fetched.read_bytes()
    rivals = sorted(name for length, chain, name in heads
                    if length > len(events) or (length and events[length - 1]["chain"] != chain))
    if rivals:
        raise LedgerRewriteError(f"the store holds ledger snapshots {', '.join(rivals)} on another history than "
                                 f"{ledger_file}'s {len(events)} events: two validations appended at once on "
                                 "different machines (or a copy diverged); keep one history (delete the other "
                                 "snapshots) before validating again")
    if fetched_bytes is not None:  # only a history with no rival replaces this machine's copy
        write_file_atomic(ledger_file, fetched_bytes)
    return events


def _publish_snapshot(ledger_file: Path, events: list[dict]) -> None:
    """Publish the ledger as it stands where the data root is a store (once per distinct state)."""
    if paths.data_store_url() is None or not events:
        return
    from ops.publish import store_root

    listing = store_root.snapshots(ledger_file)
    if listing is not None and _snapshot_name(events) not in listing.committed:
        store_root.publish_snapshot(ledger_file, _snapshot_name(events))


def validated_dir(data_root: str | Path, version: str) -> Path:
    return Path(data_root) / "validated" / version


def data_root_of_validated(directory: str | Path) -> Path:
    """The data root a validated set's folder (``validated_dir``) lies under."""
    return Path(directory).parent.parent


def write_validated(validation: Validation, quarantine: pd.DataFrame, out_dir: Path, report: dict) -> Path:
    """Publish accepted rows, quarantine and report as one immutable version directory.

    The report gains ``code_version`` (with the manifest, config and decisions it recomputes the
    version on read). The content is deterministic, so a rebuild compares it with a folder already
    published under this version and replaces one that differs (ops.publish.storage.publish_dir).
    """
    actual = validation_version(validation.manifest_version, validation.config, validation.code_version,
                                decisions_digest(validation.rejected))
    if actual != validation.version:  # compare=True below would otherwise replace a good folder with it
        raise ValueError(f"validation's manifest, config, code version and decisions hash to {actual}, not to its "
                         f"version {validation.version}; publish what validation.validate returned, unedited")
    with publish_dir(out_dir, compare=True) as staging:
        pq.write_table(validation.accepted, staging / VALIDATED_FILE)
        pq.write_table(pa.Table.from_pandas(quarantine, schema=QUARANTINE_SCHEMA, preserve_index=False),
                       staging / QUARANTINE_FILE)
        body = {**report, "code_version": validation.code_version}
        (staging / REPORT_FILE).write_text(json.dumps(body, indent=2, sort_keys=True, default=str))
    return out_dir


def _parquet(data: bytes, schema: pa.Schema | None = None) -> pa.Table:
    return pq.read_table(pa.BufferReader(data), schema=schema)


def read_quarantine(directory: Path) -> pd.DataFrame:
    """The quarantine table of a published validation, verified against its version."""
    directory = Path(directory)
    _, files = read_verified(directory, version=directory.name, complete=True)
    return _parquet(files[QUARANTINE_FILE], QUARANTINE_SCHEMA).to_pandas()


def _manifest_of(directory: Path, manifest_version: str) -> manifest_ops.Manifest:
    """The manifest a validated set was judged from: ``<data_root>/manifests/<version>``, verified."""
    return manifest_ops.read_manifest(manifest_ops.manifests_dir(directory.parent.parent) / manifest_version)


def _forged(directory: Path, version: str, what: str) -> PublishedFileCorrupt:
    return PublishedFileCorrupt(f"{directory}: validated set {version}: {what}; its files were rewritten together "
                                "with their digest record. Rebuild this version (rerun validation): the rebuild "
                                "sets this folder aside")


def _cross_check(directory: Path, version: str, report: dict, accepted: pa.Table, rejected: pd.DataFrame,
                 config: ValidationConfig) -> None:
    """The decisions must partition the manifest they came from and hash to this version.

    The digest record only binds bytes: rewritten with the files, it proves nothing. The
    version binds meaning: manifest, config, code and the (uri, reason) decisions hash to it,
    and accepted rows must be exactly the manifest's rows that were not rejected.
    """
    manifest = _manifest_of(directory, report["manifest_version"])
    if report["media_root"] != manifest.media_root:
        raise _forged(directory, version, f"media root {report['media_root']!r} is not manifest "
                                          f"{manifest.version}'s {manifest.media_root!r}")
    position = {uri: index for index, uri in enumerate(manifest.table.column("uri").to_pylist())}
    asset_ids = manifest.table.column("asset_id").to_pylist()
    unknown = sorted(set(rejected["uri"]) - set(position))
    if unknown or rejected["uri"].duplicated().any():
        raise _forged(directory, version, f"rejected uris {unknown or 'duplicated'} are not rows of manifest "
                                          f"{manifest.version} (each exactly once)")
    if any(asset_ids[position[uri]] != asset_id for uri, asset_id in zip(rejected["uri"], rejected["asset_id"])):
        raise _forged(directory, version, f"a rejected row's asset_id differs from manifest {manifest.version}")
    ordered = rejected.assign(_at=rejected["uri"].map(position)).sort_values("_at")
    # The report's own rules: a set validated before a rule existed (say allowed_licenses) hashes without it.
    recomputed = validation_version(manifest.version, report["config"], str(report.get("code_version", "")),
                                    decisions_digest(ordered))
    if recomputed != version:
        raise _forged(directory, version, f"its manifest, config, code version and decisions hash to {recomputed}")
    rejected_uris = set(rejected["uri"])
    complement = manifest.table.filter(pa.array([uri not in rejected_uris for uri in position]))
    if not accepted.equals(complement):
        raise _forged(directory, version, f"accepted rows are not exactly manifest {manifest.version}'s rows "
                                          "outside the quarantine")


def load_validation(directory: Path) -> Validation:
    """Rebuild a published validation (accepted rows, rejected rows, config) from its directory.

    Every file is read once and checked against the digest record (ops.publish.storage.PublishedFileError),
    then the decisions are checked against the manifest they were judged from (`_cross_check`), so
    an edited row never comes back as this version's decision, even with its record rewritten.
    Raises ManifestNotFound when that manifest is not under the same data root.
    """
    directory = Path(directory)
    version, files = read_verified(directory, version=directory.name, complete=True)
    report = json.loads(files[REPORT_FILE])
    if report.get("version") != version:
        raise PublishedFileCorrupt(f"{directory / REPORT_FILE}: says version {report.get('version')!r}, but it is "
                                   f"published as {version}; rebuild this version")
    if "code_version" not in report:
        raise PublishedFileCorrupt(f"{directory / REPORT_FILE}: version {version} was published before reports "
                                   "recorded code_version, so its decisions cannot be checked; rebuild this version")
    config = report["config"]
    config["allowed_video_codecs"] = tuple(config["allowed_video_codecs"])
    config = ValidationConfig(**config)
    accepted = _parquet(files[VALIDATED_FILE])
    rejected = _parquet(files[QUARANTINE_FILE], QUARANTINE_SCHEMA).to_pandas()[["asset_id", "uri", "reason", "detail"]]
    _cross_check(directory, version, report, accepted, rejected, config)
    return Validation(accepted=accepted, rejected=rejected, version=version,
                      manifest_version=report["manifest_version"], config=config, media_root=report["media_root"],
                      code_version=report["code_version"])
