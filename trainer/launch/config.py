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
Each refusal is a Refusal (trainer/launch/refusal.py): one line with its category, the key and a fix.
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
from trainer.launch.refusal import Refusal, nearest
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
class AcceptTainted:
    """A deliberate decision to start from a tainted parent checkpoint (trained on an asset the rights
    ledger revokes or an erasure deleted: ops.curation.erasure.run_taint). Both fields, or neither;
    recorded in the run's config, launch record and MLflow tags."""

    reason: str = ""
    """Why this parent is used anyway (e.g. "unlearning experiment, ticket 88")."""
    approver: str = ""
    """Who approved it."""

    def __post_init__(self) -> None:
        reason, approver = self.reason.strip(), self.approver.strip()
        if bool(reason) != bool(approver):
            raise ValueError("rights.accept_tainted needs both a reason and an approver (or neither): "
                             f"got reason={self.reason!r}, approver={self.approver!r}")
        if any(char in text for text in (reason, approver) for char in "\r\n"):
            raise ValueError("rights.accept_tainted.reason and .approver are one line each (no newline)")

    @property
    def given(self) -> bool:
        return bool(self.reason.strip() and self.approver.strip())


@dataclass(kw_only=True, slots=True)
class RightsConfig:
    """What a run decides about rights (docs/rights.md, Erasure)."""

    accept_tainted: AcceptTainted = field(default_factory=AcceptTainted)
    """Start from a tainted parent anyway: {reason, approver}. Without it a tainted parent is refused."""


@dataclass(kw_only=True, slots=True)
class SweepConfig:
    """This run is a sweep's trial (trainer/launch/sweep.py, docs/training.md "Sweeps"): rank 0 reports each
    evaluation's loss to the study and the ranks stop together at that step boundary, checkpoint committed,
    when the stated rule says so (trainer/launch/pruning.py). Set by the sweep, never by hand."""

    study: str = ""
    """The Optuna study (the sweep's name); empty: not a trial."""
    trial: int = -1
    """The trial's number in the study."""
    storage: str = ""
    """The study's storage when it is the embedded SQLite file; empty: TRAINYARD_OPTUNA_STORAGE (a password
    never reaches a config)."""
    pruner: str = "none"
    """none | median | successive_halving (Optuna's pruners)."""
    warmup_steps: int = 0
    min_trials: int = 2
    reduction_factor: int = 2
    min_resource: int = 0
    sweep_id: str = ""
    """The sweep's declaration digest (lineage: which declared sweep this trial belongs to)."""
    seed: int = 0
    """The sampler's seed (lineage)."""
    mlflow_parent: str = ""
    """The sweep's MLflow parent run: the trial's run is its child (mlflow.parentRunId)."""

    def __post_init__(self) -> None:
        if self.pruner not in ("none", "median", "successive_halving"):
            raise ValueError(f"sweep.pruner={self.pruner!r}: use none, median or successive_halving")
        if self.study and self.trial < 0:
            raise ValueError(f"sweep.study={self.study!r} needs sweep.trial (the trial's number, >= 0)")
        if "\n" in self.study or "\n" in self.storage:
            raise ValueError("sweep.study and sweep.storage are one line each (no newline)")


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
    rights: RightsConfig = field(default_factory=RightsConfig)
    """Rights decisions: a deliberately accepted tainted parent (rights.accept_tainted)."""
    sweep: SweepConfig = field(default_factory=SweepConfig)
    """A sweep trial's study and early-stopping rule (sweep.study, sweep.trial, sweep.pruner)."""

    def __post_init__(self) -> None:
        model, data = self.model, self.data
        try:
            grid_shape(data.video_shape, model.patch_size)
        except ValueError as error:
            raise ValueError(f"data.clip_frames/height/width: {error}; set data.clip_frames, data.height and "
                             f"data.width to multiples of model.patch_frames/patch_height/patch_width "
                             f"{model.patch_size}") from None
        for shape in data.buckets:
            try:
                grid_shape(shape, model.patch_size)
            except ValueError as error:
                raise ValueError(f"data.buckets: {error}; set each bucket to multiples of the patch size") from None
        if model.pos_embed == "learned" and data.video_shapes != [data.video_shape]:
            raise ValueError(f"model.pos_embed 'learned' has one embedding per token of the reference clip "
                             f"{data.video_shape} only, but data.buckets holds {data.buckets}; set model.pos_embed=sincos")
        frame = model.audio_frame_samples
        if frame and (data.audio_samples == 0 or data.audio_samples % frame):
            raise ValueError(f"data.audio_samples {data.audio_samples} must be a positive "
                             f"multiple of model.audio_frame_samples {frame}; set data.audio_samples to a multiple "
                             f"of {frame}")
        for shape in data.video_shapes:
            if frame and data.audio_samples_for(shape) % frame:
                raise ValueError(f"data.buckets: clips {list(shape)} carry {data.audio_samples_for(shape)} audio "
                                 f"samples (audio_samples x frames / clip_frames), not a multiple of "
                                 f"model.audio_frame_samples {frame}")
        if self.data.batch_size % self.train.grad_accum:
            raise ValueError(f"data.batch_size {self.data.batch_size} is not divisible by "
                             f"train.grad_accum {self.train.grad_accum}; set data.batch_size to a multiple of "
                             f"{self.train.grad_accum}, or train.grad_accum to a divisor of it")


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
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise Refusal("config", f"config file {path} cannot be read ({getattr(error, 'strerror', None) or error})",
                          "give the path of an experiment YAML (configs/ holds examples, e.g. configs/demo.yaml)",
                          key=str(path)) from None
        try:  # no aliases (a "billion laughs" would exhaust memory), no key twice, bounded depth
            raw = load_strict_yaml(text) or {}
        except (yaml.YAMLError, ValueError) as error:
            raise Refusal("config", f"config file {path} is not usable YAML: {error}",
                          "correct the YAML at the line the message names (each key once, no aliases or tags)",
                          key=str(path)) from None
        if not isinstance(raw, dict):
            raise Refusal("config", f"config file {path} holds a {type(raw).__name__}, not a mapping of sections",
                          "write it as a mapping: `preset: demo_cpu` and sections such as `train: {steps: 20}`",
                          key=str(path))
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
        if not isinstance(preset, str) or preset not in EXPERIMENT_PRESETS:
            close = nearest(str(preset), EXPERIMENT_PRESETS)
            raise Refusal("config", f"preset={preset!r} is not a known preset",
                          (f"did you mean preset={close}? " if close else "")
                          + f"use one of {', '.join(sorted(EXPERIMENT_PRESETS))}", key="preset")
        raw = _merge(_to_plain(EXPERIMENT_PRESETS[preset]()), raw)
    unknown = _unknown_keys(ExperimentConfig, raw, "")
    if unknown:
        fixes = [f"rename {key} to {close}" if close else f"remove {key} (or rename it to a key its section takes)"
                 for key, _, close in unknown]
        raise Refusal("config", "unknown config keys: " + "; ".join(found for _, found, _ in unknown),
                      ", ".join(fixes), key=unknown[0][0])
    missing = _missing_keys(ExperimentConfig, raw, "")
    if missing:
        raise Refusal("config", "missing required config keys: " + ", ".join(missing),
                      f"set them in the YAML or with --set (e.g. --set {missing[0]}=...), or start the file from a "
                      f"preset that has them (preset: {' | '.join(sorted(EXPERIMENT_PRESETS))})", key=missing[0])
    try:
        return _build(ExperimentConfig, raw, "")
    except TypeError as error:  # a value of a shape no field takes (a mapping where a list goes, ...)
        raise Refusal("config", f"a config value has a type its field cannot take: {error}",
                      "compare each section with its dataclass in trainer/launch/config.py and config_sections.py "
                      "(fields and types are documented there)", key="config") from None


