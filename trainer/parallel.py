"""Everything distributed: process group, seeding per rank, and `parallelize()`.

The model (trainer/models/video.py) holds no distributed code; `parallelize` wraps it in a fixed order
(activation checkpointing, compile, then DDP or FSDP2). Launch under torchrun, which sets RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; without torchrun the program is rank 0 of
1, and DDP/FSDP2 then run over a single-process group backed by an in-memory store (no port).

Backends: gloo on CPU, nccl on CUDA. Every collective has the config's `collective_timeout_s`:
when a peer dies or hangs, the survivors raise instead of waiting forever. (Under torchrun a
peer that exits also makes the agent stop the others; the timeout covers a peer that hangs.)
"""

from __future__ import annotations

import contextlib
import inspect
import os
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from ops.loading.sampling import World, rank_seed
from trainer.devices import resolve_device_type

if TYPE_CHECKING:
    from trainer.launch.config import TrainConfig

@dataclass(frozen=True, kw_only=True, slots=True)
class Distributed:
    """What `init_distributed` set up for this rank: its World, its device and the process group.

    Which rank of how many (and the local rank) is the World's to answer (ops.loading.sampling.World);
    this adds only what a rank computes and communicates with.
    """

    world: World
    """This rank: rank, world size, local rank."""
    device: torch.device
    """Where this rank computes."""
    backend: str | None
    """Process-group backend ('gloo', 'nccl'), or None when no process group exists."""




