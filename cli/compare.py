"""``trainyard compare``: training runs side by side, and what differs between them.

    trainyard compare RUN_A RUN_B [RUN ...] [--align step|samples] [--out PATH.png] [--json]

A run is a trainer run folder (``train.run_dir``) or a run id: that folder's name under
``<data root>/runs``, where the Dagster stages put theirs. Each run's ``final.json`` (written by
the trainer however the run ended) gives the per-step losses and gradient norms, the step log
(samples seen and throughput per step), the evaluations and the lineage; ``launch.json``, when a
Dagster stage launched the run, gives the shard index version it read.

The table has one column group per run and a row per aligned point: every step when there are
at most 40, else 40 evenly spaced ones ending at the last. ``--align samples`` aligns on samples
seen instead of steps, which is what compares runs of different global batch: at one step they
have seen different amounts of data. The differences section names every config key whose value
differs (dotted, ``optim.lr``; the run's own folder and Dagster ids are left out, they differ for
every run), the data (source, seed, manifest version, shard index and its version) and the code
(commit, dirty tree, code version, container and environment digests). The PNG (``--out``,
default ./trainyard-compare.png) plots train loss against steps and against samples seen, and the
val loss where the run evaluated.

Runs recorded before final.json had ``step_log``, ``evaluations`` or ``lineage`` still compare:
samples seen are then estimated as step x data.batch_size and marked ``~``, as they are for the
steps a resumed run ran before its resume; code fields are reported as not recorded, never as
equal. Each fallback is named in the run's notes.

Exit codes: 0 compared; 2 bad input (fewer than two runs, a missing run folder or final.json).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ops.publish import paths
from ops.publish.durable import write_file_atomic
from trainer.launch.stage_launch import StageLaunch

EXIT_OK = 0
ALIGNS = ("step", "samples")
DEFAULT_PNG = Path("trainyard-compare.png")
MAX_TABLE_ROWS = 40
NOT_RECORDED = "<not recorded>"
# Differ for every run, even two launches of one config: naming them would hide what matters.
RUN_NOISE_KEYS = frozenset({"train.run_dir", "stage.dagster_run_id", "stage.retry_of"})
# Config keys that say which data a run read: reported under "data", not again under "config".
DATA_CONFIG_KEYS = ("data.source", "data.seed", "data.manifest_version", "data.shard_index")
CODE_KEYS = ("git_commit", "git_dirty", "code_version", "container_digest", "env_digest")
CATEGORIES = ("config", "data", "code")


class RunRecordError(ValueError):
    """A run that cannot be compared: no such folder, or no readable final.json; names the path."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Point:
    """One step of one run."""

    step: int
    samples: int | None
    """Samples consumed by the end of this step, over all ranks; None when it cannot be known."""
    samples_estimated: bool
    """True when ``samples`` is step x data.batch_size, not the trainer's count (module docstring)."""
    train_loss: float | None
    """None: a non-finite step (final.json records it as null)."""
    val_loss: float | None
    """The "ok" val evaluation at this step; None where the run did not evaluate."""
    grad_norm: float | None
    samples_per_s: float | None
    """None for steps this process did not run (before a resume) and for older runs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunSummary:
    label: str
    """Column-group and legend name: the run folder's name, numbered if two runs share one."""
    run_dir: str
    name: str
    status: str
    final_step: int
    steps_requested: int | None
    final_train_loss: float | None
    last_val_loss: float | None
    last_val_step: int | None
    median_samples_per_s: float | None
    notes: tuple[str, ...]
    """What this run's records lack and what was estimated or left out instead."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    key: int
    """The step, or the samples seen (``--align samples``)."""
    cells: tuple[Point | None, ...]
    """One per run, in argument order; None where that run has no point at ``key``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Difference:
    category: str
    """config, data or code."""
    key: str
    values: tuple[Any, ...]
    """One per run; NOT_RECORDED where the run's records do not hold the key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    align: str
    runs: tuple[RunSummary, ...]
    points: tuple[tuple[Point, ...], ...]
    """Every step of each run, for the plots (rows hold the same points, aligned)."""
    rows: tuple[Row, ...]
    differences: tuple[Difference, ...]
    not_recorded: Mapping[str, tuple[str, ...]]
    """Category -> labels of the runs that do not record it (so "none" there is not proof)."""

    def differences_in(self, category: str) -> list[Difference]:
        return [difference for difference in self.differences if difference.category == category]

    def as_dict(self) -> dict[str, Any]:
        return {"align": self.align, "runs": [asdict(run) for run in self.runs],
                "rows": [{"key": row.key, "cells": [None if cell is None else asdict(cell) for cell in row.cells]}
                         for row in self.rows],
                "differences": {category: [{"key": d.key, "values": list(d.values)}
                                           for d in self.differences_in(category)] for category in CATEGORIES},
                "not_recorded": {category: list(labels) for category, labels in self.not_recorded.items()}}


@dataclass(frozen=True, kw_only=True, slots=True)
class _Run:
    summary: RunSummary
    points: tuple[Point, ...]
    config: dict[str, Any]
    """The redacted config, flattened to dotted keys."""
    lineage: Mapping[str, Any] | None
    shard_index_version: str | None
    """From launch.json; None when no Dagster stage launched the run."""


# ---------------------------------------------------------------------------------------------
# Loading one run


def resolve_run(run: str | Path) -> Path:
    """The run folder for a folder path or a run id (a folder name under <data root>/runs)."""
    path = Path(run)
    if path.is_dir():
        return path
    if len(path.parts) == 1:
        by_id = paths.data_root() / "runs" / path.name
        if by_id.is_dir():
            return by_id
        raise RunRecordError(f"run {run}: no such folder, nor a run id under {by_id.parent}")
    raise RunRecordError(f"run {run}: no such folder")


def _read_final(run_dir: Path) -> dict[str, Any]:
    """final.json as strict JSON: NaN, Infinity and numbers out of a float's range are refused (the
    trainer records a non-finite value as null), and so is nesting too deep to read."""
    path = run_dir / "final.json"

    def refuse_constant(name: str) -> None:
        raise RunRecordError(f"{path}: holds {name}, which strict JSON does not (the trainer records a "
                             "non-finite value as null)")

    def finite(text: str) -> float:
        if not math.isfinite(value := float(text)):
            raise RunRecordError(f"{path}: the number {text[:40]} is out of a float's range")
        return value

    try:
        record = json.loads(path.read_text(), parse_constant=refuse_constant, parse_float=finite)
    except FileNotFoundError:
        raise RunRecordError(f"run {run_dir}: no final.json (the trainer writes it when the run ends: "
                             "is it still running, or not a run folder?)") from None
    except RunRecordError:
        raise
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, or an integer too long to read
        raise RunRecordError(f"{path}: not a JSON run record ({error})") from None
    except RecursionError:
        raise RunRecordError(f"{path}: nested too deeply to be a run record") from None
    if not isinstance(record, dict):
        raise RunRecordError(f"{path}: a run record is a JSON object, got {type(record).__name__}")
    if problems := _shape_problems(record):
        raise RunRecordError(f"{path}: not a run record this code reads: {'; '.join(problems[:5])}"
                             + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    return record


def _shape_problems(record: Mapping[str, Any]) -> list[str]:
    """Why ``record`` does not hold what the comparison reads, as the types it reads them as (empty
    when it does): every per-step value a number or null, every step an integer, every section an object."""
    problems: list[str] = []

    def is_number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def expect(ok: bool, where: str, value: Any, wanted: str) -> bool:
        if not ok:
            problems.append(f"{where} is {type(value).__name__} {json.dumps(value)[:40]}, not {wanted}")
        return ok

    def items(key: str, kind: type, wanted: str) -> list:
        value = record.get(key)
        return value if value is not None and expect(isinstance(value, kind), key, value, wanted) else []

    for key in ("config", "lineage", "performance", "data"):
        items(key, dict, "an object")
    for key in ("final_step", "steps_requested"):
        value = record.get(key)
        expect(value is None or (isinstance(value, int) and not isinstance(value, bool)), key, value, "an integer")
    steady = (record.get("performance") or {}).get("samples_per_s") if isinstance(record.get("performance"), dict) \
        else None
    expect(steady is None or is_number(steady), "performance.samples_per_s", steady, "a number")
    if isinstance(config := record.get("config"), dict) and isinstance(data := config.get("data"), dict):
        batch = data.get("batch_size")
        expect(batch is None or (isinstance(batch, int) and not isinstance(batch, bool)), "config.data.batch_size",
               batch, "an integer")
    for key in ("losses", "grad_norms"):
        for index, value in enumerate(items(key, list, "a list")):
            expect(value is None or is_number(value), f"{key}[{index}]", value, "a number or null")
    for index, entry in enumerate(items("step_log", list, "a list")):
        if expect(isinstance(entry, list) and len(entry) >= 4, f"step_log[{index}]", entry,
                  "[step, samples, step_time_s, samples_per_s]"):
            expect(all(isinstance(v, int) and not isinstance(v, bool) for v in entry[:2]), f"step_log[{index}]",
                   entry, "integer step and samples")
            expect(is_number(entry[2]) and (entry[3] is None or is_number(entry[3])), f"step_log[{index}]", entry,
                   "numeric step time and throughput")
    for index, evaluation in enumerate(items("evaluations", list, "a list")):
        if expect(isinstance(evaluation, dict), f"evaluations[{index}]", evaluation, "an object"):
            loss, step = evaluation.get("loss"), evaluation.get("step")
            expect(loss is None or is_number(loss), f"evaluations[{index}].loss", loss, "a number or null")
            expect(isinstance(step, int) and not isinstance(step, bool), f"evaluations[{index}].step", step,
                   "an integer")
    return problems


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"optim": {"lr": 1e-3}} -> {"optim.lr": 1e-3}; lists stay values."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _val_losses(record: Mapping[str, Any], notes: list[str]) -> dict[int, float]:
    """Step -> loss of the "ok" val evaluations; skipped ones are counted in the notes."""
    if "evaluations" not in record:
        notes.append("final.json has no evaluations (recorded before evaluation was): no val loss")
        return {}
    losses: dict[int, float] = {}
    skipped = []
    for evaluation in record["evaluations"] or []:
        if evaluation.get("split", "val") != "val":
            continue
        if evaluation.get("status") == "ok" and evaluation.get("loss") is not None:
            losses[int(evaluation["step"])] = float(evaluation["loss"])
        elif evaluation.get("status") == "skipped":
            skipped.append(f"step {evaluation.get('step')}: {evaluation.get('reason') or 'no reason given'}")
    if skipped:
        notes.append(f"{len(skipped)} val evaluation(s) skipped ({'; '.join(skipped)})")
    return losses


def _points(record: Mapping[str, Any], batch_size: int | None, notes: list[str]) -> tuple[Point, ...]:
    losses, grad_norms = record.get("losses") or [], record.get("grad_norms") or []
    logged = {int(entry[0]): entry for entry in record.get("step_log") or []}
    val_losses = _val_losses(record, notes)
    points, estimated_steps = [], []
    for step in range(1, len(losses) + 1):
        entry = logged.get(step)
        if entry is not None:
            samples, estimated, samples_per_s = int(entry[1]), False, entry[3]
        else:
            samples, estimated, samples_per_s = (None if batch_size is None else step * batch_size), True, None
            if samples is not None:
                estimated_steps.append(step)
        points.append(Point(step=step, samples=samples, samples_estimated=estimated and samples is not None,
                            train_loss=losses[step - 1], val_loss=val_losses.get(step),
                            grad_norm=grad_norms[step - 1] if step <= len(grad_norms) else None,
                            samples_per_s=samples_per_s))
    if not losses:
        notes.append("no per-step losses (the run ended before its first step)")
    elif "step_log" not in record:
        notes.append(f"final.json has no step_log (recorded before it was): samples seen estimated as "
                     f"step x data.batch_size ({batch_size}), marked ~; no per-step throughput")
    elif estimated_steps:
        notes.append(f"steps {estimated_steps[0]}-{estimated_steps[-1]} are not in the step log (run before this "
                     f"process resumed): samples seen estimated as "
                     f"step x data.batch_size ({batch_size}), marked ~; no throughput for them")
    if batch_size is None and losses and len(logged) < len(losses):
        notes.append("the config has no data.batch_size: samples seen unknown for steps outside the step log")
    outside = sorted(set(val_losses) - set(range(1, len(losses) + 1)))
    if outside:
        notes.append(f"val evaluations at steps {outside}, outside the run's steps, are left out of the table")
    return tuple(points)


def _median_throughput(record: Mapping[str, Any], notes: list[str]) -> float | None:
    rates = [entry[3] for entry in record.get("step_log") or [] if entry[3] is not None]
    if rates:
        return statistics.median(rates)
    steady = (record.get("performance") or {}).get("samples_per_s")
    if steady is not None:
        notes.append("median throughput from performance.samples_per_s (steps after warm-up), not the step log")
    return steady


def _shard_index_version(run_dir: Path) -> str | None:
    """The version of the shard index a Dagster stage launched the run on; None without launch.json."""
    if not (run_dir / "launch.json").is_file():
        return None
    return StageLaunch.read(run_dir / "launch.json").data.version  # LaunchRecordError names the file


def load_run(run_dir: Path, *, label: str) -> _Run:
    """One run's record, read for comparing; RunRecordError naming final.json if it is malformed."""
    record = _read_final(run_dir)
    shard_index_version = _shard_index_version(run_dir)
    try:
        return _parse_run(run_dir, record, label=label, shard_index_version=shard_index_version)
    except (KeyError, IndexError, TypeError, ValueError, RecursionError) as error:
        raise RunRecordError(f"{run_dir / 'final.json'}: not a run record this code reads "
                             f"({type(error).__name__}: {error})") from None


