"""Plug-in points of the training loop: hooks (observe) and the checkpointer (persist).

MLflow logging, Dagster Pipes and DCP checkpoints plug in here without editing the loop.

Hook: called on rank 0 only, with metrics already reduced over ranks, so it may write to
the outside world but must not call collectives.

    on_step_end(step, metrics)  after every step; step is 1-based (the step just finished)
    on_evaluation(step, result) after a validation loss (trainer/heldout.py: status, loss, loss_t,
                                loss_bucket, ...) or, with a "samples" entry, the end-of-run samples
    on_train_end(result)        once, whatever the status (completed, failed, diverged, canceled)

RankHook: called on EVERY rank after every step (trainer/observe/prometheus.py), with this rank's own
timings; it must not call collectives, and it is closed by Trainer.close() on every path.

    on_step_end(step, metrics, timings)  metrics as Hook sees them (loss, sample counts: global);
                                         timings this rank's (StepTimer.end_step: step_time_s,
                                         time_<phase>_s, the checkpoint save included)
    close()                              once, from Trainer.close()

Checkpointer: called on EVERY rank at the same step (saving a sharded state is collective).
The protocol is everything the loop and the wiring use, so neither probes for a method.

    load(app_state) -> int | None    once, before the first step: restore app_state in place
                                     and return the restored step, or None for a fresh start
    save(step, app_state) -> None    every train.checkpoint_every steps, after the last step,
                                     and on cancellation (SIGTERM), at a step boundary; an async
                                     save may return before its checkpoint is committed
    wait() -> None                   after the last save of a completed run: block until every
                                     save is committed (raise its error), so the run reports a
                                     checkpoint that exists
    close() -> None                  from Trainer.close(), before the process group goes:
                                     finish in-flight (async) saves, release resources
    last_record                      the commit record (COMMITTED.json) of the last checkpoint
                                     this process saw committed, or None
    last_load                        what load() restored (trainer.checkpointing.checkpointer.LoadReport: folder,
                                     step, notes), or None before load() or without a checkpoint
                                     to restore. A retry that resumes at its last step saves
                                     nothing, so its committed checkpoint is the one it loaded.

trainer.checkpointing.checkpointer.Checkpointer (DCP) implements it, and trainer.wiring.ResumeFrom around it.
app_state is `Trainer.app_state()` (see trainer/state.py for its entries).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TYPE_CHECKING

from ops.progress import duration as _duration
from trainer.state import RunResult, Stateful

if TYPE_CHECKING:  # trainer.checkpointing.checkpointer imports DCP; a hook needs none of it
    from trainer.checkpointing.checkpointer import LoadReport

log = logging.getLogger("trainer")


class Hook(Protocol):
    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def on_evaluation(self, step: int, result: Mapping[str, Any]) -> None: ...
    def on_train_end(self, result: RunResult) -> None: ...


class RankHook(Protocol):
    def on_step_end(self, step: int, metrics: Mapping[str, float], timings: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class Checkpointer(Protocol):
    def load(self, app_state: Mapping[str, Stateful]) -> int | None: ...
    def save(self, step: int, app_state: Mapping[str, Stateful]) -> None: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...

    @property
    def last_record(self) -> Mapping[str, Any] | None: ...

    @property
    def last_load(self) -> LoadReport | None: ...


class StepProgress:
    """Rate and time left of a run's steps, for its log lines (standalone, and through Pipes).

    Counted from the first step this attempt ran (a resumed run's earlier steps took no time here),
    so the rate is this attempt's average and the time left is the remaining steps at that rate.
    """

    def __init__(self, total_steps: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total_steps, self.clock = total_steps, clock
        self.started: float | None = None
        self.first_step = 0

    def text(self, step: int, step_time_s: float) -> str:
        now = self.clock()
        if self.started is None:  # the first step's own time counts: it began before this call
            self.started, self.first_step = now - step_time_s, step - 1
        elapsed, done = now - self.started, step - self.first_step
        rate = done / elapsed if elapsed > 0 else 0.0
        share = f"{100 * step / self.total_steps:.0f}%" if self.total_steps else "?"
        if step >= self.total_steps:
            return f"({share}, {rate:.2f} steps/s)"
        left = f"about {_duration((self.total_steps - step) / rate)} left" if rate > 0 else "time left unknown yet"
        return f"({share}, {rate:.2f} steps/s, {left})"


class ConsoleHook:
    """One log line every log_every steps, and on every skipped step."""

    def __init__(self, *, log_every: int, total_steps: int) -> None:
        self.log_every, self.total_steps = log_every, total_steps
        self.progress = StepProgress(total_steps)

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        progress = self.progress.text(step, metrics["step_time_s"])  # every step: the rate's clock starts at the first
        if step % self.log_every and not metrics["skipped"] and step != self.total_steps:
            return
        log.info("step %d/%d %s loss %.6f grad_norm %.4f lr %.3e step_s %.3f samples/s %.1f%s",
                 step, self.total_steps, progress, metrics["loss"], metrics["grad_norm"], metrics["lr"],
                 metrics["step_time_s"], metrics["samples_per_s"],
                 f" SKIPPED (non-finite; {int(metrics['num_skipped_steps'])} so far)"
                 if metrics["skipped"] else "")

    def on_evaluation(self, step: int, result: Mapping[str, Any]) -> None:
        """The loop logs the figures itself; the samples' folder is worth a line."""
        samples = result.get("samples")
        if samples and samples.get("dir"):
            log.info("step %d: samples in %s (contact sheet %s)", step, samples["dir"], samples.get("contact_sheet"))

    def on_train_end(self, result: RunResult) -> None:
        log.info("run %s at step %d (%d skipped steps)", result.status, result.final_step,
                 result.num_skipped_steps)
