"""The training data loader: shard samples in the deterministic, resumable order of ops.sampling.

``ClipLoader`` yields one batch per global step, forever (epochs roll over), for one rank:

    loader = ClipLoader(read_index(shard_dir), LoaderConfig(batch_size=4), rank=r, world_size=w)
    for step, batch in zip(range(num_steps), loader):   # batch["video"]: uint8 [b, T, H, W, 3]
        ...
    saved = loader.state_dict()                          # position after the last yielded batch

Batches are formed inside the DataLoader workers (``batch_size=None`` on the DataLoader):
worker k owns whole local batches k, k+K, ... (ops.sampling's contract), so a sample that
fails to decode shrinks its own batch instead of shifting every later batch boundary. A failed
sample is reported in ``batch["failed"]`` with its key, index and reason, logged once, and
kept in ``loader.failures``; decoding is deterministic, so a restart takes the same decision.

Batching policy (``LoaderConfig.batching``, recorded in ``describe()`` and the state):
- ``fixed_shape``: the shards hold one clip shape; global steps are equal runs of the epoch
  order (ops.sampling's uniform contract), and a resume may change the global batch.
- ``bucketed``: the shards hold several clip shapes (buckets of duration and aspect ratio,
  ops.clips); every global step holds one bucket (ops.sampling's bucketed layout), so a batch is
  one shape and needs no padding. A bucket's remainder that does not fill a global batch is
  dropped and counted with drop_last, or becomes one short step (shuffled in with the others) without
  it. The layout depends on the global batch, so a resume must keep it (any world size).
``auto`` (the default) is ``bucketed`` when the index has more than one bucket.
"""

from __future__ import annotations

import logging
import tarfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.utils.data

from ops import media_io, sampling, shards
from ops.shards import ShardIndex

LOGGER = logging.getLogger(__name__)
BATCHING_POLICIES = ("auto", "fixed_shape", "bucketed")


