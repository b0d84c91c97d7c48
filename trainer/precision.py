"""Numeric precision policy and the non-finite guard.

Policies
--------
| policy | compute (matmuls) | master weights, grads, norms, loss, AdamW state | loss scaling |
| ------ | ----------------- | ----------------------------------------------- | ------------ |
| fp32   | fp32              | fp32                                            | none         |
| bf16   | bf16 (autocast)   | fp32                                            | none         |
| fp16   | fp16 (autocast)   | fp32                                            | GradScaler   |

`auto` (the default) is bf16 on a CUDA device that supports it and fp32 elsewhere
(`resolve_precision`): a GPU run gets tensor cores and flash attention without asking, and a
CPU run keeps the bit-identical fp32 arithmetic the tests hold. On CUDA, fp32 matmuls use TF32
unless `train.tf32=false` (`set_tf32`).

Parameters are always fp32 (autocast casts copies per op), so the optimizer and its state are
fp32. Norms are computed in fp32 by the model (`Fp32LayerNorm`, `Fp32RMSNorm`); the loss is
reduced in fp32 (`VideoFlowModel.forward`). The residual stream between blocks is in the compute
dtype unless `train.residual_dtype=fp32` (trainer/models/video.py). Under FSDP2 with bf16, the
all-gathered parameters are bf16 and gradients are reduced in fp32 (MixedPrecisionPolicy,
trainer/parallel.py); autocast still decides the dtype of each op, so DDP and FSDP2 compute
alike.

Attention: `train.attention_backend` names torch's SDPA kernel ('flash', 'cudnn', 'efficient',
'math') or leaves the choice to torch ('auto'); a named one is probed on the device before the
first step (`probe_attention`), so an unavailable kernel is a clear error, not a silent fallback.

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
import torch.nn.functional as F

from trainer.launch.refusal import Refusal
from trainer.launch.config_sections import (
    PRECISION_CHOICES, PRECISIONS)

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class UnsupportedPrecision(Refusal):
    """The device cannot run the requested precision policy (a config refusal: the fix is train.precision)."""

    def __init__(self, found: str, fix: str) -> None:
        super().__init__("config", found, fix, key="train.precision")


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
            f"train.precision {policy!r} needs autocast to {dtype} on {device_type!r}, which this torch "
            f"{torch.__version__} build does not support",
            "use 'fp32'" + (" or 'bf16'" if policy == "fp16" else "") + " for train.precision")


def resolve_precision(policy: str, device_type: str) -> str:
    """The policy that runs: 'auto' is bf16 on a CUDA device with bf16 autocast, else fp32."""
    if policy not in PRECISION_CHOICES:
        raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {policy!r}")
    if policy != "auto":
        return policy
    return "bf16" if device_type == "cuda" and autocast_supported("cuda", torch.bfloat16) else "fp32"


@dataclass(frozen=True, slots=True)
class Tf32Flags:
    """torch's TF32 switches, to restore when a Trainer closes (they are process-global)."""

    matmul: bool
    cudnn: bool


def set_tf32(enabled: bool) -> Tf32Flags:
    """Allow (or forbid) TF32 for fp32 matmuls and convolutions on CUDA; the previous flags.

    CPU kernels ignore both flags, so CPU arithmetic is unchanged either way.
    """
    previous = Tf32Flags(torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
    return previous


def restore_tf32(flags: Tf32Flags) -> None:
    torch.backends.cuda.matmul.allow_tf32 = flags.matmul
    torch.backends.cudnn.allow_tf32 = flags.cudnn


class UnsupportedAttentionBackend(ValueError):
    """The named SDPA kernel cannot run on this device, dtype and head size."""


def attention_context(backend: str) -> contextlib.AbstractContextManager:
    """Restrict SDPA to the named kernel ('auto': torch chooses per call)."""
    if backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernels = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([kernels[backend]])


def probe_attention(backend: str, *, device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Run the named kernel forward and backward on a tiny input shaped like the model's heads.

    torch refuses a kernel it cannot use for these inputs with a RuntimeError that says why; this
    turns it into UnsupportedAttentionBackend before any step runs. 'auto' is not probed.
    """
    if backend == "auto":
        return
    q, k, v = (torch.randn(1, 2, 16, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    try:
        with attention_context(backend):
            F.scaled_dot_product_attention(q, k, v).sum().backward()
    except RuntimeError as error:
        raise UnsupportedAttentionBackend(
            f"train.attention_backend {backend!r} cannot run on {device} with {str(dtype).removeprefix('torch.')} "
            f"and head_dim {head_dim}: {str(error).splitlines()[0]}; use 'auto' or another backend") from None


class Precision:
    """Autocast context and loss scaling for one policy; its state_dict is the GradScaler's."""

    def __init__(self, policy: str, *, device_type: str) -> None:
        self.requested = policy
        policy = resolve_precision(policy, device_type)
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
            "requested_policy": self.requested,
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

