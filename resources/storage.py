"""Storage locations as a Dagster resource (local paths by default, see ops/paths.py)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from ops import paths


class StorageResource(dg.ConfigurableResource):
    """Media root (read) and data root (write) for every asset."""

    media_root: str
    """Raw media and sidecar JSON files: a folder, or an object-store URL (``s3://bucket/prefix``, ops.media_store)."""
    data_root: str
    """Folder that receives manifests, validated sets, listings, shards and runs."""

    @classmethod
    def from_env(cls) -> StorageResource:
        return cls(media_root=paths.media_location(), data_root=str(paths.data_root()))

    @property
    def media(self) -> Path:
        """The media root as a folder (ValueError for an object-store URL: use ops.media_store.open_root)."""
        if "://" in self.media_root and not self.media_root.startswith("file://"):
            raise ValueError(f"media_root {self.media_root!r} is a URL, not a folder")
        return Path(self.media_root)

    @property
    def data(self) -> Path:
        return Path(self.data_root)
