"""The step performance model: phase timers, throughput, peak memory, a bound verdict, and the
cross-rank reductions and profiler trace that go with them. Plus `compare_runs`, the numerics
report between two runs (e.g. bf16 against fp32).

Phases of a step: data_wait (next_batch), host_to_device, forward (incl. noise sampling),
backward, optimizer (unscale, clip, the loss/stop all-reduce, step), logging (hooks),
checkpoint. On CUDA the device is synchronized once at the start of a step and once where its
time is read, so step times are the device's. Per-phase times are the host's unless
`sync_phases` (train.sync_phases, always with train.profile) also synchronizes at every phase
boundary: then each phase is the device's time too, at the cost of the overlap between queued
kernels and the host's next phase, so it is for profiling, not for production runs.
Steps before `warmup_steps` (allocator, autotuning, lazy init) are left out of the summary.

Verdict rule (`bound_verdict`), over medians of the steady-state steps:
    input_s   = data_wait + host_to_device          (exposed input time)
    comm_s    = probe of the step's gradient traffic: a timed all_reduce of the gradient bytes
                (DDP); FSDP2 moves about 1.5x that (all-gather in forward and again in backward,
                reduce-scatter of gradients, each half a ring all-reduce); 0 on one rank
    compute_s = forward + backward + optimizer - comm_s (floored at 0; the collectives run
                inside backward for DDP and inside forward/backward for FSDP)
    verdict   = the largest of the three: "input-bound", "communication-bound", "compute-bound"
comm_s is measured with nothing to overlap it, so it is an upper bound of the exposed
communication: a "communication-bound" verdict says overlap is what stands between this run
and compute-bound, and is worth a side-by-side benchmark, not a conclusion by itself.

Throughput counts what each steady step really computed (`StepTimer.record_work`: samples,
frames, tokens and FLOPs of its clip shape), over a robust time: each step's time is the median
step time of the steps of its clip shape. With one shape that is the work of a step over the
median step time; with bucketed data (a clip shape per step) a long-clip step weighs as much
time as it takes, and the rates are not those of whichever shape the median step happened to be.

Cross-rank reduction semantics: `reduce_mean` (loss: every rank holds equal-sized micro-batches,
so the plain mean is the global-batch mean), `reduce_max` (step time and peak memory: the
slowest / fullest rank sets the pace and the limit), `reduce_sum` (throughput: ranks add up).
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import resource
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ops import lineage
from ops.clips.plan import bucket_name
from trainer.parallel import Distributed, all_reduce_values

PHASES = ("data_wait", "host_to_device", "forward", "backward", "optimizer", "logging", "checkpoint")
VERDICTS = ("input-bound", "compute-bound", "communication-bound")
_PROBE_MAX_BYTES = 256 * 2**20  # larger gradients: time 256 MiB and extrapolate linearly
_PROBE_REPEATS = 3
_FSDP_TRAFFIC_FACTOR = 1.5


class StepTimer:
    """Wall-clock time per phase of each step, and the work it did; keeps the steps after warmup_steps."""

    def __init__(self, *, device: torch.device, warmup_steps: int, sync_phases: bool = False) -> None:
        self.device = device
        self.warmup_steps = warmup_steps
        self.sync_phases = sync_phases and device.type == "cuda"
        self.steady: list[dict[str, float]] = []
        self.steady_work: list[dict[str, Any]] = []  # record_work of each steady step, as in steady
        self._num_steps = 0
        self._current: dict[str, float] = {}
        self._work: dict[str, Any] = {}
        self._step_start = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        self._sync()
        self._current = dict.fromkeys(PHASES, 0.0)
        self._work = {}
        self._step_start = time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the block's duration to phase name (phases repeat across micro-batches)."""
        assert name in PHASES, name
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync_phases:
                self._sync()
            self._current[name] += time.perf_counter() - start

    def record_work(self, *, clip_shape: Sequence[int], samples: int, frames: int, tokens: int,
                    flops: int) -> None:
        """What this step computed: its clip shape (T, H, W), this rank's samples, frames and
        tokens, and the FLOPs of the whole global batch."""
        self._work = {"clip_shape": tuple(clip_shape), "samples": samples, "frames": frames,
                      "tokens": tokens, "flops": flops}

    def elapsed(self) -> dict[str, float]:
        """This step so far: seconds per phase and step_time_s (after the device's queued work)."""
        self._sync()
        return {**{f"time_{name}_s": value for name, value in self._current.items()},
                "step_time_s": time.perf_counter() - self._step_start}

    def end_step(self) -> dict[str, float]:
        record = self.elapsed()
        self._num_steps += 1
        if self._num_steps > self.warmup_steps:
            self.steady.append(record)
            self.steady_work.append(self._work)
        return record

    def medians(self) -> dict[str, float]:
        """Median of each phase and of the step time over the steady-state steps ({} if none)."""
        if not self.steady:
            return {}
        return {key: statistics.median(record[key] for record in self.steady) for key in self.steady[0]}

    def shape_median_time_s(self) -> float:
        """Time of the steady steps, each counted as the median step time of its kind: its clip
        shape and sample count (a bucket's short remainder step is a kind of its own)."""
        times_by_shape: dict[tuple, list[float]] = defaultdict(list)
        for record, work in zip(self.steady, self.steady_work, strict=True):
            times_by_shape[(work["clip_shape"], work["samples"])].append(record["step_time_s"])
        return sum(statistics.median(times) * len(times) for times in times_by_shape.values())


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated device memory (CUDA), or the process's peak RSS (CPU; Linux KiB -> bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes


