"""Lineage as a resource: the deployment can pin the container digest in config."""

from __future__ import annotations

import dagster as dg

from ops import lineage


class LineageResource(dg.ConfigurableResource):
    """Collects the lineage fields that every materialization carries."""

    container_digest: str = ""
    """Image digest of the deployment; empty means read $TRAINYARD_CONTAINER_DIGEST (or "none")."""

    def collect(self, *, manifest_version: str, config: object, code_version: str) -> lineage.Lineage:
        record = lineage.collect(manifest_version=manifest_version, config=config, code_version=code_version)
        if self.container_digest:
            return lineage.Lineage(**{**record.as_metadata(), "container_digest": self.container_digest})
        return record
