"""Quarantine: the rejected rows of each validated manifest, and their history across versions.

The ledger (``<data_root>/quarantine/ledger.parquet``) keeps one entry per (uri, asset_id,
reason) with the manifest version it was first and last seen in, and the version in which it
left quarantine. A rerun on the same inputs finds the same entries, so the quarantine it
publishes is identical; a fixed file leaves quarantine in the next version and its entry
stays in the ledger with ``resolved_in_version`` set.
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

from ops.storage import publish_dir, write_file_atomic
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
    ("uri", pa.string()),
    ("asset_id", pa.string()),
    ("reason", pa.string()),
    ("detail", pa.string()),
    ("first_seen_version", pa.string()),
    ("last_seen_version", pa.string()),
    ("resolved_in_version", pa.string()),
])
_KEY = ["uri", "asset_id", "reason"]

VALIDATED_FILE = "validated.parquet"
QUARANTINE_FILE = "quarantine.parquet"
REPORT_FILE = "report.json"


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


def read_ledger(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return pq.read_table(path, schema=LEDGER_SCHEMA).to_pylist()


def _merge(entries: list[dict], rejected: list[dict], version: str) -> dict[tuple, dict]:
    """Ledger entries after seeing ``rejected`` in manifest ``version``."""
    ledger = {tuple(entry[k] for k in _KEY): entry for entry in entries}
    current = {tuple(row[k] for k in _KEY): row for row in rejected}
    for key, row in current.items():
        entry = ledger.setdefault(key, {**dict(zip(_KEY, key)), "first_seen_version": version})
        entry.update(detail=row["detail"], last_seen_version=version, resolved_in_version=None)
    for key, entry in ledger.items():
        if key not in current and entry["resolved_in_version"] is None:
            entry["resolved_in_version"] = version
    return ledger


def record(validation: Validation, ledger_file: Path) -> pd.DataFrame:
    """Update the ledger with ``validation`` and return its quarantine with first-seen versions."""
    version = validation.manifest_version
    rejected = validation.rejected.to_dict("records")
    with _locked(ledger_file):
        ledger = _merge(read_ledger(ledger_file), rejected, version)
        buffer = io.BytesIO()
        pq.write_table(pa.Table.from_pylist([ledger[key] for key in sorted(ledger)], schema=LEDGER_SCHEMA), buffer)
        write_file_atomic(ledger_file, buffer.getvalue())
    quarantine = [{**row, "first_seen_version": ledger[tuple(row[k] for k in _KEY)]["first_seen_version"],
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
    return pq.read_table(directory / QUARANTINE_FILE, schema=QUARANTINE_SCHEMA).to_pandas()


def load_validation(directory: Path) -> Validation:
    """Rebuild a published validation (accepted rows, rejected rows, config) from its directory."""
    from ops.validation import ValidationConfig

    report = json.loads((directory / REPORT_FILE).read_text())
    config = report["config"]
    config["allowed_video_codecs"] = tuple(config["allowed_video_codecs"])
    rejected = read_quarantine(directory)[["asset_id", "uri", "reason", "detail"]]
    return Validation(accepted=pq.read_table(directory / VALIDATED_FILE), rejected=rejected,
                      version=report["version"], manifest_version=report["manifest_version"],
                      config=ValidationConfig(**config), media_root=report["media_root"])
