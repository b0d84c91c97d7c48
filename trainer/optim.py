"""Optimizer and learning-rate schedule: AdamW with linear warmup, then cosine (or constant).

Weight decay applies to matmul weights only; biases, norm weights, adaLN modulation tables and
learned position embeddings (parameters with fewer than 2 dims, `scale_shift_table`,
`pos_embed`) are not decayed.
The schedule is a function of the training step, which advances on skipped (non-finite) steps
too, so the learning rate at step s never depends on how many steps were skipped before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

DECAYS = ("cosine", "constant")
# 2-D parameters that are not weights of a matmul: decaying them would pull embeddings and
# modulation offsets toward zero for no regularization benefit.
_NO_DECAY_SUFFIXES = ("pos_embed", "scale_shift_table")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay on matrices."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr / (warmup_steps + 1) to lr."""
    decay: str = "cosine"
    """After warmup: 'cosine' to min_lr_ratio * lr at the last step, or 'constant'."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of lr."""
    grad_clip_norm: float | None = 1.0
    """Clip the global gradient norm to this; None measures the norm without clipping."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # YAML gives a list
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got {self.eps}, {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ValueError(f"grad_clip_norm must be > 0 or None, got {self.grad_clip_norm}")


def build_optimizer(model: nn.Module, config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over model's parameters (call after parallelize: FSDP2 swaps in sharded ones)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(_NO_DECAY_SUFFIXES) else decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps)


def lr_factor(step: int, *, config: OptimConfig, total_steps: int) -> float:
    """Multiplier of config.lr for the update of 0-based step `step`."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.decay == "constant":
        return 1.0
    decay_steps = max(1, total_steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, *, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR over `lr_factor`; its state_dict is the step count (the lambda is code, not state)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config=config, total_steps=total_steps))