def init_distributed(*, parallelism: str, device: str, collective_timeout_s: float) -> Distributed:
    """Read torchrun's variables (World.from_env), pick the device, and start the process group if one is needed."""
    world = World.from_env()
    device_type = resolve_device_type(device)
    torch_device = torch.device("cuda", world.local_rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(torch_device)
    if parallelism == "none":
        if world.world_size != 1:
            raise ValueError(f"parallelism 'none' runs {world.world_size} independent copies; use ddp or fsdp")
        return Distributed(world=World(rank=0, world_size=1), device=torch_device, backend=None)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        # On a collective timeout NCCL's watchdog tears the whole process down by default
        # (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): no Python code runs, no rank records why it ended.
        # 2 (CleanUpOnly) aborts the communicators instead, so the blocked collective (or the next
        # one) raises in this thread and the trainer writes its classified end record
        # (trainer/endings.py) before exiting. A value the operator set is kept.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    timeout = timedelta(seconds=collective_timeout_s)
    if world.launched:  # env:// reads MASTER_ADDR and MASTER_PORT
        dist.init_process_group(backend, timeout=timeout,
                                device_id=torch_device if device_type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Distributed(world=world, device=torch_device, backend=backend)


def destroy_distributed() -> None:
    """Tear the process group down (safe to call when none exists)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True, slots=True)
class DeterminismSnapshot:
    """torch's global determinism flags before `seed_everything`, to restore on close."""

    enabled: bool
    warn_only: bool
    fill_uninitialized_memory: bool


def resolve_deterministic(setting: bool | None, device_type: str) -> bool:
    """train.deterministic as it applies: None means what the device can honour (on for CPU, off
    for CUDA: see TrainConfig.deterministic); an explicit choice is kept."""
    return device_type == "cpu" if setting is None else setting


def seed_everything(seed: int, rank: int, *, deterministic: bool, device_type: str) -> DeterminismSnapshot:
    """Seed python, numpy and torch from (seed, rank); optionally demand deterministic kernels.

    Per-rank seeds come from ops.loading.sampling.rank_seed, the derivation the checkpointer uses for a
    rank it holds no RNG state for, so ranks never share a stream. The model's
    init and the flow-matching noise use their own explicit seeds and do not depend on these.
    deterministic is strict on every device: a kernel without a deterministic version raises by
    name instead of warning (a warning would leave the run nondeterministic while it claims not
    to be). On CUDA, torch's NaN-filling of new tensors (a debugging aid: no correct kernel reads
    memory it did not write) is turned off, since it costs a memset per allocation.
    """
    import torch.utils.deterministic

    snapshot = DeterminismSnapshot(torch.are_deterministic_algorithms_enabled(),
                                   torch.is_deterministic_algorithms_warn_only_enabled(),
                                   torch.utils.deterministic.fill_uninitialized_memory)
    derived = rank_seed(seed, rank)
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)
    if deterministic and device_type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reads it at init
        torch.backends.cudnn.benchmark = False
        torch.utils.deterministic.fill_uninitialized_memory = False
    set_deterministic_algorithms(deterministic)
    return snapshot


def restore_determinism(snapshot: DeterminismSnapshot) -> None:
    import torch.utils.deterministic

    set_deterministic_algorithms(snapshot.enabled, warn_only=snapshot.warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = snapshot.fill_uninitialized_memory


def set_deterministic_algorithms(mode: bool, *, warn_only: bool = False) -> None:
    """``torch.use_deterministic_algorithms``, without importing inductor where nothing compiles.

    torch's function also sets ``torch._inductor.config.deterministic``, and imports inductor and
    dynamo to do it: about 1.6 s of CPU in every rank's start, most of them never compiling. Where
    inductor is not loaded yet, this sets the switch the kernels read, and ``compile_blocks`` gives
    inductor the same setting before the first compile (inductor reads it when it compiles)."""
    switch = getattr(torch._C, "_set_deterministic_algorithms", None)  # private: another torch may lack it
    if switch is None or "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    else:
        switch(mode, warn_only=warn_only)


def compile_blocks(blocks: Sequence[nn.Module]) -> None:
    """torch.compile each block in place (fullgraph), inductor deterministic exactly when torch is."""
    import torch._inductor.config as inductor_config

    inductor_config.deterministic = torch.are_deterministic_algorithms_enabled()
    for block in blocks:
        block.compile(fullgraph=True)


def parallelize(model: nn.Module, config: TrainConfig, distributed: Distributed, *,
                compute_dtype: torch.dtype = torch.float32) -> nn.Module:
    """Wrap model for training; model must already be initialized and on distributed.device.

    Any model of the protocol (trainer/models/protocol.py): its ``blocks`` are the units wrapped below.

    The order is fixed, because each step wraps what the previous one produced. compute_dtype is
    the precision policy's (trainer/precision.py): under FSDP2 a 16-bit one becomes the dtype
    parameters are all-gathered in, with gradients reduced in fp32.
    """
    # 1. Activation checkpointing, innermost: a block's activations are recomputed in backward,
    #    and the compiled graph (2) and FSDP's unit (3) both contain the recompute.
    if config.activation_checkpointing:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block, preserve_rng_state=False)
    # 2. torch.compile per block, in place (parameter names unchanged): blocks are identical, so
    #    one graph serves them all, and FSDP's hooks stay outside the graphs. fullgraph: a graph
    #    break would silently run part of every block eagerly, so it is an error instead
    #    (tests/test_gpu_readiness.py holds the blocks free of them across clip shapes and batch
    #    sizes, the empty micro-batch included).
    if config.compile:
        compile_blocks(model.blocks)
    # 3. Data parallelism last, over whatever the blocks became.
    if config.parallelism == "fsdp":
        # One FSDP unit per block, so only one block's full parameters exist at a time; the root
        # unit holds the embeddings, the adaLN projection and the output layer. Under a 16-bit
        # policy the all-gathers move 16-bit parameters (half the bytes, and autocast would cast
        # them anyway) and gradients are reduced in fp32, so the sum over ranks keeps fp32 precision.
        mixed = (MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
                 if compute_dtype != torch.float32 else MixedPrecisionPolicy())
        for block in model.blocks:
            fully_shard(block, mp_policy=mixed)
        fully_shard(model, mp_policy=mixed)
        # The sampler calls predict_velocity, not forward (trainer/heldout.py): FSDP must gather the
        # root unit's parameters around it too.
        register_fsdp_forward_method(model, "predict_velocity")
        return model
    if config.parallelism == "ddp":
        # Bucket views save a gradient copy. The only buffer (the sincos table) is a function of
        # the config, the same on every rank, so it is never synced per forward.
        return DistributedDataParallel(
            model, device_ids=[distributed.world.local_rank] if distributed.device.type == "cuda" else None,
            gradient_as_bucket_view=True, **_no_forward_buffer_sync())
    return model


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's keyword for "do not broadcast buffers in every forward" in the installed torch.

    torch 2.13 names it forward_sync_buffers and deprecates broadcast_buffers (with a warning);
    older torch (a lent GPU machine's, 2.11) knows only broadcast_buffers and refuses the new name.
    """
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


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


def clip_and_reduce(model: nn.Module, max_norm: float | None, totals: Sequence[torch.Tensor | float], *,
                    distributed: Distributed) -> tuple[float, list[float]]:
    """Clip the gradients by their global L2 norm and sum ``totals`` over ranks: one collective
    and one device-to-host read per step. Returns (the norm before clipping, the summed totals).

    DDP and one rank: gradients are already global after backward, so torch's clip_grad_norm_
    gives every rank the same norm; only the totals are reduced. FSDP2: each rank holds a shard of
    every gradient, so the squared norm of its shards rides in the same all-reduce as the totals,
    and the shards are scaled in place by the global clip coefficient (as clip_grad_norm_ does,
    without the second collective its DTensor norm would cost).
    """
    parameters = [p for p in model.parameters() if p.grad is not None]
    values = [torch.as_tensor(value, dtype=torch.float64, device=distributed.device).reshape(()) for value in totals]
    if not isinstance(model, FSDPModule):
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm if max_norm else float("inf"))
        summed = (_all_reduce_sum(torch.stack(values), distributed) if values
                  else torch.zeros(0, dtype=torch.float64, device=distributed.device))
        norm_value, *reduced = torch.cat([norm.double().reshape(1), summed]).tolist()  # the one host read
        return norm_value, reduced
    shards = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in parameters]
    local_sq = torch.nn.utils.get_total_norm(shards, 2.0).double() ** 2 if shards else torch.zeros((), dtype=torch.float64)
    summed = _all_reduce_sum(torch.stack([local_sq.to(distributed.device), *values]), distributed)
    norm = summed[0].sqrt()
    if max_norm:
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for shard in shards:
            shard.mul_(coefficient.to(shard.dtype))
    norm_value, *reduced = torch.cat([norm.reshape(1), summed[1:]]).tolist()
    return norm_value, reduced


def _all_reduce_sum(tensor: torch.Tensor, distributed: Distributed) -> torch.Tensor:
    """tensor summed over ranks (a copy); nccl reduces device tensors, gloo CPU ones."""
    if distributed.backend is None or distributed.world.world_size == 1:
        return tensor
    device = distributed.device if distributed.backend == "nccl" else torch.device("cpu")
    reduced = tensor.to(device)
    dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
    return reduced


def all_reduce_values(values: Sequence[float], *, op: str, distributed: Distributed) -> list[float]:
    """Reduce a few Python floats over all ranks with 'sum' or 'max' (float64, one collective).

    NaN propagates through both: a NaN on any rank gives NaN everywhere.
    """
    if distributed.backend is None or distributed.world.world_size == 1:
        return [float(value) for value in values]
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
    # nccl reduces device tensors only; gloo takes CPU tensors.
    device = distributed.device if distributed.backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=reduce_op)
    return tensor.tolist()


def barrier(distributed: Distributed) -> None:
    if distributed.backend is not None:
        dist.barrier()
