"""The embedded Dagster instance: SQLite storage under ``$DAGSTER_HOME`` (default .trainyard/dagster_home)."""

from __future__ import annotations

import os
from pathlib import Path

from ops import paths

# Run, event-log and schedule storage default to SQLite files inside DAGSTER_HOME; this file
# only turns telemetry off (machines here have no internet) and documents where to switch to
# PostgreSQL (see docs/operations.md).
DAGSTER_YAML = """\
# Embedded instance written by Trainyard. Storage: SQLite files in this folder.
# For a team deployment replace with `storage: postgres: ...` (docs/operations.md).
telemetry:
  enabled: false
"""


def ensure_dagster_home() -> Path:
    """Create DAGSTER_HOME (and export it) with a dagster.yaml if missing; return it."""
    home = paths.dagster_home().resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(DAGSTER_YAML)
    os.environ["DAGSTER_HOME"] = str(home)
    return home
