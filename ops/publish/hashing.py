"""Content hashing and canonical digests shared by manifests, shards and checkpoints."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv

# 1 MiB reads keep hashing I/O-bound on local disks without holding large buffers.
_CHUNK_BYTES = 1 << 20


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)


def digest_json(value: Any, *, length: int = 64) -> str:
    """sha256 of the canonical JSON of ``value`` (hex, truncated to ``length``)."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()[:length]


def digest_text(text: str, *, length: int = 64) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def table_digest(table: pa.Table) -> str:
    """sha256 of a table's column names and every value, as CSV batch by batch (Arrow's C++ writer:
    fast and deterministic). Every column is in it, so a published version built on it cannot leave
    a column out, and a column added later changes it (tests/test_published.py holds this)."""
    digest = hashlib.sha256(",".join(table.schema.names).encode())
    options = pyarrow.csv.WriteOptions(include_header=False)
    for batch in table.to_batches(max_chunksize=65_536):
        buffer = io.BytesIO()
        pyarrow.csv.write_csv(batch, buffer, write_options=options)
        digest.update(buffer.getvalue())
    return digest.hexdigest()
