"""Content hashing and canonical digests shared by manifests, shards and checkpoints."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

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
