"""The trainer's config sections, torch-free: model, data, optimizer, faults, and the choice lists.

Each section checks itself in ``__post_init__``; ``trainer/launch/config.py`` assembles them into an
ExperimentConfig, loads YAML and overrides, and ``trainer/launch/preflight.py`` checks a config against
a world size before launch. They live apart from the code they configure (model.py, data.py,
optim.py, faults.py, parallel.py, precision.py, which re-export their own) so that loading or
checking a config imports no torch: the Dagster Definitions and every asset that resolves a
stage's config stay light (as TorchTitan keeps its whole JobConfig in one torch-free module).
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ops.loading import sampling
from trainer.launch.refusal import Refusal

if TYPE_CHECKING:  # the shard modules load only when shards are read
    from ops.clips.shards import IndexInfo

# ---------------------------------------------------------------------------------------------
# Choices checked by TrainConfig (trainer/launch/config.py); the code that acts on them is in
# parallel.py and precision.py.

PARALLELISMS = ("none", "ddp", "fsdp")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16", "fp16")
# train.precision may also be "auto": bf16 on a CUDA device that has it, else fp32
# (trainer/precision.py:resolve_precision). What runs is always one of PRECISIONS.
PRECISION_CHOICES = ("auto", *PRECISIONS)
# train.attention_backend: torch's fused SDPA kernels by name (torch.nn.attention.SDPBackend);
# "auto" lets torch pick per call. trainer/precision.py:attention_context applies and probes it.
ATTENTION_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
# train.residual_dtype: the dtype of the residual stream between blocks under autocast
# (trainer/models/video.py, "Residual stream"). Under fp32 both are the same.
RESIDUAL_DTYPES = ("compute", "fp32")


# ---------------------------------------------------------------------------------------------
# Model (trainer/models/video.py)

POS_EMBEDS = ("sincos", "learned")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    dim: int
    """Token width."""
    num_layers: int
    """Transformer blocks."""
    num_heads: int
    """Attention heads; dim must be divisible by it."""
    mlp_ratio: float = 4.0
    """MLP hidden width as a multiple of dim."""
    patch_frames: int = 2
    """Tubelet size along time (pt)."""
    patch_height: int = 8
    """Tubelet size along height (ph)."""
    patch_width: int = 8
    """Tubelet size along width (pw)."""
    pos_embed: str = "sincos"
    """'sincos': fixed 3D sine-cosine table; 'learned': one learned vector per token position."""
    qk_norm: bool = True
    """RMS-normalize queries and keys per head (fp32), which keeps attention logits bounded."""
    audio_frame_samples: int = 0
    """PCM samples per audio frame of the audio encoder; 0 turns audio conditioning off."""
    timestep_freq_dim: int = 256
    """Sinusoidal features of the timestep before its MLP."""
    factory: str = ""
    """"package.module:function" that builds the model from the ExperimentConfig (trainer/models/protocol.py:
    the model protocol); "" is the built-in video model (trainer.models.video:build). The fields above are the
    factory's to read; the built-in one reads them all."""

    def __post_init__(self) -> None:
        if self.factory == "trainer.models.video:build":
            self.factory = ""  # the built-in model, named: the same run identity and checkpoint fingerprint
        if self.factory:
            module, sep, attribute = self.factory.partition(":")
            if not sep or not module or not attribute or any(not part.isidentifier() for part in
                                                              (*module.split("."), *attribute.split("."))):
                raise ValueError(f"factory must look like 'package.module:function', got {self.factory!r}")
        for name in ("dim", "num_layers", "num_heads", "patch_frames", "patch_height",
                     "patch_width", "timestep_freq_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.num_heads:
            raise ValueError(f"dim {self.dim} is not divisible by num_heads {self.num_heads}")
        if self.mlp_ratio <= 0:
            raise ValueError(f"mlp_ratio must be > 0, got {self.mlp_ratio}")
        if self.pos_embed not in POS_EMBEDS:
            raise ValueError(f"pos_embed must be one of {POS_EMBEDS}, got {self.pos_embed!r}")
        if self.audio_frame_samples < 0:
            raise ValueError(f"audio_frame_samples must be >= 0, got {self.audio_frame_samples}")
        if self.timestep_freq_dim % 2:
            raise ValueError(f"timestep_freq_dim must be even, got {self.timestep_freq_dim}")

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return (self.patch_frames, self.patch_height, self.patch_width)

    @property
    def patch_dim(self) -> int:
        """Values per tubelet token: pt * ph * pw * 3 channels."""
        return self.patch_frames * self.patch_height * self.patch_width * 3

    @property
    def mlp_hidden(self) -> int:
        return int(self.dim * self.mlp_ratio)


# ---------------------------------------------------------------------------------------------
# Presets: (T, H, W) of the clips is the data's business; the model is built for a shape.


def tiny() -> ModelConfig:
    """About 0.15M parameters: CPU tests."""
    return ModelConfig(dim=64, num_layers=2, num_heads=4, patch_frames=2, patch_height=4,
                       patch_width=4, audio_frame_samples=64, timestep_freq_dim=64)


def small() -> ModelConfig:
    """About 23M parameters."""
    return ModelConfig(dim=384, num_layers=12, num_heads=6, audio_frame_samples=640)


def base() -> ModelConfig:
    """About 91M parameters (DiT-B width and depth, adaLN-single)."""
    return ModelConfig(dim=768, num_layers=12, num_heads=12, audio_frame_samples=640)


def one_b() -> ModelConfig:
    """About 1.04B parameters: 20 blocks of 12 x 2048^2 plus the shared adaLN projection."""
    return ModelConfig(dim=2048, num_layers=20, num_heads=16, audio_frame_samples=640)


MODEL_PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": tiny, "small": small, "base": base, "1b": one_b,
}