def _parse_run(run_dir: Path, record: Mapping[str, Any], *, label: str, shard_index_version: str | None) -> _Run:
    config = record.get("config") or {}
    notes: list[str] = []
    batch_size = (config.get("data") or {}).get("batch_size")
    points = _points(record, batch_size, notes)
    lineage = record.get("lineage")
    if lineage is None:
        notes.append("final.json has no lineage (recorded before it was, or the trainer ran without its "
                     "plugins): code fields not recorded")
    losses = [point.train_loss for point in points]
    val_steps = [point.step for point in points if point.val_loss is not None]
    summary = RunSummary(
        label=label, run_dir=str(run_dir.resolve()), name=str(record.get("name") or config.get("name") or "?"),
        status=str(record.get("status", "?")), final_step=int(record.get("final_step") or len(points)),
        steps_requested=record.get("steps_requested"), final_train_loss=losses[-1] if losses else None,
        last_val_loss=points[val_steps[-1] - 1].val_loss if val_steps else None,
        last_val_step=val_steps[-1] if val_steps else None,
        median_samples_per_s=_median_throughput(record, notes), notes=tuple(notes))
    return _Run(summary=summary, points=points, config=flatten(config), lineage=lineage,
                shard_index_version=shard_index_version)


def _labels(run_dirs: Sequence[Path]) -> list[str]:
    names = [run_dir.resolve().name for run_dir in run_dirs]
    return [name if names.count(name) == 1 else f"{name}#{index + 1}" for index, name in enumerate(names)]


