"""Collective bandwidth between every pair of SLURM nodes: which node, or which link, is slow.

    settings = PairSettings(partition="nodes", sizes_bytes=(65536, 1048576), out_dir=Path("/shared/pairs"))
    report = run_node_pairs(settings)            # one 2-node SLURM job per pair, one after the other
    report["pairs"]["node1-node2"]["rows"]       # per collective and size: time_s (median), algbw_bytes_per_s
    report["outlier"], report["outlier_rule"]    # the slowest outlier pair (or None), and the rule

What each job runs, one rank per node (gloo, CPU tensors), writing ``<out_dir>/<a>-<b>.json``:

    srun python -m ops.drills.comm_pairs --worker --out DIR/node1-node2.json --sizes 65536,1048576

The collectives are ops/drills/reports.py's (``collective_rows``): all_reduce, all_gather and
reduce_scatter, the median over the timed iterations of the slower rank's time, algbw = bytes / time.

Pairs are measured one at a time: two pairs sharing the bridge or a CPU at once would measure each
other. Every job carries a SLURM time limit and the wait for it a deadline (pending for at most
``queue_wait_s``, running for at most the time limit and a grace); on any error the jobs started and
not yet ended are cancelled before the error is raised, which names the pair and the job.

Outlier rule (``OUTLIER_RULE``): a pair's bandwidth is the median over the collectives of the algbw
at the largest size; a node's bandwidth is the best of its pairs' (a healthy node reaches at least
one peer at full speed, a node with a slow link reaches none). The reference is the median node's
bandwidth. A node below ``outlier_fraction`` x the reference is an outlier node, a pair below it an
outlier pair, and ``outlier`` is the slowest outlier pair. Nodes, not pairs, set the reference because
with three nodes one slow node slows two pairs of three: the median pair is then a slow one, and a
rule against the median pair would name nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.drills import reports
from ops.publish.durable import write_json_atomic
from ops.publish.paths import REPO_ROOT

OUTLIER_RULE = ("pair bandwidth = median over collectives of algbw at the largest size; node bandwidth = best of "
                "its pairs; outlier = a node or pair below {fraction:g} x the median node bandwidth "
                "({reference_bytes_per_s:.4g} B/s)")
USABLE_STATES = frozenset({"idle", "mixed", "allocated", "completing", "planned"})
"""sinfo's %T states a node may be paired in; any other flag (drained, draining, down, fail, ...) or a
suffix (``*`` not responding, ``~`` powered off, ...) leaves the node out."""
ENDED_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE"})
JOB_NAME = "trainyard-comm-pair"
PORT_BASE, PORT_SPAN = 29600, 20000
"""The rendezvous port is PORT_BASE + job id mod PORT_SPAN: each job its own, known on both nodes."""
RUN_GRACE_S = 60.0
"""Past the time limit, how long SLURM may take to end a job before the wait gives up on it."""


class PairJobFailed(RuntimeError):
    """A pair's job failed, timed out or left no results; the message names the pair and the job."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PairSettings:
    """What run_node_pairs measures, and where."""

    partition: str
    """SLURM partition whose nodes are paired; '' for the cluster's default partition."""
    sizes_bytes: tuple[int, ...]
    """Message sizes (each collective's total bytes), e.g. the model's DDP buckets and FSDP units."""
    out_dir: Path
    """Where each pair's JSON is written: a folder every node sees (the shared filesystem)."""
    nodes: tuple[str, ...] = ()
    """Nodes to pair (each must be in the partition, up and not drained); empty: every usable one."""
    exclude: tuple[str, ...] = ()
    """Nodes left out of the partition's (the launcher's --exclude)."""
    iterations: int = 5
    warmup: int = 2
    time_limit_s: int = 120
    """Each job's SLURM --time (rounded up to whole minutes, SLURM's unit)."""
    queue_wait_s: float = 120.0
    """How long a job may stay pending (the nodes busy with other jobs) before it is cancelled."""
    outlier_fraction: float = 0.5
    poll_s: float = 0.5
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self) -> None:
        if not self.sizes_bytes or any(size <= 0 for size in self.sizes_bytes):
            raise ValueError(f"message sizes must be positive and at least one, got {list(self.sizes_bytes)}")
        if self.iterations < 1 or self.warmup < 0:
            raise ValueError(f"iterations must be >= 1 and warmup >= 0, got {self.iterations}, {self.warmup}")
        if not 0 < self.outlier_fraction < 1:
            raise ValueError(f"outlier_fraction must be in (0, 1), got {self.outlier_fraction}")
        if self.time_limit_s <= 0 or self.queue_wait_s <= 0:
            raise ValueError(f"time_limit_s and queue_wait_s must be positive, got {self.time_limit_s}, "
                             f"{self.queue_wait_s}")


