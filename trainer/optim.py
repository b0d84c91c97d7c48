"""Optimizer and learning-rate schedule: AdamW with linear warmup, then cosine (or constant).

Weight decay applies to matmul weights only; biases, norm weights, adaLN modulation tables and
learned position embeddings (parameters with fewer than 2 dims, `scale_shift_table`,
`pos_embed`) are not decayed.
The schedule is a function of the training step, which advances on skipped (non-finite) steps
too, so the learning rate at step s never depends on how many steps were skipped before it.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from trainer.launch.config_sections import (
    OptimConfig)

# 2-D parameters that are not weights of a matmul: decaying them would pull embeddings and
# modulation offsets toward zero for no regularization benefit.
_NO_DECAY_SUFFIXES = ("pos_embed", "scale_shift_table")


def build_optimizer(model: nn.Module, config: OptimConfig, *, fused: bool = False) -> torch.optim.AdamW:
    """AdamW over model's parameters (call after parallelize: FSDP2 swaps in sharded ones).

    fused (the trainer sets it on CUDA): one kernel per parameter group instead of a dozen
    foreach launches, and no full-size temporaries. Off on CPU, where the foreach path is the
    arithmetic the bit-identity tests were recorded with.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(_NO_DECAY_SUFFIXES) else decay).append(param)
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, **({"fused": True} if fused else {}))


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