class EmptySplitError(ValueError):
    """The requested split has no samples in the shard index."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LoaderConfig:
    batch_size: int
    """Samples per rank per step."""
    split: str = "train"
    num_workers: int = 2
    """DataLoader worker processes (0 decodes in the training process)."""
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    """Drop the end of an epoch that does not fill a whole global batch (counted in the state)."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead: bounds loader memory to num_workers * prefetch_factor batches."""
    pin_memory: bool = False
    verify_shards: bool = True
    """Re-hash the split's shards and check their samples against the index before the first batch.
    The index files are not hashed again: the loader reads only the table read_index checked."""
    decode_threads: int = 1
    """FFmpeg threads per decode; processes already use every core (see docs/data.md)."""
    batching: str = "auto"
    """'fixed_shape', 'bucketed' (one clip shape per global step) or 'auto' (module docstring)."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.num_workers < 0 or self.prefetch_factor < 1 or self.decode_threads < 1:
            raise ValueError(f"invalid loader config {self}")
        if self.batching not in BATCHING_POLICIES:
            raise ValueError(f"batching must be one of {BATCHING_POLICIES}, got {self.batching!r}")


class _ShardBatches(torch.utils.data.IterableDataset):
    """Runs in each DataLoader worker: one batch per owned global step, across epochs, forever.

    Worker k of K builds steps n = k, k + K, ... counted from the loader's start state
    (``sampling.global_steps``, or the bucketed schedule's steps); the DataLoader returns them
    in step order. Workers persist
    across epochs, so an epoch boundary costs nothing. A rank with no sample in an uneven
    last step gets an empty batch, so every rank sees the same number of steps.
    """

    def __init__(self, *, index: ShardIndex, rows: dict, state: sampling.SamplerState, world: sampling.World,
                 config: LoaderConfig, schedule: sampling.BucketedSchedule | None):
        super().__init__()
        self.directory = index.directory
        self.shapes = list(index.bucket_shapes.items())  # bucket id -> (name, shape)
        self.rows, self.state, self.world, self.config = rows, state, world, config
        self.schedule = schedule

    def __iter__(self) -> Iterator[dict]:
        me = sampling.World.from_worker_info(rank=self.world.rank, world_size=self.world.world_size)
        handles: dict[str, object] = {}
        try:
            for number, (indices, bucket) in enumerate(self._steps(me)):
                if number % me.num_workers == me.worker_id:
                    yield self._batch(indices(), bucket, handles)
        finally:
            for handle in handles.values():
                handle.close()

    def _steps(self, me: sampling.World) -> Iterator[tuple]:
        """(callable giving this rank's sample indices of the step, bucket id), one per global step.

        The indices are a callable so that a worker computes only its own steps' positions.
        """
        if self.schedule is not None:
            for layout, step in self.schedule.steps(self.state):
                yield (lambda layout=layout, step=step: layout.step_indices(step, me).tolist()), \
                    int(layout.step_bucket[step])
            return
        order_epoch, order = None, None
        for epoch, plan, step in sampling.global_steps(self.state, world_size=me.world_size,
                                                       batch_size=self.config.batch_size,
                                                       drop_last=self.config.drop_last):
            def indices(epoch=epoch, plan=plan, step=step) -> list[int]:
                nonlocal order_epoch, order
                if epoch != order_epoch:
                    order_epoch = epoch
                    order = sampling.epoch_order(self.state.num_samples, self.state.seed, epoch,
                                                 shuffle=self.config.shuffle)
                positions = me.step_positions(plan, step=step)
                return order[positions.start:positions.stop:positions.step].tolist()
            yield indices, 0

    def _sample(self, index: int, shape: media_io.ClipShape, handles: dict, out: np.ndarray):
        shard = self.rows["shard"][index]
        if shard not in handles:
            handles[shard] = open(self.directory / f"{shard}.tar", "rb")
        members = shards.read_members(handles[shard], self.rows["offset"][index], self.rows["length"][index])
        return shards.decode_members(members, shape, thread_count=self.config.decode_threads, out=out)

    def _batch(self, chunk: list[int], bucket: int, handles: dict) -> dict:
        """Decode ``chunk`` into one batch; failed samples are reported and leave no gap.

        In a worker the batch tensors are allocated in shared memory up front and compressed
        clips decode straight into them: the DataLoader then passes them to the training
        process without the copy it would otherwise make into shared memory (measured ~8% of
        a small-clip batch), and without a np.stack copy.
        """
        name, shape = self.shapes[bucket]
        video, audio = _batch_tensors(shape, len(chunk), shared=torch.utils.data.get_worker_info() is not None)
        video_np, audio_np = video.numpy(), audio.numpy()
        has_audio, keys, kept, failed = [], [], [], []
        for index in chunk:
            slot = len(kept)
            try:
                frames, pcm, meta = self._sample(index, shape, handles, video_np[slot])
            except (media_io.ClipDecodeError, tarfile.TarError, OSError) as error:
                failed.append({"sample_key": self.rows["sample_key"][index], "index": index,
                               "reason": f"{type(error).__name__}: {error}"})
                continue
            if not np.may_share_memory(frames, video_np):  # decoded encoding: np.load made its own array
                video_np[slot] = frames
            audio_np[slot] = pcm
            has_audio.append(bool(meta["has_audio"]))
            keys.append(self.rows["sample_key"][index])
            kept.append(index)
        # has_audio stays a list here: a tensor would be one more shared-memory segment per batch.
        return {"video": video[:len(kept)], "audio": audio[:len(kept)], "has_audio": has_audio,
                "keys": keys, "indices": kept, "failed": failed, "bucket": name}


def _batch_tensors(shape: media_io.ClipShape, size: int, *, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Video [size,T,H,W,3] uint8 and audio [size,A] float32 as views of ONE buffer.

    In a worker the buffer is allocated in shared memory: the DataLoader then hands the batch
    over as a single shared segment instead of one per tensor; the transfer of segments
    (shared-memory file plus a file descriptor passed between processes) measured as the
    largest cost of the loader beyond decoding.
    """
    video_bytes = size * shape.num_frames * shape.height * shape.width * 3
    offset = -(-video_bytes // 64) * 64  # float32 audio starts 64-byte aligned
    buffer = torch.empty(offset + size * shape.num_audio_samples * 4, dtype=torch.uint8)
    if shared:
        buffer.share_memory_()
    video = buffer[:video_bytes].view(size, shape.num_frames, shape.height, shape.width, 3)
    audio = buffer[offset:].view(torch.float32).view(size, shape.num_audio_samples)
    return video, audio


class ClipLoader:
    """One rank's resumable stream of batches over one split of a shard index."""

    def __init__(self, index: ShardIndex, config: LoaderConfig, *, rank: int = 0, world_size: int = 1):
        self.index, self.config = index, config
        self.world = sampling.World(rank=rank, world_size=world_size)
        table = index.split(config.split)
        if table.num_rows == 0:
            raise EmptySplitError(f"split {config.split!r} has no samples in shard index {index.version} "
                                  f"({index.directory}); splits present: {sorted(set(index.table.column('split').to_pylist()))}")
        global_batch = config.batch_size * world_size
        if config.drop_last and table.num_rows < global_batch:
            raise ValueError(f"split {config.split!r} has {table.num_rows} samples, fewer than one global batch "
                             f"({world_size} ranks x {config.batch_size}); with drop_last no step could run")
        self.rows = {name: table.column(name).to_pylist()
                     for name in ("sample_key", "shard", "offset", "length", "bucket")}
        names = list(index.bucket_shapes)
        self.batching = config.batching
        if self.batching == "auto":
            self.batching = "bucketed" if len(names) > 1 else "fixed_shape"
        if self.batching == "fixed_shape" and len(names) > 1:
            raise ValueError(f"shard index {index.version} holds {len(names)} clip shapes {names}: batching "
                             "'fixed_shape' would mix shapes in a batch; use 'bucketed' (or 'auto')")
        unknown = sorted(set(self.rows["bucket"]) - set(names))
        if unknown:
            raise ValueError(f"shard index {index.version} lists samples in buckets {unknown} that its config "
                             f"does not define ({names})")
        ids = {name: number for number, name in enumerate(names)}
        bucket_ids = np.fromiter((ids[name] for name in self.rows["bucket"]), dtype=np.int64,
                                 count=len(self.rows["bucket"]))
        self.bucket_counts = dict(zip(names, np.bincount(bucket_ids, minlength=len(names)).tolist(), strict=True))
        self.schedule = None
        if self.batching == "bucketed":
            self.schedule = sampling.BucketedSchedule(bucket_ids=bucket_ids, num_buckets=len(names),
                                                      global_batch=global_batch, shuffle=config.shuffle,
                                                      drop_last=config.drop_last)
            for name, count in self.bucket_counts.items():
                if 0 < count < global_batch:
                    LOGGER.warning("bucket %s of split %r has %d samples, fewer than a global batch of %d: %s",
                                   name, config.split, count, global_batch,
                                   "dropped every epoch (drop_last)" if config.drop_last
                                   else "one short step per epoch")
        if config.verify_shards:
            index.verify(sorted(set(self.rows["shard"])), index_files=False)
        self.state = sampling.SamplerState(seed=config.seed, num_samples=table.num_rows,
                                           dataset_version=self.dataset_version)
        self.failures: list[dict] = []

    @property
    def global_batch(self) -> int:
        return self.config.batch_size * self.world.world_size

    def describe(self) -> dict:
        """The loader's config with the batching policy resolved, for run configs and metadata."""
        described = {**asdict(self.config), "batching": self.batching, "global_batch": self.global_batch,
                     "bucket_counts": self.bucket_counts}
        if self.schedule is not None:
            described["bucket_shapes"] = {name: [shape.num_frames, shape.height, shape.width]
                                          for name, shape in self.index.bucket_shapes.items()}
        return described

    @property
    def dataset_version(self) -> str:
        return f"{self.index.version}/{self.config.split}"

    @property
    def num_samples(self) -> int:
        return self.state.num_samples

    def __iter__(self) -> Iterator[dict]:
        """Batches from the current state on, one per global step, forever (epochs roll over)."""
        config = self.config
        if self.schedule is None and sampling.plan_epoch(
                self.state, world_size=self.world.world_size, batch_size=config.batch_size,
                drop_last=config.drop_last).num_global_steps == 0:
            # Resumed onto a larger world with drop_last: nothing of this epoch fits a step.
            self.state = sampling.finish_epoch(self.state, world_size=self.world.world_size,
                                               batch_size=config.batch_size, drop_last=config.drop_last)
        dataset = _ShardBatches(index=self.index, rows=self.rows, state=self.state, world=self.world, config=config,
                                schedule=self.schedule)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=config.num_workers, pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor if config.num_workers else None, in_order=True)
        steps = self.schedule.steps(self.state) if self.schedule is not None else None
        for batch in loader:
            batch["has_audio"] = torch.tensor(batch["has_audio"], dtype=torch.bool)
            self._record(batch["failed"])
            if steps is not None:
                layout, step = next(steps)
                self.state = sampling.BucketedSchedule.advance(self.state, layout, step)
            else:
                self.state = sampling.advance_step(self.state, world_size=self.world.world_size,
                                                   batch_size=config.batch_size, drop_last=config.drop_last)
            yield batch

    def _record(self, failed: list[dict]) -> None:
        for failure in failed:
            LOGGER.warning("skipped sample %s (index %d): %s", failure["sample_key"], failure["index"], failure["reason"])
        self.failures.extend(failed)

    def state_dict(self) -> dict:
        # Identical on every rank (checkpoints check that): no per-rank counts such as failures here.
        return {"sampler": self.state.state_dict(), "manifest_version": self.index.manifest_version,
                "shard_index_version": self.index.version, "split": self.config.split,
                "batching": self._batching_state()}

    def _batching_state(self) -> dict:
        """What the sample order depends on beyond the sampler state; a resume must match it.

        Both policies depend on shuffle. The bucketed layout also depends on the global batch and
        drop_last (whether each bucket's remainder is a step changes the shuffled step list).
        """
        if self.schedule is None:
            return {"policy": "fixed_shape", "shuffle": self.config.shuffle}
        return {"policy": "bucketed", "global_batch": self.global_batch, "shuffle": self.config.shuffle,
                "drop_last": self.config.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Resume; a state from another manifest, shard index or split is refused, never applied."""
        if state.get("manifest_version") != self.index.manifest_version:
            raise sampling.ResumeStateMismatch(
                f"loader state is from manifest version {state.get('manifest_version')!r}, but this loader reads "
                f"manifest version {self.index.manifest_version!r}: resuming would replay or skip different data")
        saved = state.get("batching")
        if saved != self._batching_state():
            raise sampling.ResumeStateMismatch(
                f"loader state was saved with batching {saved}, but this loader batches with "
                f"{self._batching_state()}: the sample order is a function of these (the bucketed layout of the "
                "global batch, ranks x per-rank batch), so resuming would replay or skip samples. Resume with the "
                "saved settings (any number of ranks and workers), or start the loader fresh"
                + (" (a state without batching was written before Trainyard recorded it)" if saved is None else ""))
        restored = sampling.SamplerState.from_state_dict(
            state["sampler"], expected_dataset_version=self.dataset_version, expected_num_samples=self.num_samples)
        if self.schedule is not None:
            self.schedule.check(restored)
        self.state = restored
