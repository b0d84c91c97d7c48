"""The training data loader: shard samples in the deterministic, resumable order of ops.loading.sampling.

``ClipLoader`` yields one batch per global step, forever (epochs roll over), for one rank:

    loader = ClipLoader(read_index(shard_dir), LoaderConfig(batch_size=4), rank=r, world_size=w)
    for step, batch in zip(range(num_steps), loader):   # batch["video"]: uint8 [b, T, H, W, 3]
        ...
    saved = loader.state_dict()                          # position after the last yielded batch

Batches are formed inside the DataLoader workers (``batch_size=None`` on the DataLoader):
worker k owns whole local batches k, k+K, ... (ops.loading.sampling's contract), so a sample that
fails to decode shrinks its own batch instead of shifting every later batch boundary. A failed
sample is reported in ``batch["failed"]`` with its key, index and reason, logged once, and
kept in ``loader.failures``; decoding is deterministic, so a restart takes the same decision.

Batching policy (``LoaderConfig.batching``, one of ops.loading.sampling's ``BATCHING``; recorded in
``describe()`` and the state):
- ``fixed_shape``: the shards hold one clip shape; global steps are equal runs of the epoch
  order (ops.loading.sampling's uniform contract), and a resume may change the global batch.
- ``bucketed``: the shards hold several clip shapes (buckets of duration and aspect ratio,
  ops.clips.plan); every global step holds one bucket (ops.loading.sampling's bucketed layout), so a batch is
  one shape and needs no padding. A bucket's remainder that does not fill a global batch is
  dropped and counted with drop_last, or becomes one short step (shuffled in with the others) without
  it. The layout depends on the global batch, so a resume must keep it (any world size).
``auto`` (the default) is ``bucketed`` when the index has more than one bucket
(``sampling.resolve_batching``). Either way the loader holds one ``sampling.SampleOrder`` and
walks its steps; it never asks which policy it has.

Batch memory (``_SlotLeases``): with workers, batches are written into shared-memory slots
that each worker allocates once and reuses. Fresh shared memory per batch measured as the
loader's largest loss on 16x256x256 clips (a quarter of the decode time went to the kernel
allocating and zeroing tmpfs pages, docs/status.md). A slot is reused only after the training
process holds no reference to it (no tensor, view or numpy array of the batch is alive), so a
batch the consumer keeps is never overwritten; a worker that finds no free slot allocates a
fresh batch instead of waiting.
"""

from __future__ import annotations

import logging
import tarfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.utils.data

from ops.media import codec
from ops.loading import sampling
from ops.clips import shards
from ops.clips.shards import ShardIndex

LOGGER = logging.getLogger(__name__)
BATCHING_POLICIES = sampling.BATCHING_POLICIES
MAX_CACHED_HANDLES = 4
"""Open shard handles per process when the tars are read through a shard cache (oldest closed first)."""


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
    """Batches each worker prepares ahead. Loader memory: num_workers * (prefetch_factor + 2) reused
    batch slots (each a full batch of the largest bucket), plus fresh batches while the consumer
    holds on to more than two."""
    pin_memory: bool = False
    verify_shards: bool = True
    """Re-hash the split's shards and check their samples against the index before the first batch.
    The index files are not hashed again: the loader reads only the table read_index checked."""
    decode_threads: int = 1
    """FFmpeg threads per decode; processes already use every core (see docs/data.md)."""
    batching: str = "auto"
    """'fixed_shape', 'bucketed' (one clip shape per global step) or 'auto' (module docstring)."""
    reuse_batch_memory: bool = True
    """Workers write batches into shared-memory slots they reuse once the training process holds
    no reference to them (module docstring); False: a fresh segment per batch, as before."""

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.num_workers < 0 or self.prefetch_factor < 1 or self.decode_threads < 1:
            raise ValueError(f"invalid loader config {self}")
        if self.batching not in BATCHING_POLICIES:
            raise ValueError(f"batching must be one of {BATCHING_POLICIES}, got {self.batching!r}")


