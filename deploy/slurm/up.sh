#!/usr/bin/env bash
# A real SLURM cluster on this machine (`make slurm-up [NODES=N]`), from Debian's packages:
# munge, MariaDB + slurmdbd (so sacct works), slurmctld, slurmd. Runs as root, without systemd
# (containers, CI), with the node's real CPU count and memory (`slurmd -C`). Idempotent: a
# cluster already answering with the same nodes is left as it is. `make slurm-down`
# (deploy/slurm/down.sh) stops it.
#
# NODES=N (default 0) adds N compute nodes node1..nodeN, each a network and UTS namespace with its
# own address on a bridge, its own slurmd and one CPU (deploy/slurm/nodes.sh, docs/slurm.md).
#
# Partitions:
#   debug  this machine (Default)                 what the single-node tests and the SLURM launcher run on
#   nodes  node[1-N], one CPU each (NODES>0)      multi-node jobs: one kernel, the shared filesystem
#   gpu    gpu[1-4], 8 GPUs each, State=CLOUD, powered down (ResumeProgram=/bin/true): a 4 x 8 GPU shape
#          for `sbatch --test-only`; never submit to it for real
set -euo pipefail
NODES=${NODES:-0}
case "$NODES" in ''|*[!0-9]*) echo "slurm-up: NODES=$NODES is not a whole number" >&2; exit 2 ;; esac
[ "$NODES" -le 200 ] || { echo "slurm-up: NODES=$NODES: at most 200 nodes fit the bridge's /24" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=deploy/slurm/nodes.sh
. "$here/nodes.sh"
[ "$(id -u)" = 0 ] || { echo "slurm-up: run as root (the local cluster's daemons run as root)" >&2; exit 1; }
export DEBIAN_FRONTEND=noninteractive
need=()
for command in slurmctld slurmd slurmdbd munged mariadbd sbatch; do
  command -v "$command" >/dev/null || need=(slurm-wlm slurmdbd munge mariadb-server)
done
if [ ${#need[@]} -gt 0 ]; then
  echo "slurm-up: installing ${need[*]}"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

nodes_up() {  # the node count of the running cluster's `nodes` partition (0: none)
  local count
  count=$(sinfo -h -p nodes -o %D 2>/dev/null | awk '{s += $1} END {print s + 0}')
  echo "${count:-0}"
}
if scontrol ping 2>/dev/null | grep -q "is UP" && sinfo -h -o %T -n "$(hostname -s)" 2>/dev/null | grep -qE "idle|mix|alloc"; then
  if [ "$(nodes_up)" = "$NODES" ]; then
    all_running=1
    for i in $(seq "$NODES"); do ty_node_running "$i" || all_running=0; done
    if [ "$all_running" = 1 ]; then echo "slurm-up: the cluster is already up"; sinfo; exit 0; fi
  fi
  echo "slurm-up: the running cluster has $(nodes_up) namespace node(s), NODES=$NODES asked: restarting it"
  bash "$here/down.sh"
fi

STATE=/var/lib/trainyard-slurm RUN=/run/trainyard-slurm LOGS=/var/log/trainyard-slurm
mkdir -p "$STATE/ctld" "$STATE/d" "$RUN" "$LOGS" /etc/slurm
HOST=$(hostname -s)
NODE=$(slurmd -C | head -n 1)   # NodeName=<host> CPUs=.. Boards=.. ... RealMemory=..

# munge: the package made a key; make one if it is missing.
if [ ! -s /etc/munge/munge.key ]; then
  (command -v mungekey >/dev/null && mungekey --create --keyfile=/etc/munge/munge.key) \
    || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
fi
mkdir -p /run/munge && chown munge:munge /run/munge
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged

# MariaDB for slurmdbd: root authenticates over the local socket (unix_socket), so no password exists.
if ! mariadb -e "select 1" >/dev/null 2>&1; then
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld
  (mysqld_safe --user=mysql >/dev/null 2>&1 &)
  for _ in $(seq 60); do mariadb -e "select 1" >/dev/null 2>&1 && break; sleep 0.5; done
fi
mariadb -e "select 1" >/dev/null

CTLD_HOST=$HOST
NODE_LINES="" NODES_PARTITION=""
if [ "$NODES" -gt 0 ]; then
  ty_network_up "$NODES"
  CTLD_HOST="$HOST($TY_CTL_ADDR)"  # the nodes reach the controller over the bridge
  memory=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
  per_node=$(( memory / (NODES + 1) ))
  for i in $(seq "$NODES"); do
    NODE_LINES+="NodeName=node$i NodeAddr=$(ty_node_addr "$i") NodeHostname=node$i CPUs=1 RealMemory=$per_node State=UNKNOWN"$'\n'
    mkdir -p "$STATE/d/node$i"
  done
  NODES_PARTITION="PartitionName=nodes Nodes=node[1-$NODES] MaxTime=04:00:00 State=UP"
fi
mkdir -p "$STATE/d/$HOST"
# Power saving is for the gpu partition's CLOUD nodes only: this machine and the namespace nodes stay up.
SUSPEND_EXC=$HOST; [ "$NODES" -gt 0 ] && SUSPEND_EXC="$HOST,node[1-$NODES]"

cat > /etc/slurm/slurm.conf <<CONF
# Written by deploy/slurm/up.sh: Trainyard's local single-node cluster.
ClusterName=trainyard
SlurmctldHost=$CTLD_HOST
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
# %n: each node's own (this machine's slurmd and every namespace node's).
SlurmdSpoolDir=$STATE/d/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Start the next array task as soon as a CPU frees: SLURM's defaults (batch_sched_delay=3 s) put about
# 3 s between the tasks of a node, which a backfill of many short data tasks pays per task
# (benchmarks/backfill.py measured 3.0 s -> 1.0 s per task on one node; docs/slurm.md).
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MpiDefault=none
ReturnToService=2
KillWait=10
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=20
InactiveLimit=0
GresTypes=gpu
# Power saving for the gpu partition's CLOUD nodes only: they stay powered down ("idle~"), which the
# scheduler counts as available, so sbatch --test-only can place a job there; PrivateData=cloud
# shows them to scontrol. This machine is never suspended.
SuspendProgram=/bin/true
ResumeProgram=/bin/true
SuspendTime=600
SuspendExcNodes=$SUSPEND_EXC
ResumeTimeout=60
PrivateData=cloud
$NODE State=UNKNOWN
${NODE_LINES}NodeName=gpu[1-4] CPUs=64 Boards=1 SocketsPerBoard=2 CoresPerSocket=32 ThreadsPerCore=1 RealMemory=1000000 Gres=gpu:8 State=CLOUD
PartitionName=debug Nodes=$HOST Default=YES MaxTime=04:00:00 State=UP
PartitionName=gpu Nodes=gpu[1-4] MaxTime=2-00:00:00 State=UP
$NODES_PARTITION
CONF
cat > /etc/slurm/slurmdbd.conf <<CONF
# Written by deploy/slurm/up.sh.
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=trainyard_slurm_acct
LogFile=$LOGS/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
CONF
chmod 0600 /etc/slurm/slurmdbd.conf

pgrep -x slurmdbd >/dev/null || slurmdbd
for _ in $(seq 60); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
sacctmgr -i add cluster trainyard >/dev/null 2>&1 || true
# -c: a cold start. This cluster's only state is its own test jobs, and a recovered state would
# keep the gpu nodes in whatever state they were saved in.
pgrep -x slurmctld >/dev/null || slurmctld -c
for _ in $(seq 60); do scontrol ping 2>/dev/null | grep -q "is UP" && break; sleep 0.5; done
host_slurmd_running() {  # a slurmd in this machine's own network namespace (not a node's)
  local pid
  for pid in $(pgrep -x slurmd); do
    [ "$(readlink "/proc/$pid/ns/net")" = "$(readlink /proc/self/ns/net)" ] && return 0
  done
  return 1
}
host_slurmd_running || slurmd
for i in $(seq "$NODES"); do ty_node_running "$i" || ty_node_start "$i"; done
wanted="$HOST"; [ "$NODES" -gt 0 ] && wanted="$HOST,node[1-$NODES]"
for _ in $(seq 120); do
  states=$(sinfo -h -N -n "$wanted" -o %T 2>/dev/null || true)
  [ -n "$states" ] && ! echo "$states" | grep -qvE "^(idle|mix|alloc)" && break
  sleep 0.5
done
scontrol update nodename="$wanted" state=resume >/dev/null 2>&1 || true
sinfo
bad=$(sinfo -h -N -n "$wanted" -o "%N %T" | grep -vE " (idle|mix|alloc)" || true)
if [ -n "$bad" ]; then
  echo "slurm-up: not up: $bad; see $LOGS" >&2; tail -n 20 "$LOGS"/*.log >&2; exit 1
fi
if [ "$NODES" -gt 0 ]; then
  echo "slurm-up: cluster 'trainyard' is up (partition debug: $HOST; partition nodes: node[1-$NODES]; logs in $LOGS)"
else
  echo "slurm-up: cluster 'trainyard' is up (partition debug: $HOST; logs in $LOGS)"
fi
