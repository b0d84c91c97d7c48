"""Launch preflight: everything that can be refused before torchrun starts.

    config = load_config("exp.yaml", ["train.steps=20"])
    plan = preflight(config, world_size=8)   # raises before any process starts

``preflight`` checks what depends on the world size (batch divisibility, fault ranks), the shard
index (clip shapes, audio, manifest, encoding), the device and precision of this machine, and
the per-rank memory budget (trainer/launch/memory.py). Importing it imports no torch; the device,
precision and parameter-count probes import torch when they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainer.launch.memory import MemoryEstimate, check_memory_budget
from trainer.launch.config_sections import check_matches_index

if TYPE_CHECKING:
    from trainer.launch.config import ExperimentConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    world_size: int
    """Ranks the job will run."""
    local_batch_size: int
    """Samples per rank per step."""
    micro_batch_size: int
    """Samples per forward/backward."""
    device_type: str
    """'cpu' or 'cuda', as resolved on this machine."""
    precision: str
    """The precision policy that runs (train.precision 'auto' resolved for device_type)."""
    memory: MemoryEstimate | None
    """Per-rank memory estimate; None where preflight was asked not to make one (ranks other than 0)."""
    memory_budget_bytes: int | None
    """What the estimate was checked against: train.max_memory_bytes, else a CUDA device's memory; None: unchecked."""

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "local_batch_size": self.local_batch_size,
                "micro_batch_size": self.micro_batch_size, "device_type": self.device_type,
                "precision": self.precision, "memory": None if self.memory is None else self.memory.as_dict(),
                "memory_budget_bytes": self.memory_budget_bytes}


def preflight(config: ExperimentConfig, *, world_size: int, estimate_memory: bool = True) -> LaunchPlan:
    """Refuse a config that cannot run on world_size ranks here; else the plan it will run.

    estimate_memory=False skips the memory estimate and its budget check: the trainer's ranks other
    than 0 pass it, since the estimate measures a block on CPU (a second and half a GB for the 1b
    preset) and every rank would get the same answer; rank 0's check refuses the run for all.
    """
    train, data = config.train, config.data
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if train.parallelism == "none" and world_size > 1:
        raise ValueError(f"parallelism 'none' with world_size {world_size} would train "
                         f"{world_size} unrelated copies; use 'ddp' or 'fsdp'")
    per_step = world_size * train.grad_accum
    if data.batch_size % per_step:
        raise ValueError(f"global batch data.batch_size={data.batch_size} is not divisible by "
                         f"world_size {world_size} x train.grad_accum {train.grad_accum} = {per_step}")
    if config.faults.max_rank >= world_size:
        raise ValueError(f"faults name rank {config.faults.max_rank}, but world_size is {world_size}")
    if config.stage.checkpoint and config.stage.checkpoint_io == "store":
        from ops.publish import paths  # no store named: refused here, before any rank starts

        if paths.checkpoint_store_root() is None:
            raise ValueError(f"stage.checkpoint_io=store writes checkpoints to the object store, but neither "
                             f"{paths.CHECKPOINT_ROOT_VARIABLE} nor a data root URL (TRAINYARD_DATA_ROOT) names one")
    if data.source == "shards":  # clip shapes, audio, manifest and encoding against the index, before launch
        from ops.clips.shard_cache import read_any_index_info  # a folder, or a set in an object store

        check_matches_index(data, read_any_index_info(data.shard_index))
    # Whether this machine has the device and the precision is probed with torch: imported here,
    # so that importing this module (and checking a config's shape) stays torch-free.
    from trainer.parallel import resolve_device_type
    from trainer.precision import check_supported, resolve_precision

    if config.model.factory:  # imports and builds it on the meta device: a bad path or module is named here
        from trainer.models.protocol import check_factory

        check_factory(config)
    device_type = resolve_device_type(train.device)
    precision = resolve_precision(train.precision, device_type)
    check_supported(precision, device_type)
    device_memory = _cuda_memory_bytes() if device_type == "cuda" else None
    memory = (check_memory_budget(config, world_size, device_type=device_type, device_memory_bytes=device_memory)
              if estimate_memory else None)
    return LaunchPlan(world_size=world_size, local_batch_size=data.batch_size // world_size,
                      micro_batch_size=data.batch_size // per_step, device_type=device_type,
                      precision=precision, memory=memory,
                      memory_budget_bytes=train.max_memory_bytes if train.max_memory_bytes is not None else device_memory)


def _cuda_memory_bytes() -> int:
    """Total memory of the CUDA device this process would use (every rank of a node has the same kind)."""
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