class _Override:
    """An override's value text, typed once its field's type is known ("name=123" stays a str)."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, value = override.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise Refusal("config", f"override {key or override!r} must look like 'section.field=value'",
                      "write it as --set section.field=value, e.g. --set train.steps=20", key=key or override)
    *parents, leaf = key.strip().split(".")
    node = raw
    for depth, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            section = ".".join(parents[:depth + 1])
            raise Refusal("config", f"override {key!r}: {section} is not a section",
                          f"override a field of a section (section.field=value), or set {section} itself",
                          key=key)
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


def _unknown_keys(cls: type, raw: Any, prefix: str) -> list[tuple[str, str, str | None]]:
    """(dotted key, what to say of it, the nearest valid key) for each key no field of cls (or its sections) takes."""
    if not isinstance(raw, Mapping):
        return []
    hints, names = _hints(cls), [f.name for f in dataclasses.fields(cls)]
    problems = []
    for key in raw:
        if key not in names:
            close = nearest(str(key), names)
            hint = f"did you mean {prefix}{close}? " if close else ""
            problems.append((f"{prefix}{key}",
                             f"{prefix}{key} ({hint}{prefix.rstrip('.') or 'top level'} takes: {', '.join(names)})",
                             f"{prefix}{close}" if close else None))
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
        section = prefix.rstrip(".") or "config"
        raise Refusal("config", f"{section} must be a mapping of its fields, got {type(raw).__name__}",
                      f"write {section} as `field: value` lines (its fields: "
                      f"{', '.join(f.name for f in dataclasses.fields(cls))})", key=section)
    hints = _hints(cls)
    kwargs = {f.name: _coerce(raw[f.name], hints[f.name], prefix + f.name, secret=is_secret_field(f))
              for f in dataclasses.fields(cls) if f.name in raw}
    try:
        return cls(**kwargs)
    except Refusal:
        raise
    except ValueError as error:
        raise _field_refusal(cls, prefix, str(error)) from None


_DOTTED_KEY = re.compile(r"\b(?:model|data|train|optim|faults|stage|eval)\.[a-z_]+\b")
_MUST_BE = re.compile(r"^(?P<key>[a-z_]+) must be (?P<rule>.+?), got (?P<got>.+)$")


def _field_refusal(cls: type, prefix: str, message: str) -> Refusal:
    """A section's own check (its __post_init__ ValueError) as a Refusal naming the dotted key: the
    first dotted key the message names, else the first of the section's fields it names. A message
    of the form "<field> must be <rule>, got <value>" gives the fix "set <key> to <rule>"; one that
    already ends "; use ..." keeps that advice as the fix."""
    section = prefix.rstrip(".")
    names = [f.name for f in dataclasses.fields(cls)]
    dotted = _DOTTED_KEY.search(message)
    field_name = next((word for word in re.findall(r"[a-z_]+", message) if word in names), "")
    key = dotted.group(0) if dotted else (prefix + field_name if field_name else section or "config")
    found = message if dotted or not section else f"{section}: {message}"
    if field_name and message.startswith(field_name) and section:
        found = prefix + message  # "steps must be >= 1" -> "train.steps must be >= 1"
    must = _MUST_BE.match(message)
    if must and must.group("key") == field_name:
        rule = must.group("rule")
        fix = f"set {key} to {rule}" if rule.startswith(("one of", "a ", "an ")) else f"set {key} so it is {rule}"
    elif "; " in message and message.rsplit("; ", 1)[1].startswith(("use ", "set ", "put ", "remove ")):
        found, fix = found.rsplit("; ", 1)
    else:
        fix = (f"change {key} (or the keys it must agree with, named above); each field's rule is in its "
               f"docstring in trainer/launch/{'config.py' if cls in (TrainConfig, StageConfig) else 'config_sections.py'}")
    return Refusal("config", found, fix, key=key)


_ENV_REF = re.compile(r"^\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# ---------------------------------------------------------------------------------------------
# Secret fields in overrides: only ever by reference to the environment


_SECRET_FIX = ("give it through an environment variable: in Dagster run config `secrets: {{{key}: {{env: MY_TOKEN}}}}` "
               "(Python: StageRunConfig(secrets={{'{key}': dg.EnvVar('MY_TOKEN')}})), or the override "
               "'{key}=${{env:MY_TOKEN}}'; export MY_TOKEN where Dagster and the trainer run")


class LiteralSecretError(Refusal):
    """An override gives a secret field a literal value, which every record of it would carry."""

    def __init__(self, found: str, fix: str = "", *, key: str = "data.storage_token") -> None:
        super().__init__("credentials", found, fix or _SECRET_FIX.format(key=key), key=key)


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
            f"stored in clear text (Dagster run config, launch manifest, logs)", key=keys[0])


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
            except (yaml.YAMLError, ValueError):
                raise Refusal("config", f"{path}: cannot parse {shown}",
                              f"give {path} a YAML value of type {_type_name(hint)}", key=path) from None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _coerce(value, inner, path, secret=secret)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise Refusal("config", f"{path} must be a list, got {shown}",
                          f"write {path} as a list, e.g. {path}=[...]", key=path)
        if origin is tuple and args[-1] is not Ellipsis and len(value) != len(args):
            raise Refusal("config", f"{path} must have {len(args)} items, got {shown}",
                          f"give {path} exactly {len(args)} items", key=path)
        item_hints = [args[0]] * len(value) if origin is list or args[-1] is Ellipsis else args
        items = [_coerce(item, item_hint, f"{path}[{index}]", secret=secret)
                 for index, (item, item_hint) in enumerate(zip(value, item_hints, strict=True))]
        return tuple(items) if origin is tuple else items
    return _coerce_scalar(value, hint, path, shown, secret=secret)


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))


def _coerce_scalar(value: Any, hint: Any, path: str, shown: str, *, secret: bool = False) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is str:
        if isinstance(value, str):
            match = _ENV_REF.match(value)
            if not match:
                return value
            if match.group(1) not in os.environ:
                name = match.group(1)
                raise Refusal("credentials" if secret else "config",
                              f"{path} reads environment variable {name}, which is not set",
                              f"export {name} where the trainer runs (and Dagster, for a stage), or give {path} "
                              f"another ${{env:NAME}} reference", key=path)
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
    example = {bool: "true or false", int: "a whole number, e.g. 1", float: "a number, e.g. 0.001",
               str: "a string"}.get(hint, _type_name(hint))
    raise Refusal("config", f"{path} must be {_type_name(hint)}, got {shown}",
                  f"give {path} {example}", key=path)
