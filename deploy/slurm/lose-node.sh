#!/usr/bin/env bash
# Lose, or bring back, one node of the local multi-node lab cluster (deploy/slurm/nodes.sh): the
# fault_drill's node_lost case runs this (FaultDrillConfig.node_fault_command / node_restore_command),
# and the multi-node tests use it too. As root.
#
#   lose-node.sh kill NODE      SIGKILL every process in the node's namespace, slurmd included
#   lose-node.sh link NODE      the node's link down: a partition, its processes keep running
#   lose-node.sh restore NODE   link up, slurmd running, SLURM sees it respond again
#   lose-node.sh is-lab NODE    exit 0 when NODE is a node of this machine's lab cluster
#
# Only the lab's own nodes (node<i> with a network namespace ty-node<i>) are touched; anything else is
# refused with exit 2. On a real cluster the drill takes your own commands instead (docs/slurm.md).
set -euo pipefail

usage() { echo "usage: $0 kill|link|restore|is-lab NODE" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1 node=$2
# A node name reaches ip(8) and kill(1): only node<digits>, nothing a shell or a path could read twice.
[[ "$node" =~ ^node([0-9]{1,3})$ ]] || { echo "$0: '$node' is not a lab node name (node<i>)" >&2; exit 2; }
i=${BASH_REMATCH[1]}

# shellcheck source=deploy/slurm/nodes.sh
. "$(dirname "$0")/nodes.sh"
if [ ! -e "/run/netns/$(ty_netns "$i")" ]; then
  echo "$0: $node is not a node of this machine's lab cluster (no network namespace $(ty_netns "$i"); sudo make slurm-up NODES=<n>)" >&2
  exit 2
fi

case "$action" in
  is-lab) exit 0 ;;
  kill) ty_node_lose_processes "$i" ;;
  link) ty_node_link "$i" down ;;
  restore)
    ty_node_link "$i" up
    ty_node_running "$i" || ty_node_start "$i"
    # A node SLURM marked DOWN while it was silent returns when its slurmd registers again
    # (ReturnToService=2); one it had not yet marked needs nothing. A drained node stays drained:
    # returning it is `trainyard nodes check`'s decision, not a restore's. slurmctld may take minutes
    # to ping a DOWN node again: after 8 s without an answer, slurmd is restarted, which registers it.
    for n in $(seq 1 90); do
      if [ "$n" = 8 ] && [[ "$(scontrol show node "$node" -o 2>/dev/null || true)" == *NOT_RESPONDING* ]]; then
        ty_node_restart_slurmd "$i" || true  # the loop below still says whether the node came back
      fi
      line=$(scontrol show node "$node" -o 2>/dev/null || true)
      state=$(sed -n 's/.* State=\([^ ]*\).*/\1/p' <<<"$line")
      case "$state" in
        *NOT_RESPONDING*|"") ;;  # still silent to slurmctld
        DOWN|DOWN+*) if [[ "$state" == *DRAIN* ]]; then exit 0; fi
                     scontrol update nodename="$node" state=resume 2>/dev/null || true ;;
        *) exit 0 ;;
      esac
      sleep 1
    done
    echo "$0: $node did not respond to SLURM within 90 s: $line" >&2
    exit 1
    ;;
  *) usage ;;
esac
