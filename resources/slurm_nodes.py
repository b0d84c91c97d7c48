"""The nodes under a SLURM job: which are alive, which were lost, and how a lost node ends a run.

    states = node_states(["node1", "node2"])          # {"node1": NodeState(...), ...} from scontrol
    lost = lost_nodes(["node1", "node2"])             # {"node2": "slurmd at 10.77.0.12:6818 refused ..."}
    ending = node_lost_ending(...)                    # the run's ending.json for a lost node

A multi-node job whose node is lost (every process on it killed, its link down, the machine gone)
looks, to the ranks that survive, like a peer that closed its connection or stopped answering: they
can name neither the host nor the cause. The launcher can, because it sees the cluster:

- SLURM's own view: ``scontrol show node`` says DOWN, NOT_RESPONDING or FAIL for the node (slurmctld
  pings every node; after SlurmdTimeout without an answer the node is DOWN and its job NODE_FAIL);
- a direct look: the node's slurmd does not accept a connection on its address and port
  (``slurmd_answers``), which is immediate when the node's processes were killed and a bounded wait
  (``PROBE_TIMEOUT_S``) when its link is down.

Either is evidence; both are recorded. While the job runs, ``NodeWatch`` knocks on slurmd only once
its ``suspect`` says a rank has ended (a killed node's peers see their connection close and end
first); a cut link with every rank still waiting is seen through SLURM's state. ``lost_nodes`` is
asked again about a job that ended without completing, so a healthy cluster costs one connection
per node of a failed multi-node job.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ops.publish.durable import iso_time
from resources.slurm_commands import SlurmError, parse_records

PROBE_TIMEOUT_S = 3.0
"""How long a slurmd may take to accept a connection before it counts as not answering."""
LOST_STATES = ("DOWN", "NOT_RESPONDING", "FAIL", "FAILING", "NO_RESPOND")


@dataclass(frozen=True)
class NodeState:
    name: str
    address: str
    state: str
    """SLURM's state flags, e.g. "IDLE", "ALLOCATED+DRAIN", "DOWN+NOT_RESPONDING"."""
    reason: str = ""

    @property
    def flags(self) -> set[str]:
        return set(re.split(r"[+*]", self.state.upper())) - {""}

    @property
    def lost(self) -> bool:
        return bool(self.flags & set(LOST_STATES)) or self.state.endswith("*")

    @property
    def draining(self) -> bool:
        return bool(self.flags & {"DRAIN", "DRAINING", "DRAINED"})


def node_states(names: Sequence[str], *, run: Callable[..., str]) -> dict[str, NodeState]:
    """SLURM's view of ``names`` (``scontrol show node -o``); a name SLURM does not know is left out."""
    if not names:
        return {}
    try:
        records = parse_records(run("scontrol", "show", "node", "-o", ",".join(names)))
    except SlurmError as error:
        if "not found" not in str(error):
            raise
        # One unknown name fails the whole query: ask for each, so the known ones still answer.
        if len(names) == 1:
            return {}
        return {name: state for one in names for name, state in node_states([one], run=run).items()}
    return {record["NodeName"]: NodeState(record["NodeName"], record.get("NodeAddr", record["NodeName"]),
                                          record.get("State", ""), record.get("Reason", ""))
            for record in records if record.get("NodeName") in names}


def slurmd_port(run: Callable[..., str]) -> int:
    """The cluster's SlurmdPort (``scontrol show config``); 6818, SLURM's default, when it says none."""
    for line in run("scontrol", "show", "config").splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "SlurmdPort" and value.strip().isdigit():
            return int(value.strip())
    return 6818


def config_seconds(run: Callable[..., str], key: str, default: float) -> float:
    """A duration of ``scontrol show config`` (SlurmdTimeout, MessageTimeout), in seconds."""
    for line in run("scontrol", "show", "config").splitlines():
        name, _, value = line.partition("=")
        if name.strip() == key:
            match = re.match(r"\s*([0-9]+)", value)
            if match:
                return float(match.group(1))
    return default


