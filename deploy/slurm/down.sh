#!/usr/bin/env bash
# Stop the local cluster deploy/slurm/up.sh started: jobs, then slurmd, slurmctld, slurmdbd, MariaDB.
set -uo pipefail
[ "$(id -u)" = 0 ] || { echo "slurm-down: run as root" >&2; exit 1; }
scancel --full --state=PENDING,RUNNING,SUSPENDED "--user=$(id -un)" 2>/dev/null || true
for daemon in slurmd slurmctld slurmdbd; do
  pkill -x "$daemon" 2>/dev/null || true
done
running() { for daemon in slurmd slurmctld slurmdbd; do pgrep -x "$daemon" >/dev/null && return 0; done; return 1; }
for _ in $(seq 40); do running || break; sleep 0.25; done
for daemon in slurmd slurmctld slurmdbd slurmstepd; do pkill -9 -x "$daemon" 2>/dev/null || true; done
mariadb-admin shutdown 2>/dev/null || true
echo "slurm-down: stopped"
