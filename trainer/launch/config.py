"""Typed experiment config: YAML + `a.b=c` overrides -> ExperimentConfig. Torch-free.

    config = load_config("exp.yaml", ["train.steps=20", "optim.lr=1e-3"])
    plan = preflight(config, world_size=8)   # trainer/launch/preflight.py: raises before any process starts

A YAML file is a mapping of sections (model, data, optim, train, faults) plus `name`; an optional
top-level `preset: <name>` (see EXPERIMENT_PRESETS) supplies every field the file leaves out.
Unknown keys anywhere are rejected with their dotted names. A string field may be written
`${env:NAME}` to read it from the environment at load time, which is how secrets
(`data.storage_token`) should arrive. The sections ModelConfig, DataConfig, OptimConfig and
FaultConfig are in trainer/launch/config_sections.py (torch-free, re-exported by model.py, data.py, optim.py and
faults.py); the training loop's own settings are TrainConfig, here. Nothing here imports torch,
so the Dagster Definitions and the assets load and check configs without it.

Checks: each section's `__post_init__` checks itself; ExperimentConfig checks what sections must
agree on; `preflight` checks what depends on the world size and device, and the memory budget.
Resolved configs are recorded only through `redacted_dict` (trainer/launch/redact.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ops.curation.dataset_card import load_strict_yaml
from ops.publish.paths import data_root
from trainer.launch.redact import is_secret_field, redacted_dict
from trainer.launch.config_sections import (ATTENTION_BACKENDS, DEVICES, PARALLELISMS, PRECISION_CHOICES, RESIDUAL_DTYPES,
                                            DataConfig, EvalConfig, FaultConfig, ModelConfig, OptimConfig, grid_shape, tiny)

# preflight, LaunchPlan and the memory names still import from here, lazily (__getattr__ below),
# so they are not listed: listing them would make `from trainer.launch.config import *` load torch.
__all__ = [
    "DataConfig", "EvalConfig", "ExperimentConfig", "FaultConfig", "ModelConfig", "OptimConfig", "TrainConfig",
    "EXPERIMENT_PRESETS", "config_from_dict", "load_config", "redacted_dict", "tiny_cpu", "LiteralSecretError",
    "check_no_literal_secrets", "env_reference", "read_overrides_file", "secret_field_paths",
]


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    steps: int
    """Optimizer steps to run (skipped non-finite steps count)."""
    run_dir: str
    """Directory of this run's files (final.json, profile/); created if missing."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    precision: str = "auto"
    """'auto' (bf16 on a CUDA device with bf16, else fp32), 'fp32', 'bf16' (autocast) or 'fp16'
    (autocast + GradScaler); see trainer/precision.py."""
    parallelism: str = "none"
    """'none' (one process), 'ddp' or 'fsdp' (FSDP2, one unit per transformer block)."""
    device: str = "auto"
    """'auto' (CUDA if visible), 'cpu' or 'cuda'."""
    seed: int = 0
    """Seed of the model init, the flow-matching noise and the per-rank RNGs."""
    deterministic: bool | None = None
    """Demand deterministic kernels (torch.use_deterministic_algorithms). None (the default): what
    the device can honour, on for CPU (resumed runs are bit-identical) and off on CUDA, where the
    fused attention backward has no deterministic kernel and the mode NaN-fills every new
    tensor; true on CUDA is strict (a kernel without a deterministic version raises by name).
    Resolved per device by trainer/parallel.py:resolve_deterministic."""
    tf32: bool = True
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores (10-bit mantissa inputs,
    fp32 accumulation): the fp32 policy, and the fp32 parts of the mixed ones. No effect on CPU."""
    attention_backend: str = "auto"
    """SDPA kernel: 'auto' (torch picks per call), 'flash', 'cudnn', 'efficient' or 'math'. A named
    one is probed on the device before the first step and recorded (trainer/precision.py)."""
    residual_dtype: str = "compute"
    """Dtype of the residual stream under autocast: 'compute' (bf16/fp16, the default: every
    norm input, modulation, gate and residual add moves half the bytes) or 'fp32' (the stream
    stays fp32; costs bandwidth, sometimes wanted for very deep models). trainer/models/video.py."""
    sync_phases: bool = False
    """On CUDA, synchronize the device at every phase boundary so the per-phase times are the
    device's (costs the overlap of data loading with compute). On whenever profile is."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them."""
    compile: bool = False
    """torch.compile each transformer block (needs a working inductor toolchain)."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective: a dead or hung peer makes the others fail after this long."""
    watchdog_s: float = 600.0
    """A rank that makes no progress (no step end, data fetch or checkpoint save finished) for this
    long dumps every thread's stack, records a ``hang`` and exits (trainer/watchdog.py). Must exceed
    the longest step (the first, compiled one included), fetch and save; 0 turns it off."""
    max_consecutive_nonfinite: int = 5
    """Skipped (NaN/Inf) steps in a row after which the run ends as 'diverged'."""
    loss_spike_factor: float = 0.0
    """A finite loss above this many times the median of the last loss_spike_window finite losses
    ends the run as 'diverged' (a spike); 0 turns it off."""
    loss_spike_window: int = 8
    """Finite losses the spike test compares with (it starts once there are this many), and steps
    of losses, gradient norms and sample ids kept in run_dir/divergence.json."""
    retry_budget: int = 2
    """Automatic retries of this run after transient failures (rank crash, collective timeout,
    hang, storage error, preemption), in a launch and across launches (trainer/supervisor/elastic.py): read by
    the launchers. 0: never retried."""
    max_bad_samples: int = 16
    """Samples a run may quarantine after they made a step fail (bad_sample) before it stops."""
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGTERM"])
    """Signals that mean "preempted": checkpoint at the next step boundary, exit 143 (requeue-able).
    Add the scheduler's warning signal, e.g. "SIGUSR1" for SLURM's --signal=USR1@120."""
    preempt_grace_s: float = 300.0
    """After a preemption signal, how long the rank waits for the step boundary and its checkpoint
    before it exits 143 without one (the last committed checkpoint stands)."""
    max_memory_bytes: int | None = None
    """Per-rank device memory budget; a config whose estimate exceeds it is refused. None: no check."""
    log_every: int = 1
    """Log a metrics line every this many steps (rank 0)."""
    checkpoint_every: int = 0
    """Save through the checkpointer every this many steps (0: only at the end); no checkpointer, no-op."""
    metrics_warmup_steps: int = 2
    """Steps left out of the performance summary (allocator and kernel warm-up)."""
    profile: bool = False
    """Record a torch.profiler trace of profile_active_steps steady-state steps into run_dir/profile."""
    profile_active_steps: int = 2
    """Steps in the profiled window (after metrics_warmup_steps + 1 warm-up step)."""
    dump_final_params: bool = False
    """Write the full (unsharded) model state dict to run_dir/final_params.pt at the end (tests)."""
    eval_every: int = 0
    """Measure the validation loss (the eval section) every this many steps and at the end of a
    completed run, and generate eval.samples clips at the end; 0: no evaluation. Never changes the
    training losses, sample order or RNG streams (trainer/heldout.py)."""

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "log_every", "max_consecutive_nonfinite",
                     "profile_active_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0 or self.metrics_warmup_steps < 0 or self.seed < 0 or self.eval_every < 0:
            raise ValueError("checkpoint_every, metrics_warmup_steps, seed and eval_every must be >= 0")
        if not self.run_dir:
            raise ValueError("run_dir must be a non-empty path")
        if self.precision not in PRECISION_CHOICES:
            raise ValueError(f"precision must be one of {PRECISION_CHOICES}, got {self.precision!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype must be one of {RESIDUAL_DTYPES}, got {self.residual_dtype!r}")
        if self.parallelism not in PARALLELISMS:
            raise ValueError(f"parallelism must be one of {PARALLELISMS}, got {self.parallelism!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be > 0, got {self.collective_timeout_s}")
        if self.watchdog_s < 0:
            raise ValueError(f"watchdog_s must be >= 0 (0: off), got {self.watchdog_s}")
        if self.retry_budget < 0 or self.max_bad_samples < 0:
            raise ValueError(f"retry_budget and max_bad_samples must be >= 0, got {self.retry_budget}, "
                             f"{self.max_bad_samples}")
        if self.loss_spike_factor < 0 or (0 < self.loss_spike_factor <= 1):
            raise ValueError(f"loss_spike_factor must be 0 (off) or > 1, got {self.loss_spike_factor}")
        if self.loss_spike_window < 1 or self.preempt_grace_s <= 0:
            raise ValueError(f"loss_spike_window must be >= 1 and preempt_grace_s > 0, got "
                             f"{self.loss_spike_window}, {self.preempt_grace_s}")
        self.preempt_signals = list(self.preempt_signals)
        import signal as _signal

        for name in self.preempt_signals:
            if name not in _signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
                raise ValueError(f"preempt_signals: {name!r} is not a signal name a process can catch "
                                 f"(e.g. 'SIGTERM', 'SIGUSR1')")
        if not self.preempt_signals:
            raise ValueError("preempt_signals must name at least one signal (SIGTERM)")
        if self.max_memory_bytes is not None and self.max_memory_bytes < 1:
            raise ValueError(f"max_memory_bytes must be >= 1 or None, got {self.max_memory_bytes}")
        if self.precision == "fp16" and self.parallelism == "fsdp":
            # GradScaler's inf check would see only the local shard: ranks could disagree on
            # skipping a step. bf16 needs no scaler.
            raise ValueError("precision 'fp16' with parallelism 'fsdp' is not supported; use 'bf16'")
        if self.profile and self.steps < self.metrics_warmup_steps + 1 + self.profile_active_steps:
            raise ValueError(f"profile needs steps >= metrics_warmup_steps + 1 + profile_active_steps "
                             f"= {self.metrics_warmup_steps + 1 + self.profile_active_steps}, got "
                             f"{self.steps}")


