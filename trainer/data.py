"""Batch sources for the trainer: the contract, its config, `SyntheticClips` for tests and
`ShardClips` (the shard loader, ops/loader.ClipLoader).

The batch contract
------------------
`next_batch()` returns this rank's part of the next global step:

    {"video": uint8 [b, T, H, W, 3], "audio": float32 [b, A] (mono PCM, zeros when silent),
     "has_audio": bool [b], "keys": list[str] (stable sample ids; the noise is keyed by them),
     "bucket": str (the clip shape "TxHxW")}

with b = data.batch_size / world_size at most (the trainer splits it into grad_accum
micro-batches). The shard loader may return fewer (a sample that failed to decode is listed in
"failed") or none (an epoch's uneven last step without drop_last); the trainer weights the loss
by the global sample count of the step.
`state_dict()` describes the position after the batches already returned (so a checkpoint
taken after step s resumes at step s + 1; a prefetching loader must not count what it has
prefetched), and `load_state_dict()` restores it, under any world size.

Sample order (ops/loading/sampling.py, the scheme the shard loader uses)
---------------------------------------------------------------
Global step s covers the global positions consumed .. consumed + W*b - 1 of the epoch order
`epoch_order(num_samples, seed, epoch)`, and rank r takes the interleaved positions consumed + r,
consumed + r + W, ... (local position j -> global position consumed + j*W + r). The union of the
ranks' batches is the same set of samples for every world size, so the global batch, and with
per-sample noise the loss, does not depend on W. The tail of an epoch that does not fill a
whole global step is dropped when drop_last is set (the default) and counted in the sampler state.

Bucketed data (data.buckets: several clip shapes)
-------------------------------------------------
(T, H, W) of a batch is then one bucket's and changes from step to step: every global step holds
samples of one bucket (ops.loading.sampling's bucketed layout, which the shard loader's 'bucketed'
batching follows), so a batch needs no padding and every rank of a step has the same shape.
The layout depends on the global batch but not on the world size, so a run resumes on any number
of ranks with the same data.batch_size. (clip_frames, height, width) stays the model's reference
shape, and audio_samples the audio of a reference clip: a bucket of T frames carries
audio_samples * T / clip_frames samples (all buckets share one audio rate).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from ops.clips.plan import bucket_name
from ops.loading.sampling import BATCHING, SampleOrder, SamplerState, Step, World
from trainer.launch.config_sections import DataConfig, check_matches_index

SYNTHETIC_VERSION = "synthetic-v1"  # bump when the generated content changes


class BatchSource(Protocol):
    """What the trainer needs from a data source (see the module docstring)."""

    def next_batch(self) -> dict[str, Any]: ...
    def describe(self) -> dict[str, Any]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def synthetic_clip(*, seed: int, index: int, video_shape: tuple[int, int, int],
                   audio_samples: int) -> tuple[np.ndarray, np.ndarray, bool]:
    """One generated clip: a square moving over a flat background, and a tone (or silence).

    A function of (seed, index) only, so a sample is the same clip in every epoch and on
    every rank. Every fourth index is silent, so has_audio masking is exercised.
    """
    frames, height, width = video_shape
    rng = np.random.default_rng([seed, index])
    background, color = rng.integers(0, 256, size=(2, 3), dtype=np.uint8)
    y0, x0 = rng.integers(0, height), rng.integers(0, width)
    vy, vx = rng.integers(-2, 3, size=2)
    side = max(2, min(height, width) // 4)
    yy, xx = np.ogrid[:height, :width]
    video = np.broadcast_to(background, (frames, height, width, 3)).copy()
    for frame in range(frames):
        inside = ((yy - y0 - vy * frame) % height < side) & ((xx - x0 - vx * frame) % width < side)
        video[frame][inside] = color
    has_audio = index % 4 != 0
    audio = np.zeros(audio_samples, dtype=np.float32)
    if has_audio and audio_samples:
        cycles = rng.uniform(2.0, 16.0)
        audio = (0.5 * np.sin(2 * np.pi * cycles * np.arange(audio_samples) / audio_samples)
                 ).astype(np.float32)
    return video, audio, has_audio


class SyntheticClips:
    """Deterministic generated clips in the loader's global sample order (module docstring).

    With bucketed batching sample i belongs to bucket i % len(buckets) and is generated at that
    bucket's shape. The sample order is ops.loading.sampling's, with the shard loader's batching policies;
    drop_last is always on, so every step is a full global batch (of one bucket when bucketed).
    """

    def __init__(self, config: DataConfig, *, world: World, local_batch_size: int, pin_memory: bool = False) -> None:
        if world.global_batch(local_batch_size) != config.batch_size:
            raise ValueError(f"{world.world_size} ranks x {local_batch_size} samples != global "
                             f"batch {config.batch_size}")
        self.config = config
        self.world = world
        self.local_batch_size = local_batch_size
        self.pin_memory = pin_memory
        self.shapes = config.video_shapes
        dataset_version = SYNTHETIC_VERSION
        if config.buckets:  # a sample's shape, and so its content, depends on the bucket list
            dataset_version += "/" + ",".join(bucket_name(*shape) for shape in self.shapes)
        schedule = BATCHING[config.resolved_batching](
            bucket_ids=self._bucket_ids(), num_buckets=len(self.shapes), global_batch=config.batch_size,
            shuffle=config.shuffle, drop_last=True)
        self.order = SampleOrder(schedule, SamplerState(seed=config.seed, num_samples=config.num_samples,
                                                        dataset_version=dataset_version))
        self._steps: Iterator[Step] | None = None

    def _bucket_ids(self) -> np.ndarray:
        return np.arange(self.config.num_samples) % len(self.shapes)

    @property
    def state(self) -> SamplerState:
        return self.order.state

    def next_indices(self) -> list[int]:
        """Global sample indices of this rank's next batch; advances the state by one step."""
        return self._next_step()[0]

    def _next_step(self) -> tuple[list[int], tuple[int, int, int]]:
        """This rank's sample indices of the next global step and their clip shape; advances the state."""
        if self._steps is None:  # started lazily, so load_state_dict can come first
            self._steps = self.order.steps()
        step = next(self._steps)
        self.order.take(step)
        return step.indices(self.world), self.shapes[step.bucket]

    def next_batch(self) -> dict[str, Any]:
        indices, shape = self._next_step()
        clips = [synthetic_clip(seed=self.config.seed, index=index, video_shape=shape,
                                audio_samples=self.config.audio_samples_for(shape))
                 for index in indices]
        videos, audios, has_audio = zip(*clips, strict=True)
        tensors = {"video": torch.from_numpy(np.stack(videos)), "audio": torch.from_numpy(np.stack(audios)),
                   "has_audio": torch.tensor(has_audio, dtype=torch.bool)}
        if self.pin_memory:
            tensors = {name: tensor.pin_memory() for name, tensor in tensors.items()}
        return {**tensors, "keys": [f"synthetic-{index:09d}" for index in indices], "bucket": bucket_name(*shape)}

    def describe(self) -> dict[str, Any]:
        """Batching policy, global batch and samples per bucket, as the shard loader reports them."""
        names = [bucket_name(*shape) for shape in self.shapes]
        counts = np.bincount(self._bucket_ids(), minlength=len(names))
        return {"source": "synthetic", **self.order.describe(),
                "bucket_counts": dict(zip(names, counts.tolist(), strict=True)),
                "bucket_shapes": {name: list(shape) for name, shape in zip(names, self.shapes, strict=True)}}

    def state_dict(self) -> dict[str, Any]:
        """``{"sampler": ..., "batching": ...}`` (ops.loading.sampling.SampleOrder), as the shard loader nests it."""
        return self.order.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume, also from the flat state of earlier checkpoints (ops.loading.sampling.nested_state)."""
        self.order.load_state_dict(state)
        self._steps = None  # the next batch walks from the restored state


class ShardClips:
    """The shard loader (ops.loading.loader.ClipLoader) as a BatchSource.

    Batches are full except where a sample failed to decode (it is reported in batch["failed"]
    and the batch shrinks), or, without drop_last, in an epoch's uneven last step (a rank may
    get an empty batch); the loop weights the loss by the global sample count of each step.
    """

    def __init__(self, config: DataConfig, *, world: World, local_batch_size: int, pin_memory: bool = False) -> None:
        from ops.loading.loader import ClipLoader, LoaderConfig
        from ops.clips.shard_cache import read_any_index

        index = read_any_index(config.shard_index)  # a folder, or s3://... through the local shard cache
        check_matches_index(config, index)
        loader_config = LoaderConfig(batch_size=local_batch_size, split=config.split, num_workers=config.num_workers,
                                     seed=config.seed, shuffle=config.shuffle, drop_last=config.drop_last,
                                     batching=config.batching, pin_memory=pin_memory)
        self.loader = ClipLoader(index, loader_config, rank=world.rank, world_size=world.world_size)
        self._batches: Any = None

    def describe(self) -> dict[str, Any]:
        """The loader's resolved batching policy, global batch and bucket counts (ClipLoader.describe)."""
        return {"source": "shards", "shard_index_version": self.loader.index.version, **self.loader.describe()}

    def next_batch(self) -> dict[str, Any]:
        if self._batches is None:  # started lazily, so load_state_dict can come first
            self._batches = iter(self.loader)
        return next(self._batches)

    @property
    def failures(self) -> list[dict]:
        return self.loader.failures

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._batches is not None:
            raise RuntimeError("load_state_dict after the first batch would fork the sample order")
        self.loader.load_state_dict(state)


def build_data_source(config: DataConfig, *, world: World, local_batch_size: int,
                      pin_memory: bool = False) -> BatchSource:
    """The configured source for one rank; pin_memory: hand batches over page-locked (for CUDA)."""
    source = SyntheticClips if config.source == "synthetic" else ShardClips
    return source(config, world=world, local_batch_size=local_batch_size, pin_memory=pin_memory)
