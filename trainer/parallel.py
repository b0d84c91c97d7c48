"""Everything distributed: process group, seeding per rank, and `parallelize()`.

The model (trainer/model.py) holds no distributed code; `parallelize` wraps it in a fixed order
(activation checkpointing, compile, then DDP or FSDP2). Launch under torchrun, which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; without torchrun the program is rank 0 of
1, and DDP/FSDP2 then run over a single-process group backed by an in-memory store (no port).

Backends: gloo on CPU, nccl on CUDA. Every collective has the config's `collective_timeout_s`:
when a peer dies or hangs, the survivors raise instead of waiting forever. (Under torchrun a
peer that exits also makes the agent stop the others; the timeout covers a peer that hangs.)
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ops.sampling import World, rank_seed
from trainer.schema import DEVICES, PARALLELISMS  # noqa: F401 - torch-free (trainer/schema.py); re-exported here

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.model import VideoFlowModel

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True, kw_only=True, slots=True)
class DistWorld:
    """This process's place in the job: the device and process group, over an ops.sampling.World.

    Rank arithmetic (the interleave of samples over ranks, the global batch) lives in that World;
    the trainer and the data sources read it through `sampling_world()`.
    """

    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Data-parallel ranks in the job."""
    local_rank: int
    """Rank on this node; picks the CUDA device."""
    device: torch.device
    """Where this rank computes."""
    backend: str | None
    """Process-group backend ('gloo', 'nccl'), or None when no process group exists."""

    def __post_init__(self) -> None:
        self.sampling_world()  # the one check of rank and world size

    @property
    def is_main(self) -> bool:
        """Rank 0 writes run files and calls hooks."""
        return self.rank == 0

    def sampling_world(self) -> World:
        """This rank as the sample order sees it (ops.sampling.World): rank interleave, global batch."""
        return World(rank=self.rank, world_size=self.world_size)


def resolve_device_type(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return device


def init_distributed(*, parallelism: str, device: str, collective_timeout_s: float) -> DistWorld:
    """Read torchrun's variables, pick the device, and start the process group if one is needed."""
    env = os.environ
    launched = all(name in env for name in _TORCHRUN_VARS)
    rank, world_size = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    device_type = resolve_device_type(device)
    torch_device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(torch_device)
    if parallelism == "none":
        if world_size != 1:
            raise ValueError(f"parallelism 'none' runs {world_size} independent copies; use ddp or fsdp")
        return DistWorld(rank=0, world_size=1, local_rank=0, device=torch_device, backend=None)
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=collective_timeout_s)
    if launched:  # env:// reads MASTER_ADDR and MASTER_PORT
        dist.init_process_group(backend, timeout=timeout,
                                device_id=torch_device if device_type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistWorld(rank=rank, world_size=world_size, local_rank=local_rank, device=torch_device,
                     backend=backend)


def destroy_distributed() -> None:
    """Tear the process group down (safe to call when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class DeterminismSnapshot:
    """torch's global determinism flags before `seed_everything`, to restore on close."""

    enabled: bool
    warn_only: bool


def seed_everything(seed: int, rank: int, *, deterministic: bool, device_type: str) -> DeterminismSnapshot:
    """Seed python, numpy and torch from (seed, rank); optionally demand deterministic kernels.

    Per-rank seeds come from ops.sampling.rank_seed, the derivation the checkpointer uses for a
    rank it holds no RNG state for, so ranks never share a stream. The model's
    init and the flow-matching noise use their own explicit seeds and do not depend on these.
    On CPU a nondeterministic kernel raises; on CUDA it warns, since some fused attention
    backward kernels have no deterministic version.
    """
    snapshot = DeterminismSnapshot(torch.are_deterministic_algorithms_enabled(),
                                   torch.is_deterministic_algorithms_warn_only_enabled())
    derived = rank_seed(seed, rank)
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)
    if deterministic and device_type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reads it at init
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(deterministic, warn_only=device_type == "cuda")
    return snapshot


def restore_determinism(snapshot: DeterminismSnapshot) -> None:
    torch.use_deterministic_algorithms(snapshot.enabled, warn_only=snapshot.warn_only)


def parallelize(model: VideoFlowModel, config: TrainConfig, world: DistWorld) -> nn.Module:
    """Wrap model for training; model must already be initialized and on world.device.

    The order is fixed, because each step wraps what the previous one produced.
    """
    # 1. Activation checkpointing, innermost: a block's activations are recomputed in backward,
    #    and the compiled graph (2) and FSDP's unit (3) both contain the recompute.
    if config.activation_checkpointing:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block, preserve_rng_state=False)
    # 2. torch.compile per block, in place (parameter names unchanged): blocks are identical, so
    #    one graph serves them all, and FSDP's hooks stay outside the graphs.
    if config.compile:
        for block in model.blocks:
            block.compile()
    # 3. Data parallelism last, over whatever the blocks became.
    if config.parallelism == "fsdp":
        # One FSDP unit per block, so only one block's full parameters exist at a time; the root
        # unit holds the embeddings, the adaLN projection and the output layer.
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    if config.parallelism == "ddp":
        # Bucket views save a gradient copy. The only buffer (the sincos table) is a function of
        # the config, so it is synced once at init and never again per forward.
        return DistributedDataParallel(
            model, device_ids=[world.local_rank] if world.device.type == "cuda" else None,
            gradient_as_bucket_view=True, forward_sync_buffers=False)
    return model


@contextlib.contextmanager
def grad_sync(model: nn.Module, *, enabled: bool) -> Iterator[None]:
    """Reduce gradients across ranks in this backward only if enabled (grad accumulation).

    DDP: no_sync() on all but the last micro-batch. FSDP2: set_requires_gradient_sync, which
    keeps unsharded gradients locally until the synced backward reduce-scatters them.
    """
    if isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    yield


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Global L2 norm of the gradients (before clipping), clipping them to max_norm if set.

    With FSDP2 the norm is a DTensor over the shards; full_tensor() completes the reduction,
    so every rank returns the same value.
    """
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm if max_norm else float("inf"))
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def all_reduce_values(values: Sequence[float], *, op: str, world: DistWorld) -> list[float]:
    """Reduce a few Python floats over all ranks with 'sum' or 'max' (float64, one collective).

    NaN propagates through both: a NaN on any rank gives NaN everywhere.
    """
    if world.backend is None or world.world_size == 1:
        return [float(value) for value in values]
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    # nccl reduces device tensors only; gloo takes CPU tensors.
    device = world.device if world.backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def barrier(world: DistWorld) -> None:
    if world.backend is not None:
        dist.barrier()
