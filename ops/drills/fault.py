"""The fault drill: each injection on a short 2-rank CPU run, judged against an uninterrupted one.

assets/training_faults.py runs them through the launcher; this module says what each fault is, what
must happen, and judges what did from the run's own records (attempts.jsonl, endings/,
final.json, final_params.pt, divergence.json, quarantine/bad_samples.json), never from what the
drill expected to see.

Per fault: the class the first attempt recorded, whether the run recovered or stopped as intended,
the steps lost (the failed attempt's last step less the step the next attempt resumed from), the
time to recover (from the failure's record to the next attempt's first trained step), and whether
the final parameters equal the uninterrupted run's, bit for bit (required after kill-and-resume
and preempt-and-resume on CPU).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ops.checkpoints import store
from ops.publish.paths import REPO_ROOT

STEPS = 6
CHECKPOINT_EVERY = 2
# Every run of the drill: short, checkpointed every 2 steps, every checkpoint kept (the corrupted
# one must have an older one to fall back to), no MLflow, no checkpoint mirror, final parameters dumped.
COMMON = (f"train.steps={STEPS}", f"train.checkpoint_every={CHECKPOINT_EVERY}", "stage.keep_last_k=8",
          "stage.mlflow=false", "stage.mirror=false", "train.dump_final_params=true", "train.parallelism=ddp",
          "train.retry_budget=2", "train.log_every=1")
WORLD_SIZE = 2


@dataclass(frozen=True)
class Fault:
    name: str
    overrides: tuple[str, ...]
    expected_class: str
    expected_outcome: str  # "recovered" or "stopped"
    bit_identical: bool
    """The final parameters must equal the uninterrupted run's."""
    relaunch: bool = False
    """A requeue: the drill launches the run again, as a scheduler would."""
    what: str = ""
    needs_sample: bool = False
    """The fault names a sample id: the drill fills in one the reference trained at step 3."""
    checks: tuple[str, ...] = field(default_factory=tuple)
    node_loss: str = ""
    """A node of the run's job is lost from outside once step 2 is committed: ``kill`` (every process
    on it) or ``link`` (its network cut); the drill runs the configured node fault command."""


FAULTS: tuple[Fault, ...] = (
    Fault("rank_killed", ("faults.exit_rank=1", "faults.exit_at_step=4", "faults.exit_signal=SIGKILL"),
          "rank_crash", "recovered", True, what="SIGKILL rank 1 at step 4"),
    Fault("preempted", ("faults.sigterm_at_step=3", "faults.sigterm_rank=0"), "preempted", "recovered", True,
          relaunch=True, what="SIGTERM rank 0 at step 3; requeued", checks=("requeued",)),
    Fault("nan_loss", ("faults.nan_loss_at_steps=[3]", "train.max_consecutive_nonfinite=1"), "diverged", "stopped",
          False, what="NaN loss at step 3", checks=("not_retried", "divergence_window")),
    Fault("stalled_data_fetch", ("faults.stall_rank=0", "faults.stall_at_step=3", "faults.stall_in=data",
                                 "faults.stall_s=120", "train.watchdog_s=8"),
          "hang", "recovered", True, what="rank 0 stuck 120 s in the data fetch of step 3, watchdog 8 s"),
    Fault("bad_sample", ("faults.attempt=-1",), "bad_sample", "recovered", False, needs_sample=True,
          what="a sample that makes its step raise, on every attempt", checks=("quarantined",)),
    Fault("corrupt_newest_checkpoint", ("faults.corrupt_checkpoint_at_step=4", "faults.exit_rank=0",
                                        "faults.exit_at_step=5", "faults.exit_signal=SIGKILL"),
          "rank_crash", "recovered", True, what="bit rot in the step-4 checkpoint, then SIGKILL rank 0 at step 5",
          checks=("fell_back",)),
    Fault("disk_full_in_save", ("faults.disk_full_at_step=4",), "storage_error", "recovered", True,
          what="ENOSPC on every rank in the step-4 save", checks=("fell_back",)),
    Fault("out_of_memory", ("faults.oom_at_step=3",), "out_of_memory", "stopped", False,
          what="torch.OutOfMemoryError at step 3", checks=("not_retried",)),
    Fault("killed_in_save", ("faults.exit_rank=1", "faults.exit_at_step=4", "faults.exit_in=save"),
          "rank_crash", "recovered", True, what="rank 1 dies inside the step-4 save, before its commit",
          checks=("fell_back",)),
)


