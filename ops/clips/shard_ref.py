"""A reference to a published shard index: what the shard_index asset hands downstream.

The profile, the loader benchmark and every training stage read the index through this, and a
stage records it in its launch manifest (trainer/launch/stage_launch.py), so the restore drill replays
the same data whatever shard_index has become since. Plain Python, no I/O: the Dagster process
pickles it between assets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardIndexRef:
    path: str
    """Folder of the shard index (index.json, index.parquet and the shards), or the URL of the set
    published to an object store (``s3://bucket/shards/<version>``, read through ops.clips.shard_cache):
    data.shard_index."""
    version: str
    """The index's version (its data version in Dagster)."""
    manifest_version: str
    """Version of the manifest the shards were cut from: data.manifest_version."""

    def __post_init__(self) -> None:
        for name in ("path", "version", "manifest_version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"shard index reference: {name} must be a non-empty string, got {value!r}")

    @classmethod
    def of(cls, value: ShardIndexRef | Mapping[str, Any]) -> ShardIndexRef:
        """``value`` as a reference. The shard_index asset returned a plain dict with these keys
        before; Dagster keeps that pickled output until the asset is materialized again."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"a shard index reference is a ShardIndexRef or a mapping, got {type(value).__name__}")
        missing = sorted({"path", "version", "manifest_version"} - set(value))
        if missing:
            raise ValueError(f"shard index reference {dict(value)!r} lacks {', '.join(missing)}")
        return cls(path=str(value["path"]), version=value["version"], manifest_version=value["manifest_version"])

    def as_dict(self) -> dict[str, str]:
        return {"path": self.path, "version": self.version, "manifest_version": self.manifest_version}