CHECKPOINT_IO = ("local", "store")


@dataclass(kw_only=True, slots=True)
class StageConfig:
    """Where this run sits in the lifecycle: its stage, its parent, tracking and checkpoints."""

    stage: str = "pretrain"
    """Lifecycle stage (pretrain, finetune, restore_drill, step_profile); an MLflow tag."""
    checkpoint: bool = False
    """Save committed DCP checkpoints under train.run_dir/checkpoints and resume from them."""
    keep_last_k: int = 3
    """Retention: the newest K committed checkpoints are kept."""
    keep_every_m: int = 0
    """Retention: also keep every M-th step (0: none)."""
    async_checkpoint: bool = False
    """Save with torch.distributed.checkpoint.async_save (the loop pays only the staging copy)."""
    mirror: bool = True
    """Publish committed checkpoints to TRAINYARD_CHECKPOINT_ROOT when the deployment sets it, and restore
    from there when the run folder has none (ops.checkpoints.mirror). Drills turn it off: their runs are
    throwaway, and their folder names (same_world, rank_killed, ...) repeat from one drill to the next."""
    checkpoint_io: str = "local"
    """Where DCP writes and reads this run's checkpoints: "local" (the run folder, committed there, then
    mirrored when a checkpoint root is set) or "store" (straight to ``<checkpoint root>/<run name>``
    through DCP's fsspec writer and reader, trainer.checkpointing.object_store; needs TRAINYARD_CHECKPOINT_ROOT or a
    data root URL, and excludes start_over: in the store a run never discards its progress wholesale)."""
    init_from: str = ""
    """Committed checkpoint of the parent stage whose model weights start this run (fine-tuning)."""
    init_from_run_id: str = ""
    """Run id recorded in that checkpoint's lineage (checked before anything is loaded)."""
    resume_from: str = ""
    """Committed checkpoint of another run to resume in full (restore drills); used while this
    run has no checkpoint of its own."""
    resume_run_id: str = ""
    """Run id recorded in that checkpoint's lineage (checked before anything is loaded)."""
    start_over: bool = False
    """When this run's checkpoint folders exist but none verifies: move them to
    checkpoints/quarantine/ (with REASON.json) and train from step 0. Without it the run refuses to
    start and names what failed. Never discards a checkpoint that verifies (docs/training.md)."""
    mlflow: bool = False
    """Track the run in MLflow (MLFLOW_TRACKING_URI; rank 0 only)."""
    mlflow_experiment: str = "trainyard"
    retry_of: str = ""
    """MLflow run id of the attempt this one retries (same stage, same inputs): tag retry_of."""
    dagster_run_id: str = ""
    """The Dagster run that launched this attempt; an MLflow tag."""

    def __post_init__(self) -> None:
        if self.keep_last_k < 1 or self.keep_every_m < 0:
            raise ValueError(f"stage.keep_last_k must be >= 1 and keep_every_m >= 0, got {self.keep_last_k}, "
                             f"{self.keep_every_m}")
        if bool(self.init_from) != bool(self.init_from_run_id):
            raise ValueError("stage.init_from and stage.init_from_run_id go together")
        if bool(self.resume_from) != bool(self.resume_run_id):
            raise ValueError("stage.resume_from and stage.resume_run_id go together")
        if self.init_from and self.resume_from:
            raise ValueError("stage.init_from (weights only) and stage.resume_from (full state) exclude each other")
        if (self.init_from or self.resume_from) and not self.checkpoint:
            raise ValueError("stage.init_from / resume_from load through the checkpointer: set stage.checkpoint=true")
        if self.checkpoint_io not in CHECKPOINT_IO:
            raise ValueError(f"stage.checkpoint_io must be one of {CHECKPOINT_IO}, got {self.checkpoint_io!r}")
        if self.checkpoint_io == "store" and self.start_over:
            raise ValueError("stage.start_over moves a run folder's failed checkpoints aside; with stage.checkpoint_io="
                             "store they are versions in the object store, where a run never discards its progress "
                             "wholesale (a resume passes a failing version over; a new save of its step sets it aside): "
                             "remove the failed versions there, or start a new run")