# Faults that need a run across several nodes (a multi-node SLURM launcher) and a spare node to
# resume on: in the drill by default only there (assets/training_faults.py). Rank 0 waits 6 s at
# step 3 on the first attempt: the window in which the node is lost, after step 2 is committed. The
# collective timeout is longer than the launcher's node-loss bound, so that the bound ends the job.
NODE_FAULTS: tuple[Fault, ...] = (
    Fault("node_lost", ("faults.stall_rank=0", "faults.stall_at_step=3", "faults.stall_s=6",
                        "train.collective_timeout_s=600"),
          "node_lost", "recovered", True, node_loss="kill",
          what="every process on the last node of the job SIGKILLed after step 2; resumed on a spare node",
          checks=("excluded",)),
)
ALL_FAULTS: tuple[Fault, ...] = FAULTS + NODE_FAULTS


# ---- losing a node from outside (the node faults) ----

LAB_NODE_SCRIPT = REPO_ROOT / "deploy" / "slurm" / "lose-node.sh"
"""The local multi-node lab cluster's node faults (deploy/slurm/nodes.sh): the default node commands."""
# A node name from hosts.json (written by a rank) reaches a command line: a host name and nothing else.
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
NODE_COMMAND_TIMEOUT_S = 150.0  # a restore waits up to 90 s for SLURM to see the node again


def lab_cluster_present() -> bool:
    """This machine runs the local multi-node lab cluster (network namespaces ty-node<i>)."""
    return any(Path("/run/netns").glob("ty-node*"))


def node_command(template: str, node: str) -> list[str]:
    """``template`` split as a shell would (shlex) but run without one, with ``{node}`` replaced in
    each word. ValueError for a node name that is not a host name, or a template without ``{node}``."""
    if not NODE_NAME.fullmatch(node):
        raise ValueError(f"node name {node!r} is not a host name: not passed to a command")
    words = shlex.split(template)
    if not any("{node}" in word for word in words):
        raise ValueError(f"node command {template!r} does not name {{node}}")
    return [word.replace("{node}", node) for word in words]


class NodeLoss:
    """Loses a node of a drill run's job from outside and brings it back afterwards.

    A thread watches the run folder; once step 2 is committed and the ranks' hosts are recorded, it
    runs the fault command on the node of the highest rank (not rank 0's: the rendezvous stays up),
    provided SLURM gave the job that node (launch.json's placement). The restore command runs once
    the launcher has recorded the loss, or at the latest in ``finish``, which stops the watch. Empty commands: the
    lab cluster's ``lose-node.sh <how|restore> {node}``, for a node of the lab only. What went wrong
    is in ``problems``; the node and when it was lost in ``node`` and ``lost_at``.
    """

    def __init__(self, run_dir: Path, *, how: str, fault_command: str = "", restore_command: str = "",
                 stop: threading.Event | None = None, give_up_s: float = 900.0) -> None:
        self.run_dir, self.how = Path(run_dir), how
        self.fault_command = fault_command or f"bash {shlex.quote(str(LAB_NODE_SCRIPT))} {how} {{node}}"
        self.restore_command = restore_command or f"bash {shlex.quote(str(LAB_NODE_SCRIPT))} restore {{node}}"
        self.lab = not fault_command
        self.node: str | None = None
        self.lost_at: float | None = None
        self.restored = False
        self.problems: list[str] = []
        self._stop = threading.Event()
        self._outer_stop = stop
        self._give_up_s = give_up_s
        self._thread = threading.Thread(target=self._watch, name=f"node_loss:{self.run_dir.name}", daemon=True)

    def start(self) -> NodeLoss:
        self._thread.start()
        return self

    def _stopped(self) -> bool:
        return self._stop.is_set() or (self._outer_stop is not None and self._outer_stop.is_set())

    def _ready(self) -> tuple[dict[int, str], list[str]]:
        """The ranks' hosts (hosts.json) and the nodes SLURM gave the job (launch.json's placement),
        once step 2 is committed; ({}, []) before."""
        if not (store.checkpoints_dir(self.run_dir) / store.step_dir_name(CHECKPOINT_EVERY) / store.RECORD_NAME).is_file():
            return {}, []
        try:  # both written atomically: never half
            hosts = {int(rank): str(host) for rank, host in
                     json.loads((self.run_dir / "hosts.json").read_text())["ranks"].items()}
            placement = json.loads((self.run_dir / "launch.json").read_text()).get("placement") or []
            nodes = [str(node) for node in placement[-1]["nodes"]] if placement else []
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            return {}, []  # not written yet
        return (hosts, nodes) if nodes else ({}, [])

    def _watch(self) -> None:
        deadline = time.monotonic() + self._give_up_s
        while not self._stopped():
            hosts, nodes = self._ready()
            if hosts:
                node = hosts[max(hosts)]
                if len(set(hosts.values())) < 2:
                    self.problems.append(f"the run's ranks all ran on {node}: no node of a multi-node job to lose")
                    return
                if node not in nodes:  # a host name that is not SLURM's node name: never lose another machine
                    self.problems.append(f"rank {max(hosts)} ran on {node!r}, which is not one of the nodes SLURM "
                                         f"gave the job ({', '.join(nodes)}): no node was lost")
                    return
                self.problems += self._run("lose", node)
                self.node, self.lost_at = node, time.time()
                self._restore_once_recorded()
                return
            if time.monotonic() > deadline:
                self.problems.append(f"the run never committed step {CHECKPOINT_EVERY} with its hosts recorded "
                                     f"within {self._give_up_s:.0f} s: no node was lost")
                return
            time.sleep(0.2)

    def _restore_once_recorded(self) -> None:
        """Bring the node back as soon as the launcher has recorded the loss: the next job runs without
        it anyway (--exclude), and a cluster short of a node for the rest of the drill could leave that
        job waiting for a spare."""
        while not self._stopped():
            try:
                recorded = any(entry.get("failure_class") == "node_lost" for entry in read_attempts(self.run_dir))
            except (OSError, ValueError, AttributeError):
                recorded = False  # a line being appended: read again
            if recorded:
                self.problems += self._run("restore", self.node)
                self.restored = True
                return
            time.sleep(0.5)

    def _run(self, what: str, node: str) -> list[str]:
        template = self.fault_command if what == "lose" else self.restore_command
        try:
            argv = node_command(template, node)
            if self.lab:
                probe = subprocess.run(["bash", str(LAB_NODE_SCRIPT), "is-lab", node], capture_output=True, text=True,
                                       timeout=30)
                if probe.returncode != 0:
                    return [f"{probe.stderr.strip()}: set FaultDrillConfig.node_fault_command and "
                            f"node_restore_command for this cluster"]
            done = subprocess.run(argv, capture_output=True, text=True, timeout=NODE_COMMAND_TIMEOUT_S)
        except (ValueError, OSError, subprocess.TimeoutExpired) as error:
            return [f"the node {what} command on {node} failed: {type(error).__name__}: {error}"]
        if done.returncode != 0:
            return [f"the node {what} command {argv} exited {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}"]
        return []

    def finish(self) -> None:
        """Stop watching; bring the lost node back (its link up, slurmd running)."""
        self._stop.set()
        self._thread.join()
        if self.node is not None and not self.restored:
            self.problems += self._run("restore", self.node)
            self.restored = True


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _time(text: str) -> float:
    return dt.datetime.fromisoformat(text).timestamp()


