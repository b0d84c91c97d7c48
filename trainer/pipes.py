"""Dagster Pipes from inside the trainer: logs and the final result go back to the asset.

Only rank 0 opens the Pipes session (the Pipes environment reaches every rank through
torchrun). Progress is logged every ``log_every`` steps; when the run completes, one asset
materialization is reported with the run's figures, the committed checkpoint and the MLflow
run, so they become the asset's metadata. Runs that fail, diverge or are cancelled report
nothing: their non-zero exit fails the Dagster step.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from trainer.state import RunResult

PIPES_ENV = "DAGSTER_PIPES_CONTEXT"


def pipes_requested() -> bool:
    return bool(os.environ.get(PIPES_ENV))


class PipesHook:
    def __init__(self, pipes: Any, *, log_every: int, summary: Callable[[RunResult], Mapping[str, Any]]) -> None:
        self.pipes, self.log_every, self.summary = pipes, max(1, log_every), summary

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        if step % self.log_every == 0 or metrics.get("skipped"):
            self.pipes.log.info(f"step {step} loss {metrics['loss']:.6f} grad_norm {metrics['grad_norm']:.4f} "
                                f"step_s {metrics['step_time_s']:.3f} samples/s {metrics['samples_per_s']:.1f}")

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
        if result.status != "completed" or not self.pipes.extras.get("report_materialization", True):
            return
        metadata = {key: value for key, value in self.summary(result).items() if value is not None}
        self.pipes.report_asset_materialization(metadata=metadata, data_version=str(metadata.get("data_version", "")) or None)
