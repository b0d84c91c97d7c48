"""Fault injection for tests and drills: a rank that dies or stalls mid-run, a loss that turns NaN.

Set through the config (`faults.*`, e.g. `--set faults.exit_rank=1 --set faults.exit_at_step=3`).
Nothing here fires with the defaults.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from trainer.schema import FaultConfig  # noqa: F401 - torch-free (trainer/schema.py); re-exported here

# Exit status of an injected rank death: distinct from Python's 1 so a test can tell them apart.
INJECTED_EXIT_CODE = 17


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
        self._stall(step, "step")

    def in_data_fetch(self, step: int) -> None:
        """Inside the step's data fetch (faults.stall_in="data")."""
        self._stall(step, "data")

    def in_save(self, step: int) -> None:
        """Inside the step's checkpoint save (faults.stall_in="save")."""
        self._stall(step, "save")

    def _stall(self, step: int, place: str) -> None:
        config = self.config
        if config.stall_rank == self.rank and config.stall_at_step == step and config.stall_in == place:
            print(f"[rank {self.rank}] fault injection: stalling {config.stall_s} s in the {place} of step {step}",
                  flush=True)
            deadline = time.monotonic() + config.stall_s
            while time.monotonic() < deadline:  # sleep() resumes after signals (PEP 475): so do we
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def before_end_work(self) -> None:
        """Rank 0's slow end of run (faults.end_stall_s), after the final barrier."""
        if self.rank == 0 and self.config.end_stall_s:
            print(f"[rank 0] fault injection: {self.config.end_stall_s} s of end-of-run work", flush=True)
            time.sleep(self.config.end_stall_s)

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if step in self.config.nan_loss_at_steps and self.config.nan_loss_rank in (-1, self.rank):
            return loss * float("nan")
        return loss