def _final(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "final.json").read_text())
    except (OSError, ValueError):
        return {}


def params_equal(reference: Path, candidate: Path) -> bool | None:
    """Bit-identical final parameters; None when either run dumped none."""
    if not (reference / "final_params.pt").is_file() or not (candidate / "final_params.pt").is_file():
        return None
    truth = torch.load(reference / "final_params.pt", weights_only=True)
    other = torch.load(candidate / "final_params.pt", weights_only=True)
    return truth.keys() == other.keys() and all(torch.equal(truth[name], other[name]) for name in truth)


def trained_keys(run_dir: Path) -> set[str]:
    keys: set[str] = set()
    for path in (run_dir / "samples").glob("rank_*.json"):
        for _, step_keys in json.loads(path.read_text())["steps"]:
            keys.update(step_keys)
    return keys


def judge(fault: Fault, run_dir: Path, reference: Path, *, sample: str | None = None,
          lost_node: str | None = None) -> dict[str, Any]:
    """What happened to ``fault``'s run, from its records; ``passed`` only when all of it held.
    ``lost_node``: the node a node fault lost (NodeLoss.node), which the records must name."""
    attempts = read_attempts(run_dir)
    final = _final(run_dir)
    first = attempts[0] if attempts else {}
    recovered = final.get("status") == "completed" and len(attempts) >= 2
    outcome = "recovered" if recovered else ("stopped" if attempts and attempts[-1]["decision"] == "stop" else "neither")
    result: dict[str, Any] = {"fault": fault.name, "what": fault.what, "expected_class": fault.expected_class,
                              "class_recorded": first.get("failure_class", "none"),
                              "expected_outcome": fault.expected_outcome, "outcome": outcome,
                              "attempts": len(attempts), "decisions": [entry["decision"] for entry in attempts]}
    problems: list[str] = []
    if result["class_recorded"] != fault.expected_class:
        problems.append(f"class {result['class_recorded']}, expected {fault.expected_class}")
    if outcome != fault.expected_outcome:
        problems.append(f"outcome {outcome}, expected {fault.expected_outcome}")
    if len(attempts) >= 2:
        failed, resumed = attempts[0], attempts[1]
        result["steps_lost"] = (int(failed["step"]) - int(resumed.get("restored_step") or 0)
                                if isinstance(failed.get("step"), int) else None)
        if result["steps_lost"] is None:
            problems.append("the failed attempt recorded no step")
        ttfs = resumed.get("time_to_first_step_s")
        result["time_to_recover_s"] = (round(_time(resumed["started_at"]) + float(ttfs) - _time(failed["ended_at"]), 2)
                                       if ttfs is not None else None)
    else:
        result["steps_lost"], result["time_to_recover_s"] = None, None
    # Only where the fault leaves the computation unchanged: a quarantined sample changes the data.
    equal = params_equal(reference, run_dir) if fault.bit_identical else None
    result["params_equal_uninterrupted"] = equal
    if fault.bit_identical and equal is not True:
        problems.append(f"final parameters {'differ from' if equal is False else 'not comparable with'} the "
                        f"uninterrupted run's")
    problems += _checks(fault, run_dir, attempts, sample, lost_node)
    result["passed"] = not problems
    result["problems"] = "; ".join(problems) or "none"
    return result


