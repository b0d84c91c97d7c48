"""Prometheus metrics from training: one textfile per rank, `<run_dir>/metrics/rank-<r>.prom`.

Every rank, after every step, rewrites its own file in the Prometheus text format with
`prometheus_client.write_to_textfile` (a temporary file, then `os.replace`): node_exporter's
textfile collector (`--collector.textfile.directory=<run_dir>/metrics`) or any reader sees the
last complete file, never a half-written one, also while a rank is being restarted.

Why a textfile per rank and not an HTTP endpoint per rank: a file needs no port per rank (on
SLURM several runs share a node, and torchrun restarts ranks on new ports), it outlives the
process (after a crash or during a restart the last step's figures are still there, with the
timestamp that says how old they are: exactly what the no-progress alert needs), and it sits in
the run folder next to final.json, so it moves and is published with the run's other records.
The price is one small write per step per rank (a few hundred bytes; `write_every_s` thins it).

Series are bounded: every metric carries exactly the labels `run` (the run folder's name),
`stage` (stage.stage) and `rank`. Never a sample key, a path or a config value: the number of
series is the number of ranks, however many steps or samples a run has. A dedicated
`CollectorRegistry` per exporter, never the process-global default one.

    trainyard_step                          the last finished step
    trainyard_step_seconds                  this rank's wall time of that step (data wait to
                                            checkpoint save; evaluation excluded)
    trainyard_samples_per_second            global batch samples / this rank's step time
    trainyard_data_wait_seconds             this rank's time waiting for that step's batch
    trainyard_memory_bytes                  current memory: CUDA allocated, else the process's RSS
    trainyard_memory_peak_bytes             peak memory: CUDA max allocated, else peak RSS
    trainyard_checkpoint_seconds            the last save's blocking time on this rank (an async
                                            save's is the staging only)
    trainyard_loss                          the step's global loss (NaN when non-finite)
    trainyard_last_step_timestamp_seconds   unix time at which the step finished
    trainyard_restarts_total                the run's attempt number ($TRAINYARD_ATTEMPT, set by
                                            trainer/supervisor/elastic.py from attempts.jsonl): 0 on the
                                            first attempt, one more per restart or requeue
    trainyard_nonfinite_events_total        the run's skipped non-finite steps (restored with
                                            the checkpoint, so it spans restarts)

The loop calls `on_step_end` on every rank (trainer/observe/hooks.py, RankHook), with this rank's own
timings; nothing here calls a collective. docs/operations.md has the scrape config and alerts.
"""

from __future__ import annotations

import math
import os
import resource
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, write_to_textfile

from trainer.faults import current_attempt

LABELS = ("run", "stage", "rank")
METRICS_DIR_NAME = "metrics"
DISABLE_ENV = "TRAINYARD_PROMETHEUS"  # "off": no metrics files


def metrics_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / METRICS_DIR_NAME


def rank_file(run_dir: str | Path, rank: int) -> Path:
    return metrics_dir(run_dir) / f"rank-{rank}.prom"


def enabled() -> bool:
    return os.environ.get(DISABLE_ENV, "on").lower() not in ("off", "0", "false")


def _current_memory_bytes(device: torch.device) -> int | None:
    """CUDA allocated bytes, else the resident set size (Linux /proc); None where neither is known."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except FileNotFoundError:  # not Linux: the peak below still says something
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB, macOS bytes


class PrometheusExporter:
    """This rank's metrics in their own registry, written to `<run_dir>/metrics/rank-<rank>.prom`."""

    def __init__(self, run_dir: str | Path, *, stage: str, rank: int, device: torch.device,
                 attempt: int | None = None, write_every_s: float = 0.0) -> None:
        self.path = rank_file(run_dir, rank)
        self.device = device
        self.write_every_s = write_every_s
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"run": Path(run_dir).name, "stage": stage, "rank": str(rank)}

        def gauge(name: str, documentation: str) -> Gauge:
            return Gauge(name, documentation, LABELS, registry=self.registry).labels(**labels)

        self.step = gauge("trainyard_step", "The last finished optimizer step.")
        self.step_seconds = gauge("trainyard_step_seconds", "This rank's wall time of the last step.")
        self.samples_per_second = gauge("trainyard_samples_per_second",
                                        "Global batch samples over this rank's last step time.")
        self.data_wait_seconds = gauge("trainyard_data_wait_seconds", "This rank's wait for the last step's batch.")
        self.memory_bytes = gauge("trainyard_memory_bytes", "Current memory: CUDA allocated, else resident set size.")
        self.memory_peak_bytes = gauge("trainyard_memory_peak_bytes", "Peak memory: CUDA max allocated, else peak RSS.")
        self.checkpoint_seconds = gauge("trainyard_checkpoint_seconds", "Blocking time of this rank's last save.")
        self.loss = gauge("trainyard_loss", "The last step's global loss (NaN when non-finite).")
        self.last_step_timestamp = gauge("trainyard_last_step_timestamp_seconds", "Unix time the last step finished.")
        # Counters of the run, not of this process: both start from what the run recorded.
        self.restarts = Counter("trainyard_restarts", "Restarts and requeues of this run before this attempt.",
                                LABELS, registry=self.registry).labels(**labels)
        self.restarts.inc(current_attempt() if attempt is None else attempt)
        self.nonfinite = Counter("trainyard_nonfinite_events", "Steps of the run skipped for a non-finite loss "
                                 "or gradient norm.", LABELS, registry=self.registry).labels(**labels)
        self._nonfinite_seen: int | None = None
        self._last_write = -math.inf
        self._stepped = False

    def on_step_end(self, step: int, metrics: Mapping[str, float], timings: Mapping[str, float]) -> None:
        """After every step, on every rank: metrics as the loop made them (loss and sample counts
        global), timings this rank's phases (StepTimer.end_step: step_time_s, time_<phase>_s)."""
        self._stepped = True
        self.step.set(step)
        self.step_seconds.set(timings["step_time_s"])
        self.samples_per_second.set(metrics["num_samples"] / timings["step_time_s"] if timings["step_time_s"] else 0.0)
        self.data_wait_seconds.set(timings["time_data_wait_s"])
        if timings["time_checkpoint_s"] > 0:  # a step that saved
            self.checkpoint_seconds.set(timings["time_checkpoint_s"])
        self.loss.set(metrics["loss"])
        skipped = int(metrics["num_skipped_steps"])  # the guard's count, restored from the checkpoint
        self.nonfinite.inc(skipped - (self._nonfinite_seen or 0))
        self._nonfinite_seen = skipped
        current = _current_memory_bytes(self.device)
        if current is not None:
            self.memory_bytes.set(current)
        self.memory_peak_bytes.set(max(_peak_memory_bytes(self.device), current or 0))  # /proc and getrusage round apart
        self.last_step_timestamp.set_to_current_time()
        if time.monotonic() - self._last_write >= self.write_every_s:
            self.write()

    def write(self) -> None:
        """The whole registry to this rank's file, atomically (a temporary file, then a rename)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), self.registry)
        self._last_write = time.monotonic()

    def close(self) -> None:
        """The last figures, also when write_every_s held the last step back. An attempt that ran no
        step writes nothing: its unset gauges (step 0, a last step in 1970) would replace the figures
        the previous attempt left, and the no-progress alert would read them."""
        if self._stepped:
            self.write()
