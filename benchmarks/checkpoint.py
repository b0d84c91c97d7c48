"""Checkpoint cost against the disk it writes to, side by side in one run.

    python -m benchmarks.checkpoint [--state-mb 600] [--repeats 3] [--thread-count 2]

Builds a model of 4096x4096 Linear layers with AdamW state (params + 2 moments) of at least
``--state-mb`` and measures, interleaved over ``--repeats`` rounds (medians reported):

- disk_write_MBps: the same number of bytes written with plain file I/O and one fsync;
- torch_save_s: torch.save of the model and optimizer state dicts to one file, plus fsync;
- dcp_save_s: a bare torch.distributed.checkpoint.save (FileSystemWriter, same thread count);
- sync_pause_s: Checkpointer.save with async off: DCP write, sha256 while writing, commit record,
  renames and fsyncs; save_MBps = state_bytes / sync_pause_s, ratio_vs_disk = save_MBps / disk;
- async_pause_s: Checkpointer.save with async on, what the training loop waits for (staging into
  the reused CPU copy) when the previous save has finished in the background; async_first_pause_s
  includes allocating that copy; async_commit_s is how long after save() returns the checkpoint
  is committed (background write, digests, record, latest);
- stage_floor_s: state_bytes over this machine's memcpy bandwidth, the least async staging can cost;
- load_s: Checkpointer.load (re-hash against the record, DCP read, set_state_dict);
- reshard_load_s: load, in this one process, of a checkpoint saved by 2 FSDP2 ranks (torchrun);
- object_store: the newest checkpoint published to S3 and fetched back (the mirror), and a save and
  a load straight through the store (stage.checkpoint_io=store: DCP's fsspec writer and reader),
  with the same save to local disk in the same round (direct_save_over_local).

Ratios are taken within each round (the disk's speed drifts between rounds), then the median.
Targets (checkpoint issue): ratio_vs_disk >= 0.7; async_over_sync (async / sync pause) <= 0.15.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict

from ops.checkpoints import store as store
from ops.loading.sampling import World
from trainer.checkpointing.checkpointer import DEFAULT_THREAD_COUNT, Checkpointer

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--state-mb", "8", "--repeats", "1", "--width", "256"]

WIDTH = 4096
_MB = 1e6


class Progress:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = state["step"]


def build(state_mb: int, world: World, width: int = WIDTH) -> dict:
    """Model + AdamW with state >= state_mb (each layer: 3 copies of width^2 fp32; 201 MB at 4096)."""
    num_layers = max(1, -(-int(state_mb * _MB) // (3 * 4 * width * width)))
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(num_layers)])
    if world.world_size > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world.world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"model": model, "optimizer": optimizer, "progress": Progress()}


def state_bytes(app_state: dict) -> int:
    model_state, optimizer_state = get_state_dict(app_state["model"], app_state["optimizer"])
    tensors = list(model_state.values()) + [v for per in optimizer_state["state"].values() for v in per.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def checkpointer(run_dir: Path, world: World, *, async_mode: str, thread_count: int,
                 store_url: str | None = None) -> Checkpointer:
    return Checkpointer(run_dir, world=world, keep_last_k=1, keep_every_m=0, async_mode=async_mode,
                        lineage={"run_id": "bench"}, model_fingerprint="bench", thread_count=thread_count,
                        store_url=store_url)


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def disk_write_s(path: Path, num_bytes: int) -> float:
    chunk = memoryview(os.urandom(1 << 20) * 64)  # 64 MiB, written over and over

    def write() -> None:
        with open(path, "wb") as handle:
            left = num_bytes
            while left > 0:
                left -= handle.write(chunk[: min(left, len(chunk))])
            handle.flush()
            os.fsync(handle.fileno())

    seconds = timed(write)
    path.unlink()
    return seconds


def torch_save_s(path: Path, app_state: dict) -> float:
    def save() -> None:
        model_state, optimizer_state = get_state_dict(app_state["model"], app_state["optimizer"])
        with open(path, "wb") as handle:
            torch.save({"model": model_state, "optimizer": optimizer_state}, handle)
            handle.flush()
            os.fsync(handle.fileno())

    seconds = timed(save)
    path.unlink()
    return seconds


def dcp_save_s(path: Path, app_state: dict, thread_count: int) -> float:
    def save() -> None:
        model_state, optimizer_state = get_state_dict(app_state["model"], app_state["optimizer"])
        dcp.save({"model": model_state, "optimizer": optimizer_state}, no_dist=True,
                 storage_writer=FileSystemWriter(path, thread_count=thread_count, sync_files=True))

    seconds = timed(save)
    shutil.rmtree(path)
    return seconds


def measure(args: argparse.Namespace, work: Path) -> dict:
    world = World(rank=0, world_size=1)
    app_state = build(args.state_mb, world, args.width)
    num_bytes = state_bytes(app_state)
    rounds: dict[str, list[float]] = {name: [] for name in ("disk", "torch_save", "dcp_save", "sync", "async",
                                                            "async_commit", "load")}
    sync_ckpt = checkpointer(work / "sync", world, async_mode="off", thread_count=args.thread_count)
    async_ckpt = checkpointer(work / "async", world, async_mode="async", thread_count=args.thread_count)
    async_first_pause_s = timed(lambda: async_ckpt.save(0, app_state))  # allocates the staging copy
    async_ckpt.wait()
    for step in range(1, args.repeats + 1):
        app_state["progress"].step = step
        rounds["disk"].append(disk_write_s(work / "raw.bin", num_bytes))
        rounds["torch_save"].append(torch_save_s(work / "torch_save.pt", app_state))
        rounds["dcp_save"].append(dcp_save_s(work / "dcp", app_state, args.thread_count))
        rounds["sync"].append(timed(lambda step=step: sync_ckpt.save(step, app_state)))
        # As a training loop sees it: save, keep "training" until the background write and
        # commit are done, then the next save() (timed) finds nothing left to wait for.
        rounds["async"].append(timed(lambda step=step: async_ckpt.save(step, app_state)))
        rounds["async_commit"].append(timed(lambda: _train_while(async_ckpt.save_in_flight)))
        fresh = build(args.state_mb, world, args.width)
        rounds["load"].append(timed(lambda fresh=fresh: checkpointer(work / "sync", world, async_mode="off",
                                                                     thread_count=args.thread_count).load(fresh)))
        del fresh
    sync_ckpt.close()
    async_ckpt.close()
    median = {name: statistics.median(values) for name, values in rounds.items()}
    # The disk's speed drifts by 2-4x between minutes on shared machines, so each ratio is taken
    # within one round (disk write and save back to back), then the median over rounds.
    ratio_vs_disk = statistics.median(disk / sync for disk, sync in zip(rounds["disk"], rounds["sync"]))
    async_over_sync = statistics.median(a / s for a, s in zip(rounds["async"], rounds["sync"]))
    return {"state_bytes": num_bytes, "dcp_save_s": median["dcp_save"], "torch_save_s": median["torch_save"],
            "disk_write_MBps": num_bytes / _MB / median["disk"], "save_MBps": num_bytes / _MB / median["sync"],
            "ratio_vs_disk": ratio_vs_disk, "sync_pause_s": median["sync"], "async_pause_s": median["async"],
            "async_over_sync": async_over_sync, "async_first_pause_s": async_first_pause_s,
            "async_commit_s": median["async_commit"], "stage_floor_s": num_bytes / memcpy_bytes_per_s(),
            "load_s": median["load"], "rounds_s": rounds}


def object_store_figures(args: argparse.Namespace, work: Path) -> dict | None:
    """The object-store variant (ops/checkpoints/mirror.py): publish the newest sync checkpoint to S3, then fetch it back.

    Against ``--s3-url`` (the store of TRAINYARD_S3_ENDPOINT_URL) when given, else a throwaway
    SeaweedFS on this machine (tools.s3_server), so local and object-store figures come from one run.
    """
    from ops.publish import objstore
    from tools.s3_server import weed_binary

    if args.s3_url is None and weed_binary() is None:
        return None
    newest = sorted(store.checkpoints_dir(work / "sync").glob("step_*"))[-1]
    world = World(rank=0, world_size=1)
    app_state = build(args.state_mb, world, args.width)
    with contextlib.ExitStack() as stack:
        url = args.s3_url or stack.enter_context(sized_store(work / "s3", newest, args.repeats)).url("bench-checkpoints")
        rounds = {"publish": [], "fetch": [], "direct_save": [], "direct_load": [], "local_save": []}
        for attempt in range(args.repeats):
            target = objstore.join(url, f"round-{attempt}", newest.name)
            rounds["publish"].append(timed(lambda target=target: objstore.publish_tree(newest, target)))
            rounds["fetch"].append(timed(lambda target=target, attempt=attempt: objstore.fetch(
                target, work / "fetched" / str(attempt))))
            objstore.delete_version(target)
            # stage.checkpoint_io=store: DCP's fsspec writer straight to the store (hashed while it
            # streams, committed there), and its reader back (each object hashed whole before DCP
            # reads it); the same save to this machine's disk in the same round, for the ratio.
            app_state["progress"].step = attempt + 1
            local = checkpointer(work / "direct_local" / str(attempt), world, async_mode="off",
                                 thread_count=args.thread_count)
            rounds["local_save"].append(timed(lambda local=local, attempt=attempt: local.save(attempt + 1, app_state)))
            local.close()
            run_url = objstore.join(url, f"direct-{attempt}")
            direct = checkpointer(work / "direct" / str(attempt), world, async_mode="off",
                                  thread_count=args.thread_count, store_url=run_url)
            rounds["direct_save"].append(timed(lambda direct=direct, attempt=attempt: direct.save(attempt + 1, app_state)))
            direct.close()
            reader = checkpointer(work / "direct_read" / str(attempt), world, async_mode="off",
                                  thread_count=args.thread_count, store_url=run_url)
            rounds["direct_load"].append(timed(lambda reader=reader: reader.load(app_state)))
            reader.close()
            objstore.delete_version(objstore.join(run_url, store.step_dir_name(attempt + 1)))
            shutil.rmtree(work / "direct_local" / str(attempt), ignore_errors=True)
    num_bytes = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    median = {name: statistics.median(values) for name, values in rounds.items()}
    ratio = statistics.median(d / lo for d, lo in zip(rounds["direct_save"], rounds["local_save"]))
    return {"store": "s3 (--s3-url)" if args.s3_url else "s3 (SeaweedFS on this machine)", "bytes": num_bytes,
            "publish_s": median["publish"], "publish_MBps": num_bytes / _MB / median["publish"],
            "fetch_s": median["fetch"], "fetch_MBps": num_bytes / _MB / median["fetch"],
            "direct_save_s": median["direct_save"], "direct_load_s": median["direct_load"],
            "local_save_s": median["local_save"], "direct_save_over_local": ratio}


def sized_store(directory: Path, checkpoint: Path, repeats: int):
    """A local SeaweedFS that holds every byte the rounds write, with room to spare.

    Each round publishes one copy of ``checkpoint`` and saves one more straight to the store; both are
    deleted afterwards, but SeaweedFS frees a deleted object's space only when it compacts the volume,
    so the store must hold every round's bytes at once. The default store (32 volumes of 64 MB, 2 GiB)
    filled up at --state-mb 600 and the server refused writes ("No writable volumes").
    """
    from tools.s3_server import LocalS3

    checkpoint_bytes = sum(path.stat().st_size for path in checkpoint.rglob("*") if path.is_file())
    needed_mb = 2 * repeats * checkpoint_bytes / _MB
    volume_mb = 256
    # Twice the bytes (a volume fills before its limit, one file never splits across volumes) plus a
    # volume per collection SeaweedFS opens beside it.
    return LocalS3(directory, volume_size_mb=volume_mb, max_volumes=max(32, int(2 * needed_mb / volume_mb) + 8))


def _train_while(condition) -> None:
    while condition():
        time.sleep(0.01)


def memcpy_bytes_per_s() -> float:
    """Memory copy bandwidth: the floor of async staging on CPU (it copies every tensor once)."""
    source = torch.empty(64 * 1024 * 1024, dtype=torch.float32).normal_()
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = min(timed(lambda: target.copy_(source)) for _ in range(5))
    return source.numel() * source.element_size() / seconds


def reshard_load_s(args: argparse.Namespace, work: Path) -> float:
    """Save on 2 FSDP2 ranks (torchrun), then time the load into one unsharded process."""
    run_dir = work / "sharded"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port", "29613",
               "-m", "benchmarks.checkpoint", "--worker-save", str(run_dir), "--state-mb", str(args.state_mb),
               "--thread-count", str(args.thread_count), "--width", str(args.width)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   stdout=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent)
    world = World(rank=0, world_size=1)
    fresh = build(args.state_mb, world, args.width)
    ckpt = checkpointer(run_dir, world, async_mode="off", thread_count=args.thread_count)
    seconds = timed(lambda: ckpt.load(fresh))
    assert fresh["progress"].step == 1
    return seconds


def worker_save(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    world = World(rank=dist.get_rank(), world_size=dist.get_world_size())
    app_state = build(args.state_mb, world, args.width)
    app_state["progress"].step = 1
    ckpt = checkpointer(args.worker_save, world, async_mode="off", thread_count=args.thread_count)
    ckpt.save(1, app_state)
    ckpt.close()
    dist.destroy_process_group()


def variant(name: str, measure_it, failed: dict[str, str]):
    """One optional variant's figures; a variant that fails is recorded with its reason (``failed``)
    and None, so the figures that succeeded are still printed instead of lost with a traceback."""
    try:
        return measure_it()
    except Exception as error:  # noqa: BLE001 - recorded: the run's line names the variant and the reason
        detail = getattr(error, "stderr", None) or ""
        failed[name] = f"{type(error).__name__}: {error}"[:1500] + (f" | {str(detail)[-500:]}" if detail else "")
        print(f"benchmarks.checkpoint: the {name} variant failed: {failed[name]}", file=sys.stderr, flush=True)
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-mb", type=int, default=600, help="at least this much model + optimizer state")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--thread-count", type=int, default=DEFAULT_THREAD_COUNT, help="DCP writer threads")
    parser.add_argument("--work-dir", type=Path, help="where to write (default: a temp dir on the default disk)")
    parser.add_argument("--width", type=int, default=WIDTH, help="Linear layer width (state per layer: 12 x width^2 bytes)")
    parser.add_argument("--skip-reshard", action="store_true")
    parser.add_argument("--skip-object-store", action="store_true")
    parser.add_argument("--s3-url", help="s3://bucket/prefix for the object-store variant (default: a local SeaweedFS)")
    parser.add_argument("--worker-save", type=Path, help=argparse.SUPPRESS)
    args = harness.parse(parser, argv, SMOKE_ARGS)
    if args.worker_save:
        worker_save(args)
        return
    with tempfile.TemporaryDirectory(dir=args.work_dir, prefix="bench_checkpoint_") as work:
        result = measure(args, Path(work))
        failed: dict[str, str] = {}
        result["reshard_load_s"] = None if args.skip_reshard else variant(
            "reshard_load", lambda: reshard_load_s(args, Path(work)), failed)
        result["object_store"] = None if args.skip_object_store else variant(
            "object_store", lambda: object_store_figures(args, Path(work)), failed)
        result["failed_variants"] = failed
    result.update(thread_count=args.thread_count, repeats=args.repeats, torch_version=torch.__version__,
                  targets={"ratio_vs_disk>=0.7": result["ratio_vs_disk"] >= 0.7,
                           "async_pause<=0.15*sync_pause": result["async_over_sync"] <= 0.15})
    rounded = {key: round(value, 4) if isinstance(value, float) else value for key, value in result.items()}
    harness.emit({"benchmark": "checkpoint", **rounded}, args)


if __name__ == "__main__":
    main()
