"""Numeric precision policy and the non-finite guard.

Policies
--------
| policy | compute (matmuls) | master weights, grads, norms, loss, AdamW state | loss scaling |
| ------ | ----------------- | ----------------------------------------------- | ------------ |
| fp32   | fp32              | fp32                                            | none         |
| bf16   | bf16 (autocast)   | fp32                                            | none         |
| fp16   | fp16 (autocast)   | fp32                                            | GradScaler   |

Parameters are always fp32 (autocast casts copies per op), so the optimizer and its state are
fp32. Norms are computed in fp32 by the model (`Fp32LayerNorm`, `Fp32RMSNorm`); the loss is
reduced in fp32 (`VideoFlowModel.forward`). DDP and FSDP2 both use autocast, so the two give
the same numerics; FSDP2's bf16 all-gather (MixedPrecisionPolicy) is a later optimization.

Non-finite guard
----------------
A step whose global loss or global grad norm is NaN/Inf does not update the weights: the
optimizer step is skipped, `num_skipped_steps` counts it, and after `max_consecutive` skipped
steps in a row the run ends with status "diverged". The guard sees values already reduced over
ranks, so every rank takes the same decision.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainer.schema import PRECISIONS  # noqa: F401 - torch-free (trainer/schema.py); re-exported here

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class UnsupportedPrecision(ValueError):
    """The device cannot run the requested precision policy."""


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether autocast on device_type produces dtype for a matmul (probed, not assumed).

    A probe is the honest test: autocast support per device and dtype changes between torch
    releases and builds. Raises nothing; an unusable device gives False.
    """
    if device_type == "cuda" and not torch.cuda.is_available():
        return False
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return False
    try:
        with torch.autocast(device_type=device_type, dtype=dtype):
            probe = torch.ones(2, 2, device=device_type)
            return (probe @ probe).dtype == dtype
    except RuntimeError:  # autocast refuses this device/dtype pair outright
        return False


def check_supported(policy: str, device_type: str) -> None:
    """Raise ValueError / UnsupportedPrecision naming the policy and device if it cannot run."""
    if policy not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {policy!r}")
    dtype = _AUTOCAST_DTYPES.get(policy)
    if dtype is not None and not autocast_supported(device_type, dtype):
        raise UnsupportedPrecision(
            f"precision {policy!r} needs autocast to {dtype} on {device_type!r}, which this torch "
            f"{torch.__version__} build does not support; use 'fp32'"
            + (" or 'bf16'" if policy == "fp16" else ""))


class Precision:
    """Autocast context and loss scaling for one policy; its state_dict is the GradScaler's."""

    def __init__(self, policy: str, *, device_type: str) -> None:
        check_supported(policy, device_type)
        self.policy = policy
        self.device_type = device_type
        self.compute_dtype = _AUTOCAST_DTYPES.get(policy, torch.float32)
        # GradScaler only for fp16: bf16 has fp32's exponent range, so gradients do not underflow.
        self.scaler = torch.amp.GradScaler(device_type, enabled=policy == "fp16")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.policy == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale (no-op without fp16), before clipping."""
        if self.scaler.is_enabled():
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer, *, finite: bool) -> None:
        """Apply the update if finite; with fp16, lower the loss scale after a non-finite step."""
        if finite:
            if self.scaler.is_enabled():
                self.scaler.step(optimizer)
            else:
                optimizer.step()
        if self.scaler.is_enabled():
            self.scaler.update()  # uses the inf check recorded by unscale()

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0

    def describe(self) -> dict[str, Any]:
        """What runs in which dtype; recorded with the run config."""
        return {
            "policy": self.policy,
            "device_type": self.device_type,
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "param_dtype": "float32",
            "grad_dtype": "float32",
            "norm_dtype": "float32",
            "loss_dtype": "float32",
            "optimizer_state_dtype": "float32",
            "autocast": self.policy != "fp32",
            "grad_scaler": self.scaler.is_enabled(),
        }

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()  # {} when the scaler is disabled

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if bool(state) != self.scaler.is_enabled():
            raise ValueError(f"grad scaler state {'present' if state else 'absent'} does not match "
                             f"precision {self.policy!r}")
        if state:
            self.scaler.load_state_dict(dict(state))


@dataclass(kw_only=True, slots=True)
class NonFiniteGuard:
    """Counts skipped (non-finite) steps and decides divergence; part of the checkpointed state."""

    max_consecutive: int
    """Skipped steps in a row after which the run is declared diverged."""
    num_skipped_steps: int = 0
    """Steps skipped over the whole run."""
    num_consecutive: int = 0
    """Steps skipped since the last finite one."""

    def __post_init__(self) -> None:
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {self.max_consecutive}")

    @staticmethod
    def is_finite(*values: float) -> bool:
        return all(math.isfinite(value) for value in values)

    @property
    def diverged(self) -> bool:
        """max_consecutive non-finite steps in a row: the run cannot recover by skipping."""
        return self.num_consecutive >= self.max_consecutive

    def observe(self, *, finite: bool) -> bool:
        """Record one step; True when the run has diverged."""
        if finite:
            self.num_consecutive = 0
            return False
        self.num_skipped_steps += 1
        self.num_consecutive += 1
        return self.diverged

    def state_dict(self) -> dict[str, int]:
        return {"num_skipped_steps": self.num_skipped_steps, "num_consecutive": self.num_consecutive}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.num_skipped_steps = int(state["num_skipped_steps"])
        self.num_consecutive = int(state["num_consecutive"])

