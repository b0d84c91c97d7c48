"""Deterministic, resumable, elastic sample order for the training data loader.

This module decides WHICH global sample indices (0..N-1, the row ids of the Parquet shard
index) each rank and DataLoader worker reads, and in WHICH order. It reads no data. Two forms
of the same contract: `IndexStream`, an IterableDataset of indices for one epoch (the plain
form, below), and `global_steps` + `World.step_positions`, which ops/loader.ClipLoader uses to
keep its workers across epochs (worker k builds global steps k, k+K, ... counted from the
start state) and to advance the state as each batch is handed to the trainer.

The contract
------------
1. Epoch order. `epoch_order(num_samples, seed, epoch)` is a permutation of 0..N-1 that depends
   only on its arguments. "Global position p" of an epoch holds sample `order[p]`.
2. Global steps. With W = world_size and B = per-rank batch_size, one global step consumes the
   next W*B global positions (fewer on the last, uneven step). `SamplerState.consumed` counts
   the global positions consumed so far in the epoch; the next step starts there.
3. Ranks. Rank r's local stream is the global positions consumed + r, consumed + r + W, ...:
   local position j is global position consumed + j*W + r. So local batch t of every rank
   together covers exactly the global positions of global step t, and interleaving the ranks
   element by element (j-major, r-minor) gives the global order back.
4. Workers. Local position j goes to DataLoader worker (j // B) % num_workers, i.e. worker k
   owns whole local batches k, k+K, k+2K, ... torch's DataLoader asks its workers for batches
   round-robin and returns them in request order, so `DataLoader(stream, batch_size=B,
   num_workers=K)` hands the rank its local stream in order, batch t = local positions
   [t*B, (t+1)*B), for any K (0 included).
5. Tail. Without drop_last nothing is padded or repeated: the last global step may be uneven,
   and a rank may get fewer samples, or none, in it (`num_local_samples`, `EpochPlan`). With
   drop_last, the positions that do not fill a whole global step are dropped and counted.
6. Resume. The state is a plain dict saved at step boundaries. Resuming, with the same or another
   world size or worker count, starts rank r at global position consumed + r, so the union of the
   ranks' remaining samples, in global position order, is the uninterrupted epoch's remainder.
   A state saved for another dataset version or size is refused (`ResumeStateMismatch`).
7. Epochs. When the epoch's positions are used up, the state rolls to epoch + 1, consumed = 0.

What the loader and trainer must do
-----------------------------------
- DataLoader(batch_size=B, drop_last=False, in_order=True) with B equal to IndexStream's
  batch_size: the DataLoader's own drop_last would cut each worker's partial batch, and
  in_order=False breaks point 4. Use IndexStream's drop_last instead.
- Loop `plan.num_global_steps` times on EVERY rank, not "for batch in loader": in the uneven
  last step some ranks have no batch but must still call `advance_step` (and join collectives).
- Advance the state only for steps the optimizer finished, never for what the DataLoader has
  prefetched. Build a new DataLoader per epoch and per resume; IndexStream is immutable.
- Pass the same shuffle flag when resuming: the state does not record it.
- Each worker that has batches computes the epoch order itself when iterated: O(N log N), about
  2 s and 160 MB transient for N = 10M; nothing of size N is pickled into the workers.

    plan = plan_epoch(state, world_size=W, batch_size=B, drop_last=D)
    batches = iter(DataLoader(IndexStream(state=state, rank=r, world_size=W, batch_size=B,
                                          drop_last=D), batch_size=B, num_workers=K))
    for _ in range(plan.num_global_steps):
        batch = next(batches, None)  # None: no samples for this rank in the uneven last step
        ...train...
        state = advance_step(state, world_size=W, batch_size=B, drop_last=D)
    if plan.num_global_steps == 0:  # only after resuming onto a larger world with drop_last
        state = finish_epoch(state, world_size=W, batch_size=B, drop_last=D)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.utils.data

# Bump when the state dict layout changes, and add a shim in `SamplerState.from_state_dict`.
STATE_FORMAT = 1


class ResumeStateMismatch(ValueError):
    """A saved sampler state belongs to another dataset version or size.

    Applying it would silently skip or replay samples, so resuming is refused instead.
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """Where this process sits: distributed rank, and DataLoader worker within the rank.

    All rank and worker arithmetic of the sample order lives here.
    """

    rank: int
    """This process's rank, 0 <= rank < world_size."""
    world_size: int
    """Number of ranks (data-parallel replicas) that split each global step."""
    worker_id: int = 0
    """This DataLoader worker, 0 <= worker_id < num_workers; 0 in the main process."""
    num_workers: int = 1
    """DataLoader workers of this rank; 1 when the rank reads in its main process."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"worker_id must be in [0, {self.num_workers}), got {self.worker_id}")

    @classmethod
    def from_worker_info(cls, *, rank: int, world_size: int) -> World:
        """The World of the calling process, reading worker id and count from torch."""
        info = torch.utils.data.get_worker_info()
        if info is None:  # main process: DataLoader(num_workers=0), or iterated directly
            return cls(rank=rank, world_size=world_size)
        return cls(
            rank=rank, world_size=world_size, worker_id=info.id, num_workers=info.num_workers
        )

    def rank_positions(self, *, start: int, end: int) -> range:
        """Global positions in [start, end) of this rank's local stream (contract point 3)."""
        return range(start + self.rank, end, self.world_size)

    def worker_local_positions(self, *, num_local: int, batch_size: int) -> np.ndarray:
        """Local positions j < num_local that this worker yields, in order (contract point 4)."""
        batch_starts = np.arange(
            self.worker_id * batch_size, num_local, self.num_workers * batch_size, dtype=np.int64
        )
        local = (batch_starts[:, None] + np.arange(batch_size, dtype=np.int64)[None, :]).ravel()
        return local[local < num_local]

    def step_positions(self, plan: EpochPlan, *, step: int) -> range:
        """Global positions this rank reads in global step ``step`` of ``plan``.

        The same positions as local batch ``step`` of the rank's local stream (points 3 and 4);
        empty for a rank that has no sample in the uneven last step.
        """
        first = plan.start + step * plan.global_batch_size
        return range(first + self.rank, min(first + plan.global_batch_size, plan.end), self.world_size)

    def worker_global_positions(self, *, start: int, end: int, batch_size: int) -> np.ndarray:
        """Global positions in [start, end) that this rank's worker yields, in order."""
        rank_positions = self.rank_positions(start=start, end=end)
        local = self.worker_local_positions(num_local=len(rank_positions), batch_size=batch_size)
        return rank_positions.start + local * rank_positions.step


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s own random streams (python, numpy, torch globals), from (seed, rank).

    The one per-rank derivation: the trainer seeds every rank with it at start, and the
    checkpointer re-derives with it a rank the checkpoint holds no RNG state for. A 63-bit value
    (torch.manual_seed takes int64), so numpy's legacy seeder takes it modulo 2**32.
    """
    if seed < 0 or rank < 0:
        raise ValueError(f"seed and rank must be >= 0, got seed={seed}, rank={rank}")
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


def nested_state(data_state: Mapping[str, Any]) -> dict[str, Any]:
    """A data source's saved state in the one layout: ``{"sampler": ..., "batching": ..., ...}``.

    The read shim for states already on disk. Before the layout was one, a fixed-shape synthetic
    source saved the bare sampler state (``{"format": 1, "seed": ..., ...}``) and did not record
    its batching; such a state is nested here with ``batching`` None (the reader decides what an
    unrecorded batching may match). A nested state is returned as a copy, unchanged.
    """
    if "sampler" in data_state:
        return dict(data_state)
    if "format" in data_state and "consumed" in data_state:
        return {"sampler": dict(data_state), "batching": None}
    raise ValueError(f"not a data source state (keys {sorted(data_state)}): expected 'sampler'")


def epoch_order(num_samples: int, seed: int, epoch: int, *, shuffle: bool = True) -> np.ndarray:
    """Global sample order of one epoch: a permutation of 0..num_samples-1, as int64.

    numpy keeps SeedSequence and the PCG64 raw bit stream stable across versions and machines,
    but reserves the right to change Generator methods such as `permutation` between releases.
    So the order is the stable argsort of raw 64-bit PCG64 draws: a uniform permutation whose
    result is fixed by the raw bits alone, since a stable sort has exactly one answer (ties,
    about N^2 / 2^65 likely, go to the lower index). A test pins known values.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    keys = np.random.PCG64(np.random.SeedSequence([seed, epoch])).random_raw(num_samples)
    return np.argsort(keys, kind="stable").astype(np.int64, copy=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplerState:
    """Where the run is in the sample order; saved in every checkpoint as `state_dict()`."""

    seed: int
    """Seed of the shuffle; together with epoch it fixes `epoch_order`."""
    num_samples: int
    """Samples in the dataset (rows of the shard index)."""
    dataset_version: str
    """Version of the manifest / shard index the global indices refer to."""
    epoch: int = 0
    """Current epoch, from 0."""
    consumed: int = 0
    """Global positions consumed in this epoch by finished steps."""
    num_dropped: int = 0
    """Samples dropped by drop_last over all finished epochs of the run, for the audit trail."""

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not self.dataset_version:
            raise ValueError("dataset_version must be a non-empty string")
        if self.epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {self.epoch}")
        # consumed == num_samples never appears: a finished epoch rolls into the next one.
        if not 0 <= self.consumed < self.num_samples:
            raise ValueError(f"consumed must be in [0, {self.num_samples}), got {self.consumed}")
        if self.num_dropped < 0:
            raise ValueError(f"num_dropped must be >= 0, got {self.num_dropped}")

    def state_dict(self) -> dict[str, int | str]:
        """Plain dict of ints and strs, safe for JSON and for DCP's extra state."""
        return {"format": STATE_FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_state_dict(
        cls, state: Mapping[str, Any], *, expected_dataset_version: str, expected_num_samples: int
    ) -> SamplerState:
        """Rebuild a saved state; raise ResumeStateMismatch if it is for another dataset."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"sampler state format {state.get('format')!r} is not supported "
                f"(this code reads format {STATE_FORMAT})"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - state.keys())
        unknown = sorted(state.keys() - fields - {"format"})
        if missing or unknown:
            raise ValueError(f"sampler state has missing keys {missing}, unknown keys {unknown}")
        saved_version, saved_num = state["dataset_version"], state["num_samples"]
        if saved_version != expected_dataset_version or saved_num != expected_num_samples:
            raise ResumeStateMismatch(
                f"sampler state was saved for dataset version {saved_version!r} with {saved_num} "
                f"samples, but this run reads dataset version {expected_dataset_version!r} with "
                f"{expected_num_samples} samples; its global indices would point at other "
                "samples. Resume against the saved version, or start the sampler fresh."
            )
        for name in fields - {"dataset_version"}:
            # bool is an int subclass; a True here means the dict was built by mistake.
            if type(state[name]) is not int:
                raise ValueError(f"sampler state {name!r} must be an int, got {state[name]!r}")
        return cls(**{name: state[name] for name in fields})


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochPlan:
    """The rest of the current epoch under one world: positions left and the steps they make."""

    start: int
    """First global position not yet consumed (the state's consumed)."""
    end: int
    """End (exclusive) of the positions this epoch will use; below num_samples only by drop_last."""
    num_samples: int
    """Samples in the dataset."""
    world_size: int
    """Ranks splitting each global step."""
    batch_size: int
    """Samples per rank per full step."""

    @property
    def global_batch_size(self) -> int:
        return self.world_size * self.batch_size

    @property
    def num_dropped(self) -> int:
        """Positions drop_last leaves out of this epoch (0 without drop_last)."""
        return self.num_samples - self.end

    @property
    def num_global_steps(self) -> int:
        """Steps left in the epoch, the same on every rank; the last may be uneven."""
        return -(-(self.end - self.start) // self.global_batch_size)

    @property
    def next_step_size(self) -> int:
        """Global positions the next step consumes: a full global batch, or the uneven tail."""
        return min(self.global_batch_size, self.end - self.start)

    def num_local_samples(self, world: World) -> int:
        """Samples left for world's rank; ranks differ by at most one, in the last step."""
        return len(world.rank_positions(start=self.start, end=self.end))


def plan_epoch(
    state: SamplerState, *, world_size: int, batch_size: int, drop_last: bool = False
) -> EpochPlan:
    """Plan the rest of state's epoch for world_size ranks of batch_size samples each.

    With drop_last the dropped tail is measured from the resume point under the current world,
    so after an elastic resume it can differ from what the old world would have dropped.
    """
    if world_size < 1 or batch_size < 1:
        raise ValueError(f"world_size and batch_size must be >= 1, got {world_size}, {batch_size}")
    end = state.num_samples
    if drop_last:
        global_batch_size = world_size * batch_size
        end = state.consumed + (end - state.consumed) // global_batch_size * global_batch_size
    return EpochPlan(
        start=state.consumed,
        end=end,
        num_samples=state.num_samples,
        world_size=world_size,
        batch_size=batch_size,
    )


def num_local_samples(
    state: SamplerState, world: World, *, batch_size: int, drop_last: bool = False
) -> int:
    """Samples world's rank will read in the rest of state's epoch."""
    plan = plan_epoch(
        state, world_size=world.world_size, batch_size=batch_size, drop_last=drop_last
    )
    return plan.num_local_samples(world)


def advance(state: SamplerState, *, samples_per_rank: int, world_size: int) -> SamplerState:
    """State after a global step in which every rank consumed samples_per_rank samples.

    Rolls into the next epoch when the epoch's last position is consumed. It does not know
    about drop_last or uneven tails; `advance_step` does.
    """
    if samples_per_rank < 0 or world_size < 1:
        raise ValueError(f"bad step: samples_per_rank={samples_per_rank}, world_size={world_size}")
    consumed = state.consumed + samples_per_rank * world_size
    if consumed > state.num_samples:
        raise ValueError(
            f"a step of {samples_per_rank} x {world_size} samples from position {state.consumed} "
            f"runs past the epoch's {state.num_samples} samples; use advance_step for the tail"
        )
    if consumed == state.num_samples:
        return _next_epoch(state, num_dropped=0)
    return dataclasses.replace(state, consumed=consumed)


def advance_step(
    state: SamplerState, *, world_size: int, batch_size: int, drop_last: bool = False
) -> SamplerState:
    """State after the next global step of the plan: a full step or the uneven tail.

    Rolls into the next epoch, recording the drop_last tail, once no step is left.
    """
    plan = plan_epoch(state, world_size=world_size, batch_size=batch_size, drop_last=drop_last)
    if plan.num_global_steps == 0:
        raise ValueError(
            f"no step left in epoch {state.epoch} at position {state.consumed}; call finish_epoch"
        )
    consumed = state.consumed + plan.next_step_size
    if consumed == plan.end:
        return _next_epoch(state, num_dropped=plan.num_dropped)
    return dataclasses.replace(state, consumed=consumed)


def finish_epoch(
    state: SamplerState, *, world_size: int, batch_size: int, drop_last: bool = False
) -> SamplerState:
    """Roll a state with no step left in its plan into the next epoch, recording the drops.

    Needed only when a drop_last run resumes onto a world whose global batch exceeds what is left.
    """
    plan = plan_epoch(state, world_size=world_size, batch_size=batch_size, drop_last=drop_last)
    if plan.num_global_steps != 0:
        raise ValueError(
            f"epoch {state.epoch} still has {plan.num_global_steps} steps from position "
            f"{state.consumed}; finishing it now would skip {plan.end - plan.start} samples"
        )
    return _next_epoch(state, num_dropped=plan.num_dropped)


def _next_epoch(state: SamplerState, *, num_dropped: int) -> SamplerState:
    return dataclasses.replace(
        state, epoch=state.epoch + 1, consumed=0, num_dropped=state.num_dropped + num_dropped
    )


def global_steps(
    state: SamplerState, *, world_size: int, batch_size: int, drop_last: bool = False
) -> Iterator[tuple[int, EpochPlan, int]]:
    """Every global step from ``state`` on, across epochs: (epoch, epoch plan, step in the plan).

    The n-th item is the n-th step a run started or resumed at ``state`` takes, so a loader
    that keeps its workers across epochs can hand step n to worker n % num_workers and still
    return steps in order (the persistent-worker form of point 4).
    """
    while True:
        plan = plan_epoch(state, world_size=world_size, batch_size=batch_size, drop_last=drop_last)
        for step in range(plan.num_global_steps):
            yield state.epoch, plan, step
        state = _next_epoch(state, num_dropped=plan.num_dropped)


class IndexStream(torch.utils.data.IterableDataset):
    """Global sample indices for one rank and, inside a DataLoader, for the current worker.

    Yields Python ints in this rank's local-stream order (see the module docstring); wrap it in
    DataLoader(batch_size=batch_size, drop_last=False). Immutable and picklable: build a new
    one, and a new DataLoader, per epoch and per resume.
    """

    def __init__(
        self,
        *,
        state: SamplerState,
        rank: int,
        world_size: int,
        batch_size: int,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        self.state = state
        self.world = World(rank=rank, world_size=world_size)  # validated here, in the main process
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.plan = plan_epoch(
            state, world_size=world_size, batch_size=batch_size, drop_last=drop_last
        )

    @property
    def num_dropped(self) -> int:
        """Samples drop_last leaves out of the rest of this epoch."""
        return self.plan.num_dropped

    def __len__(self) -> int:
        # Samples for this rank over all its workers, so len(DataLoader) is its local batch count.
        return self.plan.num_local_samples(self.world)

    def __iter__(self) -> Iterator[int]:
        world = World.from_worker_info(rank=self.world.rank, world_size=self.world.world_size)
        positions = world.worker_global_positions(
            start=self.plan.start, end=self.plan.end, batch_size=self.batch_size
        )
        if positions.size == 0:
            return  # a worker with no batch skips the O(N log N) order
        order = epoch_order(
            self.state.num_samples, self.state.seed, self.state.epoch, shuffle=self.shuffle
        )
        yield from order[positions].tolist()


# ---------------------------------------------------------------------------------------------
# Bucketed batching: every global step holds samples of one bucket (one clip shape).
#
# The uniform scheme above cuts the epoch order into equal global steps, which mixes shapes
# when the shards hold several (durations, aspect ratios). Bucketed batching keeps every
# contract point except the step boundaries: the epoch order is rearranged so that each step is
# a run of positions from ONE bucket, and steps are no longer all the same size.
#
# Layout of epoch e (`bucketed_epoch`), for a global batch G:
#   1. Take `epoch_order(N, seed, e)` and split it by bucket, keeping that order inside each
#      bucket, so a bucket's samples are shuffled exactly as in the uniform scheme.
#   2. Cut each bucket's list into chunks of G; the remainder (< G) is the bucket's tail (a
#      bucket with fewer samples than a batch is all tail). With drop_last tails are dropped and
#      counted per bucket; without it each is one short step. No sample is padded, repeated or
#      mixed into another shape.
#   3. The steps (chunks, then with shuffle off each bucket's tail after its chunks) are shuffled
#      together by a second PCG64 stream keyed (seed, e, 1), so buckets interleave over the epoch
#      instead of running one after another. Short steps are shuffled in too: kept at the end of
#      the epoch they would always land on the same DataLoader workers (step n goes to worker
#      n % K), which measured as a systematic imbalance that cost 5% of loader throughput, and
#      the last steps of every epoch would always be the odd shapes.
# Ranks and workers split each step exactly as in the uniform scheme (positions first + r,
# first + r + W, ...; step n to worker n % K). The layout depends on G, not on W, so a run
# resumes on another world size with the same global batch; `consumed` must fall on a step
# boundary of the layout, and a state that does not (another G) is refused.

_CHUNK_STREAM = 1  # SeedSequence salt of the chunk shuffle (step 3)


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class BucketedEpoch:
    """Step layout of one epoch under bucketed batching (see above)."""

    epoch: int
    order: np.ndarray
    """Position -> sample index, int64; dropped tails are left out."""
    bounds: np.ndarray
    """int64 [num_steps + 1]: step k covers positions [bounds[k], bounds[k + 1])."""
    step_bucket: np.ndarray
    """int64 [num_steps]: the bucket id of each step."""
    dropped: dict[int, int]
    """Bucket id -> samples drop_last left out of this epoch (only buckets that lost some)."""

    @property
    def num_steps(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def step_at(self, consumed: int) -> int:
        """The step that starts at position ``consumed``; ResumeStateMismatch if none does."""
        step = int(np.searchsorted(self.bounds, consumed))
        if step >= self.num_steps or self.bounds[step] != consumed:
            raise ResumeStateMismatch(
                f"position {consumed} is not a step boundary of epoch {self.epoch}'s bucketed layout: the state "
                "was saved under another global batch size or bucket assignment, and resuming would mix buckets "
                "or skip samples")
        return step

    def step_positions(self, step: int, world: World) -> range:
        """Global positions world's rank reads in ``step``; empty when the step is shorter than the rank."""
        return range(int(self.bounds[step]) + world.rank, int(self.bounds[step + 1]), world.world_size)

    def step_indices(self, step: int, world: World) -> np.ndarray:
        positions = self.step_positions(step, world)
        return self.order[positions.start:positions.stop:positions.step]


def bucketed_epoch(bucket_ids: np.ndarray, *, num_buckets: int, seed: int, epoch: int, global_batch: int,
                   shuffle: bool = True, drop_last: bool = False) -> BucketedEpoch:
    """The step layout of ``epoch`` for samples whose bucket is ``bucket_ids[i]`` (0..num_buckets-1)."""
    bucket_ids = np.asarray(bucket_ids, dtype=np.int64)
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    if bucket_ids.size and (bucket_ids.min() < 0 or bucket_ids.max() >= num_buckets):
        raise ValueError(f"bucket ids must be in [0, {num_buckets})")
    permutation = epoch_order(len(bucket_ids), seed, epoch, shuffle=shuffle)
    permuted_buckets = bucket_ids[permutation]
    steps: list[tuple[int, np.ndarray]] = []
    dropped: dict[int, int] = {}
    for bucket in range(num_buckets):
        members = permutation[permuted_buckets == bucket]
        num_full = len(members) // global_batch
        steps.extend((bucket, members[k * global_batch:(k + 1) * global_batch]) for k in range(num_full))
        if len(members) % global_batch:
            if drop_last:
                dropped[bucket] = len(members) - num_full * global_batch
            else:
                steps.append((bucket, members[num_full * global_batch:]))
    if shuffle and steps:
        keys = np.random.PCG64(np.random.SeedSequence([seed, epoch, _CHUNK_STREAM])).random_raw(len(steps))
        steps = [steps[k] for k in np.argsort(keys, kind="stable")]
    sizes = np.array([len(members) for _, members in steps], dtype=np.int64)
    return BucketedEpoch(
        epoch=epoch,
        order=np.concatenate([members for _, members in steps]) if steps else np.empty(0, np.int64),
        bounds=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        step_bucket=np.array([bucket for bucket, _ in steps], dtype=np.int64),
        dropped=dropped,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class BucketedSchedule:
    """Bucketed batching of one dataset: the per-epoch layouts and how the state moves through them."""

    bucket_ids: np.ndarray
    num_buckets: int
    global_batch: int
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        counts = np.bincount(np.asarray(self.bucket_ids, dtype=np.int64), minlength=self.num_buckets)
        if self.drop_last and not (counts >= self.global_batch).any():
            raise ValueError(
                f"with drop_last no bucket fills a global batch of {self.global_batch} (bucket sizes "
                f"{counts.tolist()}): no step could run")

    def epoch(self, state: SamplerState, epoch: int) -> BucketedEpoch:
        return bucketed_epoch(self.bucket_ids, num_buckets=self.num_buckets, seed=state.seed, epoch=epoch,
                              global_batch=self.global_batch, shuffle=self.shuffle, drop_last=self.drop_last)

    def steps(self, state: SamplerState) -> Iterator[tuple[BucketedEpoch, int]]:
        """Every step from ``state`` on, across epochs: (layout of its epoch, step in the layout)."""
        epoch = state.epoch
        layout = self.epoch(state, epoch)
        first = layout.step_at(state.consumed)
        while True:
            for step in range(first, layout.num_steps):
                yield layout, step
            epoch, first = epoch + 1, 0
            layout = self.epoch(state, epoch)

    def check(self, state: SamplerState) -> None:
        """Refuse a state whose position is not a step boundary of this schedule."""
        self.epoch(state, state.epoch).step_at(state.consumed)

    @staticmethod
    def advance(state: SamplerState, layout: BucketedEpoch, step: int) -> SamplerState:
        """State after ``step`` of ``layout`` finished; rolls into the next epoch after its last step."""
        if layout.epoch != state.epoch or int(layout.bounds[step]) != state.consumed:
            raise ValueError(f"step {step} of epoch {layout.epoch} does not start at the state's position "
                             f"(epoch {state.epoch}, consumed {state.consumed})")
        consumed = int(layout.bounds[step + 1])
        if step + 1 == layout.num_steps:
            return _next_epoch(state, num_dropped=layout.num_dropped)
        return dataclasses.replace(state, consumed=consumed)
