#!/usr/bin/env bash
# Stop the local cluster deploy/slurm/up.sh started: jobs, then slurmd (this machine's and every
# namespace node's), slurmctld, slurmdbd, MariaDB; then the nodes' namespaces, bridge, cpusets and
# /etc/hosts block (deploy/slurm/nodes.sh).
set -uo pipefail
[ "$(id -u)" = 0 ] || { echo "slurm-down: run as root" >&2; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=deploy/slurm/nodes.sh
. "$here/nodes.sh"
scancel --full --state=PENDING,RUNNING,SUSPENDED "--user=$(id -un)" 2>/dev/null || true
for daemon in slurmd slurmctld slurmdbd; do
  pkill -x "$daemon" 2>/dev/null || true
done
running() { for daemon in slurmd slurmctld slurmdbd; do pgrep -x "$daemon" >/dev/null && return 0; done; return 1; }
for _ in $(seq 40); do running || break; sleep 0.25; done
for daemon in slurmd slurmctld slurmdbd slurmstepd; do pkill -9 -x "$daemon" 2>/dev/null || true; done
ty_network_down
mariadb-admin shutdown 2>/dev/null || true
echo "slurm-down: stopped"
