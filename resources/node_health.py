"""Suspect nodes: drained in SLURM on evidence, tested before they return to service.

    record_failure("node2", failure_class="node_lost", run_id=..., job_id=..., step=4, evidence=...)
        # the node's history gains the failure; at DRAIN_THRESHOLD such failures within the window
        # (since its last passed check) the node is drained: scontrol update State=DRAIN Reason=...
    check_node("node2")          # a health job pinned to the node and a healthy peer; RESUME only if all pass
    node_report()                # every node: SLURM's state and reason, and its history

The history is one JSON line per event in ``$TRAINYARD_HOME/nodes/history.jsonl`` (``NodeHistory``):

    {"at", "node", "kind": "failure", "failure_class", "run_id", "job_id", "step", "evidence"}
    {"at", "node", "kind": "drain", "reason", "runs", "classes"}
    {"at", "node", "kind": "check", "passed", "peer", "figures", "floors", "failed", "job"}
    {"at", "node", "kind": "resume" | "kept_drained", "why"}

The rule (``DrainRule``): ``threshold`` failures of a suspect class (``node_lost``,
``collective_timeout``) on the same host within ``window_h`` hours, counted since the node last
passed a check, drain it. The reason names the runs and the classes, so ``sinfo -R`` says why.

The check (``check_node``), on a node that is drained or in service, never on one that is down or
still draining (jobs run there) or unknown:

1. a maintenance reservation on the node and a healthy peer (so nothing else lands on them), and
   the node resumed inside it when it was drained;
2. ``srun`` of ops/drills/node_check.py on both: compute, memory, disk write and a gloo all_reduce
   between them, each against its floor (``FLOORS``; TRAINYARD_NODE_FLOOR_<NAME> or ``floors=``);
3. every part passes: the node stays in service (``resume``); any fails, or the job itself fails:
   it is drained again with a reason naming the failed part and its figure (``kept_drained``);
4. the reservation is deleted, whatever happened; the result joins the node's history.

A drained node never receives a training stage: SLURM does not place jobs on it, and the SLURM
launcher does not count it when it checks that a stage fits (resources/slurm.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, UTC
from pathlib import Path
from typing import Any

from ops.publish import paths
from ops.publish.durable import iso_time
from resources.slurm_commands import SlurmError, run_slurm
from resources.slurm_nodes import NodeState, node_states

SUSPECT_CLASSES = ("node_lost", "collective_timeout")
FLOORS = {"compute_gflops": 1.0, "memory_gbps": 0.5, "disk_write_mbps": 10.0, "allreduce_gbps": 0.01}
"""The least each part of the check must measure. Conservative for one CPU of a laptop-class core;
a slowed or broken node falls far below (a link shaped to 20 Mbit/s all-reduces at ~0.002 GB/s)."""
CHECK_TIMEOUT_S = 180.0
_NODE_NAME = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)


class NodeCheckError(ValueError):
    """A check that cannot run (unknown node, down, still draining, no healthy peer): the message says why."""


@dataclass(frozen=True)
class DrainRule:
    threshold: int = 2
    window_h: float = 24.0

    @classmethod
    def from_env(cls) -> DrainRule:
        env = os.environ
        return cls(threshold=int(env.get("TRAINYARD_NODE_DRAIN_THRESHOLD", cls.threshold)),
                   window_h=float(env.get("TRAINYARD_NODE_DRAIN_WINDOW_H", cls.window_h)))


class NodeHistory:
    """Every node's events, one JSON line each (module docstring)."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else paths.trainyard_home() / "nodes" / "history.jsonl"

    def append(self, event: Mapping[str, Any]) -> dict[str, Any]:
        record = {"at": iso_time(time.time()), **event}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as handle:  # one write per line: O_APPEND keeps concurrent lines whole
            handle.write(json.dumps(record, sort_keys=True) + "\n")
        return record

    def events(self, node: str | None = None) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        events = []
        for number, line in enumerate(self.path.read_text().splitlines(), start=1):
            try:
                event = json.loads(line)
            except ValueError:
                raise ValueError(f"{self.path}: line {number} is not JSON: the node history was edited or cut") from None
            if node is None or event.get("node") == node:
                events.append(event)
        return events

    def suspect_failures(self, node: str, rule: DrainRule, *, now: datetime | None = None) -> list[dict[str, Any]]:
        """The node's failures of a suspect class within the window, since its last passed check."""
        now = now or datetime.now(UTC)
        since = now - timedelta(hours=rule.window_h)
        failures: list[dict[str, Any]] = []
        for event in self.events(node):
            if event.get("kind") == "check" and event.get("passed"):
                failures = []  # a passed check clears the slate
            elif event.get("kind") == "failure" and event.get("failure_class") in SUSPECT_CLASSES \
                    and datetime.fromisoformat(event["at"]) >= since:
                failures.append(event)
        return failures


