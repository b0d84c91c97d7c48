# Compute nodes as Linux namespaces on this one machine, for deploy/slurm/up.sh and down.sh (sourced).
#
# Node i (node1 .. nodeN) is:
#   - a network namespace  ty-node<i>  with its own address 10.77.0.<10+i> on eth0, one end of a veth
#     pair whose other end (ty-node<i>-h) sits on the bridge tybr0 (10.77.0.1, this machine's side,
#     where slurmctld listens); nothing else is routed: the nodes reach each other and the
#     controller over the bridge only;
#   - a UTS namespace (unshare --uts) whose hostname is node<i>, so jobs see the node's name;
#   - a cpuset cgroup holding CPU (i-1) mod nproc, so each node's figures are one core's;
#   - its own slurmd (-N node<i>), with spool, pid and log files through %n in slurm.conf.
# All nodes share this machine's filesystem: it stands in for the NFS or Lustre mount of a real
# cluster. /etc/hosts gets one marked block naming the nodes (what a cluster's DNS does).
#
# node_lose_processes i / node_link i down|up / node_slow i RATE: the faults the tests inject.

TY_BRIDGE=tybr0
TY_SUBNET=10.77.0
TY_CTL_ADDR=$TY_SUBNET.1
TY_HOSTS_BEGIN="# trainyard-slurm nodes: begin (deploy/slurm/nodes.sh)"
TY_HOSTS_END="# trainyard-slurm nodes: end"

ty_node_addr() { echo "$TY_SUBNET.$((10 + $1))"; }
ty_netns() { echo "ty-node$1"; }

# The cpuset cgroup of node i (cgroup v1 here, v2 where that is the only hierarchy).
ty_cpuset_dir() {
  if [ -d /sys/fs/cgroup/cpuset ] && [ -f /sys/fs/cgroup/cpuset/cpuset.cpus ]; then
    echo "/sys/fs/cgroup/cpuset/trainyard/node$1"
  else
    echo "/sys/fs/cgroup/trainyard/node$1"
  fi
}

ty_cpuset_up() {  # i cpu
  local dir parent
  dir=$(ty_cpuset_dir "$1"); parent=$(dirname "$dir")
  mkdir -p "$parent"
  if [ -f /sys/fs/cgroup/cgroup.subtree_control ]; then  # v2: enable the cpuset controller downwards
    echo +cpuset > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
    echo +cpuset > "$parent/cgroup.subtree_control" 2>/dev/null || true
  else
    cat "$(dirname "$parent")/cpuset.cpus" > "$parent/cpuset.cpus"
    cat "$(dirname "$parent")/cpuset.mems" > "$parent/cpuset.mems"
  fi
  mkdir -p "$dir"
  echo "$2" > "$dir/cpuset.cpus"
  [ -f "$dir/cpuset.mems" ] && { cat "$parent/cpuset.mems" > "$dir/cpuset.mems" 2>/dev/null || echo 0 > "$dir/cpuset.mems"; }
  return 0
}

ty_network_up() {  # nodes
  local nodes=$1 i ns
  if ! ip link show "$TY_BRIDGE" >/dev/null 2>&1; then
    if ip -o addr show | grep -q " $TY_SUBNET\."; then
      echo "slurm-up: $TY_SUBNET.0/24 is already in use on this machine; the nodes' bridge needs it" >&2; return 1
    fi
    ip link add "$TY_BRIDGE" type bridge
    ip addr add "$TY_CTL_ADDR/24" dev "$TY_BRIDGE"
  fi
  ip link set "$TY_BRIDGE" up
  for i in $(seq "$nodes"); do
    ns=$(ty_netns "$i")
    ip netns list | grep -qx "$ns\( .*\)\?" || ip netns add "$ns"
    if ! ip link show "$ns-h" >/dev/null 2>&1; then
      ip link add "$ns-h" type veth peer name "$ns-c"
      ip link set "$ns-c" netns "$ns"
      ip -n "$ns" link set "$ns-c" name eth0
      ip -n "$ns" addr add "$(ty_node_addr "$i")/24" dev eth0
    fi
    ip link set "$ns-h" master "$TY_BRIDGE" up
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
  ty_hosts_write "$nodes"
}

