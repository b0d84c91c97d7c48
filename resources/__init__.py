"""Dagster resources: where data lives, and what every materialization records about itself."""

from resources.lineage import LineageResource
from resources.storage import StorageResource

__all__ = ["LineageResource", "StorageResource"]
