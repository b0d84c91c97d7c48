"""``SlurmLauncher``: the same stage launch, submitted to a SLURM cluster as one batch job.

    launcher = SlurmLauncher(partition="debug", nodes=1, nproc_per_node=2, time_limit="00:30:00")
    launcher.launch(context, stage_launch)      # what LocalTorchrunLauncher.launch does, on the cluster
    launcher.render(stage_launch)               # the sbatch script (trainyard dry-run --slurm prints it)
    launcher.check(stage_launch)                # [problems], each naming the setting to change

Why sbatch, squeue, scontrol and scancel directly, not submitit: a stage is a torchrun command line
with its own fault policy (trainer/supervisor/elastic.py), not a pickled Python function; the job must carry
``--signal``, ``--requeue`` and a rendezvous taken from the allocation's node list, and
``trainyard dry-run`` must show the exact script that would run. The commands' ``--parsable`` and
``-o`` outputs are stable interfaces; submitit would add a layer between them and the script.

One job per attempt of the launch:

1. Checks before submission (``check``): the partition exists; the request fits its limits and its
   nodes (``scontrol show partition/node``: node count, time, CPUs, memory, GPUs per node); a time
   limit is set; the run folder and the data are on a path the nodes can see (``shared_paths``,
   needed as soon as the partition has a node other than this machine).
2. The script: ``srun`` starts one ``python -m trainer.supervisor.elastic`` (torchrun plus the fault policy)
   per node, with c10d rendezvous on the allocation's first node. ``--signal=B:USR1@120`` reaches
   the script, which turns it into SIGTERM for the job step: every rank checkpoints at its next
   step boundary and the launch exits 143 (preempted, requeue-able).
3. Dagster Pipes through files under the run folder (the shared filesystem): a context file and a
   message file, so rank 0 reports logs, metrics and the committed checkpoint to the asset.
4. Following: ``scontrol show job`` every ``poll_s`` (``sacct`` once the controller forgot the
   job); the job's log streams into the Dagster run as it grows. SLURM's own requeue (preemption
   by the scheduler, ``--requeue``) keeps the same job id and is followed through.
5. An exit of 143 whose ending the policy marked ``requeue`` is submitted again (same run folder:
   it resumes from the last committed checkpoint), within the run's retry budget.
6. Cancelling the Dagster run marks the launch as cancelled (``launch/CANCELED``) and runs
   ``scancel``; the launcher waits for the job to leave the queue.
7. A job that ends NODE_FAIL, TIMEOUT, OUT_OF_MEMORY, BOOT_FAIL or CANCELLED outside Dagster
   gets its class from that state when the ranks could not record one (a node that went down is a
   ``rank_crash`` on that node, never a hang).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg

from ops.publish import objstore, paths
from ops.publish.durable import write_json_atomic
from resources.sbatch_script import (
    MEM, NAME, PARTITIONS, SIGNAL, TIME, SbatchSettingError, check_extra_options, check_path, check_script,
    check_setting)
from resources.launcher import (
    CANCEL_MARKER, FAILURE_REPORT_ENV, LAUNCH_ID_ENV, MAX_BAD_SAMPLES_ENV, RUN_DIR_ENV, TorchrunLauncher,
    attempts_metadata, raise_if_canceled, rank_failure, retry_settings, write_overrides_file)
from resources.slurm_commands import SlurmError, parse_records, run_slurm, seconds
from resources.slurm_nodes import (NodeState, NodeWatch, collective_timeout_suspects, lost_nodes, node_lost_ending,
                                   node_loss_bound_s, ranks_on)
from trainer.launch.stage_launch import StageLaunch, record_placement
from trainer.observe.host import read_hosts
from trainer.observe.startup import JOB_STARTED_ENV

TERMINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                   "BOOT_FAIL", "DEADLINE")
# A job state that says how it ended when the ranks could not say it themselves.
STATE_CLASSES = {"NODE_FAIL": "rank_crash", "BOOT_FAIL": "rank_crash", "TIMEOUT": "preempted",
                 "PREEMPTED": "preempted", "OUT_OF_MEMORY": "out_of_memory", "CANCELLED": "preempted",
                 "DEADLINE": "preempted"}
PREEMPTED_EXIT = 143  # trainer/endings.py: the requeue-able exit
def _memory_mb(text: str) -> int:
    match = MEM.fullmatch(text) and re.fullmatch(r"([0-9]+)([KMGT]?)", text.upper(), re.ASCII)
    if not match:
        raise ValueError(f"not a SLURM memory size: {text!r} (e.g. '16G', '4000M')")
    return int(match.group(1)) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2)]


def _gpus(gres: str) -> int:
    return sum(int(count) for count in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres or ""))


@dataclass(frozen=True)
class JobState:
    job_id: str
    state: str
    exit_code: int
    signal: int
    nodes: str
    reason: str = ""
    submitted_at: float = 0.0
    started_at: float | None = None
    """When the launcher first saw the job run (time.monotonic()), for a multi-node job."""
    lost_seen: Mapping[str, float] = dataclasses.field(default_factory=dict)
    """Nodes seen lost while the job ran (NodeWatch), with when the launcher first saw it (monotonic)."""
    lost_evidence: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What showed each node of ``lost_seen`` lost."""

    @property
    def done(self) -> bool:
        return self.state.split()[0] in TERMINAL_STATES


JOB_STATE_PATIENCE_S = 60.0
"""How long the launcher keeps asking SLURM for a job's state that it cannot get before it gives up
on the job (and cancels it)."""
FAULT_DRILL_STAGE = "fault_drill"  # assets/training_faults.py: its node losses are induced


