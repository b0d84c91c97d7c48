"""Per-rank memory estimate of a training config, checked against a budget before launch.

    params + grads + AdamW (exp_avg, exp_avg_sq)   4 + 4 + 8 bytes per parameter (all fp32),
                                                   divided by world_size under FSDP
    transient                                      16-bit policies: autocast's cached 2-byte
                                                   weight copies (whole model); FSDP: two
                                                   unsharded blocks (current + prefetched),
                                                   their params and grads in fp32
    activations (per micro-batch)                  tokens * dim * (12 + 2 * mlp_ratio) values per
                                                   layer saved for backward (2 bytes under
                                                   autocast, else 4); with activation
                                                   checkpointing, the block inputs plus one
                                                   block's worth; plus the fp32 token tensors of
                                                   the loss (x0, noise, x_t, target, prediction);
                                                   tokens of the data's largest clip shape, since
                                                   with bucketed data any step may be that bucket

It assumes a fused attention kernel (no tokens^2 score matrix kept) and ignores the CUDA
context, allocator fragmentation and DDP's 25 MB buckets: expect it within about +-50% of the
measured peak. Its job is to refuse a batch that clearly cannot fit before any process starts,
not to plan a tight packing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from trainer.schema import num_tokens

if TYPE_CHECKING:
    from trainer.config import ExperimentConfig

_FP32_BYTES = 4
_HALF_BYTES = 2
_ADAMW_STATES = 2
_LOSS_TENSORS = 5  # x0, noise, x_t, target velocity, predicted velocity


class MemoryBudgetExceeded(ValueError):
    """The estimated per-rank memory of a config exceeds train.max_memory_bytes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    num_params: int
    """Parameters of the whole (unsharded) model."""
    params_bytes: int
    """fp32 master weights held by one rank."""
    grads_bytes: int
    """fp32 gradients held by one rank."""
    optimizer_bytes: int
    """AdamW state held by one rank."""
    transient_bytes: int
    """Autocast weight copies and FSDP's unsharded blocks."""
    activations_bytes: int
    """Values saved for backward by one micro-batch, plus the loss's token tensors."""

    @property
    def total_bytes(self) -> int:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.transient_bytes + self.activations_bytes)

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total_bytes": self.total_bytes}


def estimate_memory(config: ExperimentConfig, world_size: int) -> MemoryEstimate:
    """Per-rank estimate for config on world_size ranks (see the module docstring)."""
    from trainer.model import count_params  # torch (a meta-device model): imported when an estimate is made

    model, data, train = config.model, config.data, config.train
    if data.batch_size % (world_size * train.grad_accum):
        raise ValueError(f"global batch {data.batch_size} is not divisible by world_size "
                         f"{world_size} x grad_accum {train.grad_accum}")
    micro_batch = data.batch_size // (world_size * train.grad_accum)
    num_params = count_params(model, video_shape=data.video_shape)
    shards = world_size if train.parallelism == "fsdp" else 1
    half = train.precision in ("bf16", "fp16")

    transient = _HALF_BYTES * num_params if half else 0
    block_params = 4 * model.dim**2 + 2 * model.dim * model.mlp_hidden
    if shards > 1:
        transient += 2 * 2 * block_params * _FP32_BYTES  # 2 blocks x (params + grads)

    tokens = micro_batch * max(num_tokens(shape, model.patch_size) for shape in data.video_shapes)
    value_bytes = _HALF_BYTES if half else _FP32_BYTES
    per_layer = tokens * model.dim * (12 + 2 * model.mlp_ratio) * value_bytes
    if train.activation_checkpointing:
        saved = model.num_layers * tokens * model.dim * value_bytes + per_layer
    else:
        saved = model.num_layers * per_layer
    loss_tensors = _LOSS_TENSORS * tokens * model.patch_dim * _FP32_BYTES
    return MemoryEstimate(
        num_params=num_params,
        params_bytes=_FP32_BYTES * num_params // shards,
        grads_bytes=_FP32_BYTES * num_params // shards,
        optimizer_bytes=_ADAMW_STATES * _FP32_BYTES * num_params // shards,
        transient_bytes=int(transient),
        activations_bytes=int(saved + loss_tensors),
    )


def estimate_memory_bytes(config: ExperimentConfig, world_size: int) -> int:
    """Estimated peak bytes per rank (`estimate_memory(...).total_bytes`)."""
    return estimate_memory(config, world_size).total_bytes


def check_memory_budget(config: ExperimentConfig, world_size: int) -> MemoryEstimate:
    """The estimate, or MemoryBudgetExceeded naming the numbers when it is over budget."""
    estimate = estimate_memory(config, world_size)
    budget = config.train.max_memory_bytes
    if budget is not None and estimate.total_bytes > budget:
        parts = ", ".join(f"{name.removesuffix('_bytes')} {_human(value)}"
                          for name, value in estimate.as_dict().items()
                          if name.endswith("_bytes") and name != "total_bytes")
        raise MemoryBudgetExceeded(
            f"estimated {_human(estimate.total_bytes)} per rank exceeds train.max_memory_bytes "
            f"{_human(budget)} ({parts}; micro-batch "
            f"{config.data.batch_size // (world_size * config.train.grad_accum)}, world_size "
            f"{world_size}, {config.train.parallelism}, {config.train.precision}); lower "
            "data.batch_size, raise train.grad_accum, or turn on activation_checkpointing / fsdp")
    return estimate


def _human(num_bytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"