# ---------------------------------------------------------------------------------------------
# Aligning and differences


def align_rows(points: Sequence[Sequence[Point]], align: str) -> tuple[Row, ...]:
    """A row per step (or per samples count) any run reached; a run without that point gets None.
    Aligned on samples, a step that consumed nothing (every sample failed to load) shares its count
    with the step before: the later one is the row's."""
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {', '.join(ALIGNS)}, got {align!r}")
    by_key = [{(point.step if align == "step" else point.samples): point for point in run_points
               if (point.step if align == "step" else point.samples) is not None} for run_points in points]
    keys = sorted(set().union(*by_key))
    return tuple(Row(key=key, cells=tuple(run.get(key) for run in by_key)) for key in keys)


def _differing(category: str, keys: Iterable[str], values_of: Sequence[Mapping[str, Any]], *,
               recorded_only: bool = False) -> list[Difference]:
    """Differences of ``keys`` between the runs' ``values_of``. ``recorded_only``: a run that does
    not record a key is unknown there, not different; the key differs only where two runs that
    record it disagree. Otherwise a key one run lacks differs (a config field added since)."""
    differences = []
    for key in keys:
        values = tuple(values.get(key, NOT_RECORDED) for values in values_of)
        compared = [value for value in values if not (recorded_only and value == NOT_RECORDED)]
        if any(value != compared[0] for value in compared[1:]):
            differences.append(Difference(category=category, key=key, values=values))
    return differences


