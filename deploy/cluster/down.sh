#!/usr/bin/env bash
# Stop what deploy/cluster/up.sh started: the proxy, the webserver and daemon, MLflow, SeaweedFS, then PostgreSQL.
# Their state ($TRAINYARD_CLUSTER_HOME) stays; `make cluster-up` starts them on it again.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${TRAINYARD_HOME:=$PWD/.trainyard}"
: "${TRAINYARD_CLUSTER_HOME:=$TRAINYARD_HOME/cluster}"
PIDS=$TRAINYARD_CLUSTER_HOME/pids
for name in nginx dagster-webserver dagster-daemon mlflow seaweed; do
  [ -s "$PIDS/$name.pid" ] || continue
  pid=$(cat "$PIDS/$name.pid")
  # Each was started in its own session: signal the whole group (gunicorn workers, code servers, ...).
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  rm -f "$PIDS/$name.pid"
done
PG=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
if [ -n "$PG" ] && [ -s "$TRAINYARD_CLUSTER_HOME/pgdata/postmaster.pid" ]; then
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$PG/pg_ctl" -D "$TRAINYARD_CLUSTER_HOME/pgdata" -m fast -w stop >/dev/null
  else
    "$PG/pg_ctl" -D "$TRAINYARD_CLUSTER_HOME/pgdata" -m fast -w stop >/dev/null
  fi
fi
echo "cluster-down: stopped (state kept in $TRAINYARD_CLUSTER_HOME)"