def _checks(fault: Fault, run_dir: Path, attempts: Sequence[Mapping[str, Any]], sample: str | None,
            lost_node: str | None = None) -> list[str]:
    problems = []
    for check in fault.checks:
        if check == "requeued" and (not attempts or attempts[0]["decision"] != "requeue"):
            problems.append("the preempted attempt was not marked requeue-able")
        if check == "not_retried" and len(attempts) != 1:
            problems.append(f"a deterministic failure was retried ({len(attempts)} attempts)")
        if check == "divergence_window":
            window = json.loads((run_dir / "divergence.json").read_text()).get("window", []) \
                if (run_dir / "divergence.json").is_file() else []
            if not window or not all(entry["sample_ids"] for entry in window):
                problems.append("no divergence window with losses, gradient norms and sample ids")
        if check == "quarantined":
            path = run_dir / "quarantine" / "bad_samples.json"
            quarantined = json.loads(path.read_text())["samples"] if path.is_file() else {}
            if sample not in quarantined:
                problems.append(f"sample {sample} is not in the quarantine")
            elif sample in trained_keys(run_dir):
                problems.append(f"quarantined sample {sample} was trained on by the last attempt")
        if check == "excluded":
            problems += _excluded(run_dir, attempts, lost_node)
        if check == "fell_back" and len(attempts) >= 2 and isinstance(attempts[0].get("step"), int):
            failed_step, restored = int(attempts[0]["step"]), attempts[1].get("restored_step")
            newest_possible = failed_step - failed_step % CHECKPOINT_EVERY
            if restored is None or restored >= newest_possible:
                problems.append(f"resumed from step {restored}, not from the checkpoint before step {newest_possible}")
    return problems


def _excluded(run_dir: Path, attempts: Sequence[Mapping[str, Any]], lost_node: str | None = None) -> list[str]:
    """The lost node is the one the first attempt named (and the one the drill lost, when given), and
    the next job ran without it (launch.json's placement, one entry per job)."""
    lost = attempts[0].get("host") if attempts else None
    if lost_node is not None and lost and lost != lost_node:
        return [f"the first attempt names {lost} as lost, but the drill lost {lost_node}"]
    try:
        placement = json.loads((run_dir / "launch.json").read_text()).get("placement") or []
    except (OSError, ValueError) as error:
        return [f"no placement to check the lost node against: {error}"]
    if not lost:
        return ["the first attempt names no lost host"]
    if len(placement) < 2:
        return [f"{len(placement)} job(s) placed; a lost node needs a second job without it"]
    problems = []
    if lost not in placement[0]["nodes"]:
        problems.append(f"the lost host {lost} is not a node of the first job ({placement[0]['nodes']})")
    if lost in placement[-1]["nodes"] or lost not in placement[-1].get("excluded", []):
        problems.append(f"the last job ran on {placement[-1]['nodes']} excluding {placement[-1].get('excluded')}: "
                        f"not without the lost host {lost}")
    return problems


def markdown(results: Sequence[Mapping[str, Any]]) -> str:
    rows = ["| fault | class recorded | outcome | attempts | steps lost | time to recover (s) | params = uninterrupted "
            "| passed | problems |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        equal = {True: "bit-identical", False: "DIFFER", None: "n/a"}[result["params_equal_uninterrupted"]]
        rows.append(f"| {result['fault']} ({result['what']}) | {result['class_recorded']} | {result['outcome']} | "
                    f"{result['attempts']} | {result['steps_lost'] if result['steps_lost'] is not None else '-'} | "
                    f"{result['time_to_recover_s'] if result['time_to_recover_s'] is not None else '-'} | {equal} | "
                    f"{'yes' if result['passed'] else 'NO'} | {result['problems']} |")
    return "\n".join(rows)