class _ShardBatches(torch.utils.data.IterableDataset):
    """Runs in each DataLoader worker: one batch per owned global step, across epochs, forever.

    Worker k of K builds steps n = k, k + K, ... of the sample order from the loader's start
    state (ops.loading.sampling, contract point 4); the DataLoader returns them in step order. Workers
    persist across epochs, so an epoch boundary costs nothing. A rank with no sample in an
    uneven last step gets an empty batch, so every rank sees the same number of steps.
    """

    def __init__(self, *, index: ShardIndex, rows: dict, order: sampling.SampleOrder, world: sampling.World,
                 config: LoaderConfig, leases: _SlotLeases | None = None):
        super().__init__()
        self.index = index
        self.cache = index.cache  # tars in an object store, read through a local cache (ops.clips.shard_cache)
        self.shapes = list(index.bucket_shapes.items())  # bucket id -> (name, shape)
        self.rows, self.order, self.world, self.config = rows, order, world, config
        self.leases = leases
        self._slots: list[torch.Tensor] = []  # this worker's batch buffers (in a worker process)

    def __iter__(self) -> Iterator[dict]:
        me = sampling.World.from_worker_info(rank=self.world.rank, world_size=self.world.world_size)
        handles: dict[str, object] = {}
        try:
            for number, step in enumerate(self.order.steps()):
                if me.owns(number):  # only owned steps compute their indices (and their epoch's order)
                    yield self._batch(step.indices(me), step.bucket, handles)
        finally:
            for handle in handles.values():
                handle.close()

    def _sample(self, index: int, shape: codec.ClipShape, handles: dict, out: np.ndarray):
        shard = self.rows["shard"][index]
        if shard not in handles:
            handles[shard] = self._open(shard, handles)
        elif self.cache is not None:
            handles[shard] = handles.pop(shard)  # most recently used last
        members = shards.read_members(handles[shard], self.rows["offset"][index], self.rows["length"][index])
        return shards.decode_members(members, shape, thread_count=self.config.decode_threads, out=out)

    def _open(self, shard: str, handles: dict):
        # Through a cache: a few handles per process, so tars the cache evicts free their space.
        while self.cache is not None and len(handles) >= MAX_CACHED_HANDLES:
            handles.pop(next(iter(handles))).close()
        return self.index.open_shard(shard)

    def _batch(self, chunk: list[int], bucket: int, handles: dict) -> dict:
        """Decode ``chunk`` into one batch; failed samples are reported and leave no gap.

        In a worker the batch tensors are views of shared memory (a reused slot, or a fresh
        segment) and compressed clips decode straight into them: the DataLoader then passes them
        to the training process without the copy it would otherwise make into shared memory
        (measured ~8% of a small-clip batch), and without a np.stack copy.
        """
        name, shape = self.shapes[bucket]
        worker = torch.utils.data.get_worker_info()
        lease, buffer = (self._slot(worker.id, _batch_bytes(shape, len(chunk)))
                         if worker is not None and self.leases is not None else (-1, None))
        video, audio = _batch_tensors(shape, len(chunk), shared=worker is not None, buffer=buffer)
        video_np, audio_np = video.numpy(), audio.numpy()
        has_audio, keys, kept, failed = [], [], [], []
        for index in chunk:
            slot = len(kept)
            try:
                frames, pcm, meta = self._sample(index, shape, handles, video_np[slot])
            except (codec.ClipDecodeError, tarfile.TarError, OSError) as error:
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
                "keys": keys, "indices": kept, "failed": failed, "bucket": name,
                "slot": [worker.id if worker is not None else -1, lease]}

    def _slot(self, worker: int, needed: int) -> tuple[int, torch.Tensor | None]:
        """A free slot of this worker's (allocated on first use), or (-1, None) when all are held."""
        capacity = max(_batch_bytes(shape, self.config.batch_size) for _, shape in self.shapes)
        if needed > capacity:  # never for a rank's own steps; a fresh buffer rather than an overrun
            return -1, None
        for slot in range(self.leases.slots):
            if not self.leases.take(worker, slot):
                continue
            while len(self._slots) <= slot:
                self._slots.append(torch.empty(capacity, dtype=torch.uint8).share_memory_())
            return slot, self._slots[slot]
        return -1, None


