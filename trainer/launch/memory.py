"""Per-rank memory estimate of a training config, checked against a budget before launch.

    static       params + grads + AdamW (exp_avg, exp_avg_sq)   4 + 4 + 8 bytes per parameter (all
                                                                 fp32), divided by world_size under FSDP
    backward     activations + transient, at the end of forward (the peak of a step):
      activations  tokens of one micro-batch x bytes saved for backward per token, MEASURED
                   (below): per layer x num_layers, plus the layers outside the blocks (patch
                   embedding, final layer, the loss's fp32 token tensors). With activation
                   checkpointing: each block's input per layer, plus one block's full activations
                   (its recompute in backward). Tokens are those of the data's largest clip shape,
                   since with bucketed data any step may be that bucket.
      transient    16-bit policies: autocast's cached 16-bit weight copies (whole model); FSDP:
                   two unsharded blocks (current + prefetched) of params and grads; FSDP with
                   gradient accumulation: the unsharded fp32 gradients every rank keeps between
                   micro-batches (set_requires_gradient_sync(False) skips the reduce-scatter)
    optimizer    the optimizer step's temporaries: foreach AdamW (CPU) builds one fp32 list the
      step       size of the (local) parameters (sqrt of exp_avg_sq); fused AdamW (CUDA) none.
                 Activations are freed by then, so the step peaks at static + this, not on top
                 of the backward peak: total = static + max(backward, optimizer step).

Measured activations. ``saved_bytes_per_token`` runs one real transformer block (and a one-block
model, for what lies outside the blocks) forward on CPU, under the run's precision and
residual dtype, with ``torch.autograd.graph.saved_tensors_hooks`` counting the bytes of every
distinct storage autograd saves. It does so at two token counts and takes the difference, so
what does not grow with tokens (autocast's weight copies, per-sample conditioning) falls out.
Weights are allocated uninitialized (the sizes do not depend on the values), and results are
cached per (width, heads, MLP, precision, residual dtype): the 1b preset costs about a second
the first time in a process. Measured on this code, for the presets: fp32 about 100 x dim bytes
per token and layer, bf16 about 66 x dim (the 40 x dim the earlier formula assumed would have let
an out-of-memory config through). CPU SDPA saves what the fused CUDA kernels save (q, k, v,
output, log-sum-exp: no tokens^2 matrix), so the figure carries over; tests hold the estimate
to within 25% of a whole-model measurement on CPU (tests/test_memory_estimate.py).

Not counted: the CUDA context, allocator fragmentation, DDP's 25 MB buckets and the gradients of
activations in flight during backward. Its job is to refuse a batch that cannot fit before any
process starts; benchmarks/gpu_check.py prints it beside the measured peak.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar
from typing import TYPE_CHECKING

from ops.publish.durable import write_json_atomic
from trainer.launch.config_sections import ModelConfig, num_tokens
from trainer.launch.refusal import Refusal

if TYPE_CHECKING:
    from trainer.launch.config import ExperimentConfig

T = TypeVar("T")
_FP32_BYTES = 4
_HALF_BYTES = 2
_ADAMW_STATES = 2
# Token counts of the two measurements (the difference is what grows per token).
_MEASURE_TOKENS = (16, 32)
# Widest block measured as it is (the 1b preset's): about 200 MB of weights, a second of CPU.
_MAX_MEASURED_DIM = 2048


class MemoryBudgetExceeded(Refusal):
    """The estimated per-rank memory of a config exceeds its budget (train.max_memory_bytes, or the device's)."""

    def __init__(self, found: str, fix: str, *, key: str = "train.max_memory_bytes") -> None:
        super().__init__("memory", found, fix, key=key)


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedBytes:
    """Bytes autograd saves for backward, per token (measured by ``saved_bytes_per_token``)."""

    per_layer: float
    """One transformer block, everything it saves."""
    block_input: float
    """What a checkpointed block saves: its input (the residual stream)."""
    outside: float
    """Everything outside the blocks: patch embedding, position add, final layer, the loss."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryEstimate:
    num_params: int
    """Parameters of the whole (unsharded) model."""
    params_bytes: int
    """fp32 master weights held by one rank."""
    grads_bytes: int
    """fp32 gradients held by one rank."""
    optimizer_bytes: int
    """AdamW state held by one rank."""
    transient_bytes: int
    """At the backward peak: autocast weight copies, FSDP's unsharded blocks and accumulated gradients."""
    activations_bytes: int
    """Values saved for backward by one micro-batch (measured per token; module docstring)."""
    optimizer_step_bytes: int
    """Temporaries of the optimizer step (activations are freed by then)."""

    @property
    def static_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        backward = self.transient_bytes + self.activations_bytes
        return self.static_bytes + max(backward, self.optimizer_step_bytes)

    def as_dict(self) -> dict[str, int]:
        return asdict(self) | {"total_bytes": self.total_bytes}


def estimate_memory(config: ExperimentConfig, world_size: int, *, device_type: str = "cpu") -> MemoryEstimate:
    """Per-rank estimate for config on world_size ranks on device_type (see the module docstring).

    A built-in model's estimate is cached on disk like its measurement (below): a launch of a config
    estimated before on the same code imports no torch for it (the Dagster process's preflight)."""
    if config.model.factory:
        return _estimate(config, world_size, device_type=device_type)
    key = {"model": asdict(config.model), "video_shapes": [list(shape) for shape in config.data.video_shapes],
           "batch_size": config.data.batch_size, "world_size": world_size, "device_type": device_type,
           **{name: getattr(config.train, name) for name in ("grad_accum", "parallelism", "precision",
                                                             "activation_checkpointing", "residual_dtype")}}
    return _disk_cached({"estimate": key}, lambda: _estimate(config, world_size, device_type=device_type),
                        _parse_estimate)


def _parse_estimate(value: dict) -> MemoryEstimate | None:
    fields = {name: int(value[name]) for name in MemoryEstimate.__dataclass_fields__}
    ok = all(number >= 0 for number in fields.values()) and fields["num_params"] > 0
    return MemoryEstimate(**fields) if ok else None


def _estimate(config: ExperimentConfig, world_size: int, *, device_type: str) -> MemoryEstimate:
    from trainer.models.video import count_params  # torch (a meta-device model): imported when an estimate is made
    from trainer.precision import resolve_precision

    model, data, train = config.model, config.data, config.train
    if data.batch_size % (world_size * train.grad_accum):
        raise ValueError(f"global batch {data.batch_size} is not divisible by world_size "
                         f"{world_size} x grad_accum {train.grad_accum}")
    micro_batch = data.batch_size // (world_size * train.grad_accum)
    shards = world_size if train.parallelism == "fsdp" else 1
    precision = resolve_precision(train.precision, device_type)
    half = precision in ("bf16", "fp16")
    if model.factory:  # a lab's own model (trainer/models/protocol.py): measured whole, per sample
        return _factory_estimate(config, micro_batch=micro_batch, shards=shards, half=half,
                                 fused_optimizer=device_type == "cuda")
    num_params = count_params(model, video_shape=data.video_shape)

    transient = _HALF_BYTES * num_params if half else 0
    block_params = 4 * model.dim**2 + 2 * model.dim * model.mlp_hidden
    if shards > 1:
        transient += 2 * 2 * block_params * _FP32_BYTES  # 2 blocks x (params + grads)
        if train.grad_accum > 1:
            transient += _FP32_BYTES * num_params  # unsharded gradients kept between micro-batches

    saved = saved_bytes_per_token(model, precision=precision, residual_fp32=train.residual_dtype == "fp32")
    tokens = micro_batch * max(num_tokens(shape, model.patch_size) for shape in data.video_shapes)
    if train.activation_checkpointing:
        per_token = model.num_layers * saved.block_input + saved.per_layer + saved.outside
    else:
        per_token = model.num_layers * saved.per_layer + saved.outside
    fused_optimizer = device_type == "cuda"  # trainer/loop.py builds fused AdamW on CUDA
    return MemoryEstimate(
        num_params=num_params,
        params_bytes=_FP32_BYTES * num_params // shards,
        grads_bytes=_FP32_BYTES * num_params // shards,
        optimizer_bytes=_ADAMW_STATES * _FP32_BYTES * num_params // shards,
        transient_bytes=int(transient),
        activations_bytes=math.ceil(tokens * per_token),
        optimizer_step_bytes=0 if fused_optimizer else _FP32_BYTES * num_params // shards,
    )


def _factory_estimate(config: ExperimentConfig, *, micro_batch: int, shards: int, half: bool,
                      fused_optimizer: bool) -> MemoryEstimate:
    """The estimate for a model.factory model: the built-in model's static and transient terms, with
    the activations measured on the whole model, one sample of the data's largest clip shape, under
    saved_tensors_hooks (uninitialized CPU weights: sizes do not depend on values), times the
    micro-batch. Activation checkpointing is not credited: the bound stays an upper one."""
    import torch

    from trainer.models.protocol import build_model

    with torch.device("meta"):
        model = build_model(config)
    num_params = sum(p.numel() for p in model.parameters())
    block_params = max(sum(p.numel() for p in block.parameters()) for block in model.blocks)
    model = model.to_empty(device="cpu")
    for name, buffer in list(model.named_buffers()):  # non-persistent buffers: to_empty left them unset
        module_name, _, buffer_name = name.rpartition(".")
        model.get_submodule(module_name).register_buffer(buffer_name, torch.zeros_like(buffer), persistent=False)
    data = config.data
    shape = max(data.video_shapes, key=lambda clip: clip[0] * clip[1] * clip[2])
    noise_shape = tuple(model.noise_shape(shape))

    def run(num: int) -> None:
        model(torch.zeros(num, *shape, 3, dtype=torch.uint8), torch.zeros(num, data.audio_samples_for(shape)),
              torch.ones(num, dtype=torch.bool), torch.zeros(num, *noise_shape), torch.full((num,), 0.5))

    per_sample = _per_sample(run, half=half)
    transient = _HALF_BYTES * num_params if half else 0
    if shards > 1:
        transient += 2 * 2 * block_params * _FP32_BYTES
        if config.train.grad_accum > 1:
            transient += _FP32_BYTES * num_params
    return MemoryEstimate(
        num_params=num_params, params_bytes=_FP32_BYTES * num_params // shards,
        grads_bytes=_FP32_BYTES * num_params // shards,
        optimizer_bytes=_ADAMW_STATES * _FP32_BYTES * num_params // shards, transient_bytes=int(transient),
        activations_bytes=math.ceil(micro_batch * per_sample),
        optimizer_step_bytes=0 if fused_optimizer else _FP32_BYTES * num_params // shards)


def _per_sample(run, *, half: bool) -> float:
    """Saved bytes of one sample: (at two samples - at one), so per-batch constants fall out."""
    return max(0.0, float(_saved_bytes(run, 2, half=half) - _saved_bytes(run, 1, half=half)))


def saved_bytes_per_token(model: ModelConfig, *, precision: str, residual_fp32: bool) -> SavedBytes:
    """Bytes saved for backward per token, measured on CPU (module docstring); cached."""
    # Only what shapes the saved tensors is part of the key: patch sizes change tokens, not bytes per token
    # (beyond the patch dim, which is part of the key), and fp16 saves what bf16 saves, at the same size.
    half = precision in ("bf16", "fp16")
    if model.dim <= _MAX_MEASURED_DIM:
        return _measure(model.dim, model.num_heads, model.mlp_ratio, model.qk_norm, model.patch_size,
                        model.audio_frame_samples, model.timestep_freq_dim, half=half, residual_fp32=residual_fp32)
    # Wider models: measure a block of _MAX_MEASURED_DIM with the same head size and MLP ratio, and
    # scale by width. Bytes per token and layer are that linear in dim (100.1 to 101.0 x dim in
    # fp32 from the tiny preset to 1b), and a preflight must not allocate a huge block to know it.
    scale = model.dim / _MAX_MEASURED_DIM
    heads = max(1, round(model.num_heads / scale))
    measured = _measure(_MAX_MEASURED_DIM, heads, model.mlp_ratio, model.qk_norm, model.patch_size,
                        model.audio_frame_samples, model.timestep_freq_dim, half=half, residual_fp32=residual_fp32)
    return SavedBytes(per_layer=measured.per_layer * scale, block_input=measured.block_input * scale,
                      outside=measured.outside * scale)


@functools.lru_cache(maxsize=64)
def _measure(dim: int, num_heads: int, mlp_ratio: float, qk_norm: bool, patch_size: tuple[int, int, int],
             audio_frame_samples: int, timestep_freq_dim: int, *, half: bool, residual_fp32: bool) -> SavedBytes:
    """The measurement, from the on-disk cache when this model code measured this shape before."""
    key = {"dim": dim, "num_heads": num_heads, "mlp_ratio": mlp_ratio, "qk_norm": qk_norm, "patch_size": list(patch_size),
           "audio_frame_samples": audio_frame_samples, "timestep_freq_dim": timestep_freq_dim, "half": half,
           "residual_fp32": residual_fp32}
    return _disk_cached(key, lambda: _measure_now(dim, num_heads, mlp_ratio, qk_norm, patch_size, audio_frame_samples,
                                                  timestep_freq_dim, half=half, residual_fp32=residual_fp32),
                        _parse_saved)


def _parse_saved(value: dict) -> SavedBytes | None:
    figures = {name: float(value[name]) for name in ("per_layer", "block_input", "outside")}
    ok = all(math.isfinite(number) and number >= 0 for number in figures.values()) and figures["per_layer"] > 0
    return SavedBytes(**figures) if ok else None


# The measured bytes per token are a function of the model's shape and of the code that builds and runs
# it: these files and torch's version. A launch measured the same shape on the same code before reads
# the figure from disk (a launch's largest avoidable start-up cost; docs/status.md). The cache lives in
# TRAINYARD_MEMORY_CACHE (default <Trainyard home>/cache/memory; "off" measures every time).
_MEASURED_CODE = ("trainer/models/video.py", "trainer/launch/memory.py", "trainer/launch/config_sections.py")
MEMORY_CACHE_VARIABLE = "TRAINYARD_MEMORY_CACHE"


@functools.cache
def measured_code_version() -> str:
    """Digest of the files whose code shapes the saved tensors, and torch's version (no import closure: a
    closure digest costs as much as the measurement it would save)."""
    import hashlib
    from importlib.metadata import version

    from ops.publish.paths import REPO_ROOT

    digest = hashlib.sha256(version("torch").encode())  # not torch.__version__: that imports torch
    for name in _MEASURED_CODE:
        digest.update(name.encode() + b"\0" + (REPO_ROOT / name).read_bytes())
    return digest.hexdigest()[:20]


def _cache_path(key: dict) -> Path | None:
    import hashlib
    import os

    from ops.publish import paths

    location = os.environ.get(MEMORY_CACHE_VARIABLE) or str(paths.trainyard_home() / "cache" / "memory")
    if location == "off":
        return None
    name = hashlib.sha256(json.dumps({**key, "code": measured_code_version()}, sort_keys=True).encode()).hexdigest()
    return Path(location) / f"{name[:32]}.json"


def _disk_cached(key: dict, compute: Callable[[], T], parse: Callable[[dict], T | None]) -> T:
    """``compute()``, or the value a cache file holds for exactly this key and code version. A file that
    holds another key or code, does not parse or fails ``parse``'s checks (negative or non-finite
    figures) is computed again and rewritten; a disk that cannot be written only costs the next launch."""
    key = json.loads(json.dumps(key, default=str))  # as the file holds it (tuples become lists)
    path = _cache_path(key)
    if path is not None:
        try:
            record = json.loads(path.read_text())
            if record.get("key") == key and record.get("code") == measured_code_version():
                value = parse(record["value"])
                if value is not None:
                    return value
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            pass  # absent or unusable: computed again
    value = compute()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {"key": key, "code": measured_code_version(), "value": asdict(value)})
        except OSError:
            pass
    return value


def _measure_now(dim: int, num_heads: int, mlp_ratio: float, qk_norm: bool, patch_size: tuple[int, int, int],
                 audio_frame_samples: int, timestep_freq_dim: int, *, half: bool, residual_fp32: bool) -> SavedBytes:
    import torch

    from trainer.models.video import DiTBlock, VideoFlowModel

    config = ModelConfig(dim=dim, num_layers=1, num_heads=num_heads, mlp_ratio=mlp_ratio, qk_norm=qk_norm,
                         patch_frames=patch_size[0], patch_height=patch_size[1], patch_width=patch_size[2],
                         audio_frame_samples=audio_frame_samples, timestep_freq_dim=timestep_freq_dim)
    stream_dtype = torch.bfloat16 if half and not residual_fp32 else torch.float32
    with torch.device("meta"):
        block = DiTBlock(config)
    block = block.to_empty(device="cpu")

    def run_block(num: int, block: DiTBlock = block) -> None:
        x = torch.zeros(1, num, dim, dtype=stream_dtype, requires_grad=True)
        modulation = torch.zeros(1, 6, dim, dtype=torch.bfloat16 if half else torch.float32, requires_grad=True)
        block(x, modulation)

    per_layer = _per_token(run_block, half=half)
    pt, ph, pw = patch_size
    with torch.device("meta"):
        one_block = VideoFlowModel(config, video_shape=(pt, ph, pw), residual_fp32=residual_fp32)
    one_block = one_block.to_empty(device="cpu")
    one_block.pos_embed = torch.zeros_like(one_block.pos_embed)  # a buffer: to_empty left it unset
    audio_samples = audio_frame_samples

    def run_model(num: int) -> None:
        video = torch.zeros(1, pt, ph * 4, pw * num // 4, 3, dtype=torch.uint8)  # num tokens: grid (1, 4, num/4)
        noise = torch.zeros(video.shape)
        one_block(video, torch.zeros(1, audio_samples), torch.ones(1, dtype=torch.bool), noise, torch.full((1,), 0.5))

    whole = _per_token(run_model, half=half)
    return SavedBytes(per_layer=per_layer, block_input=dim * stream_dtype.itemsize, outside=max(0.0, whole - per_layer))


def _per_token(run, *, half: bool) -> float:
    """(saved bytes at the second token count - at the first) / token difference."""
    first, second = (_saved_bytes(run, num, half=half) for num in _MEASURE_TOKENS)
    return (second - first) / (_MEASURE_TOKENS[1] - _MEASURE_TOKENS[0])


def _saved_bytes(run, num: int, *, half: bool) -> int:
    """Bytes of every distinct storage autograd saves for backward while ``run(num)`` goes forward."""
    import torch

    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
            run(num)
    return sum(storages.values())


def estimate_memory_bytes(config: ExperimentConfig, world_size: int, *, device_type: str = "cpu") -> int:
    """Estimated peak bytes per rank (`estimate_memory(...).total_bytes`)."""
    return estimate_memory(config, world_size, device_type=device_type).total_bytes


def check_memory_budget(config: ExperimentConfig, world_size: int, *, device_type: str = "cpu",
                        device_memory_bytes: int | None = None) -> MemoryEstimate:
    """The estimate, or MemoryBudgetExceeded naming the numbers when it is over budget.

    The budget is train.max_memory_bytes; when that is unset, the device's memory
    (device_memory_bytes: a CUDA device's total, None on CPU, where nothing is checked).
    """
    estimate = estimate_memory(config, world_size, device_type=device_type)
    budget = config.train.max_memory_bytes
    source = "train.max_memory_bytes"
    if budget is None and device_memory_bytes is not None:
        budget, source = device_memory_bytes, f"the {device_type} device's memory"
    if budget is not None and estimate.total_bytes > budget:
        parts = {name.removesuffix("_bytes"): value for name, value in estimate.as_dict().items()
                 if name.endswith("_bytes") and name != "total_bytes"}
        largest = max(parts, key=parts.get)
        shown = ", ".join(f"{name} {_human(value)}" for name, value in parts.items())
        micro_batch = config.data.batch_size // (world_size * config.train.grad_accum)
        raise MemoryBudgetExceeded(
            f"estimated {_human(estimate.total_bytes)} per rank exceeds {source} "
            f"{_human(budget)}, {largest} dominating ({shown}; micro-batch {micro_batch}, world_size "
            f"{world_size}, {config.train.parallelism}, {config.train.precision})",
            _memory_fix(config, largest, micro_batch),
            key="train.max_memory_bytes" if config.train.max_memory_bytes is not None else "train.device")
    return estimate


def _memory_fix(config: ExperimentConfig, largest: str, micro_batch: int) -> str:
    """What shrinks the term that dominates the estimate."""
    train = config.train
    if largest == "activations":
        steps = [f"halve the micro-batch ({micro_batch}): train.grad_accum={train.grad_accum * 2} or a smaller "
                 "data.batch_size"] if micro_batch > 1 else ["use fewer tokens a clip (data.clip_frames/height/width)"]
        if not train.activation_checkpointing:
            steps.append("set train.activation_checkpointing=true")
        return ", or ".join(steps)
    if train.parallelism != "fsdp":
        return (f"set train.parallelism=fsdp to shard the {largest} over the ranks (and run on more of them), "
                "or use a smaller model")
    return f"run on more ranks (fsdp shards the {largest}), or use a smaller model"


def _human(num_bytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"