@dataclass(kw_only=True, slots=True)
class ExperimentConfig:
    name: str
    """Run name, recorded with the results."""
    model: ModelConfig
    """The network (trainer/models/video.py)."""
    data: DataConfig
    """Batches: source, global batch size, clip shape (trainer/data.py)."""
    train: TrainConfig
    """The training loop: steps, precision, parallelism, budgets."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and its schedule (trainer/optim.py)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Injected faults for tests and drills (trainer/faults.py); none by default."""
    stage: StageConfig = field(default_factory=StageConfig)
    """Lifecycle stage, parent checkpoint, tracking and checkpoint policy."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation loss and generated samples (trainer/heldout.py); on when train.eval_every is set."""

    def __post_init__(self) -> None:
        model, data = self.model, self.data
        grid_shape(data.video_shape, model.patch_size)  # raises if not divisible
        for shape in data.buckets:
            try:
                grid_shape(shape, model.patch_size)
            except ValueError as error:
                raise ValueError(f"data.buckets: {error}") from None
        if model.pos_embed == "learned" and data.video_shapes != [data.video_shape]:
            raise ValueError(f"model.pos_embed 'learned' has one embedding per token of the reference clip "
                             f"{data.video_shape} only, but data.buckets holds {data.buckets}; use 'sincos'")
        frame = model.audio_frame_samples
        if frame and (data.audio_samples == 0 or data.audio_samples % frame):
            raise ValueError(f"data.audio_samples {data.audio_samples} must be a positive "
                             f"multiple of model.audio_frame_samples {frame}")
        for shape in data.video_shapes:
            if frame and data.audio_samples_for(shape) % frame:
                raise ValueError(f"data.buckets: clips {list(shape)} carry {data.audio_samples_for(shape)} audio "
                                 f"samples (audio_samples x frames / clip_frames), not a multiple of "
                                 f"model.audio_frame_samples {frame}")
        if self.data.batch_size % self.train.grad_accum:
            raise ValueError(f"data.batch_size {self.data.batch_size} is not divisible by "
                             f"train.grad_accum {self.train.grad_accum}")