def differences(runs: Sequence[_Run]) -> tuple[list[Difference], dict[str, tuple[str, ...]]]:
    """What differs in config, data and code, and per category the runs that do not record it."""
    config_keys = sorted(set().union(*(run.config for run in runs)) - RUN_NOISE_KEYS - set(DATA_CONFIG_KEYS))
    found = _differing("config", config_keys, [run.config for run in runs])
    found += _differing("data", DATA_CONFIG_KEYS, [run.config for run in runs])
    launched = [{} if run.shard_index_version is None else {"shard_index.version": run.shard_index_version}
                for run in runs]
    found += _differing("data", ["shard_index.version"], launched, recorded_only=True)
    found += _differing("code", CODE_KEYS, [run.lineage or {} for run in runs], recorded_only=True)
    not_recorded = {
        "code": tuple(run.summary.label for run in runs if run.lineage is None),
        # Only runs that read shards have a shard index version to lack.
        "data": tuple(run.summary.label for run in runs
                      if run.config.get("data.source") == "shards" and run.shard_index_version is None)}
    return found, {category: labels for category, labels in not_recorded.items() if labels}


def compare_runs(run_dirs: Sequence[str | Path], *, align: str = "step") -> Comparison:
    """Load each run (a folder or a run id), align them by step or samples seen, and name what differs."""
    if len(run_dirs) < 2:
        raise ValueError(f"compare needs at least two runs, got {len(run_dirs)}: {', '.join(map(str, run_dirs))}")
    folders = [resolve_run(run_dir) for run_dir in run_dirs]
    runs = [load_run(folder, label=label) for folder, label in zip(folders, _labels(folders))]
    found, not_recorded = differences(runs)
    points = tuple(run.points for run in runs)
    return Comparison(align=align, runs=tuple(run.summary for run in runs), points=points,
                      rows=align_rows(points, align), differences=tuple(found), not_recorded=not_recorded)