def _batch_bytes(shape: codec.ClipShape, size: int) -> int:
    """Bytes of one batch buffer: video, then float32 audio from the next 64-byte boundary."""
    video_bytes = size * shape.num_frames * shape.height * shape.width * 3
    return -(-video_bytes // 64) * 64 + size * shape.num_audio_samples * 4


def _batch_tensors(shape: codec.ClipShape, size: int, *, shared: bool,
                   buffer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Video [size,T,H,W,3] uint8 and audio [size,A] float32 as views of ONE buffer (``buffer``,
    a reused slot, or a fresh one).

    In a worker the buffer is in shared memory: the DataLoader then hands the batch over as a
    single shared segment instead of one per tensor; the transfer of segments (shared-memory
    file plus a file descriptor passed between processes) measured as the largest cost of the
    loader beyond decoding, before slots were reused.
    """
    video_bytes = size * shape.num_frames * shape.height * shape.width * 3
    offset = -(-video_bytes // 64) * 64  # float32 audio starts 64-byte aligned
    needed = _batch_bytes(shape, size)
    if buffer is None:
        buffer = torch.empty(needed, dtype=torch.uint8)
        if shared:
            buffer.share_memory_()
    video = buffer[:video_bytes].view(size, shape.num_frames, shape.height, shape.width, 3)
    audio = buffer[offset:needed].view(torch.float32).view(size, shape.num_audio_samples)
    return video, audio


# How many tensors, views and storages share a storage (a private torch API: where a torch
# release lacks it, batches fall back to fresh memory rather than a guess).
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


class _SlotLeases:
    """Which batch slots of each worker the training process has let go of.

    One shared int32 per (worker, slot): 1 while a batch in it is in flight or still referenced
    by the training process, 0 when the worker may write it again. Workers only take (0 -> 1);
    the training process only releases (1 -> 0), once the slot's storage has no reference but
    its own: the storage use count covers every tensor, view and numpy array of the batch.
    """

    def __init__(self, num_workers: int, slots: int):
        self.slots = slots
        self.table = torch.zeros((num_workers, slots), dtype=torch.int32).share_memory_()
        self._held: dict[tuple[int, int], torch.UntypedStorage] = {}  # training process: slot -> storage
        self._in_use: set[tuple[int, int]] = set()

    def take(self, worker: int, slot: int) -> bool:
        """In worker ``worker``: claim ``slot`` if it is free."""
        if self.table[worker, slot].item():
            return False
        self.table[worker, slot] = 1
        return True

    def received(self, batch: dict) -> None:
        """In the training process: a batch arrived; its slot is in use until released."""
        worker, slot = batch.pop("slot")
        if slot < 0:
            return
        key = (worker, slot)
        storage = batch["video"].untyped_storage()
        held = self._held.get(key)
        if held is not None and held.data_ptr() != storage.data_ptr():
            raise RuntimeError(f"loader worker {worker} slot {slot} arrived in different memory")
        # Kept for good: the next batch in this slot then maps the same memory (torch's shared cache).
        self._held.setdefault(key, storage)
        self._in_use.add(key)

    def release_unreferenced(self) -> None:
        """In the training process: free every in-use slot that nothing but this object references."""
        for key in list(self._in_use):
            if _storage_use_count(self._held[key]._cdata) == 1:
                self._in_use.discard(key)
                self.table[key] = 0


class ClipLoader:
    """One rank's resumable stream of batches over one split of a shard index."""

    def __init__(self, index: ShardIndex, config: LoaderConfig, *, rank: int = 0, world_size: int = 1):
        self.index, self.config = index, config
        self.world = sampling.World(rank=rank, world_size=world_size)
        table = index.split(config.split)
        if table.num_rows == 0:
            raise EmptySplitError(f"split {config.split!r} has no samples in shard index {index.version} "
                                  f"({index.directory}); splits present: {sorted(set(index.table.column('split').to_pylist()))}")
        global_batch = self.world.global_batch(config.batch_size)
        if config.drop_last and table.num_rows < global_batch:
            raise ValueError(f"split {config.split!r} has {table.num_rows} samples, fewer than one global batch "
                             f"({world_size} ranks x {config.batch_size}); with drop_last no step could run")
        self.rows = {name: table.column(name).to_pylist()
                     for name in ("sample_key", "shard", "offset", "length", "bucket")}
        names = list(index.bucket_shapes)
        try:
            self.batching = sampling.resolve_batching(config.batching, names)
        except ValueError as error:
            raise ValueError(f"shard index {index.version}: {error}") from error
        unknown = sorted(set(self.rows["bucket"]) - set(names))
        if unknown:
            raise ValueError(f"shard index {index.version} lists samples in buckets {unknown} that its config "
                             f"does not define ({names})")
        ids = {name: number for number, name in enumerate(names)}
        bucket_ids = np.fromiter((ids[name] for name in self.rows["bucket"]), dtype=np.int64,
                                 count=len(self.rows["bucket"]))
        self.bucket_counts = dict(zip(names, np.bincount(bucket_ids, minlength=len(names)).tolist(), strict=True))
        schedule = sampling.BATCHING[self.batching](bucket_ids=bucket_ids, num_buckets=len(names),
                                                    global_batch=global_batch, shuffle=config.shuffle,
                                                    drop_last=config.drop_last)
        self._warn_small_buckets(global_batch)
        if config.verify_shards:  # through a shard cache: each tar fetched (when missing) and checked the same way
            index.verify(sorted(set(self.rows["shard"])), index_files=False)
        self.order = sampling.SampleOrder(schedule, sampling.SamplerState(
            seed=config.seed, num_samples=table.num_rows, dataset_version=self.dataset_version))
        self.failures: list[dict] = []

    def _warn_small_buckets(self, global_batch: int) -> None:
        for name, count in self.bucket_counts.items():
            if 0 < count < global_batch:
                LOGGER.warning("bucket %s of split %r has %d samples, fewer than a global batch of %d: %s",
                               name, self.config.split, count, global_batch,
                               "dropped every epoch (drop_last)" if self.config.drop_last else "one short step per epoch")

    @property
    def schedule(self) -> sampling.Schedule:
        return self.order.schedule

    @property
    def state(self) -> sampling.SamplerState:
        """Where the loader is: after the last batch it yielded."""
        return self.order.state

    @property
    def global_batch(self) -> int:
        return self.world.global_batch(self.config.batch_size)

    def describe(self) -> dict:
        """The loader's config with the batching policy resolved, for run configs and metadata."""
        return {**asdict(self.config), **self.order.describe(), "bucket_counts": self.bucket_counts,
                "bucket_shapes": {name: [shape.num_frames, shape.height, shape.width]
                                  for name, shape in self.index.bucket_shapes.items()}}

    @property
    def dataset_version(self) -> str:
        return f"{self.index.version}/{self.config.split}"

    @property
    def num_samples(self) -> int:
        return self.state.num_samples

    def __iter__(self) -> Iterator[dict]:
        """Batches from the current state on, one per global step, forever (epochs roll over)."""
        config = self.config
        # Reused slots need the training process to see the worker's memory, which the pin-memory
        # thread replaces by its own copy: pinned batches keep a fresh buffer each.
        leases = (_SlotLeases(config.num_workers, config.prefetch_factor + 2)
                  if config.num_workers and not config.pin_memory and config.reuse_batch_memory
                  and _storage_use_count is not None else None)
        dataset = _ShardBatches(index=self.index, rows=self.rows, order=self.order, world=self.world, config=config,
                                leases=leases)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=None, num_workers=config.num_workers, pin_memory=config.pin_memory,
            prefetch_factor=config.prefetch_factor if config.num_workers else None, in_order=True)
        steps = self.order.steps()  # the workers' steps, walked here only for the state after each
        for batch in loader:
            if leases is not None:
                leases.received(batch)
            else:
                batch.pop("slot")
            batch["has_audio"] = torch.tensor(batch["has_audio"], dtype=torch.bool)
            self._record(batch["failed"])
            self.order.take(next(steps))
            yield batch
            del batch  # this frame's reference, before asking which slots are still referenced
            if leases is not None:
                leases.release_unreferenced()

    def _record(self, failed: list[dict]) -> None:
        for failure in failed:
            LOGGER.warning("skipped sample %s (index %d): %s", failure["sample_key"], failure["index"], failure["reason"])
        self.failures.extend(failed)

    def state_dict(self) -> dict:
        # Identical on every rank (checkpoints check that): no per-rank counts such as failures here.
        return {**self.order.state_dict(), "manifest_version": self.index.manifest_version,
                "shard_index_version": self.index.version, "split": self.config.split}

    def load_state_dict(self, state: dict) -> None:
        """Resume; a state from another manifest, shard index or split is refused, never applied."""
        if state.get("manifest_version") != self.index.manifest_version:
            raise sampling.ResumeStateMismatch(
                f"loader state is from manifest version {state.get('manifest_version')!r}, but this loader reads "
                f"manifest version {self.index.manifest_version!r}: resuming would replay or skip different data")
        self.order.load_state_dict(state)  # batching, dataset version and size (ops.loading.sampling)