# ---------------------------------------------------------------------------------------------
# Presets


def tiny_cpu() -> ExperimentConfig:
    """A 0.15M-parameter model on 4 x 16 x 16 synthetic clips: seconds per run on a laptop CPU."""
    return ExperimentConfig(
        name="tiny_cpu",
        model=tiny(),
        data=DataConfig(batch_size=8, clip_frames=4, height=16, width=16, audio_samples=256,
                        num_samples=256),
        optim=OptimConfig(lr=1e-3, warmup_steps=2, weight_decay=0.01),
        train=TrainConfig(steps=8, run_dir=str(data_root() / "runs" / "tiny_cpu"), device="cpu"),
    )


def demo_cpu() -> ExperimentConfig:
    """The demo's model on the demo's shards (reference clip 8 x 64 x 64 with 1 s of 16 kHz audio;
    the pipeline adds the shard index's buckets, e.g. 16 x 64 x 64: 256 to 512 tokens a clip).

    The preset reads synthetic clips of that shape; the pipeline switches it to the shards
    (data.source=shards plus shard_index and manifest_version from the shard_index asset).
    256 tokens per clip keep a CPU step well under a second.
    """
    return ExperimentConfig(
        name="demo_cpu",
        model=ModelConfig(dim=96, num_layers=3, num_heads=4, patch_frames=2, patch_height=8, patch_width=8,
                          audio_frame_samples=400, timestep_freq_dim=64),
        data=DataConfig(batch_size=8, clip_frames=8, height=64, width=64, audio_samples=16_000,
                        num_samples=256, num_workers=1),
        optim=OptimConfig(lr=1e-3, warmup_steps=4, weight_decay=0.01),
        train=TrainConfig(steps=20, run_dir=str(data_root() / "runs" / "demo_cpu"), device="cpu",
                          parallelism="ddp", checkpoint_every=10, log_every=5),
        stage=StageConfig(checkpoint=True, mlflow=True),
    )


