"""Fault injection for tests and drills: a rank that dies or stalls mid-run, a loss that turns NaN.

Set through the config (`faults.*`, e.g. `--set faults.exit_rank=1 --set faults.exit_at_step=3`).
Nothing here fires with the defaults.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field

import torch

# Exit status of an injected rank death: distinct from Python's 1 so a test can tell them apart.
INJECTED_EXIT_CODE = 17


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    exit_rank: int = -1
    """Rank that dies (os._exit, no cleanup, like a killed process) at exit_at_step; -1: none."""
    exit_at_step: int = 0
    """1-based step at whose start exit_rank dies; 0: never."""
    exit_signal: str = ""
    """How exit_rank dies: "" exits with INJECTED_EXIT_CODE; a signal name (e.g. "SIGKILL") sends
    that signal to itself, like the OOM killer or a lost node."""
    stall_rank: int = -1
    """Rank that stops responding (sleeps, ignoring the others) at stall_at_step; -1: none."""
    stall_at_step: int = 0
    """1-based step at whose start stall_rank stalls; 0: never."""
    stall_s: float = 0.0
    """How long the stall lasts; make it longer than train.collective_timeout_s to test that."""
    nan_loss_at_steps: list[int] = field(default_factory=list)
    """1-based steps whose loss is replaced by NaN (so are its gradients)."""
    nan_loss_rank: int = -1
    """Rank whose loss turns NaN at those steps; -1: every rank."""
    drop_optimizer_state_on_restore: bool = False
    """A broken restore, for restore-drill tests: resuming another run's checkpoint
    (stage.resume_from) restores everything but the optimizer state, which starts fresh."""

    def __post_init__(self) -> None:
        self.nan_loss_at_steps = list(self.nan_loss_at_steps)
        if min(self.exit_rank, self.stall_rank, self.nan_loss_rank) < -1:
            raise ValueError("exit_rank, stall_rank and nan_loss_rank must be >= -1")
        if min(self.exit_at_step, self.stall_at_step, self.stall_s) < 0:
            raise ValueError("exit_at_step, stall_at_step and stall_s must be >= 0")
        if any(step < 1 for step in self.nan_loss_at_steps):
            raise ValueError(f"nan_loss_at_steps entries must be >= 1, got {self.nan_loss_at_steps}")
        if self.exit_signal and self.exit_signal not in signal.Signals.__members__:
            raise ValueError(f"exit_signal must be a signal name such as 'SIGKILL', got {self.exit_signal!r}")
        for kind in ("exit", "stall"):
            rank, step = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_at_step")
            if (rank >= 0) != (step > 0):
                raise ValueError(f"set {kind}_rank and {kind}_at_step together, got {rank}, {step}")

    @property
    def max_rank(self) -> int:
        """Highest rank the faults name (-1 if none), checked against the world size at launch."""
        return max(self.exit_rank, self.stall_rank, self.nan_loss_rank)


class FaultInjector:
    def __init__(self, config: FaultConfig, *, rank: int) -> None:
        self.config = config
        self.rank = rank

    def before_step(self, step: int) -> None:
        """Kill or stall this process at the configured step, without cleanup or collectives."""
        config = self.config
        if config.exit_rank == self.rank and config.exit_at_step == step:
            print(f"[rank {self.rank}] fault injection: exiting at step {step}", flush=True)
            sys.stderr.flush()
            if config.exit_signal:
                os.kill(os.getpid(), signal.Signals[config.exit_signal])
            os._exit(INJECTED_EXIT_CODE)  # also if the signal was caught or ignored
        if config.stall_rank == self.rank and config.stall_at_step == step:
            print(f"[rank {self.rank}] fault injection: stalling {config.stall_s} s at step {step}",
                  flush=True)
            deadline = time.monotonic() + config.stall_s
            while time.monotonic() < deadline:  # sleep() resumes after signals (PEP 475): so do we
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if step in self.config.nan_loss_at_steps and self.config.nan_loss_rank in (-1, self.rank):
            return loss * float("nan")
        return loss