class SlurmLauncher(TorchrunLauncher):
    """A stage as a SLURM batch job: ``srun torchrun`` on ``nodes`` nodes (module docstring)."""

    partition: str = ""
    """Partition to submit to; empty: the cluster's default partition."""
    account: str = ""
    nodes: int = 1
    gpus_per_node: int = 0
    """GPUs per node (--gpus-per-node); the ranks per node are nproc_per_node (one per GPU, usually)."""
    cpus_per_task: int = 2
    """CPUs of the one task per node (torchrun and its ranks)."""
    mem: str = ""
    """Memory per node (--mem), e.g. "16G"; empty: the partition's default."""
    time_limit: str = "00:30:00"
    """--time; required (a job without one is refused before submission)."""
    warning_signal: str = "USR1@120"
    """--signal=B:<this>: SIGUSR1 to the batch script 120 s before the time limit; it becomes a
    SIGTERM stop with a checkpoint, and the job is submitted again."""
    requeue: bool = True
    """--requeue: SLURM may requeue a one-node job itself (preemption by the scheduler, a failed
    node). A job on several nodes is submitted --no-requeue: a lost node is the launcher's to handle
    (``min_nodes``), since it knows which node was lost and where the run may continue."""
    min_nodes: int = 0
    """After a node of a multi-node job is lost: 0 submits the job again at the same node count with
    the lost node excluded (it waits in the queue for a healthy replacement, and the continuation is
    bit-identical); k >= 1 continues on the remaining nodes, never fewer than k, at the smaller world
    size with the same global batch and sample order."""
    exclude: list[str] = []
    """Nodes never to run on (--exclude); a node lost under a job is added for the rest of the launch."""
    node_loss_grace_s: float = 30.0
    """A node SLURM reports not responding under a running job gets this long to answer again before
    the launcher cancels the job; the run then ends within ``node_loss_bound_s`` of the loss."""
    shared_paths: list[str] = []
    """Filesystem prefixes every node mounts (the run folder, the data and the repository must be
    under one). Empty: only valid where the partition's only node is this machine."""
    python: str = ""
    """The Python the nodes run (the same virtual environment, on the shared filesystem); empty:
    this process's interpreter."""
    rendezvous_port: int = 29500
    poll_s: float = 1.0
    cancel_timeout_s: float = 120.0
    extra_sbatch: list[str] = []
    """More #SBATCH options, e.g. ["--exclusive", "--qos=high"]."""
    # Data work as array jobs (resources/slurm_array.py): clip_shards backfills, dataset_manifest probing.
    array_parallel: int = 8
    """The most array tasks of one job running at once (--array=...%N); 0: no cap but the cluster's."""
    array_task_time: str = "00:20:00"
    """--time of each data task: one that hangs is ended there, classified timeout and run again."""
    array_cpus_per_task: int = 1
    array_max_size: int = 0
    """The most tasks in one array job; 0: the cluster's MaxArraySize. A larger round is split."""
    array_retries: int = 2
    """Rounds that run again only the failed items (a lost node, a timeout, a task that died)."""
    shards_per_task: int = 1
    """clip_shards partitions one array task writes."""
    probe_objects_per_task: int = 256
    """Listed objects one array task probes; a listing no larger than this is probed in the step."""

    @property
    def default_world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @classmethod
    def from_env(cls, **overrides: Any) -> SlurmLauncher:
        """TRAINYARD_SLURM_PARTITION, _ACCOUNT, _NODES, _MIN_NODES, _NPROC_PER_NODE, _GPUS_PER_NODE,
        _CPUS_PER_TASK, _MEM, _TIME, _SHARED_PATHS (colon-separated), _EXCLUDE (comma-separated), the data
        work's _ARRAY_PARALLEL, _ARRAY_TIME, _ARRAY_RETRIES, _SHARDS_PER_TASK, _PROBE_OBJECTS_PER_TASK,
        and MLFLOW_TRACKING_URI, when set."""
        env = os.environ
        fields: dict[str, Any] = {"partition": env.get("TRAINYARD_SLURM_PARTITION", ""),
                                  "account": env.get("TRAINYARD_SLURM_ACCOUNT", ""),
                                  "mem": env.get("TRAINYARD_SLURM_MEM", ""),
                                  "time_limit": env.get("TRAINYARD_SLURM_TIME", "00:30:00"),
                                  "mlflow_tracking_uri": env.get("MLFLOW_TRACKING_URI", "") or paths.mlflow_tracking_uri()}
        if env.get("TRAINYARD_SLURM_ARRAY_TIME"):
            fields["array_task_time"] = env["TRAINYARD_SLURM_ARRAY_TIME"]
        for name in ("nodes", "min_nodes", "nproc_per_node", "gpus_per_node", "cpus_per_task", "array_parallel",
                     "array_retries", "shards_per_task", "probe_objects_per_task"):
            if f"TRAINYARD_SLURM_{name.upper()}" in env:
                fields[name] = int(env[f"TRAINYARD_SLURM_{name.upper()}"])
        if env.get("TRAINYARD_SLURM_SHARED_PATHS"):
            fields["shared_paths"] = env["TRAINYARD_SLURM_SHARED_PATHS"].split(":")
        if env.get("TRAINYARD_SLURM_EXCLUDE"):
            fields["exclude"] = env["TRAINYARD_SLURM_EXCLUDE"].split(",")
        return cls(**(fields | overrides))

    def placement(self, world_size: int) -> tuple[int, int]:
        """(nodes, ranks per node) of a launch of ``world_size`` ranks: one node when ``nodes`` is 1
        (every rank there), else whole nodes of ``nproc_per_node`` ranks, at most ``nodes`` of them (a
        world smaller than one node's ranks runs on one node). ValueError naming the settings when
        the ranks do not fill whole nodes."""
        if self.nodes <= 1:
            return 1, world_size
        if world_size <= self.nproc_per_node:
            return 1, world_size
        if world_size % self.nproc_per_node or world_size > self.nodes * self.nproc_per_node:
            raise ValueError(f"the stage asks for {world_size} ranks, which SlurmLauncher.nodes x nproc_per_node "
                             f"({self.nodes} x {self.nproc_per_node}) cannot place as whole nodes; set the stage's "
                             f"nproc to a multiple of {self.nproc_per_node} up to {self.nodes * self.nproc_per_node}")
        return world_size // self.nproc_per_node, self.nproc_per_node

    # ---- the script ----

    def render(self, stage_launch: StageLaunch, *, overrides_file: Path | None = None, log_path: Path | None = None,
               max_restarts: int = 0, exclude: Sequence[str] = ()) -> str:
        """The sbatch script of ``stage_launch`` (a named launch: its run folder is set); ``exclude``:
        nodes lost earlier in the launch, besides ``SlurmLauncher.exclude``."""
        self.validate(stage_launch)
        nodes, per_node = self.placement(stage_launch.world_size)
        excluded = list(dict.fromkeys([*self.exclude, *exclude]))
        for name in excluded:
            check_setting("SlurmLauncher.exclude", name, NAME, "a node name such as 'node2'")
        run_dir = Path(stage_launch.run_dir)
        overrides_file = check_path("the overrides file", str(
            overrides_file or run_dir / "launch" / "dagster-run-id.overrides.json"))
        log_path = check_path("the job log", str(log_path or run_dir / "launch" / "slurm-%j.log"), allow="%")
        python = check_path("SlurmLauncher.python", self.python or sys.executable)
        options = [f"--job-name=trainyard-{stage_launch.stage}-{stage_launch.run_id}"[:120],
                   f"--nodes={nodes}", "--ntasks-per-node=1", f"--cpus-per-task={self.cpus_per_task}",
                   f"--time={self.time_limit}", f"--signal=B:{self.warning_signal}",
                   "--requeue" if self.requeue and nodes == 1 else "--no-requeue", f"--output={log_path}",
                   "--open-mode=append",
                   f"--chdir={paths.REPO_ROOT}"]
        options += [f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node else []
        options += [f"--mem={self.mem}"] if self.mem else []
        options += [f"--partition={self.partition}"] if self.partition else []
        options += [f"--account={self.account}"] if self.account else []
        options += [f"--exclude={','.join(excluded)}"] if excluded else []
        options += check_extra_options("SlurmLauncher.extra_sbatch", self.extra_sbatch)
        trainer = [shlex.quote(python), "-m", "trainer.supervisor.elastic", "--nnodes=$SLURM_JOB_NUM_NODES",
                   f"--nproc-per-node={per_node}",
                   "--rdzv-backend=c10d", '--rdzv-endpoint="$head_node:$port"', '--rdzv-id="$SLURM_JOB_ID"',
                   f"--max-restarts={max_restarts}", "-m", "trainer.train",
                   "--config", shlex.quote(stage_launch.config_path), "--overrides-file", shlex.quote(str(overrides_file))]
        lines = ["#!/bin/bash", f"# {stage_launch.stage} run {stage_launch.run_id}: written by Trainyard's SlurmLauncher",
                 *(f"#SBATCH {option}" for option in options), "",
                 "set -uo pipefail",
                 "# The job's start, for the run's start-up breakdown (the queue wait ends here; trainer/observe/startup.py).",
                 f"export {JOB_STARTED_ENV}=$(date +%s.%N)",
                 'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
                 'head_node=$(echo "$nodes" | head -n 1)',
                 f"port={self.rendezvous_port}",
                 'echo "[trainyard] job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s): $(echo $nodes);'
                 ' rendezvous $head_node:$port"',
                 "# One torchrun (with Trainyard's fault policy) per node; the ranks meet on the first node.",
                 f"srun --kill-on-bad-exit=1 --ntasks-per-node=1 {' '.join(trainer)} &",
                 "step=$!",
                 "# The warning signal before the time limit (and scancel's TERM) become a SIGTERM stop of the",
                 "# job step: every rank checkpoints at its next step boundary and the launch exits 143.",
                 "# scancel --signal only signals (no KillWait countdown): the ranks take the time the save needs.",
                 "forward() { echo \"[trainyard] $1: SIGTERM to the job step, the ranks checkpoint at the next step"
                 " boundary\"; scancel --signal=TERM \"$SLURM_JOB_ID.0\" 2>/dev/null || kill -TERM \"$step\"; }",
                 "trap 'forward SIGUSR1' USR1", "trap 'forward SIGTERM' TERM",
                 "rc=0",
                 'while :; do wait "$step"; rc=$?; kill -0 "$step" 2>/dev/null || break; done',
                 'echo "[trainyard] job step exited $rc"', "exit $rc", ""]
        return check_script("\n".join(lines), lines=lines, header=options)

    def validate(self, stage_launch: StageLaunch) -> None:
        """Every value the script holds against its option's grammar (resources/sbatch_script.py):
        SbatchSettingError, naming the setting, for the first that does not fit."""
        grammars = (("partition", PARTITIONS, "e.g. 'debug' or 'gpu,debug'"), ("account", NAME, "e.g. 'ml-team'"),
                    ("mem", MEM, "e.g. '16G' or '4000M'"), ("time_limit", TIME, "e.g. '00:30:00' or '2-00:00:00'"),
                    ("warning_signal", SIGNAL, "e.g. 'USR1@120'"))
        for name, grammar, example in grammars:
            value = getattr(self, name)
            if value or name in ("time_limit", "warning_signal"):  # the others are left out when empty
                check_setting(f"SlurmLauncher.{name}", value, grammar, example)
        for name in ("nodes", "gpus_per_node", "cpus_per_task", "rendezvous_port", "nproc_per_node"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise SbatchSettingError(f"SlurmLauncher.{name}", f"{value!r} is not a whole number >= 0")
        check_extra_options("SlurmLauncher.extra_sbatch", self.extra_sbatch)
        check_setting("the stage (stage.stage)", stage_launch.stage, NAME, "e.g. 'pretrain'")
        check_path("the run folder (train.run_dir)", stage_launch.run_dir)
        check_path("the config path", stage_launch.config_path)
        check_path("the repository (SlurmLauncher's --chdir)", str(paths.REPO_ROOT))
        if type(stage_launch.world_size) is not int:
            raise SbatchSettingError("the stage's world size", f"{stage_launch.world_size!r} is not a whole number")

    # ---- checks before submission ----

    def check(self, stage_launch: StageLaunch) -> list[str]:
        """What would make the job fail or never start, each naming the setting to change."""
        problems = []
        try:
            limit = seconds(self.time_limit)
        except ValueError as error:
            return [f"SlurmLauncher.time_limit: {error}"]
        self.validate(stage_launch)
        if limit is None:
            problems.append("SlurmLauncher.time_limit is not set: a job without a time limit may never be "
                            "scheduled and cannot be warned before it ends; set e.g. time_limit='02:00:00'")
        if self.nodes < 1 or self.cpus_per_task < 1 or self.gpus_per_node < 0:
            problems.append(f"SlurmLauncher.nodes ({self.nodes}) and cpus_per_task ({self.cpus_per_task}) must be "
                            f">= 1 and gpus_per_node ({self.gpus_per_node}) >= 0")
        try:
            nodes_needed = self.placement(stage_launch.world_size)[0]
        except ValueError as error:
            problems.append(str(error))
            nodes_needed = self.nodes
        if self.min_nodes < 0 or self.min_nodes > self.nodes:
            problems.append(f"SlurmLauncher.min_nodes ({self.min_nodes}) must be between 0 (keep the node count) "
                            f"and nodes ({self.nodes})")
        partitions = parse_records(run_slurm("scontrol", "show", "partition", "-o"))
        by_name = {record.get("PartitionName"): record for record in partitions}
        name = self.partition or next((p["PartitionName"] for p in partitions if p.get("Default") == "YES"), "")
        partition = by_name.get(name)
        if partition is None:
            known = ", ".join(sorted(n for n in by_name if n)) or "none"
            problems.append(f"SlurmLauncher.partition: {self.partition or '(the default)'} does not exist on this "
                            f"cluster (partitions: {known})")
            return problems
        if partition.get("State", "UP") != "UP":
            problems.append(f"SlurmLauncher.partition: {name} is {partition.get('State')}, not UP")
        max_time = seconds(partition.get("MaxTime", "UNLIMITED"))
        if limit is not None and max_time is not None and limit > max_time:
            problems.append(f"SlurmLauncher.time_limit {self.time_limit} exceeds partition {name}'s MaxTime "
                            f"{partition['MaxTime']}")
        max_nodes = partition.get("MaxNodes", "UNLIMITED")
        if max_nodes not in ("UNLIMITED", "") and nodes_needed > int(max_nodes):
            problems.append(f"SlurmLauncher.nodes {nodes_needed} exceeds partition {name}'s MaxNodes {max_nodes}")
        node_names, nodes, unusable, fitting = self._partition_nodes(partition)
        if len(fitting) < nodes_needed:
            want = f"{self.cpus_per_task} CPUs" + (f", {self.mem} memory" if self.mem else "") + (
                f", {self.gpus_per_node} GPUs" if self.gpus_per_node else "")
            biggest = max(nodes, key=lambda node: int(node.get("CPUTot", 0)), default={})
            problems.append(
                f"SlurmLauncher.nodes={nodes_needed} with {want} per node: partition {name} has {len(nodes)} node(s), "
                f"{len(fitting)} of them that large, in service and not excluded"
                + (f" (drained or down: {', '.join(unusable)})" if unusable else "")
                + f" (its largest: {biggest.get('CPUTot', 0)} CPUs, "
                f"{biggest.get('RealMemory', 0)} MB, {_gpus(biggest.get('Gres', ''))} GPUs); lower nodes, "
                f"cpus_per_task, mem or gpus_per_node, or choose another partition")
        problems += self._check_paths(stage_launch, node_names)
        return problems

    def _partition_nodes(self, partition: Mapping[str, str]) -> tuple[list[str], list[dict], list[str], list[dict]]:
        """The partition's node names, their records, the drained or down ones, and those a job of
        this launcher fits on, in service and not excluded."""
        node_names = run_slurm("scontrol", "show", "hostnames", partition.get("Nodes", "")).split() \
            if partition.get("Nodes") not in (None, "", "(null)") else []
        nodes = [record for record in parse_records(run_slurm("scontrol", "show", "node", "-o"))
                 if record.get("NodeName") in node_names]
        # A drained or down node receives no stage: SLURM places nothing there, so it does not count.
        unusable = [node.get("NodeName", "") for node in nodes
                    if (state := NodeState(node.get("NodeName", ""), "", node.get("State", ""))).lost or state.draining]
        fitting = [node for node in nodes if self._fits(node) and node.get("NodeName") not in (*self.exclude, *unusable)]
        return node_names, nodes, unusable, fitting

    def usable_nodes(self) -> list[str]:
        """The nodes a job of this launcher can be placed on now (its partition's, large enough, in
        service, not excluded). SlurmError when the partition does not exist, or when none is named
        and the cluster has no default one."""
        partitions = parse_records(run_slurm("scontrol", "show", "partition", "-o"))
        name = self.partition or next((p["PartitionName"] for p in partitions if p.get("Default") == "YES"), "")
        if not name:
            raise SlurmError("SlurmLauncher.partition is empty and the cluster has no default partition: name one "
                             "(TRAINYARD_SLURM_PARTITION)")
        partition = next((p for p in partitions if p.get("PartitionName") == name), None)
        if partition is None:
            raise SlurmError(f"partition {name!r} does not exist (scontrol show partition lists "
                             f"{', '.join(p.get('PartitionName', '?') for p in partitions) or 'none'})")
        return [node.get("NodeName", "") for node in self._partition_nodes(partition)[3]]

    def _fits(self, node: Mapping[str, str]) -> bool:
        if int(node.get("CPUTot", 0)) < self.cpus_per_task:
            return False
        if self.mem and int(node.get("RealMemory", 0)) < _memory_mb(self.mem):
            return False
        return _gpus(node.get("Gres", "")) >= self.gpus_per_node

    def _check_paths(self, stage_launch: StageLaunch, node_names: Sequence[str]) -> list[str]:
        here = {socket.gethostname(), socket.gethostname().split(".")[0]}
        needed = {"run folder": Path(stage_launch.run_dir), "shard index": Path(stage_launch.data.path),
                  "config": Path(stage_launch.config_path), "repository": paths.REPO_ROOT}
        if not self.shared_paths:
            if set(node_names) <= here:
                return []  # the partition is this machine: every local path is the nodes' path
            return [f"SlurmLauncher.shared_paths is empty, but partition nodes {', '.join(node_names)} are not this "
                    f"machine: name the filesystem they mount (the run folder, data and repository must be on it)"]
        roots = [Path(root).resolve() for root in self.shared_paths]
        return [f"the {what} {path} is not under SlurmLauncher.shared_paths ({', '.join(self.shared_paths)}): the "
                f"nodes cannot see it; move it there (TRAINYARD_HOME / TRAINYARD_DATA_ROOT) or add its filesystem"
                for what, path in needed.items()
                if not any(path.resolve().is_relative_to(root) for root in roots)]

    # ---- data work: array jobs (resources/slurm_array.py) ----

    @property
    def runs_data_on_cluster(self) -> bool:
        return True

    def check_data(self, locations: Mapping[str, str]) -> list[str]:
        """Before data tasks are submitted: what would make them fail or never start, each naming the
        setting. ``locations``: setting -> a folder the tasks read or write, or a URL."""
        problems = []
        try:
            limit = seconds(self.array_task_time)
        except ValueError as error:
            return [f"SlurmLauncher.array_task_time: {error}"]
        if limit is None:
            problems.append("SlurmLauncher.array_task_time is not set: a data task that hangs would hold its node "
                            "forever; set e.g. array_task_time='00:20:00'")
        for name in ("array_parallel", "array_cpus_per_task", "array_max_size", "array_retries"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                problems.append(f"SlurmLauncher.{name} ({getattr(self, name)!r}) must be a whole number >= 0")
        for name in ("shards_per_task", "probe_objects_per_task"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                problems.append(f"SlurmLauncher.{name} ({getattr(self, name)!r}) must be a whole number >= 1")
        try:
            usable = self.usable_nodes_for(self.array_cpus_per_task)
        except SlurmError as error:
            return problems + [f"SlurmLauncher.partition: {error}"]
        if not usable:
            problems.append(f"SlurmLauncher.partition {self.partition or '(the default)'}: no node in service with "
                            f"{self.array_cpus_per_task} CPU(s) (array_cpus_per_task) that is not excluded")
        here = {socket.gethostname(), socket.gethostname().split(".")[0]}
        remote = [name for name, path in locations.items() if objstore.is_remote(path)]
        endpoint = os.environ.get("TRAINYARD_S3_ENDPOINT_URL", "")
        host = (urllib.parse.urlsplit(endpoint).hostname or "") if endpoint else ""
        if remote and usable and not set(usable) <= here and (host == "localhost" or host.startswith("127.")
                                                              or host == "::1"):
            problems.append(f"TRAINYARD_S3_ENDPOINT_URL is {endpoint}, this machine's loopback, which nodes "
                            f"{', '.join(usable)} cannot reach for {', '.join(remote)}: name the store by an "
                            f"address the nodes reach")
        local = {name: path for name, path in locations.items() if not objstore.is_remote(path)}
        local |= {"the repository (SlurmLauncher's --chdir)": str(paths.REPO_ROOT)}
        for setting, path in local.items():
            if not Path(str(path).removeprefix("file://")).exists():
                problems.append(f"{setting}: {path} does not exist")
        if not self.shared_paths:
            if usable and not set(usable) <= here:
                problems.append(f"SlurmLauncher.shared_paths is empty, but nodes {', '.join(usable)} are not this "
                                f"machine: name the filesystem they mount (TRAINYARD_SLURM_SHARED_PATHS); the media, "
                                f"the data and the repository must be on it")
            return problems
        roots = [Path(root).resolve() for root in self.shared_paths]
        problems += [f"{setting}: {path} is not under SlurmLauncher.shared_paths ({', '.join(self.shared_paths)}): "
                     f"the nodes cannot see it" for setting, path in local.items()
                     if not any(Path(str(path).removeprefix("file://")).resolve().is_relative_to(root)
                                for root in roots)]
        return problems

    def usable_nodes_for(self, cpus: int) -> list[str]:
        """usable_nodes() for a job of ``cpus`` CPUs per node."""
        return self.model_copy(update={"cpus_per_task": cpus, "gpus_per_node": 0}).usable_nodes()

    def run_tasks(self, context: dg.AssetExecutionContext, **arguments: Any):
        """resources.slurm_array.run_rounds with this launcher's settings."""
        from resources.slurm_array import run_rounds

        return run_rounds(self, context, **arguments)

    # ---- the launch ----

    def launch(self, context: dg.AssetExecutionContext, stage_launch: StageLaunch, *,
               extras: Mapping[str, Any] | None = None,
               cancel: threading.Event | None = None) -> dg.PipesClientCompletedInvocation:
        if not stage_launch.run_dir:
            raise ValueError(f"{stage_launch.stage}: a launch runs in its run folder; name it first (StageLaunch.named)")
        try:
            problems = self.check(stage_launch)
        except SbatchSettingError as error:  # a value that would reach the script unchecked: never retried
            raise dg.Failure(description=f"SLURM job refused before submission: {error}", allow_retries=False,
                             metadata={"setting": error.setting}) from error
        if problems:
            raise dg.Failure(description="SLURM job refused before submission:\n- " + "\n- ".join(problems),
                             allow_retries=False, metadata={"problems": len(problems)})
        run_dir = Path(stage_launch.run_dir)
        folder = run_dir / "launch"
        launch_id = context.run.run_id
        overrides_file = write_overrides_file(folder / f"{launch_id}.overrides.json", stage_launch.overrides())
        failure_report = folder / f"{launch_id}.failure.json"
        failure_report.unlink(missing_ok=True)
        (folder / CANCEL_MARKER).unlink(missing_ok=True)
        budget, max_bad = retry_settings(stage_launch)
        injector = dg.PipesFileContextInjector(str(folder / f"{launch_id}.pipes-context.json"))
        reader = dg.PipesFileMessageReader(str(folder / f"{launch_id}.pipes-messages.jsonl"))
        with dg.open_pipes_session(context=context, context_injector=injector, message_reader=reader,
                                   extras=dict(extras or {})) as session:
            env = {**os.environ, "MLFLOW_TRACKING_URI": self.tracking_uri, "PYTHONUNBUFFERED": "1",
                   FAILURE_REPORT_ENV: str(failure_report), RUN_DIR_ENV: str(run_dir), LAUNCH_ID_ENV: launch_id,
                   MAX_BAD_SAMPLES_ENV: str(max_bad), **session.get_bootstrap_env_vars(),
                   **objstore.role_credentials("training")}  # the ranks read data and write checkpoints only
            launch, excluded = stage_launch, list(self.exclude)
            while True:
                spent = attempts_metadata(run_dir, budget)["retries_spent"]
                # Several nodes: each job is one attempt (the policy on each node restarts nothing
                # itself; a transient end asks to be submitted again).
                restarts = max(0, budget - spent) if self.placement(launch.world_size)[0] == 1 else 0
                state = self._submit_and_follow(context, launch, overrides_file, env, restarts, cancel, excluded)
                if state.state.startswith("COMPLETED"):
                    return dg.PipesClientCompletedInvocation(session)
                lost = self._lost(context, state, launch)
                if lost:
                    failure, launch = self._node_lost(context, state, lost, launch, budget)
                    excluded += [name for name in lost if name not in excluded]
                else:
                    self._suspects(context, state, launch)  # before _failure, which raises a stop
                    failure = self._failure(state, run_dir, failure_report, budget)
                if failure.allow_retries and isinstance(failure, _Resubmit):
                    context.log.warning(f"SLURM job {state.job_id} ended {'node_lost' if lost else 'preempted'}: "
                                        f"submitting it again (retry budget {budget}, spent {spent + 1})")
                    continue
                self._record_root_cause(context, failure.description, failure.metadata)
                raise failure

    def _submit_and_follow(self, context: dg.AssetExecutionContext, stage_launch: StageLaunch, overrides_file: Path,
                           env: dict[str, str], restarts: int, cancel: threading.Event | None = None,
                           exclude: Sequence[str] = ()) -> JobState:
        folder = Path(stage_launch.run_dir) / "launch"
        log_path = folder / f"{context.run.run_id}.slurm.log"
        script = folder / f"{context.run.run_id}.sbatch"
        script.write_text(self.render(stage_launch, overrides_file=overrides_file, log_path=log_path,
                                      max_restarts=restarts, exclude=exclude))
        nodes, per_node = self.placement(stage_launch.world_size)
        submitted_at = time.time()
        job_id = run_slurm("sbatch", "--parsable", str(script), env=env).strip().split(";")[0]
        context.log.info(f"submitted SLURM job {job_id} ({script}); log {log_path}")
        offset = log_path.stat().st_size if log_path.exists() else 0
        watch: NodeWatch | None = None
        placed = False
        cancelled_for: list[str] = []
        try:
            unanswered_since: float | None = None
            while True:
                try:
                    state = self.job_state(job_id)
                    unanswered_since = None
                except SlurmError as error:  # a restarting slurmctld answers again within a minute
                    unanswered_since = unanswered_since or time.monotonic()
                    if time.monotonic() - unanswered_since > JOB_STATE_PATIENCE_S:
                        raise
                    context.log.warning(f"SLURM job {job_id}: no state ({error}); asking again")
                    time.sleep(self.poll_s)
                    raise_if_canceled(cancel)
                    continue
                offset = self._stream(context, log_path, offset)
                if state.done:
                    time.sleep(self.poll_s)  # the last lines the job wrote
                    self._stream(context, log_path, offset)
                    context.log.info(f"SLURM job {job_id}: {state.state}, exit {state.exit_code}:{state.signal}")
                    return dataclasses.replace(state, submitted_at=submitted_at,
                                               started_at=watch.started if watch else None,
                                               lost_seen=dict(watch.seen) if watch else {},
                                               lost_evidence=dict(watch.evidence) if watch else {})
                if not placed and state.state.startswith("RUNNING") and state.nodes:
                    placed = True
                    hosts = run_slurm("scontrol", "show", "hostnames", state.nodes).split()
                    record_placement(stage_launch, job_id=job_id, hosts=hosts, per_node=per_node,
                                     partition=self.partition, excluded=list(exclude))
                    context.log.info(f"SLURM job {job_id} runs on {len(hosts)} node(s): {', '.join(hosts)} "
                                     f"({per_node} rank(s) each)")
                    if nodes > 1:
                        watch = NodeWatch(hosts, grace_s=self.node_loss_grace_s, run=run_slurm,
                                          suspect=lambda: _a_rank_ended(Path(stage_launch.run_dir), submitted_at))
                if watch is not None and not cancelled_for:
                    try:
                        overdue = watch.check()
                        if overdue:  # its ranks may wait on the lost peer for the whole collective timeout
                            context.log.warning(f"node {', '.join(overdue)} of SLURM job {job_id} lost for over "
                                                f"{watch.grace_s:g} s ({'; '.join(watch.evidence[n] for n in overdue)})"
                                                f": cancelling the job")
                            run_slurm("scancel", "--full", job_id)
                            cancelled_for = overdue
                    except SlurmError as error:  # a busy or restarting slurmctld: the next poll asks again
                        context.log.warning(f"SLURM job {job_id}: its nodes could not be checked or the job "
                                            f"cancelled ({error}); asking again at the next poll")
                time.sleep(self.poll_s)
                raise_if_canceled(cancel)
        except dg.DagsterExecutionInterruptedError:
            self._cancel(context, job_id, folder)
            raise
        except BaseException as error:
            # The launcher no longer watches the job: it must not run on unwatched (holding nodes,
            # writing into a run folder a retry will use).
            context.log.error(f"SLURM job {job_id}: the launcher stopped watching it ({type(error).__name__}: "
                              f"{error}); cancelling it")
            try:
                run_slurm("scancel", job_id)
            except SlurmError as cancel_error:
                context.log.error(f"SLURM job {job_id} could not be cancelled: {cancel_error}; scancel it by hand")
            raise

    def _stream(self, context: dg.AssetExecutionContext, log_path: Path, offset: int) -> int:
        """The job log's new complete lines into the Dagster run; the new offset."""
        try:
            with open(log_path, "rb") as handle:
                handle.seek(offset)
                data = handle.read()
        except FileNotFoundError:
            return offset
        complete = data[:data.rfind(b"\n") + 1]
        for line in complete.decode("utf-8", "replace").splitlines():
            context.log.info(line)
        return offset + len(complete)

    def job_state(self, job_id: str) -> JobState:
        """From the controller while it knows the job, else from accounting (sacct)."""
        try:
            (record,) = parse_records(run_slurm("scontrol", "show", "job", "-o", job_id))
        except (SlurmError, ValueError):
            line = run_slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode,NodeList").strip()
            state, exit_code, nodes = (line.splitlines()[0].split("|") + ["", "0:0", ""])[:3] if line else (
                "PENDING", "0:0", "")
            code, _, sig = exit_code.partition(":")
            return JobState(job_id, state.split()[0], int(code or 0), int(sig or 0), nodes)
        code, _, sig = record.get("ExitCode", "0:0").partition(":")
        return JobState(job_id, record.get("JobState", "PENDING"), int(code or 0), int(sig or 0),
                        record.get("NodeList", ""), record.get("Reason", ""))

    def _cancel(self, context: dg.AssetExecutionContext, job_id: str, folder: Path) -> None:
        """A cancel, marked as such for the policy; scancel; wait for the job to leave the queue."""
        (folder / CANCEL_MARKER).write_text(f"canceled: Dagster run {context.run.run_id}\n")
        context.log.info(f"run canceled: scancel {job_id} (SIGTERM, then SIGKILL after the cluster's KillWait)")
        run_slurm("scancel", job_id)
        deadline = time.monotonic() + self.cancel_timeout_s
        while time.monotonic() < deadline and not self.job_state(job_id).done:
            time.sleep(self.poll_s)

    # ---- a lost node ----

    def node_loss_bound_s(self) -> float:
        """At most how long after a node is lost its job has ended (resources/slurm_nodes.py)."""
        return node_loss_bound_s(run_slurm, grace_s=self.node_loss_grace_s)

    def _lost(self, context: dg.AssetExecutionContext, state: JobState, launch: StageLaunch) -> dict[str, str]:
        """The nodes lost under a multi-node job that did not complete, each with its evidence."""
        if self.placement(launch.world_size)[0] <= 1 or not state.nodes:
            return {}
        hosts = run_slurm("scontrol", "show", "hostnames", state.nodes).split()
        lost = lost_nodes(hosts, run=run_slurm)
        for name in state.lost_seen:
            lost.setdefault(name, f"while the job ran: {state.lost_evidence.get(name, 'SLURM reported it not responding')}")
        if lost:
            context.log.warning(f"SLURM job {state.job_id}: lost node(s) " +
                                "; ".join(f"{name}: {why}" for name, why in lost.items()))
        return lost

    def _node_lost(self, context: dg.AssetExecutionContext, state: JobState, lost: Mapping[str, str],
                   launch: StageLaunch, budget: int) -> tuple[dg.Failure, StageLaunch]:
        """Record a lost node as the attempt's end (``node_lost``) and decide: the job again without
        the node, at the node count ``min_nodes`` says, or stop. Returns the failure and the launch
        the next job runs."""
        run_dir = Path(launch.run_dir)
        base = state.state.split()[0]
        ending_path = run_dir / "ending.json"
        ranks_view = json.loads(ending_path.read_text()) if _written_since(ending_path, state.submitted_at) else None
        hosts = read_hosts(run_dir) if _written_since(run_dir / "hosts.json", state.submitted_at) else {}
        ranks = ranks_on(hosts, list(lost))
        step = _step_reached(run_dir, state, ranks_view)
        attempts = attempts_metadata(run_dir, budget)
        nodes_now, per_node = self.placement(launch.world_size)
        next_nodes = nodes_now if self.min_nodes == 0 else max(self.min_nodes, nodes_now - len(lost))
        next_world = next_nodes * per_node
        global_batch = ((launch.config or {}).get("data") or {}).get("batch_size")
        if attempts["retries_spent"] >= budget:
            decision, why = "stop", "node_lost is transient, but the retry budget (train.retry_budget) is spent"
        elif isinstance(global_batch, int) and global_batch % next_world:
            decision, why = "stop", (f"the global batch {global_batch} does not split over {next_world} ranks on "
                                     f"{next_nodes} node(s): set SlurmLauncher.min_nodes so it does")
        else:
            decision = "requeue"
            where = ("at the same world size" if next_world == launch.world_size else
                     f"at world size {launch.world_size} -> {next_world}, the same global batch and sample order")
            why = (f"node {', '.join(lost)} lost: the job again without it on {next_nodes} node(s) {where}, from the "
                   f"last committed checkpoint" + (" (it waits in the queue for a healthy node)"
                                                   if self.min_nodes == 0 else ""))
        detected = None
        if state.lost_seen:
            detected = round(time.monotonic() - min(state.lost_seen.values()), 1)
        attempt = (ranks_view or {}).get("attempt", attempts["num_attempts"])
        ending = node_lost_ending(job_id=state.job_id, job_state=base, lost=lost, ranks=ranks, step=step,
                                  attempt=attempt, ranks_view=ranks_view, decision=decision, why=why,
                                  detected_after_s=detected)
        ending["bound_s"] = self.node_loss_bound_s()
        write_json_atomic(ending_path, ending)
        (run_dir / "endings").mkdir(exist_ok=True)
        write_json_atomic(run_dir / "endings" / f"attempt_{attempt}.json", ending)
        line = {"attempt": attempt, "launch_id": context.run.run_id, "failure_class": "node_lost", "rank": ending["rank"],
                "ranks": ranks, "host": ending["host"], "step": step,
                "decision": decision, "why": why, "slurm_job_id": state.job_id, "ended_at": ending["ended_at"]}
        _replace_or_append_attempt(run_dir, line, replace=ranks_view is not None)
        context.log.warning(f"[trainyard] attempt {attempt}: node_lost at step {step} (ranks {ranks} on "
                            f"{ending['host']}): {decision}: {why}")
        self._hold_against(context, launch, state, "node_lost", lost, step)
        metadata = {"failure_class": "node_lost", "lost_nodes": ", ".join(lost), "lost_ranks": str(ranks),
                    "step": step if step is not None else -1, "slurm_job_id": state.job_id, "slurm_state": base,
                    "slurm_nodes": state.nodes, "first_error": str(ending.get("first_error") or "none")[:500]}
        description = f"SLURM job {state.job_id} {base}: node_lost: {ending['error']}"
        if decision == "requeue":
            return (_Resubmit(description=description, metadata=metadata, allow_retries=True),
                    dataclasses.replace(launch, world_size=next_world))
        return dg.Failure(description=f"{description}; {why}", metadata=metadata, allow_retries=False), launch

    def _hold_against(self, context: dg.AssetExecutionContext, launch: StageLaunch, state: JobState,
                      failure_class: str, nodes: Mapping[str, str], step: int | None) -> None:
        """``failure_class`` in the history of each of ``nodes`` (node -> evidence); a repeat offender
        is drained (resources/node_health.py). A fault drill's failures are induced: not held."""
        if not nodes:
            return
        if launch.stage == FAULT_DRILL_STAGE:
            context.log.info(f"node {', '.join(nodes)}: {failure_class} induced by a fault drill, not held against "
                             f"its history")
            return
        from resources.node_health import record_failure  # it runs SLURM commands through this module

        for name, evidence in nodes.items():
            try:
                drained = record_failure(name, failure_class=failure_class, run_id=launch.run_id,
                                         job_id=state.job_id, step=step, evidence=evidence)
            except (OSError, ValueError, SlurmError) as error:
                # The run's recovery does not wait on the node's history: the failure is logged, and
                # the history (or SLURM) is what a person fixes.
                context.log.error(f"node {name}: its history was not updated and it was not judged for a drain: "
                                  f"{type(error).__name__}: {error}")
                continue
            if drained is not None:
                context.log.warning(f"node {name} drained: {drained['reason']}")

    def _suspects(self, context: dg.AssetExecutionContext, state: JobState, launch: StageLaunch) -> None:
        """A multi-node job that ended in a collective timeout: the hosts the others waited on go in
        their node histories (collective_timeout_suspects). Never raises: a malformed record must not
        hide the job's own failure, which _failure reports next."""
        try:
            run_dir = Path(launch.run_dir)
            if self.placement(launch.world_size)[0] <= 1 or not _written_since(run_dir / "ending.json",
                                                                               state.submitted_at):
                return
            ending = json.loads((run_dir / "ending.json").read_text())
            if not isinstance(ending, dict):
                raise ValueError("ending.json does not hold an object")
            hosts = read_hosts(run_dir) if _written_since(run_dir / "hosts.json", state.submitted_at) else {}
            from trainer.endings import rank_end_path, read_rank_ends

            late = {rank: record for rank, record in read_rank_ends(run_dir).items()
                    if _written_since(rank_end_path(run_dir, rank), state.submitted_at)}
            suspects = collective_timeout_suspects(ending, hosts, late)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            context.log.error(f"SLURM job {state.job_id}: the hosts of a collective timeout could not be judged "
                              f"({type(error).__name__}: {error}); no node history was changed")
            return
        if suspects:
            context.log.warning(f"SLURM job {state.job_id}: collective_timeout waiting on " + "; ".join(suspects))
        self._hold_against(context, launch, state, "collective_timeout", suspects, ending.get("step"))

    def _failure(self, state: JobState, run_dir: Path, failure_report: Path, budget: int) -> dg.Failure:
        """The Dagster failure of a job that did not complete, with the run's class; a _Resubmit when
        it may run again (the policy asked for a requeue, or SLURM stopped it at its time limit).

        Where SLURM ended the job itself (its node failed, its time ran out, its memory limit), the
        job's state is the class: the ranks only saw the SIGTERM that SLURM sent them."""
        base = state.state.split()[0]
        ending_path = run_dir / "ending.json"
        if base in STATE_CLASSES:
            self._record_state_ending(state, run_dir, budget)
        failure = rank_failure(state.exit_code or 1, failure_report, run_dir=run_dir, budget=budget)
        description = f"SLURM job {state.job_id} {base} on {state.nodes or 'no node'} (exit {state.exit_code}:" \
                      f"{state.signal}): {failure.description}"
        metadata = {**failure.metadata, "slurm_job_id": state.job_id, "slurm_state": base, "slurm_nodes": state.nodes}
        ending = json.loads(ending_path.read_text()) if ending_path.is_file() else {}
        if ending.get("decision") == "requeue":
            return _Resubmit(description=description, metadata=metadata, allow_retries=True)
        return dg.Failure(description=description, metadata=metadata, allow_retries=False)

    def _record_state_ending(self, state: JobState, run_dir: Path, budget: int) -> None:
        """ending.json (and a ledger line) from the job's state, keeping what the ranks recorded."""
        base = state.state.split()[0]
        failure_class = STATE_CLASSES[base]
        ending_path = run_dir / "ending.json"
        ranks_view = json.loads(ending_path.read_text()) if _written_since(ending_path, state.submitted_at) else None
        attempts = attempts_metadata(run_dir, budget)
        requeue = base in ("TIMEOUT", "DEADLINE", "PREEMPTED") and attempts["retries_spent"] < budget
        why = {"NODE_FAIL": f"node {state.nodes} failed under the job" + (
                   "; SLURM requeues such a job itself (requeue=True)" if self.requeue else ""),
               "BOOT_FAIL": f"node {state.nodes} failed to boot",
               "OUT_OF_MEMORY": "the job exceeded its memory limit (SlurmLauncher.mem)",
               "CANCELLED": "cancelled outside Dagster (scancel): not retried",
               }.get(base, f"SLURM ended the job {base}" + ("; submitted again" if requeue else ""))
        ending = {"failure_class": failure_class, "attempt": (ranks_view or {}).get("attempt", attempts["num_attempts"]),
                  "rank": -1, "host": state.nodes, "step": (ranks_view or {}).get("step"),
                  "sample_ids": [], "job_state": base, "exit": f"SLURM {base}",
                  "error": f"SLURM job {state.job_id} ended {base} on {state.nodes}: {why}",
                  "decision": "requeue" if requeue else "stop", "why": why,
                  "log_tail": (ranks_view or {}).get("log_tail", []), "ranks_view": ranks_view}
        ending_path.write_text(json.dumps(ending))
        if ranks_view is None:  # no policy line for this job: the launch adds one
            with open(run_dir / "attempts.jsonl", "a") as handle:
                handle.write(json.dumps({"attempt": ending["attempt"], "launch_id": "", "failure_class": failure_class,
                                         "rank": -1, "host": state.nodes, "step": ending["step"], "restored_step": None,
                                         "sample_ids": [], "decision": ending["decision"], "why": why}) + "\n")
        else:  # the policy's line for this job says what the ranks saw: the state's class replaces it
            lines = (run_dir / "attempts.jsonl").read_text().splitlines()
            last = json.loads(lines[-1])
            last.update(failure_class=failure_class, decision=ending["decision"], why=why, host=state.nodes)
            (run_dir / "attempts.jsonl").write_text("\n".join([*lines[:-1], json.dumps(last)]) + "\n")


class _Resubmit(dg.Failure):
    """The policy ended the job requeue-able: the launcher submits it again itself."""


def _written_since(path: Path, when: float) -> bool:
    """Whether ``path`` was written by this job (after its submission), not by an earlier one."""
    try:
        return path.stat().st_mtime >= when
    except OSError:
        return False


def _a_rank_ended(run_dir: Path, since: float) -> bool:
    """Whether a rank of the job submitted at ``since`` has recorded its end (or its node's policy the
    run's): the cause to ask the job's nodes whether they are still there."""
    return _written_since(run_dir / "ending.json", since) or any(
        _written_since(path, since) for path in (run_dir / "ranks").glob("rank_*.json"))


def _step_reached(run_dir: Path, state: JobState, ranks_view: Mapping[str, Any] | None) -> int | None:
    """The step the run had reached when the node was lost: the furthest step a surviving rank
    recorded in this job, else the rank-level ending's, else None."""
    from trainer.endings import read_rank_ends

    steps = [record.get("step") for rank, record in read_rank_ends(run_dir).items()
             if _written_since(run_dir / "ranks" / f"rank_{rank}.json", state.submitted_at)]
    steps = [step for step in steps if isinstance(step, int)]
    if steps:
        return max(steps)
    step = (ranks_view or {}).get("step")
    if isinstance(step, int):
        return step
    # No rank recorded an end (SLURM killed the survivors while they waited on the lost peer): the
    # last step each rank finished, from its Prometheus textfile (trainer/observe/prometheus.py).
    finished = []
    for path in (run_dir / "metrics").glob("rank-*.prom"):
        if not _written_since(path, state.submitted_at):
            continue
        try:
            match = re.search(r"^trainyard_step\{[^}]*\} ([0-9.e+]+)$", path.read_text(), re.MULTILINE)
        except OSError:
            continue
        if match:
            finished.append(int(float(match.group(1))))
    return max(finished) if finished else None


def _replace_or_append_attempt(run_dir: Path, line: Mapping[str, Any], *, replace: bool) -> None:
    """attempts.jsonl with ``line`` as this job's entry: replacing the one the first node's policy
    wrote for the same attempt (``replace``), else added. A last line that is not that attempt's (cut
    short, or an earlier attempt's) is kept as it is: a record is never dropped."""
    path = run_dir / "attempts.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    kept: dict[str, Any] = {}
    if replace and lines:
        try:  # what only the ranks knew (when the attempt started, its first step) stays
            last = json.loads(lines[-1])
        except ValueError:
            last = None
        if isinstance(last, dict) and last.get("attempt") == line.get("attempt"):
            kept, lines = last, lines[:-1]
    path.write_text("\n".join([*lines, json.dumps({"restored_step": None, "sample_ids": [], **kept, **line})]) + "\n")
