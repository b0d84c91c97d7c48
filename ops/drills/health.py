"""Health of a training run, read from its run folder: the plain functions under assets/health.py.

Each function measures one property and returns a `Health` (passed, a one-line description, the
numbers that explain it). "Cannot measure" is never an error: a missing baseline or a run with
nothing to compare passes with `skipped` set and says why, so a warning means a measured problem.

    no_stall(run_dir, max_step_gap_s=...)              the longest step of the run's last attempt
                                                       (final.json step_log; an attempt that ran no
                                                       step, e.g. one resumed at the run's last
                                                       step, passes: an ended run is no stall), or
                                                       for a run that has not ended, the age of its
                                                       least recent rank's last step
                                                       (metrics/rank-<r>.prom)
    restarts_within_budget(attempts, max_restarts=...) restarts and requeues recorded in
                                                       attempts.jsonl
    checkpoints_not_corrupted(run_dir, ...)            every committed checkpoint the run keeps,
                                                       re-hashed against its signed record
    throughput_vs_baseline(measured, baseline, ...)    the run's steady samples/s against
                                                       step_profile's, only when they ran the same
                                                       world size, precision, batch and clip shapes

Thresholds: `Thresholds.from_env()` reads the TRAINYARD_HEALTH_* variables (docs/operations.md).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.checkpoints import store

MAX_STEP_GAP_S_ENV = "TRAINYARD_HEALTH_MAX_STEP_GAP_S"
MAX_RESTARTS_ENV = "TRAINYARD_HEALTH_MAX_RESTARTS"
MAX_THROUGHPUT_REGRESSION_ENV = "TRAINYARD_HEALTH_MAX_THROUGHPUT_REGRESSION"
# What a restart is: an attempt after which the launch policy started another one (trainer/supervisor/elastic.py).
RESTART_DECISIONS = ("restart", "requeue")
# What must match for two runs' samples/s to be compared (read from final.json, see throughput_profile).
LIKE_FOR_LIKE = ("device_type", "world_size", "precision", "global_batch", "local_batch_size", "clip_shapes")
_LAST_STEP_METRIC = "trainyard_last_step_timestamp_seconds"


@dataclass(frozen=True, slots=True)
class Thresholds:
    max_step_gap_s: float = 300.0
    """Longest acceptable step (or time since the last step of a live run), in seconds."""
    max_restarts: int = 1
    """Restarts and requeues a run may need before it warns (the retry budget is separate)."""
    max_throughput_regression: float = 0.3
    """Largest acceptable drop of samples/s below step_profile's, as a fraction of it."""

    def __post_init__(self) -> None:
        if self.max_step_gap_s <= 0 or self.max_restarts < 0 or not 0 < self.max_throughput_regression < 1:
            raise ValueError(f"health thresholds out of range: {self}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Thresholds:
        defaults = cls()
        return cls(max_step_gap_s=float(environ.get(MAX_STEP_GAP_S_ENV, defaults.max_step_gap_s)),
                   max_restarts=int(environ.get(MAX_RESTARTS_ENV, defaults.max_restarts)),
                   max_throughput_regression=float(environ.get(MAX_THROUGHPUT_REGRESSION_ENV,
                                                               defaults.max_throughput_regression)))


@dataclass(frozen=True, slots=True)
class Health:
    passed: bool
    description: str
    metadata: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False


class RunRecordUnreadable(ValueError):
    """A run's final.json that is truncated, not JSON or not an object; names the file."""


def read_final(run_dir: str | Path) -> dict[str, Any] | None:
    """The run's final.json, or None when it has none (not ended, or never started);
    RunRecordUnreadable naming the file when it is damaged."""
    path = Path(run_dir) / "final.json"
    record, problem = None, ""
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bytes that are not UTF-8
        problem = f"truncated or invalid JSON ({type(error).__name__}: {error})"
    if not problem and not isinstance(record, dict):
        problem = f"a run record is a JSON object, not a {type(record).__name__}"
    if problem:
        raise RunRecordUnreadable(f"{path}: {problem}")
    return record


def last_step_timestamps(run_dir: str | Path) -> dict[str, float]:
    """Rank -> unix time of its last finished step, from the per-rank metrics files (trainer/observe/prometheus.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float] = {}
    for path in sorted((Path(run_dir) / "metrics").glob("rank-*.prom")):
        for family in text_string_to_metric_families(path.read_text()):
            if family.name == _LAST_STEP_METRIC:
                found |= {sample.labels["rank"]: sample.value for sample in family.samples}
    return found


def no_stall(run_dir: str | Path, *, max_step_gap_s: float, now: float | None = None) -> Health:
    """No step took longer than max_step_gap_s (an ended run), or no rank has gone that long
    without finishing a step (a run without final.json)."""
    final = read_final(run_dir)
    if final is not None and not final.get("step_log"):
        # The attempt ended without running a step: a run resumed at its last step (a second
        # `make demo`), or one that failed before its first. Older attempts' metrics files say
        # nothing about this one, and an ended run is never a stall.
        status = final.get("status", "unknown")
        return Health(
            passed=True, skipped=True,
            description=(f"the last attempt ended ({status}) at step {final.get('final_step')} without running a "
                         "step" + (": the run was already complete" if status == "completed" else "")
                         + "; an ended run is not a stall"),
            metadata={"measured": "nothing: the last attempt ran no step (final.json step_log is empty)",
                      "status": status, "final_step": final.get("final_step"), "max_step_gap_s": max_step_gap_s})
    if final is not None:
        step, _, step_time_s, _ = max(final["step_log"], key=lambda row: row[2])
        return Health(
            passed=step_time_s <= max_step_gap_s,
            description=(f"longest step of the last attempt: step {step}, {step_time_s:.3f} s "
                         f"({'within' if step_time_s <= max_step_gap_s else 'over'} {max_step_gap_s:g} s)"),
            metadata={"measured": "longest step of the last attempt (final.json step_log: data wait through "
                                  "checkpoint save, evaluation excluded)",
                      "longest_step": step, "longest_step_s": step_time_s, "max_step_gap_s": max_step_gap_s,
                      "num_steps": len(final["step_log"]), "status": final.get("status", "unknown")})
    timestamps = last_step_timestamps(run_dir)
    if not timestamps:
        return Health(passed=False, description=f"{Path(run_dir).name}: no step recorded (no final.json step log, "
                                                "no metrics file): progress cannot be shown",
                      metadata={"measured": "nothing", "max_step_gap_s": max_step_gap_s})
    rank, last = min(timestamps.items(), key=lambda item: item[1])
    age_s = (time.time() if now is None else now) - last
    return Health(
        passed=age_s <= max_step_gap_s,
        description=f"rank {rank} finished its last step {age_s:.1f} s ago (limit {max_step_gap_s:g} s)",
        metadata={"measured": "seconds since the least recent rank's last step (metrics/rank-<r>.prom)",
                  "stalest_rank": rank, "since_last_step_s": round(age_s, 3), "max_step_gap_s": max_step_gap_s,
                  "num_ranks": len(timestamps)})


def restarts_within_budget(attempts: Sequence[Mapping[str, Any]], *, max_restarts: int) -> Health:
    """The run needed at most max_restarts restarts or requeues (attempts.jsonl, trainer/supervisor/elastic.py)."""
    restarts = [entry for entry in attempts if entry.get("decision") in RESTART_DECISIONS]
    classes = ",".join(str(entry.get("failure_class")) for entry in restarts) or "none"
    return Health(
        passed=len(restarts) <= max_restarts,
        description=(f"{len(restarts)} restart(s) over {len(attempts)} recorded attempt(s) (limit {max_restarts})"
                     if attempts else "no attempt recorded (launched without the retry policy): no restart"),
        metadata={"num_restarts": len(restarts), "num_attempts": len(attempts), "max_restarts": max_restarts,
                  "restart_classes": classes})


def checkpoints_not_corrupted(run_dir: str | Path, *, hmac_key: bytes | str | None = None,
                              expected_run_id: str | None = None) -> Health:
    """Every committed checkpoint the run keeps re-hashes to its signed record (not only the newest,
    which checkpoint_integrity verifies: the older ones are what a resume falls back to)."""
    infos = [info for info in store.list_checkpoints(run_dir) if not info.is_hidden]
    problems: list[str] = []
    for info in infos:
        if info.status == store.STATUS_INCOMPLETE:
            continue  # never resumable, never reported: the retention sweeps it
        report = store.verify(info.path, hmac_key, expected_run_id=expected_run_id)
        problems += [f"{info.name}/{file}: {problem}" for file, problem in report.problems]
    verified = [info.name for info in infos if info.status != store.STATUS_INCOMPLETE]
    return Health(
        passed=not problems,
        description=(f"{len(problems)} problem(s) in the run's committed checkpoints" if problems else
                     f"every one of the {len(verified)} committed checkpoint(s) verifies" if verified else
                     "no committed checkpoint kept: nothing to verify (checkpoint_committed says whether one should be)"),
        metadata={"num_checkpoints": len(verified), "checkpoints": ",".join(verified) or "none",
                  "problems": "; ".join(problems[:20]) or "none"},
        skipped=not verified)


def throughput_profile(final: Mapping[str, Any]) -> dict[str, Any]:
    """The steady samples/s of a run and what it depends on, from its final.json."""
    plan, data = final.get("launch_plan") or {}, final.get("data") or {}
    performance = final.get("performance") or {}
    return {"samples_per_s": performance.get("samples_per_s"), "num_steady_steps": performance.get("num_steady_steps", 0),
            "device_type": plan.get("device_type"), "world_size": final.get("world_size"),
            "precision": (final.get("precision") or {}).get("policy"), "global_batch": data.get("global_batch"),
            "local_batch_size": plan.get("local_batch_size"), "clip_shapes": ",".join(data.get("clip_shapes_trained", []))}


def throughput_vs_baseline(measured: Mapping[str, Any], baseline: Mapping[str, Any] | None, *,
                           max_regression: float) -> Health:
    """samples/s at least (1 - max_regression) x the baseline's, when both ran alike (throughput_profile)."""
    if baseline is None:
        return Health(True, "no baseline: step_profile has no materialization with a run record to compare with",
                      {"baseline": "none"}, skipped=True)
    unlike = {key: f"{measured.get(key)} vs baseline {baseline.get(key)}"
              for key in LIKE_FOR_LIKE if measured.get(key) != baseline.get(key)}
    figures = {"samples_per_s": measured.get("samples_per_s"), "baseline_samples_per_s": baseline.get("samples_per_s"),
               "max_regression": max_regression}
    if unlike:
        return Health(True, "not compared: the run and the baseline differ in " + ", ".join(sorted(unlike)),
                      {**figures, **{f"differs/{key}": value for key, value in unlike.items()}}, skipped=True)
    rate, base = measured.get("samples_per_s"), baseline.get("samples_per_s")
    if not rate or not base or not math.isfinite(rate) or not measured.get("num_steady_steps") \
            or not baseline.get("num_steady_steps"):
        return Health(True, "not compared: no steady-state throughput in the run or the baseline", figures, skipped=True)
    ratio = rate / base
    return Health(
        passed=ratio >= 1 - max_regression,
        description=f"{rate:.3g} samples/s is {ratio:.0%} of step_profile's {base:.3g} (floor {1 - max_regression:.0%})",
        metadata={**figures, "ratio": round(ratio, 4), **{key: str(measured.get(key)) for key in LIKE_FOR_LIKE}})
