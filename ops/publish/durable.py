"""Durable writes: a file is replaced whole or not at all, and a crash after the write keeps it.

Every small file Trainyard replaces in place (ledgers, digest records, pins, the run's JSON
records) goes through `write_file_atomic`: the bytes go to a temporary file in the same
directory, which is flushed and fsynced, renamed over the target with ``os.replace``, and then
the directory is fsynced so the rename itself survives a power loss. A reader sees the old file
or the whole new one, never a part of either. `write_json_atomic` is the same for the run's JSON
records (final.json, ending.json, samples/rank_R.json, ...), held to strict JSON.

`FileDigest` is the sha256 and size of one file, the one definition that published records
(ops.publish.storage), object-store records (ops.publish.objstore) and checkpoint records
(ops.checkpoints.store) list for each file.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, UTC
from pathlib import Path
from typing import Any

from ops.publish.hashing import sha256_file


@dataclass(kw_only=True, slots=True, frozen=True)
class FileDigest:
    """sha256 and size of one file: the one definition, shared by published records and checkpoint records."""
    sha256: str
    size_bytes: int


def digest_of(path: Path) -> FileDigest:
    return FileDigest(sha256=sha256_file(path), size_bytes=path.stat().st_size)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path``, then ``path`` itself (a folder about to be renamed into place)."""
    for item in sorted(path.rglob("*")):
        if item.is_file():
            with open(item, "rb+") as handle:
                os.fsync(handle.fileno())
    fsync_path(path)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename, fsync the directory.

    The temporary name is random, so nothing planted at a guessable name is written through.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    try:
        with open(staging, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)  # only left when the write or the rename failed
    fsync_path(path.parent)


def json_safe(value: Any) -> Any:
    """Non-finite floats become null: strict JSON readers (jq, JavaScript) reject NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def write_json_atomic(path: Path, record: Mapping[str, Any]) -> None:
    """``record`` as strict, indented JSON (NaN and infinities as null), written by `write_file_atomic`."""
    write_file_atomic(path, json.dumps(json_safe(record), indent=2, allow_nan=False).encode())


def iso_time(timestamp: float) -> str:
    """A unix time as the run records write it: ISO 8601 in UTC."""
    return datetime.fromtimestamp(timestamp, tz=UTC).isoformat()
