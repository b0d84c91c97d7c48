"""The Dagster instance file: SQLite storage under ``$DAGSTER_HOME`` (default .trainyard/dagster_home), or
PostgreSQL with a run queue and pools when ``TRAINYARD_ENV`` is a cluster one (pipelines/environment.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ops.publish import paths
from pipelines import environment

# Run, event-log and schedule storage default to SQLite files inside DAGSTER_HOME; this file
# only turns telemetry off (machines here have no internet) and the UI's first-visit pop-ups
# ("nux"), and documents where to switch to PostgreSQL (see docs/operations.md).
DAGSTER_YAML = """\
# Embedded instance written by Trainyard. Storage: SQLite files in this folder.
# For a team deployment, TRAINYARD_ENV=cluster writes a PostgreSQL one (docs/cluster.md).
telemetry:
  enabled: false
nux:
  enabled: false
"""

# Written (and rewritten) by Trainyard in the cluster's DAGSTER_HOME. Connection settings and the
# password are read from the environment when the instance loads, never stored here.
# - storage: runs, event logs and schedules in PostgreSQL, shared by the daemon, the webserver,
#   every run worker and `make demo`.
# - concurrency.runs: the daemon's run queue (QueuedRunCoordinator) starts at most 4 runs at once.
# - concurrency.pools: the training stages share the "training" pool (assets/training.py), so one
#   trains at a time; a second waits for the slot instead of oversubscribing the machine.
# - run_monitoring: the daemon notices a run worker that died (its run fails visibly) and frees
#   the pool slots of runs that ended, so a crash never leaves the pool held.
CLUSTER_DAGSTER_YAML = """\
# Written by Trainyard (pipelines/instance.py) for TRAINYARD_ENV=cluster; edits are overwritten.
telemetry:
  enabled: false
nux:
  enabled: false
storage:
  postgres:
    postgres_db:
      hostname: {env: TRAINYARD_PG_HOST}
      port: {env: TRAINYARD_PG_PORT}
      username: {env: TRAINYARD_PG_USER}
      password: {env: TRAINYARD_PG_PASSWORD}
      db_name: {env: TRAINYARD_PG_DB}
      # dagster-postgres speaks psycopg2 (SQLAlchemy 2.1 would pick psycopg 3 for plain postgresql://).
      scheme: postgresql+psycopg2
concurrency:
  runs:
    max_concurrent_runs: 4
  pools:
    default_limit: 1
    granularity: op
run_monitoring:
  enabled: true
  poll_interval_seconds: 15
  free_slots_after_run_end_seconds: 30
"""


def ensure_dagster_home() -> Path:
    """Create DAGSTER_HOME (and export it) with its dagster.yaml; return it.

    The embedded file is written once (a user may edit it); the cluster's is Trainyard's and is
    kept equal to `CLUSTER_DAGSTER_YAML`.
    """
    if environment.current().cluster:
        environment.load_cluster_env()
    home = paths.dagster_home().resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if environment.current().cluster:
        if not config.exists() or config.read_text() != CLUSTER_DAGSTER_YAML:
            config.write_text(CLUSTER_DAGSTER_YAML)
    elif not config.exists():
        config.write_text(DAGSTER_YAML)
    os.environ["DAGSTER_HOME"] = str(home)
    return home