def probe_comm_s(distributed: Distributed, *, grad_bytes: int, parallelism: str) -> float:
    """Seconds of one step's gradient traffic, measured alone (see the module docstring).

    A collective: every rank must call it at the same point.
    """
    if distributed.backend is None or distributed.world.world_size == 1 or parallelism == "none":
        return 0.0
    probe_bytes = min(grad_bytes, _PROBE_MAX_BYTES)
    device = distributed.device if distributed.backend == "nccl" else torch.device("cpu")
    buffer = torch.ones(max(1, probe_bytes // 4), dtype=torch.float32, device=device)
    dist.all_reduce(buffer)  # untimed: connection setup, algorithm selection
    durations = []
    for _ in range(_PROBE_REPEATS):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        durations.append(time.perf_counter() - start)
    seconds = statistics.median(durations) * grad_bytes / max(1, probe_bytes)
    return seconds * (_FSDP_TRAFFIC_FACTOR if parallelism == "fsdp" else 1.0)


def bound_verdict(*, input_s: float, compute_s: float, comm_s: float) -> str:
    """The largest of the three components (ties go to compute, then input)."""
    ranked = {"compute-bound": compute_s, "input-bound": input_s, "communication-bound": comm_s}
    return max(ranked, key=ranked.get)


def reduce_mean(values: Sequence[float], distributed: Distributed) -> list[float]:
    return [value / distributed.world.world_size for value in all_reduce_values(values, op="sum", distributed=distributed)]


def reduce_max(values: Sequence[float], distributed: Distributed) -> list[float]:
    return all_reduce_values(values, op="max", distributed=distributed)


def reduce_sum(values: Sequence[float], distributed: Distributed) -> list[float]:
    return all_reduce_values(values, op="sum", distributed=distributed)


def summarize(timer: StepTimer, *, distributed: Distributed, comm_s: float, collective: bool) -> dict[str, Any]:
    """The run's performance summary; with collective=True reduced over ranks (all must call).

    Rates are the steady steps' recorded work over their clip-shape median time (module
    docstring); collective=False (after a failure, when a peer may be gone) summarizes this
    rank alone and scales its rates by the world size.
    """
    medians = timer.medians()
    peak = peak_memory_bytes(distributed.device)
    if not medians:
        return {"num_steady_steps": 0, "peak_memory_bytes": peak, "verdict": None}
    step_s, time_s = medians["step_time_s"], timer.shape_median_time_s()
    totals = {key: sum(work[key] for work in timer.steady_work) for key in ("samples", "frames", "tokens", "flops")}
    local_rates = [totals[key] / time_s if time_s > 0 else math.nan for key in ("samples", "frames", "tokens")]
    if collective:
        step_s, peak_f, time_s = reduce_max([step_s, float(peak), time_s], distributed)
        peak = int(peak_f)
        samples_per_s, frames_per_s, tokens_per_s = reduce_sum(local_rates, distributed)
    else:
        samples_per_s, frames_per_s, tokens_per_s = (rate * distributed.world.world_size for rate in local_rates)
    input_s = medians["time_data_wait_s"] + medians["time_host_to_device_s"]
    busy_s = medians["time_forward_s"] + medians["time_backward_s"] + medians["time_optimizer_s"]
    compute_s = max(0.0, busy_s - comm_s)
    return {
        "num_steady_steps": len(timer.steady),
        "reduced_over_ranks": collective,
        "phase_medians_s": {key.removeprefix("time_").removesuffix("_s"): value
                            for key, value in medians.items() if key.startswith("time_")},
        "step_time_s": step_s,
        "samples_per_s": samples_per_s,
        "frames_per_s": frames_per_s,
        "tokens_per_s": tokens_per_s,
        # FLOPs are of the global batch, the same on every rank: the slowest rank sets the pace.
        "achieved_flops_per_s": totals["flops"] / time_s if time_s > 0 else math.nan,
        "flops_per_step": round(totals["flops"] / len(timer.steady_work)),
        "clip_shapes": sorted({bucket_name(*work["clip_shape"]) for work in timer.steady_work}),
        "peak_memory_bytes": peak,
        "peak_memory_kind": "cuda_max_allocated" if distributed.device.type == "cuda" else "process_max_rss",
        "input_s": input_s,
        "compute_s": compute_s,
        "comm_s": comm_s,
        "verdict": bound_verdict(input_s=input_s, compute_s=compute_s, comm_s=comm_s),
    }


# ---------------------------------------------------------------------------------------------
# Profiler trace


def environment_record(*, distributed: Distributed, batch_shape: Sequence[int], clip_shapes: Sequence[Sequence[int]],
                       parallelism: str, precision: str) -> dict[str, Any]:
    """What a trace needs to be read later: commit, versions, device, batch shape, parallelism.

    batch_shape is the global batch at the reference clip shape; clip_shapes every shape a step
    may have (bucketed data).
    """
    commit, dirty = lineage.git_state()  # runs git: only when a trace is requested
    device_name = (torch.cuda.get_device_name(distributed.device) if distributed.device.type == "cuda"
                   else platform.processor() or platform.machine())
    return {
        "git_commit": commit, "git_dirty": dirty, "python": platform.python_version(),
        "torch": torch.__version__, "numpy": np.__version__, "cuda": torch.version.cuda,
        "device": str(distributed.device), "device_name": device_name, "world_size": distributed.world.world_size,
        "parallelism": parallelism, "precision": precision, "batch_shape": list(batch_shape),
        "clip_shapes": [list(shape) for shape in clip_shapes],
        "num_threads": torch.get_num_threads(),
    }


@contextlib.contextmanager
def profile_window(*, enabled: bool, run_dir: Path, distributed: Distributed, skip_steps: int,
                   active_steps: int, environment: Mapping[str, Any] | None
                   ) -> Iterator[torch.profiler.profile | None]:
    """Yield a torch.profiler recording one steady-state window, or None when not enabled.

    Writes run_dir/profile/trace_rank<r>.json (Chrome trace) and, on rank 0, environment.json.
    """
    if not enabled:
        yield None
        return
    out_dir = run_dir / "profile"
    out_dir.mkdir(parents=True, exist_ok=True)
    if distributed.world.is_main and environment is not None:
        (out_dir / "environment.json").write_text(json.dumps(environment, indent=2))
    activities = [torch.profiler.ProfilerActivity.CPU]
    if distributed.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def export(profiler: torch.profiler.profile) -> None:
        profiler.export_chrome_trace(str(out_dir / f"trace_rank{distributed.world.rank}.json"))

    schedule = torch.profiler.schedule(wait=skip_steps, warmup=1, active=active_steps, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=export, record_shapes=True) as profiler:
        yield profiler


def profiler_step(profiler: torch.profiler.profile | None) -> None:
    """Advance the profiler's schedule at the end of a step (no-op without a profiler)."""
    if profiler is not None:
        profiler.step()


# ---------------------------------------------------------------------------------------------
# Numerics report


def compare_runs(reference: Mapping[str, Any], candidate: Mapping[str, Any]) -> dict[str, Any]:
    """Per-step loss deltas and grad-norm ratios of candidate against reference (final.json dicts)."""
    ref_losses, cand_losses = reference["losses"], candidate["losses"]
    ref_norms, cand_norms = reference["grad_norms"], candidate["grad_norms"]
    if len(ref_losses) != len(cand_losses):
        raise ValueError(f"runs differ in length: {len(ref_losses)} vs {len(cand_losses)} steps")
    loss_abs = [c - r for r, c in zip(ref_losses, cand_losses, strict=True)]
    loss_rel = [abs(d) / abs(r) if r else math.inf for d, r in zip(loss_abs, ref_losses, strict=True)]
    norm_ratio = [c / r if r else math.nan for r, c in zip(ref_norms, cand_norms, strict=True)]
    return {
        "num_steps": len(ref_losses),
        "loss_delta": loss_abs,
        "loss_rel_delta": loss_rel,
        "grad_norm_ratio": norm_ratio,
        "max_loss_rel_delta": max(loss_rel, default=0.0),
        "max_grad_norm_ratio_deviation": max((abs(r - 1) for r in norm_ratio), default=0.0),
    }