def grid_shape(video_shape: Sequence[int], patch_size: Sequence[int]) -> tuple[int, int, int]:
    """Tokens along (time, height, width) for a clip of video_shape = (T, H, W)."""
    for size, patch in zip(video_shape, patch_size, strict=True):
        if size % patch:
            raise ValueError(f"clip shape {tuple(video_shape)} is not divisible by patch size "
                             f"{tuple(patch_size)}")
    return tuple(size // patch for size, patch in zip(video_shape, patch_size, strict=True))


def num_tokens(video_shape: Sequence[int], patch_size: Sequence[int]) -> int:
    """Tokens of one clip of video_shape = (T, H, W); ValueError if the patch does not divide it."""
    return math.prod(grid_shape(video_shape, patch_size))


# ---------------------------------------------------------------------------------------------
# Data (trainer/data.py)

SOURCES = ("synthetic", "shards")
ENCODINGS = ("any", "compressed", "decoded")
BATCHING_POLICIES = sampling.BATCHING_POLICIES  # the one registry (ops/loading/sampling.py imports no torch)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    batch_size: int
    """Global batch: samples per optimizer step over all ranks and micro-batches."""
    clip_frames: int
    """Frames per clip (T)."""
    height: int
    """Clip height in pixels (H)."""
    width: int
    """Clip width in pixels (W)."""
    buckets: list[list[int]] = field(default_factory=list)
    """Clip shapes [T, H, W] of bucketed data (module docstring); empty: every clip has
    (clip_frames, height, width). For shards, the set must be the shard index's bucket shapes."""
    batching: str = "auto"
    """'fixed_shape', 'bucketed' (each global step one bucket) or 'auto': bucketed when the data
    has more than one clip shape (the shard loader's rule, ops.loading.loader)."""
    audio_samples: int = 0
    """Mono PCM samples of a clip of the reference shape (A); a bucket of T frames has A * T /
    clip_frames. 0: synthetic batches carry an empty audio tensor, and the shard index's audio
    length is not checked."""
    source: str = "synthetic"
    """'synthetic' (deterministic generated clips, for tests) or 'shards' (the shard loader)."""
    shard_index: str = ""
    """Folder of the shard index (index.json, index.parquet and the shards); required for 'shards'."""
    split: str = "train"
    """Split of the shard index to read."""
    drop_last: bool = True
    """Drop the end of an epoch that does not fill a global batch, so every step is full."""
    manifest_version: str = ""
    """Version of the validated manifest the shards were built from; required for 'shards'."""
    encoding: str = "any"
    """Shard encoding the run expects: 'compressed', 'decoded', or 'any' (the index decides)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: read in the training process)."""
    pin_memory: bool = True
    """When the run is on CUDA, hand batches over in page-locked host memory so the copy to the
    device is asynchronous (non_blocking); ignored on CPU, where there is no copy to overlap."""
    seed: int = 0
    """Seed of the sample order (and of the synthetic clips' content)."""
    shuffle: bool = True
    """Shuffle the sample order each epoch."""
    num_samples: int = 4096
    """Size of the synthetic dataset; ignored for 'shards' (the index decides)."""
    storage_token: str = field(default="", repr=False, metadata={"secret": True})
    """Credential for the shard store (object storage); secret, redacted in every record."""

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        for name in ("batch_size", "clip_frames", "height", "width", "num_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.audio_samples < 0 or self.num_workers < 0 or self.seed < 0:
            raise ValueError("audio_samples, num_workers and seed must be >= 0")
        if self.source == "shards" and not (self.shard_index and self.manifest_version):
            unset = [f"data.{name}" for name in ("shard_index", "manifest_version") if not getattr(self, name)]
            raise Refusal("data", f"data.source 'shards' needs data.shard_index and data.manifest_version; "
                                  f"{' and '.join(unset)} unset",
                          "set data.shard_index to a shard index folder (the shard_index asset's, <data root>/shards/"
                          "<plan version>) and data.manifest_version to the manifest it was built from", key=unset[0])
        if self.source == "synthetic" and self.num_samples < self.batch_size:
            raise ValueError(f"num_samples {self.num_samples} is smaller than one global batch "
                             f"({self.batch_size}): no step would ever be full")
        self._check_buckets()

    def _check_buckets(self) -> None:
        for shape in self.buckets:
            if len(shape) != 3 or any(type(size) is not int or size < 1 for size in shape):
                raise ValueError(f"each of buckets must be [frames, height, width] of positive ints, got {shape}")
        if len({tuple(shape) for shape in self.buckets}) != len(self.buckets):
            raise ValueError(f"buckets must be distinct, got {self.buckets}")
        sampling.resolve_batching(self.batching, self.buckets)  # refuses fixed_shape over several shapes
        for frames, height, width in self.video_shapes:
            if self.audio_samples * frames % self.clip_frames:
                raise ValueError(f"bucket {[frames, height, width]}: audio_samples {self.audio_samples} x "
                                 f"{frames} / clip_frames {self.clip_frames} is not a whole number of samples")
        if self.source == "synthetic" and self.resolved_batching == "bucketed":
            # Synthetic sample i belongs to bucket i % len(buckets) (SyntheticClips).
            largest = -(-self.num_samples // len(self.video_shapes))
            if largest < self.batch_size:
                raise ValueError(f"num_samples {self.num_samples} over {len(self.video_shapes)} buckets leaves "
                                 f"at most {largest} samples a bucket, fewer than one global batch "
                                 f"({self.batch_size}): no step would ever be full")

    @property
    def video_shape(self) -> tuple[int, int, int]:
        """The reference clip shape, which the model is built for."""
        return (self.clip_frames, self.height, self.width)

    @property
    def video_shapes(self) -> list[tuple[int, int, int]]:
        """Every clip shape of the data: the buckets, or the reference shape alone."""
        return [tuple(shape) for shape in self.buckets] or [self.video_shape]

    @property
    def resolved_batching(self) -> str:
        """The batching policy 'auto' resolves to for these clip shapes (ops.loading.sampling.resolve_batching)."""
        return sampling.resolve_batching(self.batching, self.video_shapes)

    def audio_samples_for(self, video_shape: tuple[int, int, int]) -> int:
        """Audio samples of a clip of video_shape: the reference clip's audio rate (module docstring)."""
        return self.audio_samples * video_shape[0] // self.clip_frames


def check_matches_index(config: DataConfig, index: IndexInfo) -> None:
    """Refuse a config whose manifest, clip shapes, audio length or encoding differ from the shard index.

    One clip shape on both sides: it must be the reference shape, and audio_samples (unless 0)
    its audio length. Bucketed: the config's shapes must be the index's bucket shapes, and each
    bucket's audio length what audio_samples implies for it (module docstring).
    """
    shapes = index.bucket_shapes
    index_shapes = {name: (shape.num_frames, shape.height, shape.width) for name, shape in shapes.items()}
    problems: list[tuple[str, str, str]] = []  # (key, what differs, its fix)
    if config.manifest_version != index.manifest_version:
        problems.append(("data.manifest_version",
                         f"data.manifest_version {config.manifest_version!r} != index {index.manifest_version!r}",
                         f"set data.manifest_version={index.manifest_version}, or data.shard_index to an index built "
                         f"from manifest {config.manifest_version}"))
    if len(shapes) == 1 and not config.buckets:
        ((name, shape),) = shapes.items()
        if config.video_shape != index_shapes[name]:
            frames, height, width = index_shapes[name]
            problems.append(("data.clip_frames/height/width", f"clip shape (data.clip_frames, data.height, data.width) "
                             f"{config.video_shape} != index {index_shapes[name]}",
                             f"set data.clip_frames={frames} data.height={height} data.width={width}"))
        if config.audio_samples not in (0, shape.num_audio_samples):
            problems.append(("data.audio_samples",
                             f"data.audio_samples {config.audio_samples} != index {shape.num_audio_samples}",
                             f"set data.audio_samples={shape.num_audio_samples}"))
    else:
        if set(config.video_shapes) != set(index_shapes.values()):
            problems.append(("data.buckets", f"clip shapes (data.buckets) {sorted(config.video_shapes)} != index "
                             f"bucket shapes {sorted(index_shapes.values())}",
                             f"set data.buckets={[list(shape) for shape in sorted(index_shapes.values())]}"))
        for name, shape in shapes.items():
            expected = config.audio_samples * shape.num_frames / config.clip_frames
            if config.audio_samples and shape.num_audio_samples != expected:
                problems.append(("data.audio_samples", f"bucket {name} holds {shape.num_audio_samples} audio samples, "
                                 f"but audio_samples {config.audio_samples} per {config.clip_frames} frames means "
                                 f"{expected:g}", "set data.audio_samples to the index's audio samples per reference clip"))
    if config.encoding not in ("any", index.config.encoding):
        problems.append(("data.encoding", f"data.encoding {config.encoding!r} != index {index.config.encoding!r}",
                         f"set data.encoding={index.config.encoding} (or any)"))
    if problems:
        raise Refusal("data", f"data config does not match shard index {index.version} at {index.directory}: "
                      + "; ".join(found for _, found, _ in problems),
                      " and ".join(dict.fromkeys(fix for _, _, fix in problems)), key=problems[0][0])


# ---------------------------------------------------------------------------------------------
# Evaluation (trainer/heldout.py)

SOLVERS = ("euler", "heun")
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """How a run measures itself on held-out data: validation loss every train.eval_every steps and at
    the end, and samples generated at the end. Nothing here changes training (its sample order, RNG
    streams or losses), so these fields are not part of a run's identity."""

    split: str = "val"
    """Split of the shard index whose loss is measured (the evaluation asset uses "test")."""
    timesteps: int = 8
    """Fixed flow-matching times, evenly spaced: (i + 0.5) / timesteps. With noise fixed by sample key
    (and seed below), the loss depends on the weights alone: two runs or checkpoints compare directly."""
    max_samples: int = 64
    """Evaluate at most this many samples of the split, the first ones of its unshuffled order; 0: all."""
    seed: int = 0
    """Seed of the evaluation noise; not train.seed, so runs with different seeds see the same noise."""
    synthetic_samples: int = 16
    """Size of the held-out split of synthetic data (generated apart from the training clips)."""
    samples: int = 2
    """Clips generated at the end of a run (and by the evaluation asset), conditioned like the first
    held-out clips (their audio); written as MP4 with that audio and a contact sheet. 0: none."""
    sample_steps: int = 16
    """Integration steps of the flow ODE, from noise at t=1 to data at t=0."""
    solver: str = "heun"
    """'euler' (one velocity per step) or 'heun' (two: second order)."""
    audio_rate: int = 16_000
    """Synthetic data's audio sample rate, for the MP4's audio track (shards: each bucket's own)."""
    fps: float = 8.0
    """Synthetic data's frame rate, for the MP4 (shards: each bucket's own)."""

    def __post_init__(self) -> None:
        if not _SPLIT_NAME.match(self.split):
            # It names MLflow metrics (<split>/loss): a name MLflow refuses would stop the run's metrics.
            raise ValueError(f"split must be a split name of letters, digits, '_', '.' or '-', got {self.split!r}")
        if self.timesteps < 1 or self.sample_steps < 1 or self.synthetic_samples < 1:
            raise ValueError(f"timesteps, sample_steps and synthetic_samples must be >= 1, got {self.timesteps}, "
                             f"{self.sample_steps}, {self.synthetic_samples}")
        if self.max_samples < 0 or self.samples < 0 or self.seed < 0:
            raise ValueError(f"max_samples, samples and seed must be >= 0, got {self.max_samples}, {self.samples}, "
                             f"{self.seed}")
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {self.solver!r}")
        if self.audio_rate < 1 or not self.fps > 0:
            raise ValueError(f"audio_rate must be >= 1 and fps > 0, got {self.audio_rate}, {self.fps}")

    @property
    def times(self) -> list[float]:
        return [(index + 0.5) / self.timesteps for index in range(self.timesteps)]


# ---------------------------------------------------------------------------------------------
# Optimizer (trainer/optim.py)

DECAYS = ("cosine", "constant")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay on matrices."""
    warmup_steps: int = 0
    """Steps of linear warmup from lr / (warmup_steps + 1) to lr."""
    decay: str = "cosine"
    """After warmup: 'cosine' to min_lr_ratio * lr at the last step, or 'constant'."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of lr."""
    grad_clip_norm: float | None = 1.0
    """Clip the global gradient norm to this; None measures the norm without clipping."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # YAML gives a list
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"eps must be > 0 and weight_decay >= 0, got {self.eps}, {self.weight_decay}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay not in DECAYS:
            raise ValueError(f"decay must be one of {DECAYS}, got {self.decay!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip_norm is not None and self.grad_clip_norm <= 0:
            raise ValueError(f"grad_clip_norm must be > 0 or None, got {self.grad_clip_norm}")


# ---------------------------------------------------------------------------------------------
# Faults (trainer/faults.py)

STALL_PLACES = ("step", "data", "save")
EXIT_PLACES = ("step", "save")


@dataclass(kw_only=True, slots=True)
class FaultConfig:
    exit_rank: int = -1
    """Rank that dies (os._exit, no cleanup, like a killed process) at exit_at_step; -1: none."""
    exit_at_step: int = 0
    """1-based step at whose start exit_rank dies; 0: never."""
    exit_signal: str = ""
    """How exit_rank dies: "" exits with INJECTED_EXIT_CODE; a signal name (e.g. "SIGKILL") sends
    that signal to itself, like the OOM killer or a lost node."""
    exit_in: str = "step"
    """Where exit_rank dies: "step" (at the step's start) or "save" (inside the checkpoint save of
    that step, after the data files are written and before the commit record: set
    train.checkpoint_every so there is one)."""
    stall_rank: int = -1
    """Rank that stops responding (sleeps, ignoring the others) at stall_at_step; -1: none."""
    stall_at_step: int = 0
    """1-based step at whose start stall_rank stalls; 0: never."""
    stall_s: float = 0.0
    """How long the stall lasts; make it longer than train.collective_timeout_s to test that."""
    stall_in: str = "step"
    """Where the rank stalls: "step" (at the step's start), "data" (inside the data fetch) or "save"
    (inside the checkpoint save of that step: set train.checkpoint_every so there is one)."""
    nan_loss_at_steps: list[int] = field(default_factory=list)
    """1-based steps whose loss is replaced by NaN (so are its gradients)."""
    nan_loss_rank: int = -1
    """Rank whose loss turns NaN at those steps; -1: every rank."""
    spike_loss_at_steps: list[int] = field(default_factory=list)
    """1-based steps whose loss (and gradients) are multiplied by 1000 on every rank: a loss spike."""
    sigterm_at_step: int = 0
    """1-based step at whose start sigterm_rank sends itself SIGTERM (a preemption); 0: never."""
    sigterm_rank: int = 0
    """Rank that receives the injected SIGTERM."""
    sigterm_count: int = 1
    """How many SIGTERMs it sends (2: an impatient scheduler that signals twice)."""
    preempt_with: str = "SIGTERM"
    """The signal sigterm_at_step sends: a scheduler's warning signal such as "SIGUSR1" (which
    train.preempt_signals must name for it to mean preemption)."""
    raise_on_sample: str = ""
    """A sample key: the step whose batch holds it raises BadSampleError on that rank (a sample that
    crashes the model); "" none."""
    oom_at_step: int = 0
    """1-based step at whose start rank 0 raises torch.OutOfMemoryError (as an allocator would); 0: never."""
    disk_full_at_step: int = 0
    """1-based step whose checkpoint save raises OSError(ENOSPC) on every rank (a full shared disk); 0:
    never. Set train.checkpoint_every so that step saves."""
    corrupt_checkpoint_at_step: int = 0
    """After the checkpoint of this step commits, rank 0 flips a byte in its largest data file (bit
    rot under the newest checkpoint); 0: never."""
    attempt: int = 0
    """The attempt of the run (trainer/supervisor/elastic.py) on which these faults fire; -1: every attempt.
    So a killed-and-restarted run is not killed again at the same step."""
    end_stall_s: float = 0.0
    """Rank 0 sleeps this long in its end-of-run work (after the final barrier, before final.json
    and the end hooks), like a slow MLflow server: no other rank may be left waiting on it in a
    collective (a test of the final barrier, trainer/loop.py)."""
    drop_optimizer_state_on_restore: bool = False
    """A broken restore, for restore-drill tests: resuming another run's checkpoint
    (stage.resume_from) restores everything but the optimizer state, which starts fresh."""

    def __post_init__(self) -> None:
        self.nan_loss_at_steps = list(self.nan_loss_at_steps)
        self.spike_loss_at_steps = list(self.spike_loss_at_steps)
        if any(step < 1 for step in self.spike_loss_at_steps):
            raise ValueError(f"spike_loss_at_steps entries must be >= 1, got {self.spike_loss_at_steps}")
        if min(self.exit_rank, self.stall_rank, self.nan_loss_rank, self.attempt) < -1:
            raise ValueError("exit_rank, stall_rank, nan_loss_rank and attempt must be >= -1")
        if min(self.exit_at_step, self.stall_at_step, self.stall_s, self.end_stall_s, self.sigterm_at_step,
               self.sigterm_rank, self.corrupt_checkpoint_at_step, self.oom_at_step, self.disk_full_at_step) < 0:
            raise ValueError("exit_at_step, stall_at_step, stall_s, end_stall_s, sigterm_at_step, sigterm_rank, "
                             "corrupt_checkpoint_at_step, oom_at_step and disk_full_at_step must be >= 0")
        if self.sigterm_count not in (1, 2, 3):
            raise ValueError(f"sigterm_count must be 1, 2 or 3, got {self.sigterm_count}")
        if any(step < 1 for step in self.nan_loss_at_steps):
            raise ValueError(f"nan_loss_at_steps entries must be >= 1, got {self.nan_loss_at_steps}")
        if self.stall_in not in STALL_PLACES:
            raise ValueError(f"stall_in must be one of {STALL_PLACES}, got {self.stall_in!r}")
        if self.exit_in not in EXIT_PLACES:
            raise ValueError(f"exit_in must be one of {EXIT_PLACES}, got {self.exit_in!r}")
        if self.preempt_with not in signal.Signals.__members__:
            raise ValueError(f"preempt_with must be a signal name such as 'SIGUSR1', got {self.preempt_with!r}")
        if self.exit_signal and self.exit_signal not in signal.Signals.__members__:
            raise ValueError(f"exit_signal must be a signal name such as 'SIGKILL', got {self.exit_signal!r}")
        for kind in ("exit", "stall"):
            rank, step = getattr(self, f"{kind}_rank"), getattr(self, f"{kind}_at_step")
            if (rank >= 0) != (step > 0):
                raise ValueError(f"set {kind}_rank and {kind}_at_step together, got {rank}, {step}")
        # One run ends one way: two faults that each end or stop the run at one step are ambiguous.
        at_step = [("exit_at_step", self.exit_at_step), ("sigterm_at_step", self.sigterm_at_step),
                   ("oom_at_step", self.oom_at_step),
                   # a stall in a save can meet a preemption's save: that is the grace-period test
                   *(("stall_at_step", self.stall_at_step) for _ in [0] if self.stall_s > 0 and self.stall_in != "save"),
                   *(("nan_loss_at_steps", step) for step in self.nan_loss_at_steps)]
        seen: dict[int, str] = {}
        for name, step in at_step:
            if step and step in seen and seen[step] != name:
                raise ValueError(f"faults.{seen[step]} and faults.{name} both fire at step {step}: a run ends one "
                                 f"way at a step, so the drill could not say which fault it recovered from; "
                                 f"put them at different steps")
            seen.setdefault(step, name)

    @property
    def max_rank(self) -> int:
        """Highest rank the faults name (-1 if none), checked against the world size at launch."""
        return max(self.exit_rank, self.stall_rank, self.nan_loss_rank,
                   self.sigterm_rank if self.sigterm_at_step else -1)
