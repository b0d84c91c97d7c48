"""The launch report: what a launch will run, written for people (issue 40). Torch-free.

    report = build_report(result, title="...", warnings=[...])   # result: trainer/dry_run.py's dict
    print_report(report)        # `trainyard dry-run`: rich tables (plain text on a pipe)
    markdown(report)            # a stage's "launch_report" metadata, which the Dagster UI shows

One model, two renderers. A report is its warnings (both renderers put them first) and its
sections, each a small table with notes, built by plain functions from what a launch checks: the
config (redacted) against the defaults, the launch plan with its memory estimate, the data
source's description and, in a dry run, the decoded batches. Every figure comes from those.
A refusal (trainer/launch/refusal.py) has no place in a report: it ends the launch, and the dry
run, before any table is made, in one line that is then the first and only thing shown.

A Dagster stage builds its report from its preflight's plan without decoding a batch or building a
model (``stage_report``): its data section has the batching but not the samples per bucket, which
the run's loader counts when it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.launch.config import ExperimentConfig
    from trainer.launch.preflight import LaunchPlan
    from trainer.launch.redact import Redactor

REQUIRED = "(required)"
"""The default column of a field that has none: the config (or its preset) must set it."""
CONSOLE_WIDTH = 100
"""Columns of the terminal report: fixed, so that a pipe, a log and a test see the same lines."""
TIGHT_HEADROOM = 0.10
"""Memory headroom below this fraction of the budget is a warning: the estimate leaves out the CUDA
context and allocator fragmentation (trainer/launch/memory.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Section:
    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchReport:
    title: str
    warnings: tuple[str, ...]
    """Shown before every table."""
    sections: tuple[Section, ...]


# ---------------------------------------------------------------------------------------------
# Building: the dry run's dict (or a stage's plan) -> LaunchReport


def build_report(result: Mapping[str, Any], *, title: str, warnings: Sequence[str] = (),
                 redactor: Redactor | None = None) -> LaunchReport:
    """The report of a dry run's ``result`` (trainer/dry_run.py): config, plan, data, num_params and,
    when present, tokens_per_sample, flops_per_local_step and batches. ``warnings``: lines logged while
    it ran, shown before the ones the report derives; every warning passes ``redactor``."""
    config, plan, data = result["config"], result["plan"], result["data"]
    memory, memory_warnings = memory_section(plan)
    buckets, data_warnings = buckets_section(data)
    sections = (config_section(config), plan_section(result), memory, data_section(data, config), buckets,
                batches_section(result.get("batches")))
    derived = [*memory_warnings, *data_warnings, *_failed_sample_warnings(result.get("batches") or [])]
    scrub = redactor.text if redactor is not None else str
    shown = dict.fromkeys(scrub(text) for text in (*warnings, *derived))  # each once, in order
    return LaunchReport(title=title, warnings=tuple(shown), sections=sections)


def stage_report(config: ExperimentConfig, plan: LaunchPlan, *, title: str, shard_index_version: str) -> LaunchReport:
    """A stage's report before its launch, from the config and its preflight's plan alone: no batch is
    decoded and no model built (the launch waits for this), so num_params is the memory estimate's."""
    from trainer.launch.redact import redacted_dict

    result = {"config": redacted_dict(config), "plan": plan.as_dict(),
              "data": planned_data(config, shard_index_version=shard_index_version),
              "num_params": plan.memory.num_params if plan.memory is not None else None}
    return build_report(result, title=title)


def planned_data(config: ExperimentConfig, *, shard_index_version: str) -> dict[str, Any]:
    """What the config says of the data, in the keys of a source's describe() that do not need the
    index's table: no bucket_counts (the run's loader counts them when it starts)."""
    from ops.clips.plan import bucket_name

    data = config.data
    planned = {"source": data.source, "batching": data.resolved_batching, "global_batch": data.batch_size,
               "bucket_shapes": {bucket_name(*shape): list(shape) for shape in data.video_shapes}}
    if data.source == "shards":
        planned |= {"shard_index_version": shard_index_version, "split": data.split, "drop_last": data.drop_last}
    return planned


def config_defaults(cls: type | None = None) -> dict[str, Any]:
    """Every config field's default as a nested plain dict; REQUIRED where a field has none."""
    from trainer.launch.config import ExperimentConfig

    cls = cls or ExperimentConfig
    hints = typing.get_type_hints(cls)
    defaults: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = _plain(field.default)
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = _plain(field.default_factory())
        elif dataclasses.is_dataclass(hints[field.name]):
            defaults[field.name] = config_defaults(hints[field.name])
        else:
            defaults[field.name] = REQUIRED
    return defaults


def config_section(config: Mapping[str, Any]) -> Section:
    """The keys whose value differs from the field's default (a preset's values count as changes)."""
    values, defaults = _flat(config), _flat(config_defaults())
    rows = tuple((key, _show(defaults[key]) if key in defaults else "(no default)", _show(value))
                 for key, value in values.items() if key not in defaults or defaults[key] != value)
    return Section(title="Config against the defaults", columns=("key", "default", "value"), rows=rows,
                   notes=(f"{len(rows)} of {len(values)} keys differ from the defaults of trainer/launch/config.py; "
                          "a preset's values count as changes, secrets show as ***.",))


def plan_section(result: Mapping[str, Any]) -> Section:
    plan, config = result["plan"], result["config"]
    train = config["train"]
    micro = plan["micro_batch_size"]
    cuda = plan["device_type"] == "cuda"
    kernels = (f"attention {train['attention_backend']}, compile {_on(train['compile'])}, "
               f"activation checkpointing {_on(train['activation_checkpointing'])}, "
               f"tf32 {_on(train['tf32'] and cuda)}{'' if cuda or not train['tf32'] else ' (CUDA only)'}, "
               f"residual stream {train['residual_dtype']}")
    rows = [("world size", f"{plan['world_size']} rank(s), parallelism {train['parallelism']}"),
            ("device", plan["device_type"]),
            ("global batch", f"{config['data']['batch_size']} samples a step"),
            ("per rank", f"{plan['local_batch_size']} samples a step"),
            ("micro-batch", f"{micro} samples a forward/backward"),
            ("accumulation", f"{plan['local_batch_size'] // micro} micro-batch(es) a step"),
            ("precision", f"{plan['precision']} (train.precision {train['precision']})"),
            ("kernels", kernels),
            ("steps", str(train["steps"]))]
    if result.get("num_params") is not None:
        rows.append(("parameters", f"{result['num_params']:,}"))
    if result.get("tokens_per_sample") is not None:
        rows.append(("tokens per sample", f"{result['tokens_per_sample']:,} (reference clip)"))
    if result.get("flops_per_local_step") is not None:
        rows.append(("FLOPs per rank step", f"{result['flops_per_local_step']:.3g}"))
    return Section(title="Parallel plan", columns=("", "value"), rows=tuple(rows))


def memory_section(plan: Mapping[str, Any]) -> tuple[Section, list[str]]:
    """Per-rank estimate against the budget, the headroom, and what dominates the peak."""
    estimate, budget = plan["memory"], plan["memory_budget_bytes"]
    if estimate is None:
        return Section(title="Memory per rank", columns=("", "bytes"), rows=(),
                       notes=("No estimate was made for this plan.",)), []
    total = estimate["total_bytes"]
    backward = estimate["transient_bytes"] + estimate["activations_bytes"]
    at_peak_backward = backward >= estimate["optimizer_step_bytes"]  # total = static + max(backward, step)
    parts = [("parameters (fp32)", estimate["params_bytes"], True), ("gradients (fp32)", estimate["grads_bytes"], True),
             ("optimizer state", estimate["optimizer_bytes"], True),
             ("transient", estimate["transient_bytes"], at_peak_backward),
             ("activations", estimate["activations_bytes"], at_peak_backward),
             ("optimizer step", estimate["optimizer_step_bytes"], not at_peak_backward)]
    rows = [(name, format_bytes(size), f"{size / total:.1%}" if counted else "not at the peak")
            for name, size, counted in parts]
    rows.append(("peak (estimate)", format_bytes(total), "100.0%"))
    name, size, _ = max((part for part in parts if part[2]), key=lambda part: part[1])
    notes = [f"Largest part of the peak: {name}, {size / total:.1%} of it."]
    warnings = []
    if budget is None:
        rows.append(("budget", "none", ""))
        warnings.append(f"memory: the estimate ({format_bytes(total)} a rank) is checked against no budget: set "
                        "train.max_memory_bytes (on CUDA the device's memory is the budget)")
    else:
        headroom = budget - total
        rows += [("budget", format_bytes(budget), ""),
                 ("headroom", format_bytes(headroom), f"{headroom / budget:.1%} of the budget")]
        if headroom < TIGHT_HEADROOM * budget:
            warnings.append(f"memory: headroom {format_bytes(headroom)} is {headroom / budget:.1%} of the budget "
                            f"{format_bytes(budget)}; the estimate leaves out the CUDA context and fragmentation")
    return Section(title="Memory per rank", columns=("", "bytes", "share of the peak"), rows=tuple(rows),
                   notes=tuple(notes)), warnings


def data_section(data: Mapping[str, Any], config: Mapping[str, Any]) -> Section:
    source = data["source"]
    if source == "shards":
        version = f"shard index {data['shard_index_version']}, manifest {config['data']['manifest_version']}"
    else:
        version = f"generated clips, seed {config['data']['seed']}, {config['data']['num_samples']} samples"
    drop_last, why = _drop_last(data)
    rows = [("source", source), ("version", version)]
    if "split" in data:
        rows.append(("split", data["split"]))
    rows += [("batching", data["batching"]), ("global batch", f"{data['global_batch']} samples"),
             ("drop_last", f"{_on(drop_last)}{why}")]
    return Section(title="Data", columns=("", "value"), rows=tuple(rows))


def buckets_section(data: Mapping[str, Any]) -> tuple[Section, list[str]]:
    """Samples per bucket, full steps an epoch and what drop_last leaves out: each bucket is cut
    into global batches and its remainder is its tail (ops/loading/sampling.py); fixed-shape data
    is one bucket."""
    shapes, counts = data["bucket_shapes"], data.get("bucket_counts")
    columns = ("bucket", "clip (frames x h x w)", "samples", "full steps an epoch", "dropped an epoch")
    if counts is None:
        rows = tuple((name, " x ".join(map(str, shape)), "", "", "") for name, shape in shapes.items())
        return Section(title="Buckets", columns=columns, rows=rows,
                       notes=("Samples per bucket are counted by the run's loader when it starts "
                              "(`trainyard dry-run` counts them beforehand).",)), []
    drop_last, _ = _drop_last(data)
    global_batch = data["global_batch"]
    rows, dropped = [], {}
    for name, shape in shapes.items():
        count = counts.get(name, 0)
        tail = count % global_batch
        dropped[name] = tail if drop_last else 0
        rows.append((name, " x ".join(map(str, shape)), f"{count:,}", f"{count // global_batch:,}",
                     f"{dropped[name]:,}"))
    total, total_dropped = sum(counts.values()), sum(dropped.values())
    rows.append(("all", "", f"{total:,}", f"{sum(c // global_batch for c in counts.values()):,}", f"{total_dropped:,}"))
    notes = () if drop_last else ("Without drop_last each bucket's tail is one short step an epoch.",)
    warnings = []
    if total_dropped:
        lost = ", ".join(f"{name} {count}" for name, count in dropped.items() if count)
        warnings.append(f"data: drop_last leaves out {total_dropped} of {total} samples every epoch ({lost}), "
                        f"the tails short of a global batch of {global_batch}")
    return Section(title="Buckets", columns=columns, rows=tuple(rows), notes=notes), warnings


def batches_section(batches: Sequence[Mapping[str, Any]] | None) -> Section:
    columns = ("batch", "bucket", "video", "audio", "tokens/sample", "failed", "decode s")
    if batches is None:
        return Section(title="Decoded batches", columns=columns, rows=(),
                       notes=("None decoded before the launch (it would delay it): the run decodes its own; "
                              "`trainyard dry-run` decodes a few.",))
    rows = tuple((str(number), batch["bucket"], _shape(batch["video"]), _shape(batch["audio"]),
                  f"{batch['tokens_per_sample']:,}", str(batch["failed"]), f"{batch['decode_s']:.4f}")
                 for number, batch in enumerate(batches, 1))
    return Section(title="Decoded batches", columns=columns, rows=rows, notes=(decode_rate(batches),))


def decode_rate(batches: Sequence[Mapping[str, Any]]) -> str:
    """Samples a second on rank 0; past the first batch when there are more, since the first one
    also waits for the loader (and its workers) to start."""
    if not batches:
        return "No batch decoded (--batches 0)."
    steady = batches[1:] or batches
    samples, seconds = sum(batch["num_samples"] for batch in steady), sum(batch["decode_s"] for batch in steady)
    which = {1: "one batch, with the loader's start", 2: "batch 2"}.get(len(batches), f"batches 2 to {len(batches)}")
    rate = f"{samples / seconds:,.1f} samples/s" if seconds > 0 else "too fast to time"
    return f"Decode rate on rank 0: {rate} ({which}); the first batch took {batches[0]['decode_s']:.3f} s."


def _failed_sample_warnings(batches: Sequence[Mapping[str, Any]]) -> list[str]:
    failed = sum(batch["failed"] for batch in batches)
    return [f"data: {failed} sample(s) of the decoded batches failed to decode and were skipped"] if failed else []


def _drop_last(data: Mapping[str, Any]) -> tuple[bool, str]:
    if "drop_last" in data:
        return bool(data["drop_last"]), ""
    return True, " (always, for generated clips)"  # trainer/data.py SyntheticClips


# ---------------------------------------------------------------------------------------------
# Rendering


def print_report(report: LaunchReport, console: Any = None) -> None:
    """Rich tables on ``console`` (default: stdout, CONSOLE_WIDTH wide; no colour codes off a terminal).
    Markup is off: a config value such as "[1, 2]" is text, never a style."""
    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console(width=CONSOLE_WIDTH, markup=False, highlight=False, emoji=False)
    console.print(Text(report.title, style="bold"))
    for warning in report.warnings:
        console.print(Text(f"WARNING: {warning}", style="yellow"))
    if not report.warnings:
        console.print(Text("No warnings."))
    for section in report.sections:
        console.print()
        table = Table(*section.columns, title=Text(section.title, style="bold"), title_justify="left",
                      box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for row in section.rows:
            table.add_row(*(Text(cell) for cell in row))
        if section.rows:
            console.print(table)
        else:
            console.print(Text(section.title, style="bold"))
        for note in section.notes:
            console.print(Text(f"  {note}", style="dim"))


def markdown(report: LaunchReport) -> str:
    """The same report as Markdown (Dagster's MetadataValue.md)."""
    lines = [f"## {_md(report.title)}", ""]
    lines += [f"- **Warning:** {_md(warning)}" for warning in report.warnings]
    if not report.warnings:
        lines.append("No warnings.")
    for section in report.sections:
        lines += ["", f"### {_md(section.title)}", ""]
        if section.rows:
            lines.append("| " + " | ".join(_md(column) for column in section.columns) + " |")
            lines.append("|" + " --- |" * len(section.columns))
            lines += ["| " + " | ".join(_md(cell) for cell in row) + " |" for row in section.rows]
            lines.append("")
        lines += [_md(note) for note in section.notes]
    return "\n".join(lines).rstrip() + "\n"


@contextlib.contextmanager
def captured_warnings(level: int = logging.WARNING) -> Iterator[list[str]]:
    """The messages logged at ``level`` or above in this process while inside, for the report's
    warnings; they reach no other handler meanwhile (the report shows them, first)."""
    captured: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(record.getMessage())

    root, handler = logging.getLogger(), _Collect(level)
    root.addHandler(handler)
    try:
        yield captured
    finally:
        root.removeHandler(handler)


def format_bytes(size: int) -> str:
    """1536 -> '1.5 KiB'; binary units, one decimal; negative sizes (no headroom) keep their sign."""
    magnitude = abs(size)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if magnitude >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: _plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def _show(value: Any) -> str:
    if isinstance(value, str):
        return value if value else '""'
    return json.dumps(value)


def _shape(shape: Sequence[int]) -> str:
    return " x ".join(map(str, shape))


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _md(text: str) -> str:
    """A table cell or line of Markdown: pipes escaped, one line."""
    return " ".join(str(text).replace("|", "\\|").splitlines())
