"""The plain computations behind the report assets (assets/reports.py): comm_benchmark, scaling_report,
cost_report and canary. No Dagster; torch only inside the functions that run collectives.

    write_report(directory, report, png)          # report.json + plot.png, written atomically
    bucket_bytes(numels, element_bytes=4)        # DDP's gradient buckets for these parameters
    time_collectives(sizes_bytes, world_size=2)  # all_reduce / all_gather / reduce_scatter on spawned ranks
    collective_rows(settings, device)            # the same, in a process group already joined (comm_pairs)
    run_workloads([(run_dir, config_path, nproc, overrides)])       # the trainer (torchrun for > 1 rank)
    scaling_rows(finals) / cost_report(data_root, prices) / compare_arms(run_a, run_b, tolerances)

Every report carries ``status``: "empty" (no input yet, said in ``empty_reason``), "ok", or for the
canary "passed" / "failed".
"""

from __future__ import annotations

import io
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ops import process_tree
from ops.publish.durable import write_file_atomic
from ops.publish.paths import REPO_ROOT

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb=25, in MiB (torch's _MB_TO_BYTES)
DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
RUN_ROOTS = ("runs", "drills", "fault_drills")


def write_report(directory: Path, report: Mapping[str, Any], png: bytes | None) -> Path:
    """``directory``/report.json (and plot.png): the plot first, the JSON that names it last."""
    directory.mkdir(parents=True, exist_ok=True)
    if png is not None:
        write_file_atomic(directory / "plot.png", png)
    path = directory / "report.json"
    write_file_atomic(path, json.dumps(report, indent=2, sort_keys=True, default=str).encode())
    return path


def empty_report(name: str, reason: str, **fields: Any) -> dict[str, Any]:
    return {"report": name, "status": "empty", "empty_reason": reason, **fields}


def _png(figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.tight_layout()
    figure.savefig(buffer, format="png", dpi=90)
    plt.close(figure)
    return buffer.getvalue()


def _figure(num_axes: int = 1):
    import matplotlib

    matplotlib.use("Agg")  # no display in a Dagster step
    import matplotlib.pyplot as plt

    return plt.subplots(1, num_axes, figsize=(5 * num_axes, 3.6), squeeze=False)


# ---------------------------------------------------------------------------------------------
# Communication


def bus_bandwidth(collective: str, algbw: float, world_size: int) -> float:
    """Bus bandwidth from algorithm bandwidth, as nccl-tests' doc/PERFORMANCE.md defines it:
    all_reduce busbw = algbw * 2(n-1)/n; all_gather and reduce_scatter busbw = algbw * (n-1)/n,
    where their algbw counts the total size (n x the per-rank chunk, see collective_bytes)."""
    n = world_size
    if collective == "all_reduce":
        return algbw * 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter"):
        return algbw * (n - 1) / n
    raise ValueError(f"unknown collective {collective!r}; one of {COLLECTIVES}")


def collective_bytes(collective: str, numel: int, element_bytes: int) -> int:
    """The size S nccl-tests times: all_reduce's buffer; for all_gather the gathered output and for
    reduce_scatter the scattered input, both n x the per-rank chunk (``numel`` is that total)."""
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; one of {COLLECTIVES}")
    return numel * element_bytes


def bucket_bytes(numels: Sequence[int], *, element_bytes: int = 4, cap_bytes: int = DDP_BUCKET_CAP_BYTES,
                 first_bytes: int = DDP_FIRST_BUCKET_BYTES) -> list[int]:
    """The gradient buckets DDP forms in steady state for parameters of these sizes (model order):
    after its first iteration the reducer rebuilds buckets in gradient-ready order (about the reverse
    of the parameter order) with a small first bucket and ``cap_bytes`` after it."""
    import torch
    import torch.distributed as dist

    ready_order = list(reversed(numels))
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[element_bytes]
    tensors = [torch.empty(numel, dtype=dtype, device="meta") for numel in ready_order]
    limits = [first_bytes, cap_bytes] if first_bytes < cap_bytes else [cap_bytes]
    buckets, _limits = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    return [sum(ready_order[index] for index in bucket) * element_bytes for bucket in buckets]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class CommSettings:
    """What time_collectives measures."""

    sizes_bytes: tuple[int, ...]
    """Message sizes (the total S of each collective)."""
    world_size: int = 2
    iterations: int = 20
    """Timed iterations per collective and size; the median is reported."""
    warmup: int = 5
    backend: str = ""
    """'' picks NCCL where CUDA has world_size devices, else gloo."""

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"a collective benchmark needs at least 2 ranks, got {self.world_size}")
        if self.iterations < 1 or self.warmup < 0:
            raise ValueError(f"iterations must be >= 1 and warmup >= 0, got {self.iterations}, {self.warmup}")
        if any(size <= 0 for size in self.sizes_bytes):
            raise ValueError(f"message sizes must be positive, got {list(self.sizes_bytes)}")


def _resolved_backend(settings: CommSettings) -> str:
    import torch

    if settings.backend:
        return settings.backend
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= settings.world_size else "gloo"


def time_collectives(settings: CommSettings) -> dict[str, Any]:
    """Each collective at each size on ``world_size`` spawned processes (real process group, free TCP
    port): per-iteration time is the slowest rank's, the figure the median after warm-up."""
    import tempfile

    import torch.multiprocessing as mp

    backend = _resolved_backend(settings)
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "result.json"
        mp.spawn(_collective_worker, args=(settings, backend, free_port(), str(out)), nprocs=settings.world_size,
                 join=True)
        rows = json.loads(out.read_text())
    return {"backend": backend, "world_size": settings.world_size, "dtype": "float32", "iterations": settings.iterations,
            "warmup": settings.warmup, "rows": rows}


def _collective_worker(rank: int, settings: CommSettings, backend: str, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    n = settings.world_size
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    try:
        rows = collective_rows(settings, device)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def collective_rows(settings: CommSettings, device) -> list[dict[str, Any]]:
    """Each collective at each size in the process group this rank has joined (every rank calls it):
    one row per collective and size, the median of the slowest rank's times. Also the worker of
    ops/drills/comm_pairs.py, one rank per SLURM node."""
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)  # *_into_tensor's rename notice, per call
    n = dist.get_world_size()
    rows = []
    for size in settings.sizes_bytes:
        numel = max(n, size // 4 // n * n)  # float32, divisible into n chunks
        full = torch.ones(numel, device=device)
        chunk = torch.ones(numel // n, device=device)
        ops = {"all_reduce": lambda full=full: dist.all_reduce(full),
               "all_gather": lambda full=full, chunk=chunk: dist.all_gather_into_tensor(full, chunk),
               "reduce_scatter": lambda full=full, chunk=chunk: dist.reduce_scatter_tensor(chunk, full)}
        for collective, op in ops.items():
            times = _timed(op, settings, device)
            time_s = statistics.median(times)
            nbytes = collective_bytes(collective, numel, 4)
            algbw = nbytes / time_s
            rows.append({"collective": collective, "size_bytes": nbytes, "time_s": time_s,
                         "algbw_gbps": algbw / 1e9, "busbw_gbps": bus_bandwidth(collective, algbw, n) / 1e9})
    return rows


def _timed(op, settings: CommSettings, device) -> list[float]:
    """Per-iteration seconds, the slowest rank's (one small all_reduce of MAX after each timing)."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(settings.warmup):
        op()
    sync()
    times = torch.zeros(settings.iterations, dtype=torch.float64)
    for index in range(settings.iterations):
        dist.barrier()
        start = time.perf_counter()
        op()
        sync()
        times[index] = time.perf_counter() - start
    times = times.to(device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.cpu().tolist()


def plot_comm(report: Mapping[str, Any]) -> bytes:
    figure, axes = _figure()
    ax = axes[0][0]
    for collective in COLLECTIVES:
        rows = sorted((row for row in report["rows"] if row["collective"] == collective), key=lambda r: r["size_bytes"])
        ax.plot([row["size_bytes"] for row in rows], [row["busbw_gbps"] for row in rows], marker="o", label=collective)
    ax.set(xscale="log", xlabel="message size (bytes)", ylabel="bus bandwidth (GB/s)",
           title=f"{report['backend']}, {report['world_size']} ranks")
    ax.legend()
    return _png(figure)


def plot_pairs(report: Mapping[str, Any]) -> bytes:
    """comm_benchmark's node-pair mode (ops/drills/comm_pairs.py): each pair's bandwidth, outliers in red,
    the outlier threshold dashed."""
    figure, axes = _figure()
    ax = axes[0][0]
    names = list(report["pairs"])
    values = [report["pairs"][name]["bandwidth_bytes_per_s"] / 1e6 for name in names]
    ax.bar(names, values, color=["tab:red" if name in report["outlier_pairs"] else "tab:blue" for name in names])
    ax.axhline(report["outlier_fraction"] * report["reference_bytes_per_s"] / 1e6, linestyle="--", color="gray")
    ax.set(yscale="log", ylabel="algbw at the largest size (MB/s)", title=f"node pairs of {report['partition']}")
    ax.tick_params(axis="x", labelrotation=45)
    return _png(figure)


# ---------------------------------------------------------------------------------------------
# Workloads (scaling, canary): the real trainer under torchrun


class WorkloadFailed(RuntimeError):
    """A report's training workload ended without a completed final.json; names the run folder."""


def _command(run_dir: Path, config_path: str | Path, nproc: int, overrides: Sequence[str]) -> list[str]:
    # One rank runs the trainer directly (no torchrun agent: seconds less per run, the same process).
    launcher = (["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else [])
    return [sys.executable, *launcher, "-m", "trainer.train", "--config", str(config_path),
            *[item for override in (*overrides, f"train.run_dir={run_dir}") for item in ("--set", override)]]


def _completed(run_dir: Path) -> dict[str, Any] | None:
    record = _read_json(run_dir / "final.json")
    return record if record and record.get("status") == "completed" else None


def run_workloads(jobs: Sequence[tuple[Path, str | Path, int, Sequence[str]]], *, side_by_side: bool = False,
                  timeout_s: float = 1800) -> list[dict[str, Any]]:
    """The trainer on each (run_dir, config_path, nproc, overrides); their final.json records. A folder
    that holds a completed final.json is reused: the callers name folders by what they run.
    ``side_by_side`` starts them together (numerics only: never for a timing), else one after another."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("DAGSTER_PIPES")}
    pending = [job for job in jobs if _completed(job[0]) is None]
    started: list[tuple[Path, subprocess.Popen]] = []
    for run_dir, config_path, nproc, overrides in pending:
        run_dir.mkdir(parents=True, exist_ok=True)
        log = open(run_dir / "workload.log", "w")  # noqa: SIM115 (closed by the child's end below)
        process = subprocess.Popen(_command(run_dir, config_path, nproc, overrides), cwd=REPO_ROOT, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        started.append((run_dir, process))
        if not side_by_side:
            _wait(run_dir, process, timeout_s)
    try:
        for run_dir, process in started:
            _wait(run_dir, process, timeout_s)
    finally:  # one failed or timed out: the others side by side with it are not left running
        for _run_dir, process in started:
            if process.poll() is None:
                process_tree.kill_tree(process)
    records = []
    for run_dir, *_rest in jobs:
        record = _completed(run_dir)
        assert record is not None, run_dir  # _wait raised otherwise
        records.append(record)
    return records


def _wait(run_dir: Path, process: subprocess.Popen, timeout_s: float) -> None:
    try:
        returncode = process.wait(timeout=timeout_s)
    except BaseException as error:  # past its time or interrupted: the workload goes with torchrun's ranks
        process_tree.kill_tree(process)
        if isinstance(error, subprocess.TimeoutExpired):
            raise WorkloadFailed(f"workload in {run_dir} took over {timeout_s} s and was killed with its ranks; "
                                 f"workload.log: {run_dir / 'workload.log'}") from error
        raise
    if returncode != 0 or _completed(run_dir) is None:
        lines = (run_dir / "workload.log").read_text().splitlines()
        # Each rank's own exception first: torchrun's summary at the end names only exit codes.
        errors = [line for line in lines if line[:1].isalpha() and "Error" in line.split(":")[0]][:4]
        tail = "\n".join([*errors, "...", *lines[-15:]])
        raise WorkloadFailed(f"workload in {run_dir} failed (exit {returncode}); workload.log:\n{tail}")


def scaling_rows(finals: Mapping[int, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Throughput per world size and efficiency = throughput(n) / (n x throughput(1)), weak scaling."""
    base = finals[1]["performance"]["samples_per_s"] if 1 in finals else None
    rows = []
    for world_size, final in sorted(finals.items()):
        performance, plan = final["performance"], final["launch_plan"]
        throughput = performance["samples_per_s"]
        rows.append({"world_size": world_size, "global_batch": final["data"]["global_batch"],
                     "per_device_batch": plan["local_batch_size"], "samples_per_s": throughput,
                     "step_time_s": performance["step_time_s"], "num_steady_steps": performance["num_steady_steps"],
                     "efficiency": throughput / (world_size * base) if base else None,
                     "clip_shapes": performance.get("clip_shapes", []), "precision": final["precision"]["policy"]})
    return rows


def node_scaling_rows(finals: Mapping[int, Mapping[str, Any]],
                      hosts: Mapping[int, Sequence[str]]) -> list[dict[str, Any]]:
    """Throughput per node count (each run's steady steps, global samples) and efficiency against the
    fewest nodes: samples_per_s(n) / (n / n0 x samples_per_s(n0)). The hosts each count ran on are
    kept, so that the baseline's node is named; ``samples_per_s_per_node`` is the per-node share."""
    base_nodes = min(finals)
    base = finals[base_nodes]["performance"]["samples_per_s"]
    rows = []
    for nodes, final in sorted(finals.items()):
        performance, plan = final["performance"], final["launch_plan"]
        throughput = performance["samples_per_s"]
        rows.append({"nodes": nodes, "world_size": plan["world_size"], "hosts": list(hosts.get(nodes, [])),
                     "global_batch": final["data"]["global_batch"], "per_device_batch": plan["local_batch_size"],
                     "samples_per_s": throughput, "samples_per_s_per_node": throughput / nodes,
                     "step_time_s": performance["step_time_s"], "num_steady_steps": performance["num_steady_steps"],
                     "efficiency": throughput / (nodes / base_nodes * base) if base else None,
                     "clip_shapes": performance.get("clip_shapes", []), "precision": final["precision"]["policy"]})
    return rows


def plot_scaling(rows: Sequence[Mapping[str, Any]], *, unit: str = "ranks") -> bytes:
    """Throughput and efficiency against ranks (``world_size``) or nodes (``nodes``)."""
    key = "nodes" if unit == "nodes" else "world_size"
    figure, axes = _figure(2)
    counts = [row[key] for row in rows]
    axes[0][0].plot(counts, [row["samples_per_s"] for row in rows], marker="o", label="measured")
    if rows:
        axes[0][0].plot(counts, [rows[0]["samples_per_s"] * n / counts[0] for n in counts], linestyle="--",
                        label="linear")
    axes[0][0].set(xlabel=unit, ylabel="samples / s (global)", title="throughput")
    axes[0][0].legend()
    axes[0][1].plot(counts, [row["efficiency"] for row in rows], marker="o")
    axes[0][1].set(xlabel=unit, ylabel=f"throughput(n) / (n / {counts[0] if counts else 1} x throughput)",
                   title="scaling efficiency", ylim=(0, 1.2))
    return _png(figure)


# ---------------------------------------------------------------------------------------------
# Cost


class PriceMissing(ValueError):
    """A run used a device type the price table does not price."""


CPU_DEVICE = "cpu"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunCost:
    run_dir: str
    stage: str
    data_version: str
    status: str
    device_type: str
    num_devices: int
    """GPUs (world size) on a GPU run; machines (node_count) on a CPU run: CPUs are priced per machine-hour."""
    elapsed_s: float
    elapsed_from: str
    checkpoint_s: float
    num_checkpoints: int

    @property
    def device_hours(self) -> float:
        return self.elapsed_s * self.num_devices / 3600


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def _seconds(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


COPIED_RECORDS = frozenset({"original_records", "from_store"})
"""Folders under a drill holding copies of another run's records (ops/drills/restore_drill.py)."""


def run_folders(data_root: Path) -> list[Path]:
    """Every training run folder under runs/, drills/ and fault_drills/: a folder holding a launch
    record, a final.json, attempts or per-rank samples, whatever state the run ended in."""
    found = []
    for root in RUN_ROOTS:
        for marker in ("launch.json", "final.json", "attempts.jsonl", "samples/rank_0.json"):
            found += [path.parent.parent if marker.startswith("samples/") else path.parent
                      for path in (data_root / root).glob(f"**/{marker}")]
    # A restore drill's copies of the original run's records (or checkpoints fetched from the store) are
    # that run again, not another one: billing them would count the original once per drill.
    return sorted({path for path in found if not set(path.parts) & COPIED_RECORDS})


def _elapsed(run_dir: Path, final: Mapping[str, Any] | None) -> tuple[float, str]:
    """Wall time of every attempt: attempts.jsonl (trainer/supervisor/elastic.py) when there, else final.json's
    start and end, else (a run that died before writing either) from rank 0's process start to the
    last write in its folder."""
    attempts = _attempts(run_dir)
    timed = [entry for entry in attempts if _attempt_seconds(entry) is not None]
    if timed:
        untimed = len(attempts) - len(timed)  # e.g. SLURM's line for a job it ended before the policy wrote one
        how = "attempts.jsonl" + (f" ({untimed} attempt(s) without a duration not counted)" if untimed else "")
        return sum(_attempt_seconds(entry) for entry in timed), how
    if final and final.get("started_at") and final.get("ended_at"):
        return _seconds(final["started_at"], final["ended_at"]), "final.json"
    samples = _read_json(run_dir / "samples" / "rank_0.json") or {}
    start = samples.get("startup", {}).get("process_start_s")
    if start is None:
        return 0.0, "none"
    last = max(path.stat().st_mtime for path in run_dir.rglob("*") if path.is_file())
    return max(0.0, last - float(start)), "samples/rank_0.json start to the folder's last write"


def _attempts(run_dir: Path) -> list[dict]:
    """attempts.jsonl's lines (trainer/supervisor/elastic.py); a torn last line (a writer killed mid-line) is left out,
    as resources.launcher.read_attempts does."""
    path = run_dir / "attempts.jsonl"
    if not path.is_file():
        return []
    found = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            found.append(entry)
    return found


def _attempt_seconds(entry: Mapping[str, Any]) -> float | None:
    if isinstance(entry.get("duration_s"), (int, float)):
        return float(entry["duration_s"])
    if entry.get("started_at") and entry.get("ended_at"):
        return _seconds(entry["started_at"], entry["ended_at"])
    return None


def checkpoint_seconds(run_dir: Path) -> tuple[float, int]:
    """Time spent writing committed checkpoints: per checkpoint, from its first finished data file to
    its COMMITTED.json record (ops.checkpoints.store writes the record last). A lower bound: the first
    file's own write and the state-dict staging before it are not in it."""
    from ops.checkpoints import store  # the one place checkpoint paths are built

    total, count = 0.0, 0
    for info in store.list_checkpoints(run_dir):
        record_path = info.path / store.RECORD_NAME
        if info.status != "committed" or not record_path.is_file():
            continue
        record = json.loads(record_path.read_text())
        files = [path.stat().st_mtime for path in info.path.iterdir() if path.name != store.RECORD_NAME]
        if files:
            total += max(0.0, float(record["created_unix_s"]) - min(files))
        count += 1
    return total, count


def _device(final: Mapping[str, Any] | None, launch: Mapping[str, Any] | None) -> tuple[str, int]:
    """(device type, devices billed). GPU: gpu_model x world size; CPU: 'cpu' x machines."""
    environment = (final or {}).get("environment") or {}
    world_size = int((final or {}).get("world_size") or (launch or {}).get("world_size") or 1)
    if environment.get("gpu_model"):
        return str(environment["gpu_model"]), world_size
    if environment:
        return CPU_DEVICE, int(environment.get("node_count") or 1)
    device = ((launch or {}).get("config") or {}).get("train", {}).get("device", "")
    if device == "cpu":
        return CPU_DEVICE, 1
    return f"unrecorded ({device or 'no environment or launch record'})", world_size


def run_cost(run_dir: Path) -> RunCost:
    final, launch = _read_json(run_dir / "final.json"), _read_json(run_dir / "launch.json")
    config = (final or {}).get("config") or (launch or {}).get("config") or {}
    stage = ((launch or {}).get("stage") or ((final or {}).get("lineage") or {}).get("stage")
             or config.get("stage", {}).get("stage") or run_dir.name.split("-")[0])
    data = config.get("data", {})
    if launch and launch.get("shard_index_version"):
        data_version = f"{launch['shard_index_version']} (manifest {launch.get('manifest_version')})"
    else:
        data_version = data.get("manifest_version") or data.get("source") or "unrecorded"
    elapsed_s, elapsed_from = _elapsed(run_dir, final)
    device_type, num_devices = _device(final, launch)
    checkpoint_s, num_checkpoints = checkpoint_seconds(run_dir)
    status = (final or {}).get("status") or "abandoned (no final.json)"
    return RunCost(run_dir=str(run_dir), stage=stage, data_version=data_version, status=status,
                   device_type=device_type, num_devices=num_devices, elapsed_s=elapsed_s, elapsed_from=elapsed_from,
                   checkpoint_s=checkpoint_s, num_checkpoints=num_checkpoints)


def cost_report(data_root: Path, prices_per_hour: Mapping[str, float]) -> dict[str, Any]:
    """Cost of every run folder, by stage and by data version; PriceMissing names an unpriced device."""
    runs = [run_cost(path) for path in run_folders(data_root)]
    if not runs:
        return empty_report("cost_report", f"no training run folders under {data_root} ({', '.join(RUN_ROOTS)})",
                            prices_per_hour=dict(prices_per_hour))
    missing = sorted({run.device_type for run in runs} - set(prices_per_hour))
    if missing:
        users = [run.run_dir for run in runs if run.device_type in missing][:3]
        raise PriceMissing(f"the price table has no price for device type(s) {', '.join(map(repr, missing))}, "
                           f"used by {', '.join(users)}; add them to prices_per_hour")
    rows = []
    for run in runs:
        price = prices_per_hour[run.device_type]
        rows.append({**{name: getattr(run, name) for name in RunCost.__slots__}, "device_hours": run.device_hours,
                     "cost": run.device_hours * price,
                     "checkpoint_cost": run.checkpoint_s * run.num_devices / 3600 * price})
    by_stage, by_data = defaultdict(float), defaultdict(float)
    for row in rows:
        by_stage[row["stage"]] += row["cost"]
        by_data[row["data_version"]] += row["cost"]
    return {"report": "cost_report", "status": "ok", "prices_per_hour": dict(prices_per_hour),
            "billing": "GPU runs per GPU-hour (world size x wall time); CPU runs per machine-hour (node count x wall time)",
            "num_runs": len(rows), "num_unfinished": sum(row["status"] != "completed" for row in rows),
            "total_cost": sum(row["cost"] for row in rows), "total_device_hours": sum(row["device_hours"] for row in rows),
            "checkpoint_cost": sum(row["checkpoint_cost"] for row in rows),
            "by_stage": dict(by_stage), "by_data_version": dict(by_data), "runs": rows}


def plot_cost(report: Mapping[str, Any]) -> bytes:
    figure, axes = _figure(2)
    for ax, key, title in ((axes[0][0], "by_stage", "cost by stage"), (axes[0][1], "by_data_version", "cost by data version")):
        names = list(report[key])
        ax.barh([name[:24] for name in names], [report[key][name] for name in names])
        ax.set(xlabel="cost", title=title)
    return _png(figure)


# ---------------------------------------------------------------------------------------------
# Canary


class CanaryDataMismatch(ValueError):
    """The canary's two arms did not see the same data, so their curves are not comparable."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tolerances:
    """|b - a| <= atol + rtol x |a| at every compared step, for loss and for gradient norm."""

    loss_rtol: float = 0.02
    loss_atol: float = 1e-4
    grad_norm_rtol: float = 0.05
    grad_norm_atol: float = 1e-4
    max_steps: int = 20
    """Steps compared, from the first."""

    def __post_init__(self) -> None:
        if min(self.loss_rtol, self.loss_atol, self.grad_norm_rtol, self.grad_norm_atol) < 0 or self.max_steps < 1:
            raise ValueError(f"canary tolerances must be >= 0 and max_steps >= 1, got {self}")


def sample_order(run_dir: Path) -> dict[int, dict[int, list[str]]]:
    """Per rank, per step, the sample keys the run consumed (samples/rank_R.json)."""
    order = {}
    for path in sorted((run_dir / "samples").glob("rank_*.json")):
        record = json.loads(path.read_text())
        order[int(record["rank"])] = {int(step): list(keys) for step, keys in record["steps"]}
    return order


def _data_identity(final: Mapping[str, Any]) -> dict[str, Any]:
    data = final["config"]["data"]
    return {key: data.get(key) for key in ("source", "shard_index", "manifest_version", "split", "seed")}


def check_same_data(run_a: Path, run_b: Path, final_a: Mapping, final_b: Mapping, num_steps: int) -> None:
    """CanaryDataMismatch unless both arms read the same data version and the same sample keys at every
    compared step on every rank."""
    ident_a, ident_b = _data_identity(final_a), _data_identity(final_b)
    if ident_a != ident_b:
        differ = {key: (ident_a[key], ident_b[key]) for key in ident_a if ident_a[key] != ident_b[key]}
        raise CanaryDataMismatch(f"canary arms read different data: {differ} (arm A vs arm B)")
    order_a, order_b = sample_order(run_a), sample_order(run_b)
    if not order_a or sorted(order_a) != sorted(order_b):
        raise CanaryDataMismatch(f"canary arms' sample records differ in ranks: {sorted(order_a)} vs {sorted(order_b)} "
                                 f"({run_a}/samples, {run_b}/samples)")
    for rank in sorted(order_a):
        for step in range(1, num_steps + 1):
            keys_a, keys_b = order_a[rank].get(step), order_b[rank].get(step)
            if keys_a is None or keys_a != keys_b:
                raise CanaryDataMismatch(f"canary arms saw different samples at step {step} on rank {rank}: "
                                         f"{keys_a} vs {keys_b}; the arms must share data order and shard index")


def _within(a: float, b: float, rtol: float, atol: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(b - a) <= atol + rtol * abs(a)


def compare_arms(run_a: Path, run_b: Path, tolerances: Tolerances) -> dict[str, Any]:
    """The canary verdict of two run folders of the same workload: loss and grad norm step by step."""
    final_a, final_b = json.loads((run_a / "final.json").read_text()), json.loads((run_b / "final.json").read_text())
    num_steps = min(len(final_a["losses"]), len(final_b["losses"]), tolerances.max_steps)
    if num_steps == 0:
        return empty_report("canary", "neither arm recorded a step", arms=[str(run_a), str(run_b)])
    check_same_data(run_a, run_b, final_a, final_b, num_steps)
    steps = []
    for index in range(num_steps):
        loss_a, loss_b = final_a["losses"][index], final_b["losses"][index]
        norm_a, norm_b = final_a["grad_norms"][index], final_b["grad_norms"][index]
        steps.append({"step": index + 1, "loss_a": loss_a, "loss_b": loss_b, "grad_norm_a": norm_a, "grad_norm_b": norm_b,
                      "loss_ok": _within(loss_a, loss_b, tolerances.loss_rtol, tolerances.loss_atol),
                      "grad_norm_ok": _within(norm_a, norm_b, tolerances.grad_norm_rtol, tolerances.grad_norm_atol)})
    failed = [row["step"] for row in steps if not (row["loss_ok"] and row["grad_norm_ok"])]
    return {"report": "canary", "status": "failed" if failed else "passed", "passed": not failed,
            "failed_steps": failed, "num_steps": num_steps, "tolerances": {name: getattr(tolerances, name)
                                                                            for name in Tolerances.__slots__},
            "max_loss_abs_delta": max(abs(row["loss_b"] - row["loss_a"]) for row in steps),
            "max_grad_norm_abs_delta": max(abs(row["grad_norm_b"] - row["grad_norm_a"]) for row in steps),
            "arms": {"a": str(run_a), "b": str(run_b)},
            "precision": {"a": final_a["precision"]["policy"], "b": final_b["precision"]["policy"]}, "steps": steps}


def plot_canary(report: Mapping[str, Any]) -> bytes:
    figure, axes = _figure(2)
    steps = [row["step"] for row in report["steps"]]
    for ax, key in ((axes[0][0], "loss"), (axes[0][1], "grad_norm")):
        ax.plot(steps, [row[f"{key}_a"] for row in report["steps"]], marker="o", label="A")
        ax.plot(steps, [row[f"{key}_b"] for row in report["steps"]], marker="x", label="B")
        ax.set(xlabel="step", ylabel=key, title=f"{key}: {report['status']}")
        ax.legend()
    return _png(figure)


# ---------------------------------------------------------------------------------------------
# Sweeps (trainer.launch.sweep.sweep_report)


def plot_sweep(report: Mapping[str, Any]) -> bytes:
    """Each trial's validation loss against consumed samples (not wall-clock): pruned trials dashed and
    ended with an x at the step the rule stopped them, the best trial drawn thicker."""
    figure, axes = _figure(1)
    ax = axes[0][0]
    best = (report.get("best") or {}).get("trial_id")
    for row in report["trials"]:
        if not row["curve"]:
            continue
        samples = [point[0] for point in row["curve"]]
        losses = [point[2] for point in row["curve"]]
        pruned = row["state"] == "pruned"
        label = f"{row['trial_id']} ({row['state']})"
        line, = ax.plot(samples, losses, linestyle="--" if pruned else "-", linewidth=2.5 if row["trial_id"] == best
                        else 1.2, marker="o", markersize=3, label=label)
        if pruned:
            ax.plot(samples[-1:], losses[-1:], marker="x", markersize=10, color=line.get_color())
    ax.set(xlabel="consumed samples", ylabel=report["objective"]["metric"],
           title=f"sweep {report['sweep']}: {report['counts']['complete']} complete, {report['counts']['pruned']} pruned")
    ax.legend(fontsize=6)
    return _png(figure)
