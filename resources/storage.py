"""Storage locations as a Dagster resource (local paths by default, see ops/paths.py)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from ops import paths


class StorageResource(dg.ConfigurableResource):
    """Media root (read) and data root (write) for every asset."""

    media_root: str
    """Folder of raw media and sidecar JSON files."""
    data_root: str
    """Folder that receives manifests, validated sets, listings, shards and runs."""

    @classmethod
    def from_env(cls) -> StorageResource:
        return cls(media_root=str(paths.media_root()), data_root=str(paths.data_root()))

    @property
    def media(self) -> Path:
        return Path(self.media_root)

    @property
    def data(self) -> Path:
        return Path(self.data_root)
