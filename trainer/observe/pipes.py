"""Dagster Pipes from inside the trainer: logs and the final result go back to the asset.

Only rank 0 opens the Pipes session (the Pipes environment reaches every rank through
torchrun). Progress is logged every ``log_every`` steps; when the run completes, one asset
materialization is reported with the run's figures, the committed checkpoint and the MLflow
run, so they become the asset's metadata. Runs that fail, diverge or are cancelled report
nothing: their non-zero exit fails the Dagster step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from trainer.observe.hooks import StepProgress
from trainer.state import RunResult

PIPES_ENV = "DAGSTER_PIPES_CONTEXT"


def pipes_requested() -> bool:
    return bool(os.environ.get(PIPES_ENV))


class PipesHook:
    """Logs a step line every ``log_every`` steps, and at least every ``every_s`` seconds whatever
    ``log_every`` is, so slow steps never leave the Dagster run's log silent for minutes."""

    def __init__(self, pipes: Any, *, log_every: int, summary: Callable[[RunResult], Mapping[str, Any]],
                 total_steps: int = 0, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.pipes, self.log_every, self.summary = pipes, max(1, log_every), summary
        self.every_s, self.clock = every_s, clock
        self.progress = StepProgress(total_steps, clock=clock) if total_steps else None
        self.last_line = clock()

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        progress = self.progress.text(step, metrics["step_time_s"]) + " " if self.progress else ""
        now = self.clock()
        if step % self.log_every == 0 or metrics.get("skipped") or now - self.last_line >= self.every_s:
            self.last_line = now
            total = f"/{self.progress.total_steps}" if self.progress else ""
            self.pipes.log.info(f"step {step}{total} {progress}loss {metrics['loss']:.6f} "
                                f"grad_norm {metrics['grad_norm']:.4f} step_s {metrics['step_time_s']:.3f} "
                                f"samples/s {metrics['samples_per_s']:.1f}")

    def on_evaluation(self, step: int, result: Mapping[str, Any]) -> None:
        if result.get("status") == "ok":
            self.pipes.log.info(f"step {step} {result['split']} loss {result['loss']:.6f} ({result['num_samples']} samples)")
        elif "samples" in result:
            self.pipes.log.info(f"step {step} samples: {result['samples'].get('status')} in {result['samples'].get('dir')}")
        else:
            self.pipes.log.warning(f"step {step} evaluation {result.get('status')}: {result.get('reason')}")

    def on_train_end(self, result: RunResult) -> None:
        self.pipes.log.info(f"run {result.status} at step {result.final_step}")
        # A launch may ask for logs only (restore drills launch twice for one asset).
        # A pruned sweep trial is done too: its materialization says so, with its committed checkpoint.
        if result.status not in ("completed", "pruned") or not self.pipes.extras.get("report_materialization", True):
            return
        metadata = {key: value for key, value in self.summary(result).items() if value is not None}
        self.pipes.report_asset_materialization(metadata=metadata, data_version=str(metadata.get("data_version", "")) or None)
