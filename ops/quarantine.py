"""Quarantine: the rejected rows of each validated manifest, and their history across versions.

The ledger (``<data_root>/quarantine/ledger.parquet``) is append-only history: one event per
change of an entry (uri, asset_id, reason), "quarantined" or "resolved", with the manifest
version it was seen in and a sequence number. Recording never edits or drops an earlier event
(``record`` refuses to write a ledger that is not the old one plus new events), so validating
an older manifest again adds an event instead of rewriting when an entry was resolved.
`ledger_entries` folds the events into one row per entry: first and last version it was
quarantined in, and the version in which it left quarantine (None while it is in). A rerun on
the same inputs adds no event, so the quarantine it publishes is identical.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from ops.storage import PublishedFileCorrupt, publish_dir, verify_published, write_file_atomic
from ops.validation import Validation

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
    ("event", pa.string()),          # QUARANTINED or RESOLVED
    ("manifest_version", pa.string()),
    ("detail", pa.string()),
])
# The fold of the events per entry (what the ledger held before it became a history).
ENTRY_FIELDS = ("uri", "asset_id", "reason", "detail", "first_seen_version", "last_seen_version",
                "resolved_in_version")
QUARANTINED, RESOLVED = "quarantined", "resolved"
_KEY = ["uri", "asset_id", "reason"]

VALIDATED_FILE = "validated.parquet"
QUARANTINE_FILE = "quarantine.parquet"
REPORT_FILE = "report.json"


class LedgerRewriteError(RuntimeError):
    """An update would change or drop events already in the ledger (history must only grow)."""


def ledger_path(data_root: str | Path) -> Path:
    return Path(data_root) / "quarantine" / "ledger.parquet"


@contextlib.contextmanager
def _locked(path: Path):
    """Exclusive lock so two validations never interleave their ledger updates."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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
    return [{"sequence": number, **event} for number, event in enumerate(events)]


def read_ledger(path: Path) -> list[dict]:
    """Every event of the ledger, in the order they were recorded."""
    if not path.exists():
        return []
    names = pq.read_schema(path).names
    if "resolved_in_version" in names and "event" not in names:
        return _events_from_entries(pq.read_table(path).to_pylist())
    events = pq.read_table(path, schema=LEDGER_SCHEMA).to_pylist()
    if [event["sequence"] for event in events] != list(range(len(events))):
        raise LedgerRewriteError(f"{path}: event sequence numbers are not 0..{len(events) - 1}: events were removed "
                                 "or reordered; restore the ledger from a backup")
    return events


def ledger_entries(events: list[dict]) -> dict[tuple, dict]:
    """Fold events into one entry per (uri, asset_id, reason), with ENTRY_FIELDS."""
    entries: dict[tuple, dict] = {}
    for event in events:
        key = tuple(event[k] for k in _KEY)
        entry = entries.setdefault(key, {**dict(zip(_KEY, key)), "first_seen_version": event["manifest_version"],
                                         "last_seen_version": None, "resolved_in_version": None})
        if event["event"] == QUARANTINED:
            entry.update(detail=event["detail"], last_seen_version=event["manifest_version"],
                         resolved_in_version=None)
        else:
            entry["resolved_in_version"] = event["manifest_version"]
    return entries


def _new_events(events: list[dict], rejected: list[dict], version: str) -> list[dict]:
    """Events that seeing ``rejected`` in manifest ``version`` adds: only changes, so a rerun adds none."""
    latest = {tuple(event[k] for k in _KEY): event for event in events}
    current = {tuple(row[k] for k in _KEY): row for row in rejected}
    added = []
    for key in sorted(current):
        last = latest.get(key)
        if last is None or (last["event"], last["manifest_version"]) != (QUARANTINED, version):
            added.append({**dict(zip(_KEY, key)), "event": QUARANTINED, "manifest_version": version,
                          "detail": current[key]["detail"]})
    for key in sorted(set(latest) - set(current)):
        if latest[key]["event"] == QUARANTINED:
            added.append({**dict(zip(_KEY, key)), "event": RESOLVED, "manifest_version": version,
                          "detail": latest[key]["detail"]})
    return [{"sequence": len(events) + number, **event} for number, event in enumerate(added)]


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
    with _locked(ledger_file):
        events = read_ledger(ledger_file)
        added = _new_events(events, rejected, version)
        if added or (ledger_file.exists() and "event" not in pq.read_schema(ledger_file).names):
            _append(ledger_file, events, added)
        entries = ledger_entries([*events, *added])
    quarantine = [{**row, "first_seen_version": entries[tuple(row[k] for k in _KEY)]["first_seen_version"],
                   "manifest_version": version} for row in rejected]
    quarantine.sort(key=lambda row: (row["uri"], row["reason"]))
    return pd.DataFrame(quarantine, columns=QUARANTINE_SCHEMA.names)


def validated_dir(data_root: str | Path, version: str) -> Path:
    return Path(data_root) / "validated" / version


def write_validated(validation: Validation, quarantine: pd.DataFrame, out_dir: Path, report: dict) -> Path:
    """Publish accepted rows, quarantine and report as one immutable version directory."""
    with publish_dir(out_dir) as staging:
        if staging is not None:
            pq.write_table(validation.accepted, staging / VALIDATED_FILE)
            pq.write_table(pa.Table.from_pandas(quarantine, schema=QUARANTINE_SCHEMA, preserve_index=False),
                           staging / QUARANTINE_FILE)
            (staging / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True, default=str))
    return out_dir


def read_quarantine(directory: Path) -> pd.DataFrame:
    """The quarantine table of a published validation, verified against its version."""
    verify_published(directory)
    return pq.read_table(directory / QUARANTINE_FILE, schema=QUARANTINE_SCHEMA).to_pandas()


def load_validation(directory: Path) -> Validation:
    """Rebuild a published validation (accepted rows, rejected rows, config) from its directory.

    Every file is checked against the digest record first (ops.storage.PublishedFileError), so an
    edited row never comes back as this version's decision.
    """
    from ops.validation import ValidationConfig

    directory = Path(directory)
    version = verify_published(directory)
    report = json.loads((directory / REPORT_FILE).read_text())
    if report.get("version") != version:
        raise PublishedFileCorrupt(f"{directory / REPORT_FILE}: says version {report.get('version')!r}, but it is "
                                   f"published as {version}; rebuild this version")
    config = report["config"]
    config["allowed_video_codecs"] = tuple(config["allowed_video_codecs"])
    rejected = pq.read_table(directory / QUARANTINE_FILE, schema=QUARANTINE_SCHEMA).to_pandas()
    return Validation(accepted=pq.read_table(directory / VALIDATED_FILE), rejected=rejected[["asset_id", "uri", "reason", "detail"]],
                      version=report["version"], manifest_version=report["manifest_version"],
                      config=ValidationConfig(**config), media_root=report["media_root"])
