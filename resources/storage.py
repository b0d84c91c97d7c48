"""Storage locations as a Dagster resource (local paths by default, see ops/publish/paths.py)."""

from __future__ import annotations

from pathlib import Path

import dagster as dg

from ops.publish import paths


class StorageResource(dg.ConfigurableResource):
    """Media root (read) and data root (write) for every asset."""

    media_root: str
    """Raw media and sidecar JSON files: a folder, or an object-store URL (``s3://bucket/prefix``, ops.media.roots)."""
    data_root: str
    """Manifests, validated sets, listings, shards and runs: a folder, or an object-store URL whose
    working copy on this machine every step writes in (ops.publish.store_root; set by TRAINYARD_DATA_ROOT)."""

    @classmethod
    def from_env(cls) -> StorageResource:
        return cls(media_root=paths.media_location(), data_root=paths.data_location())

    @property
    def media(self) -> Path:
        """The media root as a folder (ValueError for an object-store URL: use ops.media.roots.open_root)."""
        if "://" in self.media_root and not self.media_root.startswith("file://"):
            raise ValueError(f"media_root {self.media_root!r} is a URL, not a folder")
        return Path(self.media_root)

    @property
    def data(self) -> Path:
        """The folder steps write in: the data root, or this machine's working copy of a data root URL."""
        if "://" in self.data_root and not self.data_root.startswith("file://"):
            if self.data_root.rstrip("/") != paths.data_store_url():
                # ops.publish.store_root publishes and fetches by TRAINYARD_DATA_ROOT: one setting, not two that disagree
                raise ValueError(f"data_root {self.data_root!r} is a URL other than TRAINYARD_DATA_ROOT "
                                 f"({paths.data_location()!r}); set the variable, not the resource")
            return paths.data_root()
        return Path(self.data_root.removeprefix("file://"))