# ---------------------------------------------------------------------------------------------
# The nodes


def _slurm(*command: str, timeout_s: float = 30) -> str:
    """A SLURM command's stdout; PairJobFailed with its output when it fails or does not answer."""
    try:
        done = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError as error:
        raise PairJobFailed(f"{command[0]} not found: the node-pair benchmark needs a SLURM submit host") from error
    except subprocess.TimeoutExpired as error:
        raise PairJobFailed(f"{shlex.join(command)} did not answer in {timeout_s:g} s: is slurmctld up?") from error
    if done.returncode != 0:
        raise PairJobFailed(f"{shlex.join(command)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done.stdout


def partition_states(partition: str) -> tuple[str, dict[str, str]]:
    """(the partition's name, {node: sinfo state}); '' names the default partition. ValueError for an
    unknown partition, naming the known ones."""
    names = _slurm("sinfo", "-h", "-o", "%P").split()
    known = [name.rstrip("*") for name in names]
    if not partition:
        defaults = [name.rstrip("*") for name in names if name.endswith("*")]
        if not defaults:
            raise ValueError(f"no partition given and the cluster has no default one; one of {known}")
        partition = defaults[0]
    if partition not in known:
        raise ValueError(f"unknown SLURM partition {partition!r}; the cluster has {known}")
    states = {}
    for line in _slurm("sinfo", "-h", "-N", "-p", partition, "-o", "%N|%T").splitlines():
        name, _, state = line.strip().partition("|")
        if name:
            states[name] = state
    return partition, states


def usable(state: str) -> bool:
    flags = state.lower().split("+")
    return all(flag in USABLE_STATES for flag in flags)


def usable_nodes(partition: str, states: Mapping[str, str], *, nodes: Sequence[str] = (),
                 exclude: Sequence[str] = ()) -> list[str]:
    """The nodes to pair: ``nodes`` (each checked) or every usable node of the partition, less
    ``exclude``. ValueError naming the node for one not in the partition or not usable, and for
    fewer than 2 left."""
    for name in [*nodes, *exclude]:
        if name not in states:
            raise ValueError(f"node {name!r} is not in partition {partition!r} (its nodes: {', '.join(states)})")
    for name in nodes:
        if not usable(states[name]):
            raise ValueError(f"node {name!r} of partition {partition!r} is {states[name]}: only nodes that are up "
                             f"and not drained can be paired")
    chosen = [name for name in (nodes or states) if name not in exclude and usable(states[name])]
    if len(set(chosen)) < 2:
        raise ValueError(f"the node-pair benchmark needs at least 2 usable nodes in partition {partition!r}, got "
                         f"{sorted(set(chosen))} (states: {', '.join(f'{n}={s}' for n, s in states.items())})")
    return list(dict.fromkeys(chosen))


def pair_name(pair: Sequence[str]) -> str:
    return "-".join(pair)


# ---------------------------------------------------------------------------------------------
# One job per pair


def _sbatch_command(pair: tuple[str, str], partition: str, settings: PairSettings, out: Path) -> list[str]:
    worker = [settings.python, "-m", "ops.drills.comm_pairs", "--worker", "--out", str(out),
              "--sizes", ",".join(map(str, settings.sizes_bytes)), "--iterations", str(settings.iterations),
              "--warmup", str(settings.warmup), "--timeout-s", str(settings.time_limit_s)]
    minutes = max(1, math.ceil(settings.time_limit_s / 60))
    return ["sbatch", "--parsable", "-p", partition, "-N", "2", "-w", ",".join(pair), "--ntasks-per-node=1",
            f"--time={minutes}", "--no-requeue", f"--job-name={JOB_NAME}", f"--chdir={REPO_ROOT}",
            f"--output={out.with_suffix('.log')}", "--wrap", shlex.join(["srun", "--kill-on-bad-exit=1", *worker])]


def job_state(job_id: str) -> tuple[str, str]:
    """(state, exit code) of a job: the controller's view, else the accounting's; ('', '') while neither knows it."""
    try:
        text = _slurm("scontrol", "show", "job", "-o", job_id)
    except PairJobFailed as error:
        if "Invalid job id" not in str(error):
            raise
        text = ""
    match = re.search(r"\bJobState=(\S+)", text)
    if match:
        exit_code = re.search(r"\bExitCode=(\S+)", text)
        return match.group(1), exit_code.group(1) if exit_code else ""
    record = _slurm("sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,ExitCode").strip().splitlines()
    if not record:
        return "", ""
    state, _, exit_code = record[0].partition("|")
    return state.split()[0] if state else "", exit_code


def wait_for_job(job_id: str, pair: tuple[str, str], settings: PairSettings) -> tuple[str, str]:
    """Poll until the job ends: its (state, exit code). PairJobFailed when it stays pending past
    queue_wait_s or runs past its time limit and the grace (the caller cancels it)."""
    submitted = time.monotonic()
    started = None
    while True:
        state, exit_code = job_state(job_id)
        if state.split("+")[0] in ENDED_STATES:
            return state, exit_code
        now = time.monotonic()
        if state in ("RUNNING", "COMPLETING"):
            started = started or now
        if started is None and now - submitted > settings.queue_wait_s:
            raise PairJobFailed(f"node pair {pair_name(pair)}: SLURM job {job_id} did not start within "
                                f"{settings.queue_wait_s:g} s (state {state or 'unknown'}): are the nodes busy?")
        if started is not None and now - started > settings.time_limit_s + RUN_GRACE_S:
            raise PairJobFailed(f"node pair {pair_name(pair)}: SLURM job {job_id} ran past its time limit "
                                f"({settings.time_limit_s} s) and did not end")
        time.sleep(settings.poll_s)


def _log_tail(path: Path, num_lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    except FileNotFoundError:
        return "(no job log)"


def measure_pair(pair: tuple[str, str], partition: str, settings: PairSettings, active: set[str]) -> dict[str, Any]:
    """Submit the pair's job, wait for it, and return its result; ``active`` holds the job id while it runs."""
    out = settings.out_dir / f"{pair_name(pair)}.json"
    out.unlink(missing_ok=True)  # an earlier run's result must not pass for this one's
    job_id = _slurm(*_sbatch_command(pair, partition, settings, out)).strip().split(";")[0]
    active.add(job_id)
    state, exit_code = wait_for_job(job_id, pair, settings)
    active.discard(job_id)
    if not state.startswith("COMPLETED") or not out.exists():
        raise PairJobFailed(f"node pair {pair_name(pair)}: SLURM job {job_id} ended {state} (exit {exit_code}) "
                            f"without results; its log ({out.with_suffix('.log')}) ends:\n{_log_tail(out.with_suffix('.log'))}")
    result = json.loads(out.read_text())
    if sorted(result["hosts"]) != sorted(pair):
        raise PairJobFailed(f"node pair {pair_name(pair)}: SLURM job {job_id} ran on {result['hosts']}")
    return {**result, "job_id": job_id}


def cancel(job_ids: Sequence[str]) -> None:
    """scancel the jobs, then wait (bounded) until they leave the queue."""
    if not job_ids:
        return
    _slurm("scancel", *job_ids)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(job_state(job)[0].split("+")[0] not in ENDED_STATES for job in job_ids):
        time.sleep(0.5)


def run_node_pairs(settings: PairSettings) -> dict[str, Any]:
    """Every unordered pair of the usable nodes, one job after another (module docstring): the report
    with each pair's rows, the bandwidths and the outlier."""
    partition, states = partition_states(settings.partition)
    nodes = usable_nodes(partition, states, nodes=settings.nodes, exclude=settings.exclude)
    settings.out_dir.mkdir(parents=True, exist_ok=True)
    active: set[str] = set()
    results = {}
    try:
        for pair in itertools.combinations(nodes, 2):
            results[pair_name(pair)] = measure_pair(pair, partition, settings, active)
    except BaseException:
        cancel(sorted(active))  # an error, a timeout or an interrupt: leave no job of ours behind
        raise
    summary = outliers({name: pair_bandwidth(result["rows"]) for name, result in results.items()},
                       {name: result["hosts"] for name, result in results.items()}, settings.outlier_fraction)
    return {"partition": partition, "nodes": nodes, "backend": "gloo", "sizes_bytes": list(settings.sizes_bytes),
            "iterations": settings.iterations, "warmup": settings.warmup, "out_dir": str(settings.out_dir),
            "pairs": {name: {**result, "bandwidth_bytes_per_s": summary["pair_bandwidth_bytes_per_s"][name]}
                      for name, result in results.items()}, **summary}


# ---------------------------------------------------------------------------------------------
# The outlier


def pair_bandwidth(rows: Sequence[Mapping[str, Any]]) -> float:
    """The median over the collectives of the algbw (bytes/s) at the largest size."""
    largest = max(row["size_bytes"] for row in rows)
    return statistics.median(row["algbw_bytes_per_s"] for row in rows if row["size_bytes"] == largest)


def outliers(bandwidths: Mapping[str, float], hosts: Mapping[str, Sequence[str]], fraction: float) -> dict[str, Any]:
    """The outlier nodes and pairs by OUTLIER_RULE, from each pair's bandwidth and its two hosts."""
    node_bandwidths: dict[str, float] = {}
    for name, bandwidth in bandwidths.items():
        for host in hosts[name]:
            node_bandwidths[host] = max(node_bandwidths.get(host, 0.0), bandwidth)
    reference = statistics.median(node_bandwidths.values())
    slow_pairs = sorted((name for name, bandwidth in bandwidths.items() if bandwidth < fraction * reference),
                        key=bandwidths.__getitem__)
    return {"pair_bandwidth_bytes_per_s": dict(bandwidths), "node_bandwidth_bytes_per_s": node_bandwidths,
            "reference_bytes_per_s": reference, "outlier_fraction": fraction,
            "outlier_rule": OUTLIER_RULE.format(fraction=fraction, reference_bytes_per_s=reference),
            "outlier_nodes": sorted(host for host, bandwidth in node_bandwidths.items()
                                    if bandwidth < fraction * reference),
            "outlier_pairs": slow_pairs, "outlier": slow_pairs[0] if slow_pairs else None}


def pair_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per pair, collective and size, for a table."""
    return [{"pair": name, "collective": row["collective"], "size_bytes": row["size_bytes"], "time_s": row["time_s"],
             "algbw_bytes_per_s": row["algbw_bytes_per_s"], "outlier": name in report["outlier_pairs"]}
            for name, pair in report["pairs"].items() for row in pair["rows"]]


# ---------------------------------------------------------------------------------------------
# The worker: one rank per node of the pair's job


def worker(out: Path, settings: reports.CommSettings, timeout_s: float) -> None:
    """Join the job's process group (rank SLURM_PROCID, the first node of the allocation as the
    rendezvous), time the collectives, and on rank 0 write the rows and the ranks' host names."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    env = os.environ
    rank, world_size = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    first_node = _slurm("scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]).split()[0]
    port = PORT_BASE + int(env["SLURM_JOB_ID"]) % PORT_SPAN
    dist.init_process_group("gloo", init_method=f"tcp://{first_node}:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        hosts: list[Any] = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        rows = reports.collective_rows(settings, torch.device("cpu"))
        if rank == 0:
            rows = [{**row, "algbw_bytes_per_s": row["size_bytes"] / row["time_s"]} for row in rows]
            write_json_atomic(out, {"hosts": hosts, "rows": rows, "slurm_job_id": env["SLURM_JOB_ID"]})
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", required=True, help="run as one rank of a pair's job")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=120)
    args = parser.parse_args(argv)
    settings = reports.CommSettings(sizes_bytes=tuple(int(size) for size in args.sizes.split(",")),
                                    iterations=args.iterations, warmup=args.warmup, backend="gloo")
    worker(args.out, settings, args.timeout_s)


if __name__ == "__main__":
    main()