def record_failure(node: str, *, failure_class: str, run_id: str, job_id: str, step: int | None, evidence: str,
                   history: NodeHistory | None = None, rule: DrainRule | None = None,
                   run: Callable[..., str] = run_slurm) -> dict[str, Any] | None:
    """Add a failure to the node's history; drain the node when the rule says so. The drain event,
    or None when the node stays in service (or was drained already)."""
    history = history or NodeHistory()
    rule = rule or DrainRule.from_env()
    history.append({"node": node, "kind": "failure", "failure_class": failure_class, "run_id": run_id,
                    "job_id": job_id, "step": step, "evidence": evidence})
    failures = history.suspect_failures(node, rule)
    if len(failures) < rule.threshold:
        return None
    state = node_states([node], run=run).get(node)
    if state is not None and state.draining:
        return None
    runs = list(dict.fromkeys(event["run_id"] for event in failures))
    classes = sorted({event["failure_class"] for event in failures})
    reason = (f"trainyard: {len(failures)} x {'/'.join(classes)} within {rule.window_h:g} h (runs {', '.join(runs)}); "
              f"trainyard nodes check {node} to return it")
    drain(node, reason, run=run)
    return history.append({"node": node, "kind": "drain", "reason": reason, "runs": runs, "classes": classes,
                           "failures": len(failures)})


def drain(node: str, reason: str, *, run: Callable[..., str] = run_slurm) -> None:
    # scontrol takes the reason as one argument; a line end in it would end SLURM's record line.
    reason = " ".join(reason.split())[:200]
    run("scontrol", "update", f"nodename={node}", "state=DRAIN", f"reason={reason}")


# ---------------------------------------------------------------------------------------------
# The check


@dataclass
class CheckResult:
    node: str
    peer: str
    passed: bool
    figures: dict[str, float]
    floors: dict[str, float]
    failed: dict[str, str]
    """Each failed part: why (its figure against its floor, or the error that stopped it)."""
    state_after: str
    job_output: str = ""


def floors_from_env(overrides: Mapping[str, float] | None = None) -> dict[str, float]:
    floors = dict(FLOORS)
    for name in FLOORS:
        value = os.environ.get(f"TRAINYARD_NODE_FLOOR_{name.upper()}")
        if value:
            floors[name] = float(value)
    for name, value in (overrides or {}).items():
        if name not in FLOORS:
            raise NodeCheckError(f"unknown floor {name!r}: the check measures {', '.join(FLOORS)}")
        floors[name] = float(value)
    return floors


def _partition_nodes(partition: str, run: Callable[..., str]) -> list[str]:
    listed = run("sinfo", "-h", "-p", partition, "-o", "%N").strip()
    return run("scontrol", "show", "hostnames", listed).split() if listed else []


def _usable_for_check(state: NodeState) -> str | None:
    """Why the node cannot be checked now, or None."""
    if state.flags & {"POWERED_DOWN", "POWERING_DOWN", "POWERING_UP", "CLOUD"}:
        return (f"node {state.name} is a cloud node that is not booted ({state.state}): it has nothing to check "
                f"until SLURM powers it up for a job")
    if state.lost:
        return (f"node {state.name} is down ({state.state}{': ' + state.reason if state.reason else ''}): bring its "
                f"slurmd back (or the machine) first; a check needs a node that answers")
    if state.draining and state.flags & {"ALLOCATED", "MIXED", "COMPLETING"}:
        return (f"node {state.name} is still draining ({state.state}): jobs run there; check it once they ended "
                f"and it is drained")
    return None


def check_node(node: str, *, partition: str = "", peer: str = "", floors: Mapping[str, float] | None = None,
               history: NodeHistory | None = None, run: Callable[..., str] = run_slurm,
               python: str = "", timeout_s: float = CHECK_TIMEOUT_S, size_mb: int = 16) -> CheckResult:
    """The health check of one node (module docstring). NodeCheckError when it cannot run."""
    history = history or NodeHistory()
    floors = floors_from_env(floors)
    if not isinstance(node, str) or not _NODE_NAME.fullmatch(node):
        raise NodeCheckError(f"{node!r} is not a node name")
    states = node_states([node], run=run)
    if node not in states:
        known = ", ".join(sorted(node_states(_all_nodes(run), run=run))) or "none"
        raise NodeCheckError(f"unknown node {node!r}: this cluster's nodes are {known}")
    state = states[node]
    if (why := _usable_for_check(state)) is not None:
        raise NodeCheckError(why)
    partition = partition or _partition_of(node, run)
    peer = peer or _healthy_peer(node, partition, run)
    peer_state = node_states([peer], run=run).get(peer)
    if peer_state is None or peer_state.lost or peer_state.draining or peer == node:
        raise NodeCheckError(f"peer {peer!r} is not a healthy node other than {node} (its state: "
                             f"{peer_state.state if peer_state else 'unknown'})")
    was_drained = state.draining
    reservation = f"trainyard-check-{node}-{uuid.uuid4().hex[:8]}"
    out = paths.trainyard_home() / "nodes" / "checks" / reservation
    out.mkdir(parents=True, exist_ok=True)
    run("scontrol", "create", "reservation", f"ReservationName={reservation}", f"Nodes={node},{peer}",
        "StartTime=now", "Duration=00:10:00", "Users=root", "Flags=MAINT,IGNORE_JOBS")
    output, figures, failed, passed = "", {}, {}, False
    try:
        if was_drained:
            run("scontrol", "update", f"nodename={node}", "state=RESUME")
        try:
            output, figures, failed = _run_check_job(node, peer, partition, reservation, out, python=python,
                                                     timeout_s=timeout_s, size_mb=size_mb)
        except BaseException as error:  # the check did not run: a node that was drained stays drained
            if was_drained:
                drain(node, f"trainyard check did not run: {type(error).__name__}: {error}", run=run)
            raise
        for name, floor in floors.items():
            if name in failed:
                continue
            value = figures.get(name)
            if value is None:
                failed[name] = "not measured"
            elif value < floor:
                failed[name] = f"{value:g} < floor {floor:g}"
        passed = not failed
        if not passed:
            drain(node, "trainyard check failed: " + "; ".join(f"{name} {why}" for name, why in failed.items()), run=run)
    finally:
        try:
            run("scontrol", "delete", f"ReservationName={reservation}")
        except SlurmError as error:  # the check's result stands; the reservation ends by itself (Duration)
            print(f"trainyard nodes check: could not delete reservation {reservation}: {error}", file=sys.stderr)
    history.append({"node": node, "kind": "check", "passed": passed, "peer": peer, "figures": figures,
                    "floors": floors, "failed": failed, "reservation": reservation})
    history.append({"node": node, "kind": "resume" if passed else "kept_drained",
                    "why": "every part passed its floor" if passed else "; ".join(f"{k} {v}" for k, v in failed.items())})
    after = node_states([node], run=run)[node].state
    return CheckResult(node=node, peer=peer, passed=passed, figures=figures, floors=floors, failed=failed,
                       state_after=after, job_output=output)


