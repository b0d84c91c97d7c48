"""Batch sources for the trainer: the contract, its config, `SyntheticClips` for tests and
`ShardClips` (the shard loader, ops/loader.ClipLoader).

The batch contract
------------------
`next_batch()` returns this rank's part of the next global step:

    {"video": uint8 [b, T, H, W, 3], "audio": float32 [b, A] (mono PCM, zeros when silent),
     "has_audio": bool [b], "keys": list[str] (stable sample ids; the noise is keyed by them)}

with b = data.batch_size / world_size at most (the trainer splits it into grad_accum
micro-batches). The shard loader may return fewer (a sample that failed to decode is listed in
"failed") or none (an epoch's uneven last step without drop_last); the trainer weights the loss
by the global sample count of the step.
`state_dict()` describes the position after the batches already returned (so a checkpoint
taken after step s resumes at step s + 1; a prefetching loader must not count what it has
prefetched), and `load_state_dict()` restores it, under any world size.

Sample order (ops/sampling.py, the scheme the shard loader uses)
---------------------------------------------------------------
Global step s covers the global positions consumed .. consumed + W*b - 1 of the epoch order
`epoch_order(num_samples, seed, epoch)`, and rank r takes the interleaved positions consumed + r,
consumed + r + W, ... (local position j -> global position consumed + j*W + r). The union of the
ranks' batches is the same set of samples for every world size, so the global batch, and with
per-sample noise the loss, does not depend on W. The tail of an epoch that does not fill a
whole global step is dropped when drop_last is set (the default) and counted in the sampler state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from ops.sampling import (
    SamplerState,
    World,
    advance_step,
    epoch_order,
    finish_epoch,
    plan_epoch,
)

SOURCES = ("synthetic", "shards")
ENCODINGS = ("any", "compressed", "decoded")
SYNTHETIC_VERSION = "synthetic-v1"  # bump when the generated content changes


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
    audio_samples: int = 0
    """Mono PCM samples per clip (A); 0: batches carry an empty audio tensor."""
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
            raise ValueError("source 'shards' needs shard_index and manifest_version")
        if self.source == "synthetic" and self.num_samples < self.batch_size:
            raise ValueError(f"num_samples {self.num_samples} is smaller than one global batch "
                             f"({self.batch_size}): no step would ever be full")

    @property
    def video_shape(self) -> tuple[int, int, int]:
        return (self.clip_frames, self.height, self.width)


class BatchSource(Protocol):
    """What the trainer needs from a data source (see the module docstring)."""

    def next_batch(self) -> dict[str, Any]: ...
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
    """Deterministic generated clips in the loader's global sample order (module docstring)."""

    def __init__(self, config: DataConfig, *, world: World, local_batch_size: int) -> None:
        if world.world_size * local_batch_size != config.batch_size:
            raise ValueError(f"{world.world_size} ranks x {local_batch_size} samples != global "
                             f"batch {config.batch_size}")
        self.config = config
        self.world = world
        self.local_batch_size = local_batch_size
        self.state = SamplerState(seed=config.seed, num_samples=config.num_samples,
                                  dataset_version=SYNTHETIC_VERSION)
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def _plan_kwargs(self) -> dict[str, Any]:
        return dict(world_size=self.world.world_size, batch_size=self.local_batch_size, drop_last=True)

    def next_indices(self) -> list[int]:
        """Global sample indices of this rank's next batch; advances the state by one step."""
        if plan_epoch(self.state, **self._plan_kwargs()).num_global_steps == 0:
            self.state = finish_epoch(self.state, **self._plan_kwargs())
        if self._order_epoch != self.state.epoch:
            self._order = epoch_order(self.config.num_samples, self.config.seed, self.state.epoch,
                                      shuffle=self.config.shuffle)
            self._order_epoch = self.state.epoch
        start = self.state.consumed
        positions = self.world.rank_positions(
            start=start, end=start + self.world.world_size * self.local_batch_size)
        self.state = advance_step(self.state, **self._plan_kwargs())
        return self._order[np.asarray(positions)].tolist()

    def next_batch(self) -> dict[str, Any]:
        indices = self.next_indices()
        clips = [synthetic_clip(seed=self.config.seed, index=index,
                                video_shape=self.config.video_shape,
                                audio_samples=self.config.audio_samples)
                 for index in indices]
        videos, audios, has_audio = zip(*clips, strict=True)
        return {
            "video": torch.from_numpy(np.stack(videos)),
            "audio": torch.from_numpy(np.stack(audios)),
            "has_audio": torch.tensor(has_audio, dtype=torch.bool),
            "keys": [f"synthetic-{index:09d}" for index in indices],
        }

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state = SamplerState.from_state_dict(
            state, expected_dataset_version=SYNTHETIC_VERSION,
            expected_num_samples=self.config.num_samples)


class ShardClips:
    """The shard loader (ops.loader.ClipLoader) as a BatchSource.

    Batches are full except where a sample failed to decode (it is reported in batch["failed"]
    and the batch shrinks), or, without drop_last, in an epoch's uneven last step (a rank may
    get an empty batch); the loop weights the loss by the global sample count of each step.
    """

    def __init__(self, config: DataConfig, *, world: World, local_batch_size: int) -> None:
        from ops.loader import ClipLoader, LoaderConfig
        from ops.shards import read_index

        index = read_index(config.shard_index)
        _check_matches_index(config, index)
        loader_config = LoaderConfig(batch_size=local_batch_size, split=config.split, num_workers=config.num_workers,
                                     seed=config.seed, shuffle=config.shuffle, drop_last=config.drop_last)
        self.loader = ClipLoader(index, loader_config, rank=world.rank, world_size=world.world_size)
        self._batches: Any = None

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


def _check_matches_index(config: DataConfig, index) -> None:
    """Refuse a config whose manifest, clip shape or encoding differ from the shard index."""
    shape = index.config.shape
    problems = []
    if config.manifest_version != index.manifest_version:
        problems.append(f"manifest_version {config.manifest_version!r} != index {index.manifest_version!r}")
    if (config.clip_frames, config.height, config.width) != (shape.num_frames, shape.height, shape.width):
        problems.append(f"clip shape {config.video_shape} != index {(shape.num_frames, shape.height, shape.width)}")
    if config.audio_samples not in (0, shape.num_audio_samples):
        problems.append(f"audio_samples {config.audio_samples} != index {shape.num_audio_samples}")
    if config.encoding not in ("any", index.config.encoding):
        problems.append(f"encoding {config.encoding!r} != index {index.config.encoding!r}")
    if problems:
        raise ValueError(f"data config does not match shard index {index.version} at {index.directory}: "
                         + "; ".join(problems))


def build_data_source(config: DataConfig, *, world: World, local_batch_size: int) -> BatchSource:
    if config.source == "synthetic":
        return SyntheticClips(config, world=world, local_batch_size=local_batch_size)
    return ShardClips(config, world=world, local_batch_size=local_batch_size)