ty_hosts_write() {  # nodes: the marked block in /etc/hosts (rewritten whole, never appended twice)
  local nodes=$1 i wanted
  wanted=$(awk -v begin="$TY_HOSTS_BEGIN" -v end="$TY_HOSTS_END" \
    '$0 == begin {skip = 1} !skip {print} $0 == end {skip = 0}' /etc/hosts)
  if [ "$nodes" -gt 0 ]; then
    wanted+=$'\n'"$TY_HOSTS_BEGIN"
    for i in $(seq "$nodes"); do wanted+=$'\n'"$(ty_node_addr "$i") node$i"; done
    wanted+=$'\n'"$TY_HOSTS_END"
  fi
  [ "$wanted" = "$(cat /etc/hosts)" ] && return 0
  printf '%s\n' "$wanted" > /etc/hosts.trainyard
  # Only a whole copy replaces the file (a full disk leaves the old one, not a cut one); written
  # through, not renamed over, since /etc/hosts may be a bind mount (containers).
  if [ "$(cat /etc/hosts.trainyard 2>/dev/null)" != "$wanted" ]; then
    echo "slurm-up: could not write the new /etc/hosts (disk full?); left as it was" >&2
    rm -f /etc/hosts.trainyard; return 1
  fi
  cat /etc/hosts.trainyard > /etc/hosts
  rm -f /etc/hosts.trainyard
}

ty_node_start() {  # i: slurmd in the node's namespaces and cpuset
  local i=$1 ns dir cpus
  ns=$(ty_netns "$i"); dir=$(ty_cpuset_dir "$i")
  cpus=$(nproc --all)
  ty_cpuset_up "$i" "$(( (i - 1) % cpus ))"
  # The shell joins the cpuset, then becomes slurmd: every job step it starts inherits the cpuset and
  # both namespaces. nsenter rather than `ip netns exec`, which would remount /sys for the namespace
  # and hide the cgroup hierarchy from the node.
  nsenter --net="/run/netns/$ns" unshare --uts \
    sh -c "echo \$\$ > '$dir/cgroup.procs' && hostname node$i && exec slurmd -N node$i"
}

ty_node_pids() {  # i: every process in the node's network namespace
  ip netns pids "$(ty_netns "$1")" 2>/dev/null
}

ty_node_running() {  # i: its slurmd is alive
  local pid
  for pid in $(ty_node_pids "$1"); do
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ] && return 0
  done
  return 1
}

ty_node_restart_slurmd() {  # i: slurmd stopped (SIGTERM, its job steps' processes left alone) and started again
  local pid
  for pid in $(ty_node_pids "$1"); do
    # || true: a slurmd that exited between the listing and the kill is what we wanted (set -e callers)
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = slurmd ]; then kill -TERM "$pid" 2>/dev/null || true; fi
  done
  for _ in $(seq 1 50); do ty_node_running "$1" || break; sleep 0.2; done
  ty_node_running "$1" || ty_node_start "$1"
}

ty_node_lose_processes() {  # i: SIGKILL to everything in the node (slurmd, slurmstepd, the ranks)
  local pid
  for pid in $(ty_node_pids "$1"); do kill -9 "$pid" 2>/dev/null || true; done
}

ty_node_link() {  # i up|down: the node's cable (a partition: its processes keep running)
  ip link set "$(ty_netns "$1")-h" "$2"
}

ty_network_down() {
  local ns i
  for ns in $(ip netns list | awk '{print $1}' | grep -E '^ty-node[0-9]+$'); do
    i=${ns#ty-node}
    ty_node_lose_processes "$i"
    ip link del "$ns-h" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
    rmdir "$(ty_cpuset_dir "$i")" 2>/dev/null || true
  done
  ip link del "$TY_BRIDGE" 2>/dev/null || true
  rmdir "$(dirname "$(ty_cpuset_dir 1)")" 2>/dev/null || true
  ty_hosts_write 0
}