# ---------------------------------------------------------------------------------------------
# The table and the plot

_WIDTH = 11


def table_rows(rows: Sequence[Row], max_rows: int = MAX_TABLE_ROWS) -> list[Row]:
    """Every row when there are at most ``max_rows``, else ``max_rows`` evenly spaced ending at the last."""
    if len(rows) <= max_rows:
        return list(rows)
    picked = sorted({round(index * (len(rows) - 1) / (max_rows - 1)) for index in range(max_rows)})
    return [rows[index] for index in picked]


def _number(value: float | None, spec: str, *, missing: str) -> str:
    return missing if value is None else format(value, spec)


def _cells(point: Point | None, align: str) -> list[str]:
    if point is None:
        return [""] * 5
    mark = "~" if point.samples_estimated else ""  # aligned on samples, the step sits at an estimated count
    other = ("" if point.samples is None else f"{mark}{point.samples}") if align == "step" else f"{mark}{point.step}"
    # A point with a None loss or norm is a non-finite step: "nan", unlike a blank (no point there).
    return [other, _number(point.train_loss, ".6f", missing="nan"), _number(point.val_loss, ".6f", missing=""),
            _number(point.grad_norm, ".4f", missing="nan"), _number(point.samples_per_s, ".1f", missing="")]


def _format_value(value: Any) -> str:
    """Strings as they are (NOT_RECORDED too), but an empty one quoted so it shows; the rest as JSON."""
    return value if isinstance(value, str) and value else json.dumps(value)


def render_table(comparison: Comparison) -> str:
    align, runs = comparison.align, comparison.runs
    columns = ["samples" if align == "step" else "step", "train_loss", "val_loss", "grad_norm", "samples/s"]
    group_width = len(columns) * _WIDTH
    shown = table_rows(comparison.rows)
    lines = [f"aligned by {align}: {len(shown)} of {len(comparison.rows)} rows"
             + ("" if len(shown) == len(comparison.rows) else " (evenly spaced, and the last)")]
    if any(point.samples_estimated for points in comparison.points for point in points):
        lines.append("~: samples seen estimated as step x data.batch_size (see the run's notes)")
    lines.append("")
    lines.append(f"{'':>10} | " + " | ".join(f"{run.label:<{group_width}}"[:group_width] for run in runs))
    lines.append(f"{align:>10} | " + " | ".join("".join(f"{column:>{_WIDTH}}" for column in columns) for _ in runs))
    for row in shown:
        groups = ("".join(f"{cell:>{_WIDTH}}" for cell in _cells(point, align)) for point in row.cells)
        lines.append(f"{row.key:>10} | " + " | ".join(groups))
    lines += ["", "runs:"]
    for run in runs:
        steps = f"step {run.final_step}" + ("" if run.steps_requested is None else f" of {run.steps_requested}")
        val = ("-" if run.last_val_loss is None else f"{run.last_val_loss:.6f} (step {run.last_val_step})")
        lines.append(f"  {run.label}: {run.name}, {run.status} at {steps}, {run.run_dir}")
        lines.append(f"    final train loss {_number(run.final_train_loss, '.6f', missing='-')}, last val loss {val}, "
                     f"median throughput {_number(run.median_samples_per_s, '.1f', missing='-')} samples/s")
        lines += [f"    note: {note}" for note in run.notes]
    lines += ["", "differences:"]
    for category in CATEGORIES:
        found = comparison.differences_in(category)
        lines += [f"  {category}: {d.key}: {' | '.join(_format_value(v) for v in d.values)}" for d in found]
        if not found:
            lines.append(f"  {category}: none")
        if category in comparison.not_recorded:
            lines.append(f"  {category}: not recorded for {', '.join(comparison.not_recorded[category])} "
                         "(see their notes): \"none\" above covers only the runs that record it")
    return "\n".join(line.rstrip() for line in lines)


