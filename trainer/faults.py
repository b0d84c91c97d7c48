"""Fault injection for tests and drills: a rank that dies, stalls or is preempted mid-run, a loss
that turns NaN, a sample that crashes the step, bit rot under the newest checkpoint.

Set through the config (`faults.*`, e.g. `--set faults.exit_rank=1 --set faults.exit_at_step=3`).
Nothing here fires with the defaults, and faults fire on attempt `faults.attempt` of the run only
(trainer/supervisor/elastic.py tells each rank its attempt through $TRAINYARD_ATTEMPT; 0 without it), so a
run restarted after an injected death is not killed again at the same step.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from trainer.endings import INJECTED_EXIT, BadSampleError
from trainer.launch.config_sections import (
    FaultConfig)

# Exit status of an injected rank death: distinct from Python's 1 so a test can tell them apart.
INJECTED_EXIT_CODE = INJECTED_EXIT
ATTEMPT_ENV = "TRAINYARD_ATTEMPT"  # trainer/supervisor/elastic.py sets it for every rank of an attempt


def current_attempt() -> int:
    return int(os.environ.get(ATTEMPT_ENV, "0") or 0)


class FaultInjector:
    def __init__(self, config: FaultConfig, *, rank: int, attempt: int | None = None) -> None:
        self.config = config
        self.rank = rank
        self.attempt = current_attempt() if attempt is None else attempt
        self.armed = config.attempt in (-1, self.attempt)

    def before_step(self, step: int) -> None:
        """Kill, preempt or stall this process at the configured step, without cleanup or collectives."""
        if not self.armed:
            return
        config = self.config
        if config.exit_rank == self.rank and config.exit_at_step == step and config.exit_in == "step":
            self._exit(f"exiting at step {step}")
        if config.sigterm_at_step == step and config.sigterm_rank == self.rank:
            for _ in range(config.sigterm_count):
                print(f"[rank {self.rank}] fault injection: {config.preempt_with} to itself at step {step}", flush=True)
                os.kill(os.getpid(), signal.Signals[config.preempt_with])
        if config.oom_at_step == step and self.rank == 0:
            print(f"[rank 0] fault injection: out of memory at step {step}", flush=True)
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at step {step})")
        self._stall(step, "step")

    def before_commit(self, step: int) -> None:
        """Inside a checkpoint save, data written, record not yet (faults.exit_in="save")."""
        config = self.config
        if self.armed and config.exit_rank == self.rank and config.exit_at_step == step and config.exit_in == "save":
            self._exit(f"exiting inside the checkpoint save of step {step}, before its commit")

    def _exit(self, what: str) -> None:
        print(f"[rank {self.rank}] fault injection: {what}", flush=True)
        sys.stderr.flush()
        if self.config.exit_signal:
            os.kill(os.getpid(), signal.Signals[self.config.exit_signal])
        os._exit(INJECTED_EXIT_CODE)  # also if the signal was caught or ignored

    def in_data_fetch(self, step: int) -> None:
        """Inside the step's data fetch (faults.stall_in="data")."""
        self._stall(step, "data")

    def in_save(self, step: int) -> None:
        """Inside the step's checkpoint save (faults.stall_in="save", faults.disk_full_at_step)."""
        self._stall(step, "save")
        if self.armed and self.config.disk_full_at_step == step:
            print(f"[rank {self.rank}] fault injection: disk full in the save of step {step}", flush=True)
            raise OSError(errno.ENOSPC, f"No space left on device (injected in the checkpoint save of step {step})")

    def _stall(self, step: int, place: str) -> None:
        config = self.config
        if self.armed and config.stall_rank == self.rank and config.stall_at_step == step and config.stall_in == place:
            print(f"[rank {self.rank}] fault injection: stalling {config.stall_s} s in the {place} of step {step}",
                  flush=True)
            deadline = time.monotonic() + config.stall_s
            while time.monotonic() < deadline:  # sleep() resumes after signals (PEP 475): so do we
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def check_batch(self, step: int, keys: Sequence[str]) -> None:
        """Raise BadSampleError when this rank's batch holds faults.raise_on_sample."""
        key = self.config.raise_on_sample
        if self.armed and key and key in keys:
            print(f"[rank {self.rank}] fault injection: sample {key} crashes step {step}", flush=True)
            raise BadSampleError([key], f"injected failure in the step that holds it (step {step}, rank {self.rank})")

    def after_commit(self, step: int, checkpoint_dir: Path | None) -> None:
        """Rank 0 flips one byte of the largest data file of the checkpoint just committed at
        faults.corrupt_checkpoint_at_step (its record still claims the original digest)."""
        if not (self.armed and self.rank == 0 and checkpoint_dir is not None
                and self.config.corrupt_checkpoint_at_step == step):
            return
        files = [path for path in Path(checkpoint_dir).rglob("*") if path.is_file() and path.suffix == ".distcp"]
        target = max(files, key=lambda path: path.stat().st_size)
        with open(target, "r+b") as handle:
            handle.seek(target.stat().st_size // 2)
            byte = handle.read(1)
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte[0] ^ 0xFF]))
        print(f"[rank 0] fault injection: flipped a byte of {target} (checkpoint of step {step})", flush=True)

    def before_end_work(self) -> None:
        """Rank 0's slow end of run (faults.end_stall_s), after the final barrier."""
        if self.rank == 0 and self.config.end_stall_s:
            print(f"[rank 0] fault injection: {self.config.end_stall_s} s of end-of-run work", flush=True)
            time.sleep(self.config.end_stall_s)

    def corrupt_loss(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        if self.armed and step in self.config.nan_loss_at_steps and self.config.nan_loss_rank in (-1, self.rank):
            return loss * float("nan")
        if self.armed and step in self.config.spike_loss_at_steps:
            return loss * 1000.0
        return loss