def _run_check_job(node: str, peer: str, partition: str, reservation: str, out: Path, *, python: str,
                   timeout_s: float, size_mb: int) -> tuple[str, dict[str, float], dict[str, str]]:
    """srun the worker on the node and its peer; (its output, the node's figures, failed parts)."""
    master = sorted([node, peer])[0]  # srun gives task 0 to the first node of the sorted list
    port = 29700 + int(uuid.uuid4().int % 200)
    command = ["srun", f"--reservation={reservation}", "-N2", "--ntasks-per-node=1", f"--nodelist={node},{peer}",
               "--time=00:05:00", "--kill-on-bad-exit=1", f"--chdir={paths.REPO_ROOT}"]
    command += [f"--partition={partition}"] if partition else []
    command += [python or sys.executable, "-m", "ops.drills.node_check", "--out", str(out), "--master", master,
                "--port", str(port), "--size-mb", str(size_mb)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        output = (done.stdout + done.stderr)[-4000:]
    except subprocess.TimeoutExpired as error:
        subprocess.run(["scancel", f"--reservation={reservation}"], capture_output=True, timeout=30)
        return f"{error}", {}, {"job": f"the check job did not end within {timeout_s:g} s (cancelled)"}
    try:
        result = json.loads((out / f"{node}.json").read_text())
    except (OSError, ValueError):
        return output, {}, {"job": f"the check job wrote no result for {node} (exit {done.returncode}): "
                                   f"{output.strip().splitlines()[-1] if output.strip() else 'no output'}"}
    figures = {name: float(result[name]) for name in FLOORS if isinstance(result.get(name), (int, float))}
    failed = {name: f"failed: {why}" for name, why in (result.get("errors") or {}).items()}
    return output, figures, failed


def _all_nodes(run: Callable[..., str]) -> list[str]:
    return list(dict.fromkeys(line.split()[0] for line in run("sinfo", "-h", "-N", "-o", "%N").splitlines()
                              if line.strip()))


def _partition_of(node: str, run: Callable[..., str]) -> str:
    partitions = run("sinfo", "-h", "-N", "-n", node, "-o", "%P").split()
    return partitions[0].rstrip("*") if partitions else ""


def _healthy_peer(node: str, partition: str, run: Callable[..., str]) -> str:
    candidates = [name for name in _partition_nodes(partition, run) if name != node]
    for name, state in node_states(candidates, run=run).items():
        if not state.lost and not state.draining:
            return name
    raise NodeCheckError(f"no healthy peer for {node} in partition {partition or '(default)'}: the check's collective "
                         f"needs a second node that is up and in service")


# ---------------------------------------------------------------------------------------------
# The list


def node_report(*, history: NodeHistory | None = None, run: Callable[..., str] = run_slurm,
                nodes: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every node: SLURM's state and reason, and its history (failures, drains, checks)."""
    history = history or NodeHistory()
    names = list(nodes) if nodes is not None else _all_nodes(run)
    states = node_states(names, run=run)
    events = history.events()
    report = []
    for name in names:
        state = states.get(name)
        mine = [event for event in events if event.get("node") == name]
        checks = [event for event in mine if event.get("kind") == "check"]
        report.append({"node": name, "state": state.state if state else "unknown",
                       "reason": state.reason if state else "", "draining": bool(state and state.draining),
                       "failures": [event for event in mine if event.get("kind") == "failure"],
                       "drains": [event for event in mine if event.get("kind") == "drain"],
                       "last_check": checks[-1] if checks else None})
    return report