def node_loss_bound_s(run: Callable[..., str], *, grace_s: float, every_s: float = 2.0) -> float:
    """How long after a node is lost its job has ended, at most. slurmctld pings every node each
    SlurmdTimeout / 3 s, a ping fails after MessageTimeout, and a node silent for SlurmdTimeout is set
    DOWN: so SLURM reports it within 4/3 SlurmdTimeout + MessageTimeout; the launcher sees that
    within two polls and cancels the job ``grace_s`` later (``NodeWatch``)."""
    slurmd_timeout = config_seconds(run, "SlurmdTimeout", 300.0)
    return slurmd_timeout * 4 / 3 + config_seconds(run, "MessageTimeout", 10.0) + 2 * every_s + grace_s


def slurmd_answers(address: str, port: int, *, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the node's slurmd accepts a connection; else what went wrong, as evidence."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return f"slurmd at {address}:{port} refused the connection (no slurmd runs there)"
    except TimeoutError:
        return f"slurmd at {address}:{port} did not answer within {timeout_s:g} s (the node or its link is down)"
    except OSError as error:
        return f"slurmd at {address}:{port} unreachable: {error.strerror or error}"


def lost_nodes(names: Sequence[str], *, run: Callable[..., str], port: int | None = None,
               probe: Callable[[str, int], str | None] = slurmd_answers) -> dict[str, str]:
    """The nodes of ``names`` that are lost, each with the evidence: SLURM's state, else the probe."""
    states = node_states(names, run=run)
    port = slurmd_port(run) if port is None else port
    lost = {}
    for name in names:
        state = states.get(name)
        if state is not None and state.lost:
            lost[name] = f"SLURM says {state.state}" + (f" ({state.reason})" if state.reason else "")
            continue
        failed = probe(state.address if state is not None else name, port)
        if failed is not None:
            lost[name] = failed
    return lost


class NodeWatch:
    """While a multi-node job runs: the first time each of its nodes was seen lost, and why.

    Lost is what ``lost_nodes`` says: SLURM reports the node down or not responding, or its slurmd
    refuses or does not answer a connection. The probe sees a dead node within one poll; SLURM only
    after SlurmdTimeout. It runs only while ``suspect()`` says there is cause (the launcher: a rank of
    the job has ended), so that a healthy job does not knock on every slurmd every poll (slurmd logs
    each bare connection as an error). ``overdue`` names a node lost for longer than ``grace_s``: the launcher then
    cancels the job, so a run whose ranks wait on a lost peer ends within ``node_loss_bound_s`` even
    when the collective timeout is longer. The grace lets a node that missed one ping or one probe
    (a busy slurmd) answer again before the job is given up."""

    def __init__(self, nodes: Sequence[str], *, grace_s: float, run: Callable[..., str],
                 every_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 probe: Callable[[str, int], str | None] = slurmd_answers,
                 suspect: Callable[[], bool] | None = None) -> None:
        self.nodes, self.grace_s, self.run, self.every_s, self.clock = list(nodes), grace_s, run, every_s, clock
        self.probe, self.suspect = probe, suspect
        self.seen: dict[str, float] = {}
        self.evidence: dict[str, str] = {}
        self.started = clock()
        self._last = self.started - every_s
        self._port: int | None = None

    def check(self) -> list[str]:
        """The nodes lost for longer than the grace (empty while none is); looks every_s at most."""
        now = self.clock()
        if now - self._last < self.every_s:
            return self.overdue(now)
        self._last = now
        if self._port is None:
            self._port = slurmd_port(self.run)
        probing = self.suspect is None or self.suspect()
        lost = lost_nodes(self.nodes, run=self.run, port=self._port,
                          probe=self.probe if probing else lambda address, port: None)
        for name in [name for name in self.seen if name not in lost]:  # it answered again within the grace
            del self.seen[name]
            self.evidence.pop(name, None)
        for name, why in lost.items():
            self.seen.setdefault(name, now)
            self.evidence.setdefault(name, why)
        return self.overdue(now)

    def overdue(self, now: float) -> list[str]:
        return [name for name, since in self.seen.items() if now - since > self.grace_s]


def ranks_on(hosts: Mapping[int, str], lost: Sequence[str]) -> list[int]:
    """The ranks that ran on the lost hosts, from the run's hosts.json (trainer/observe/host.py)."""
    return sorted(rank for rank, host in hosts.items() if host in lost)


def collective_timeout_suspects(ending: Mapping[str, Any], hosts: Mapping[int, str],
                                late: Mapping[int, Mapping[str, Any]] | None = None) -> dict[str, str]:
    """The hosts a multi-node ``collective_timeout`` ending points at, each with the evidence: those
    none of whose ranks timed out themselves (the peers the others waited on). {} for another class,
    a one-host run, no rank recorded as waiting, or ranks whose hosts are unknown.

    ``late``: the ranks' own records (ranks/rank_*.json) read again after the whole job ended. The
    ending is written by the first node's supervisor as soon as its ranks exit, and a healthy rank on
    another node that timed out in the same collective a moment later records its timeout after that;
    its late record clears its host. A host is held responsible only while its ranks, given every
    record the job left, never timed out: a rank waiting in the collective times out within a
    moment of its peers (the same timeout, the same collective), long before SLURM kills the job's
    other tasks, so a rank without a timeout was not waiting in it (stalled, frozen or slow)."""
    if ending.get("failure_class") != "collective_timeout" or len(set(hosts.values())) < 2:
        return {}
    views: dict[int, Mapping[str, Any]] = {}
    recorded = ending.get("ranks") if isinstance(ending.get("ranks"), Mapping) else {}
    for rank, view in recorded.items():
        try:
            views[int(rank)] = view if isinstance(view, Mapping) else {}
        except (TypeError, ValueError):
            continue  # a rank that is not a number: a record edited by hand says nothing
    for rank, record in (late or {}).items():
        if isinstance(record, Mapping) and record.get("failure_class"):
            views[int(rank)] = record
    waited = sorted(rank for rank, view in views.items() if view.get("failure_class") == "collective_timeout")
    if not waited or any(rank not in hosts for rank in waited):
        return {}
    waiting_hosts = sorted({hosts[rank] for rank in waited})
    suspects = {}
    for host in dict.fromkeys(hosts.values()):
        ranks = sorted(rank for rank, name in hosts.items() if name == host)
        if host not in waiting_hosts:
            suspects[host] = (f"collective_timeout: rank(s) {', '.join(map(str, waited))} on "
                              f"{', '.join(waiting_hosts)} timed out waiting; rank(s) {', '.join(map(str, ranks))} "
                              f"on {host} recorded no timeout of their own, in any record the job left")
    return suspects


def node_lost_ending(*, job_id: str, job_state: str, lost: Mapping[str, str], ranks: Sequence[int], step: int | None,
                     attempt: int, ranks_view: Mapping[str, Any] | None, decision: str, why: str,
                     detected_after_s: float | None) -> dict[str, Any]:
    """The run's ending for a lost node: the class, the host, its ranks and the step, with the
    survivors' first error kept as they recorded it."""
    hosts = ", ".join(lost)
    evidence = "; ".join(f"{name}: {what}" for name, what in lost.items())
    first_error = (ranks_view or {}).get("error")
    return {"failure_class": "node_lost", "attempt": attempt, "rank": ranks[0] if ranks else -1,
            "ranks": list(ranks), "host": hosts, "lost_nodes": list(lost), "step": step, "sample_ids": [],
            "job_state": job_state, "exit": f"SLURM {job_state}",
            "error": f"node {hosts} was lost under SLURM job {job_id} at step {step if step is not None else '?'} "
                     f"(ranks {', '.join(map(str, ranks)) or 'unknown'} ran there): {evidence}",
            "first_error": first_error, "evidence": dict(lost), "detected_after_s": detected_after_s,
            # When the attempt ended: the survivors' record's time, else now (the launcher saw the job end).
            "ended_at": (ranks_view or {}).get("ended_at") or iso_time(time.time()),
            "decision": decision, "why": why, "log_tail": (ranks_view or {}).get("log_tail", []),
            "ranks_view": dict(ranks_view) if ranks_view else None}
