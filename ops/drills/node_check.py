"""The health job of ``trainyard nodes check NODE`` (resources/node_health.py): one task on the node
under test and one on a healthy peer, started by ``srun``; each measures its own node and both time a
collective between them.

    python -m ops.drills.node_check --out DIR --master HOST --port PORT [--size-mb 16]

Each task writes ``DIR/<hostname>.json``:

    compute_gflops    float32 matmul throughput on this node's CPUs (or its GPU, if any)
    memory_gbps       copy bandwidth of a --size-mb tensor
    disk_write_mbps   --size-mb written to DIR (the shared filesystem the runs write to) and fsync'd
    allreduce_gbps    gloo all_reduce of --size-mb / 4 float32 between the two nodes (algorithmic
                      bandwidth: bytes / seconds), the median of the timed rounds
    errors            what failed to measure (a measurement that raised is 0.0 and named here)

Plain measurements: the judgement against the floors is the orchestrator's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta
from pathlib import Path


def _best_seconds(work, rounds: int) -> float:
    work()  # warm-up
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def compute_gflops(size: int = 256, rounds: int = 5) -> float:
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = _best_seconds(lambda: torch.mm(a, b), rounds)
    return 2 * size ** 3 / seconds / 1e9


def memory_gbps(size_mb: int, rounds: int = 5) -> float:
    import torch

    source = torch.ones(size_mb * 1024 * 1024 // 4)
    target = torch.empty_like(source)
    seconds = _best_seconds(lambda: target.copy_(source), rounds)
    return 2 * source.numel() * 4 / seconds / 1e9  # read + write


def disk_write_mbps(folder: Path, size_mb: int) -> float:
    path = folder / f".disk-{socket.gethostname()}-{os.getpid()}"
    block = os.urandom(1024 * 1024)
    started = time.perf_counter()
    try:
        with open(path, "wb") as handle:
            for _ in range(size_mb):
                handle.write(block)
            handle.flush()
            os.fsync(handle.fileno())
        return size_mb / (time.perf_counter() - started)
    finally:
        path.unlink(missing_ok=True)


def allreduce_gbps(*, master: str, port: int, rank: int, world: int, size_mb: int, rounds: int = 5,
                   timeout_s: float = 60.0) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        tensor = torch.ones(max(1, size_mb * 1024 * 1024 // 4))
        dist.all_reduce(tensor)  # warm-up: the connections
        times = []
        for _ in range(rounds):
            dist.barrier()
            started = time.perf_counter()
            dist.all_reduce(tensor)
            times.append(time.perf_counter() - started)
        return tensor.numel() * 4 / statistics.median(times) / 1e9
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.drills.node_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--master", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--size-mb", type=int, default=16)
    args = parser.parse_args(argv)
    rank, world = int(os.environ.get("SLURM_PROCID", "0")), int(os.environ.get("SLURM_NTASKS", "1"))
    result: dict = {"host": socket.gethostname(), "rank": rank, "world": world, "errors": {}}
    measures = {"compute_gflops": compute_gflops, "memory_gbps": lambda: memory_gbps(args.size_mb),
                "disk_write_mbps": lambda: disk_write_mbps(args.out, args.size_mb)}
    if world > 1:
        measures["allreduce_gbps"] = lambda: allreduce_gbps(master=args.master, port=args.port, rank=rank, world=world,
                                                            size_mb=args.size_mb // 4 or 1)
    for name, measure in measures.items():
        try:
            result[name] = round(measure(), 4)
        except Exception as error:  # noqa: BLE001 - recorded by name; the orchestrator fails the check on it
            result[name] = 0.0
            result["errors"][name] = f"{type(error).__name__}: {error}"[:500]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{result['host']}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0 if not result["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