EXPERIMENT_PRESETS: dict[str, Callable[[], ExperimentConfig]] = {"tiny_cpu": tiny_cpu, "demo_cpu": demo_cpu}


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read YAML at path (None: only a preset override), apply "a.b=c" overrides, build and check."""
    raw: Any = {}
    if path is not None:
        try:  # no aliases (a "billion laughs" would exhaust memory), no key twice, bounded depth
            raw = load_strict_yaml(Path(path).read_text()) or {}
        except yaml.YAMLError as error:
            raise ValueError(f"{path}: not a usable config: {error}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a config file must be a mapping, got {type(raw).__name__}")
    for override in overrides:
        _apply_override(raw, override)
    return config_from_dict(raw)


def config_from_dict(raw: Mapping[str, Any]) -> ExperimentConfig:
    """Build from a nested mapping (YAML's), starting from `preset` if it names one."""
    raw = dict(raw)
    preset = raw.pop("preset", None)
    if isinstance(preset, _Override):
        preset = preset.text
    if preset is not None:
        if preset not in EXPERIMENT_PRESETS:
            raise ValueError(f"unknown preset {preset!r}; known: {sorted(EXPERIMENT_PRESETS)}")
        raw = _merge(_to_plain(EXPERIMENT_PRESETS[preset]()), raw)
    unknown = _unknown_keys(ExperimentConfig, raw, "")
    if unknown:
        raise ValueError("unknown config keys: " + "; ".join(unknown))
    missing = _missing_keys(ExperimentConfig, raw, "")
    if missing:
        raise ValueError("missing required config keys: " + ", ".join(missing))
    return _build(ExperimentConfig, raw, "")


class _Override:
    """An override's value text, typed once its field's type is known ("name=123" stays a str)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ValueError(f"override {key or override!r} must look like 'section.field=value'")
    *parents, leaf = key.strip().split(".")
    node = raw
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {key!r}: {'.'.join(parents[:depth + 1])} is not a section")
    node[leaf] = _Override(value)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _to_plain(config: Any) -> Any:
    """Dataclass -> nested dict with every value (secrets included): only for preset merging."""
    if dataclasses.is_dataclass(config):
        return {f.name: _to_plain(getattr(config, f.name)) for f in dataclasses.fields(config)}
    return list(config) if isinstance(config, tuple) else config


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unknown_keys(cls: type, raw: Any, prefix: str) -> list[str]:
    if not isinstance(raw, Mapping):
        return []
    hints, names = _hints(cls), [f.name for f in dataclasses.fields(cls)]
    problems = [f"{prefix}{key} ({prefix.rstrip('.') or 'top level'} takes: {', '.join(names)})"
                for key in raw if key not in names]
    for name in names:
        if dataclasses.is_dataclass(hints[name]) and name in raw:
            problems += _unknown_keys(hints[name], raw[name], f"{prefix}{name}.")
    return problems


def _missing_keys(cls: type, raw: Any, prefix: str) -> list[str]:
    if not isinstance(raw, Mapping):
        return []
    hints, missing = _hints(cls), []
    for f in dataclasses.fields(cls):
        if f.name in raw:
            if dataclasses.is_dataclass(hints[f.name]):
                missing += _missing_keys(hints[f.name], raw[f.name], f"{prefix}{f.name}.")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            missing.append(prefix + f.name)
    return missing


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {type(raw).__name__}")
    hints = _hints(cls)
    kwargs = {f.name: _coerce(raw[f.name], hints[f.name], prefix + f.name, secret=is_secret_field(f))
              for f in dataclasses.fields(cls) if f.name in raw}
    try:
        return cls(**kwargs)
    except ValueError as error:
        raise ValueError(f"{prefix.rstrip('.') or 'config'}: {error}") from None


_ENV_REF = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---------------------------------------------------------------------------------------------
# Secret fields in overrides: only ever by reference to the environment


class LiteralSecretError(ValueError):
    """An override gives a secret field a literal value, which every record of it would carry."""


def secret_field_paths(cls: type = None, prefix: str = "") -> set[str]:
    """Dotted paths of every secret-marked field (trainer/launch/redact.py) of the config tree, e.g. data.storage_token."""
    cls = cls or ExperimentConfig
    hints, paths = _hints(cls), set()
    for f in dataclasses.fields(cls):
        if is_secret_field(f):
            paths.add(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            paths |= secret_field_paths(hints[f.name], f"{prefix}{f.name}.")
    return paths


def env_reference(name: str) -> str:
    """The override value that reads environment variable ``name`` when the config is loaded."""
    if not ENV_NAME.match(name):
        raise ValueError(f"environment variable names are letters, digits and '_' (not starting with a digit); "
                         f"got one of {len(name)} characters that is not")  # never echo: it may be the secret
    return f"${{env:{name}}}"


def literal_secret_keys(overrides: Sequence[str]) -> list[str]:
    """Keys of overrides that set a secret field to a literal (neither empty nor ``${env:NAME}``),
    whatever the key's case, separators or nesting (trainer.launch.redact.literal_secret_keys_in)."""
    from trainer.launch.redact import literal_secret_keys_in

    return literal_secret_keys_in(overrides, secret_field_paths())


def check_no_literal_secrets(overrides: Sequence[str], *, where: str = "overrides") -> None:
    """Refuse literal secret values: they would be written to every record of the run (run config,
    launch manifest, logs). The message names the field, never the value."""
    keys = literal_secret_keys(overrides)
    if keys:
        raise LiteralSecretError(
            f"{where}: {', '.join(keys)} is a secret field and was given a literal value, which would be "
            f"stored in clear text (Dagster run config, launch manifest, logs). Give it through an environment "
            f"variable instead: in Dagster run config `secrets: {{{keys[0]}: {{env: MY_TOKEN}}}}` "
            f"(Python: StageRunConfig(secrets={{'{keys[0]}': dg.EnvVar('MY_TOKEN')}})), or the override "
            f"'{keys[0]}=${{env:MY_TOKEN}}'; export MY_TOKEN where Dagster and the trainer run.")


def read_overrides_file(path: str | Path) -> list[str]:
    """Overrides from a launcher's file (resources/launcher.py): a JSON list of "a.b=c" strings,
    refused if other users could read it (it may give secret fields their ${env:NAME} references,
    and a careless caller could put more)."""
    path = Path(path)
    try:  # one descriptor for the mode check and the read: the file checked is the file read
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        if path.is_symlink():
            raise ValueError(f"{path}: overrides file is a symlink; the launcher writes a regular file, "
                             f"so something else put a link there: remove it and launch again") from error
        raise
    with os.fdopen(descriptor, "rb") as handle:
        mode = os.fstat(handle.fileno()).st_mode & 0o777
        if mode & 0o077:
            raise ValueError(f"{path}: overrides file has mode {mode:o}; it may carry secrets, so it must be "
                             f"readable by its owner only (chmod 600)")
        overrides = json.loads(handle.read())
    if not isinstance(overrides, list) or not all(isinstance(item, str) for item in overrides):
        raise ValueError(f"{path}: an overrides file is a JSON list of 'a.b=c' strings")
    return overrides


def _coerce(value: Any, hint: Any, path: str, *, secret: bool) -> Any:
    """value as type hint, or ValueError naming path (never showing a secret's value)."""
    shown = "a value (hidden: secret field)" if secret else repr(getattr(value, "text", value))
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path + ".")
    if isinstance(value, _Override):
        if hint is str:
            value = value.text
        else:
            try:
                value = load_strict_yaml(value.text)
            except yaml.YAMLError:
                raise ValueError(f"{path}: cannot parse {shown}") from None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _coerce(value, inner, path, secret=secret)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path} must be a list, got {shown}")
        if origin is tuple and args[-1] is not Ellipsis and len(value) != len(args):
            raise ValueError(f"{path} must have {len(args)} items, got {shown}")
        item_hints = [args[0]] * len(value) if origin is list or args[-1] is Ellipsis else args
        items = [_coerce(item, item_hint, f"{path}[{index}]", secret=secret)
                 for index, (item, item_hint) in enumerate(zip(value, item_hints, strict=True))]
        return tuple(items) if origin is tuple else items
    return _coerce_scalar(value, hint, path, shown)


def _coerce_scalar(value: Any, hint: Any, path: str, shown: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is str:
        if isinstance(value, str):
            match = _ENV_REF.match(value)
            if not match:
                return value
            if match.group(1) not in os.environ:
                raise ValueError(f"{path} reads environment variable {match.group(1)}, which is not set")
            return os.environ[match.group(1)]
    elif hint in (int, float) and not isinstance(value, bool):
        # YAML 1.1 reads 1e-3 as a string and 2e9 as a float: accept both when the number is exact.
        number = value
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                number = None
        if hint is float and isinstance(number, (int, float)):
            return float(number)
        if hint is int and isinstance(number, int):
            return number
        if hint is int and isinstance(number, float) and number.is_integer():
            return int(number)
    raise ValueError(f"{path} must be {getattr(hint, '__name__', hint)}, got {shown}")
