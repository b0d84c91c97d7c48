"""What a checkpoint holds: the app state of a run, and the result of a run.

`Trainer.app_state()` returns a dict of name -> Stateful (state_dict() / load_state_dict()):

| name          | object                        | state                                          |
| ------------- | ----------------------------- | ---------------------------------------------- |
| model         | ModelState (wraps the model)  | get_model_state_dict: FQNs without DDP/compile/ |
|               |                               | checkpoint-wrapper prefixes; DTensor shards     |
|               |                               | under FSDP2 (DCP saves them as one tensor)      |
| optimizer     | OptimizerState                | get_optimizer_state_dict, keyed by FQN          |
| lr_scheduler  | LambdaLR                      | its step count                                  |
| grad_scaler   | Precision                     | GradScaler state ({} unless fp16)              |
| nonfinite     | NonFiniteGuard                | skipped-step counters                           |
| data          | the batch source              | sampler position (ops.loading.sampling SamplerState)    |
| train_state   | TrainState                    | step, epoch, consumed samples, loss history     |

A checkpointer saves and loads that dict as is (DCP's `dcp.save(app_state)` does exactly this).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

STATUSES = ("completed", "failed", "diverged", "canceled", "pruned")


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class ModelState:
    """The model's state dict with wrapper prefixes removed (works for DDP, FSDP2 and plain)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_model_state_dict(self.model, dict(state))


class OptimizerState:
    """The optimizer's state keyed by parameter FQN, so it survives a change of wrapper."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, dict(state))


@dataclass(kw_only=True, slots=True)
class TrainState:
    """Where the run is, in steps and samples, and its per-step history (identical on all ranks)."""

    step: int = 0
    """Steps finished (skipped non-finite steps included); the next step is step + 1."""
    epoch: int = 0
    """Data epoch after the last finished step, as the batch source reports it."""
    consumed_samples: int = 0
    """Global samples consumed by finished steps over the whole run."""
    losses: list[float] = field(default_factory=list)
    """Global mean loss of each finished step (NaN for non-finite steps)."""
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm of each finished step, before clipping."""

    def record(self, *, loss: float, grad_norm: float, samples: int, epoch: int) -> None:
        self.step += 1
        self.consumed_samples += samples
        self.epoch = epoch
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch, "consumed_samples": self.consumed_samples,
                "losses": list(self.losses), "grad_norms": list(self.grad_norms)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.consumed_samples = int(state["consumed_samples"])
        self.losses, self.grad_norms = list(state["losses"]), list(state["grad_norms"])


@dataclass(kw_only=True, slots=True)
class RunResult:
    """How a run ended; rank 0 writes it (with config and performance) as run_dir/final.json."""

    status: str
    """'completed', 'failed', 'diverged', 'canceled' (SIGTERM) or 'pruned' (a sweep's rule)."""
    final_step: int
    """Steps finished when the run ended."""
    losses: list[float]
    """Global mean loss per finished step."""
    grad_norms: list[float]
    """Global gradient norm per finished step."""
    num_skipped_steps: int
    """Steps whose update was skipped because loss or gradient norm was non-finite."""
    error: str | None = None
    """The error of a failed run, redacted."""
    failure_class: str = ""
    """This rank's class of the end (trainer/endings.py)."""
    pruning: dict | None = None
    """A pruned trial's decision (trainer/launch/pruning.py): the rule, the step, its value and the compared values."""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