def write_plot(comparison: Comparison, path: Path) -> Path:
    """PNG at ``path``: train loss vs step, train loss vs samples seen (estimated stretches dotted),
    val loss vs step; one colour per run."""
    if path.suffix.lower() != ".png":
        raise ValueError(f"plot path {path}: the plot is a PNG, name it *.png")
    # The Figure API, not pyplot: no global backend or figure registry, so no display is needed.
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    figure = Figure(figsize=(16, 4.8), layout="constrained")
    by_step, by_samples, val = figure.subplots(1, 3)
    for run, points in zip(comparison.runs, comparison.points):
        label = run.label if run.name == run.label else f"{run.label} ({run.name})"
        nan = float("nan")
        (line,) = by_step.plot([p.step for p in points], [nan if p.train_loss is None else p.train_loss for p in points],
                               label=label)
        measured = [p for p in points if p.samples is not None and not p.samples_estimated]
        estimated = [p for p in points if p.samples_estimated]
        if estimated and measured and measured[0].step == estimated[-1].step + 1:
            estimated.append(measured[0])  # join the dotted stretch (before a resume) to the solid one
        for part, style, legend in ((measured, "-", label), (estimated, ":", None if measured else label)):
            by_samples.plot([p.samples for p in part], [nan if p.train_loss is None else p.train_loss for p in part],
                            linestyle=style, color=line.get_color(), label=legend)
        evaluated = [p for p in points if p.val_loss is not None]
        val.plot([p.step for p in evaluated], [p.val_loss for p in evaluated], marker="o", color=line.get_color(),
                 label=label)
    by_step.set(title="train loss by step", xlabel="step", ylabel="loss")
    by_samples.set(title="train loss by samples seen (dotted: estimated)", xlabel="samples seen", ylabel="loss")
    val.set(title="val loss", xlabel="step", ylabel="loss")
    for axis in (by_step, val):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # no step 2.5
    axes = [by_step, by_samples, val]
    if not any(p.val_loss is not None for points in comparison.points for p in points):
        val.set(xticks=[], yticks=[])
        val.text(0.5, 0.5, "no val evaluations recorded", ha="center", va="center", transform=val.transAxes)
        axes.pop()
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    write_file_atomic(path, buffer.getvalue())
    return path


# ---------------------------------------------------------------------------------------------
# Command line


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``compare`` to the ``trainyard`` parser."""
    command = subparsers.add_parser("compare", help="training runs side by side: losses, throughput, what differs")
    command.add_argument("runs", nargs="+", metavar="RUN",
                         help="a run folder (train.run_dir) or a run id under <data root>/runs; two or more")
    command.add_argument("--align", choices=ALIGNS, default="step",
                         help="table rows by step, or by samples seen (runs of different global batch)")
    command.add_argument("--out", type=Path, default=DEFAULT_PNG,
                         help=f"the loss curves as a PNG (default: ./{DEFAULT_PNG})")
    command.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    command.set_defaults(handler=_compare)


def _compare(args: argparse.Namespace) -> int:
    comparison = compare_runs(args.runs, align=args.align)
    png = write_plot(comparison, args.out)
    if args.json:
        print(json.dumps({**comparison.as_dict(), "png": str(png)}, allow_nan=False))
    else:
        print(render_table(comparison))
        print(f"\nplot: {png}")
    return EXIT_OK
