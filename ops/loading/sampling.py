"""Deterministic, resumable, elastic sample order for the training data: one order, two schedules.

This module decides WHICH global sample indices (0..N-1, the row ids of the Parquet shard
index, or a synthetic source's sample numbers) each rank and DataLoader worker reads, and in
WHICH order. It reads no data and imports no torch (trainer/launch/config_sections.py takes its batching
policies from here). Every data source holds one `SampleOrder`: a schedule (how an epoch is cut
into global steps) and a `SamplerState` (where the run is). ops/loader.ClipLoader and
trainer/data.SyntheticClips both walk `SampleOrder.steps()` and advance by taking each step.

The contract
------------
1. Epoch order. `epoch_order(num_samples, seed, epoch)` is a permutation of 0..N-1 that depends
   only on its arguments. "Global position p" of an epoch holds sample `order[p]`.
2. Global steps. A schedule cuts each epoch's positions into consecutive global steps.
   `UniformSchedule` ('fixed_shape'): runs of G = ranks x per-rank batch positions (fewer on the
   last, uneven step). `BucketedSchedule` ('bucketed'): the order rearranged so that each step is
   one bucket's run (section below). `SamplerState.consumed` counts the global positions
   consumed so far in the epoch; the next step starts there. A `Step` carries its bucket and
   the state after it, so advancing is taking that state.
3. Ranks. Rank r of W reads the step's positions first + r, first + r + W, ... (`World`), so
   interleaving the ranks' batches element by element (j-major, r-minor) gives the step back.
   W must divide G (`World.local_batch`).
4. Workers. DataLoader worker k of K builds steps n = k, k + K, ... counted from the state the
   loader started at (`World.owns`); torch's DataLoader asks its workers round-robin and returns
   batches in request order, so the rank receives its steps in order for any K (0 included).
   A worker computes an epoch's order (O(N log N), about 2 s and 160 MB transient for N = 10M)
   only when it first needs indices of that epoch; nothing of size N is pickled into workers
   beyond the bucket ids of a bucketed schedule.
5. Tail. Without drop_last nothing is padded or repeated: a step may be short, and a rank may get
   fewer samples, or none, in it (the loader then yields an empty batch, so every rank sees the
   same steps). With drop_last the positions that do not fill a whole step are dropped and
   counted in `num_dropped`.
6. Resume. The state is a plain dict saved at step boundaries, nested as
   ``{"sampler": SamplerState.state_dict(), "batching": schedule.batching_state()}``; the
   batching part records what the order depends on beyond the sampler state, and a resume with
   other values is refused (`ResumeStateMismatch`), as is a state for another dataset version
   or size. The uniform global batch may change on resume (rank r restarts at consumed + r); the
   bucketed layout is a function of G, so only the world size and worker count may change.
7. Epochs. When the epoch's steps are used up, the state rolls to epoch + 1, consumed = 0. After
   a drop_last resume onto a larger global batch the rest of an epoch may hold no step at all: it
   is rolled over, its drops counted, before the first step.

What a data source must do: take a step only once the optimizer finished it, never for what
a DataLoader has prefetched, and start a fresh `steps()` (and DataLoader) after each resume.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np

_TORCHRUN_VARIABLES = {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0}
"""The variables torchrun sets for each process, and their values without torchrun."""

# Bump when the state dict layout changes, and add a shim in `SamplerState.from_state_dict`.
STATE_FORMAT = 1


class ResumeStateMismatch(ValueError):
    """A saved sampler state belongs to another dataset version or size, or another batching.

    Applying it would silently skip or replay samples, so resuming is refused instead.
    """


@dataclass(frozen=True, kw_only=True, slots=True)
class World:
    """Where this process sits: distributed rank, and DataLoader worker within the rank.

    The one answer to "which rank am I, of how many": the trainer, the checkpointer and the data
    sources all hold this object, read from torchrun's variables by `World.from_env`, the only
    reader of RANK, WORLD_SIZE and LOCAL_RANK. All rank and worker arithmetic of the sample order
    lives here: the rank interleave (point 3), the worker round-robin (point 4) and the global
    batch = ranks x per-rank batch.
    """

    rank: int
    """This process's rank, 0 <= rank < world_size."""
    world_size: int
    """Number of ranks (data-parallel replicas) that split each global step."""
    local_rank: int = 0
    """Rank on this node; picks the CUDA device."""
    launched: bool = False
    """Whether torchrun started this process (it set RANK, WORLD_SIZE and LOCAL_RANK): the process
    group then meets through env:// (MASTER_ADDR, MASTER_PORT)."""
    worker_id: int = 0
    """This DataLoader worker, 0 <= worker_id < num_workers; 0 in the main process."""
    num_workers: int = 1
    """DataLoader workers of this rank; 1 when the rank reads in its main process."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if self.local_rank < 0:
            raise ValueError(f"local_rank must be >= 0, got {self.local_rank}")
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if not 0 <= self.worker_id < self.num_workers:
            raise ValueError(f"worker_id must be in [0, {self.num_workers}), got {self.worker_id}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> World:
        """This process's World from torchrun's RANK, WORLD_SIZE and LOCAL_RANK (default: os.environ).

        A variable that is not set counts as 0, 1 and 0: without torchrun the program is rank 0 of 1.
        ValueError names the variable that is not an integer, or the values when the rank lies
        outside the world.
        """
        env = os.environ if environ is None else environ
        values = {}
        for name, default in _TORCHRUN_VARIABLES.items():
            text = env.get(name)
            try:
                values[name] = default if text is None else int(text)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None
        try:
            return cls(rank=values["RANK"], world_size=values["WORLD_SIZE"], local_rank=values["LOCAL_RANK"],
                       launched=all(name in env for name in _TORCHRUN_VARIABLES))
        except ValueError as error:
            shown = ", ".join(f"{name}={value}" for name, value in values.items())
            raise ValueError(f"torchrun's variables ({shown}) do not describe a rank: {error}") from None

    @classmethod
    def from_worker_info(cls, *, rank: int, world_size: int) -> World:
        """The World of the calling process, reading worker id and count from torch."""
        import torch.utils.data  # here, not at the top: trainer/launch/config_sections.py imports this module torch-free

        info = torch.utils.data.get_worker_info()
        if info is None:  # main process: DataLoader(num_workers=0), or iterated directly
            return cls(rank=rank, world_size=world_size)
        return cls(rank=rank, world_size=world_size, worker_id=info.id, num_workers=info.num_workers)

    @property
    def is_main(self) -> bool:
        """Rank 0 writes run files and calls hooks."""
        return self.rank == 0

    def global_batch(self, per_rank: int) -> int:
        """Samples of one global step when every rank reads ``per_rank``."""
        if per_rank < 1:
            raise ValueError(f"per-rank batch must be >= 1, got {per_rank}")
        return per_rank * self.world_size

    def local_batch(self, global_batch: int) -> int:
        """Samples per rank of a full global step; ValueError unless the ranks divide it evenly."""
        if global_batch < 1 or global_batch % self.world_size:
            raise ValueError(f"global batch {global_batch} does not split into {self.world_size} equal "
                             "per-rank batches")
        return global_batch // self.world_size

    def rank_positions(self, *, start: int, end: int) -> range:
        """Global positions in [start, end) that this rank reads (point 3)."""
        return range(start + self.rank, end, self.world_size)

    def owns(self, step_number: int) -> bool:
        """Whether this worker builds the ``step_number``-th step since the loader started (point 4)."""
        return step_number % self.num_workers == self.worker_id


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



def _next_epoch(state: SamplerState, *, num_dropped: int) -> SamplerState:
    return dataclasses.replace(
        state, epoch=state.epoch + 1, consumed=0, num_dropped=state.num_dropped + num_dropped
    )


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class Step:
    """One global step of a schedule: its bucket, the state once it is finished, and its samples."""

    bucket: int
    """Bucket id of every sample of the step (0 under fixed-shape batching)."""
    state_after: SamplerState
    """Where the run is once this step is finished; an epoch's last step rolls into the next."""
    select: Callable[[World], np.ndarray]
    """World -> its rank's sample indices (int64), computed when asked: see contract point 4."""

    def indices(self, world: World) -> list[int]:
        """Global sample indices that world's rank reads in this step, in order (contract point 3)."""
        return self.select(world).tolist()


class Schedule(Protocol):
    """How epochs are cut into global steps: what `SampleOrder` needs of a batching policy."""

    policy: ClassVar[str]
    global_batch: int
    shuffle: bool
    drop_last: bool

    def steps(self, state: SamplerState) -> Iterator[Step]: ...
    def check(self, state: SamplerState) -> None: ...
    def batching_state(self) -> dict[str, Any]: ...


# ---------------------------------------------------------------------------------------------
# Uniform batching: global steps are equal runs of the epoch order.


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochPlan:
    """The rest of the current epoch under one global batch: positions left and the steps they make."""

    start: int
    """First global position not yet consumed (the state's consumed)."""
    end: int
    """End (exclusive) of the positions this epoch will use; below num_samples only by drop_last."""
    num_samples: int
    """Samples in the dataset."""
    global_batch: int
    """Positions of a full step."""

    @property
    def num_global_steps(self) -> int:
        """Steps left in the epoch, the same on every rank; the last may be uneven."""
        return -(-(self.end - self.start) // self.global_batch)

    @property
    def num_dropped(self) -> int:
        """Positions drop_last leaves out of the rest of this epoch."""
        return self.num_samples - self.end


class _EpochOrders:
    """The epoch order of the latest epoch asked for, computed on first use (contract point 4)."""

    def __init__(self, state: SamplerState, *, shuffle: bool) -> None:
        self.num_samples, self.seed, self.shuffle = state.num_samples, state.seed, shuffle
        self.epoch, self.order = -1, np.empty(0, dtype=np.int64)

    def select(self, world: World, *, epoch: int, start: int, end: int) -> np.ndarray:
        if epoch != self.epoch:
            self.epoch, self.order = epoch, epoch_order(self.num_samples, self.seed, epoch, shuffle=self.shuffle)
        positions = world.rank_positions(start=start, end=end)
        return self.order[positions.start:positions.stop:positions.step]


@dataclass(frozen=True, kw_only=True, slots=True)
class UniformSchedule:
    """Fixed-shape batching: steps of ``global_batch`` consecutive positions of the epoch order.

    The step boundaries are measured from the state's position, so a resume may change the
    global batch; with drop_last the dropped tail is then what is left over under the new one.
    """

    policy: ClassVar[str] = "fixed_shape"
    global_batch: int
    shuffle: bool = True
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be >= 1, got {self.global_batch}")

    @classmethod
    def for_buckets(cls, *, bucket_ids: np.ndarray, num_buckets: int, global_batch: int, shuffle: bool = True,
                    drop_last: bool = False) -> UniformSchedule:
        """The registry's constructor; one clip shape, so the bucket ids do not matter."""
        return cls(global_batch=global_batch, shuffle=shuffle, drop_last=drop_last)

    def plan(self, state: SamplerState) -> EpochPlan:
        """The rest of state's epoch: where it ends (drop_last) and how many steps it makes."""
        end = state.num_samples
        if self.drop_last:
            end = state.consumed + (end - state.consumed) // self.global_batch * self.global_batch
        return EpochPlan(start=state.consumed, end=end, num_samples=state.num_samples, global_batch=self.global_batch)

    def steps(self, state: SamplerState) -> Iterator[Step]:
        """Every step from ``state`` on, across epochs; an epoch with no step left is rolled over."""
        orders = _EpochOrders(state, shuffle=self.shuffle)
        while True:
            plan = self.plan(state)
            epoch_end = _next_epoch(state, num_dropped=plan.num_dropped)
            for start in range(plan.start, plan.end, self.global_batch):
                end = min(start + self.global_batch, plan.end)
                yield Step(bucket=0, state_after=epoch_end if end == plan.end else dataclasses.replace(state, consumed=end),
                           select=functools.partial(orders.select, epoch=state.epoch, start=start, end=end))
            state = epoch_end

    def check(self, state: SamplerState) -> None:
        """Every position is a step boundary: steps are measured from wherever the state is."""

    def batching_state(self) -> dict[str, Any]:
        # drop_last is not recorded: it only decides where this epoch ends, measured from the resume point.
        return {"policy": self.policy, "shuffle": self.shuffle}


# ---------------------------------------------------------------------------------------------
# Bucketed batching: every global step holds samples of one bucket (one clip shape).
#
# The uniform schedule above cuts the epoch order into equal global steps, which mixes shapes
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
        return world.rank_positions(start=int(self.bounds[step]), end=int(self.bounds[step + 1]))

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

    policy: ClassVar[str] = "bucketed"
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

    @classmethod
    def for_buckets(cls, **kwargs: Any) -> BucketedSchedule:
        """The registry's constructor (the same keywords as every policy's)."""
        return cls(**kwargs)

    def epoch(self, state: SamplerState, epoch: int) -> BucketedEpoch:
        return bucketed_epoch(self.bucket_ids, num_buckets=self.num_buckets, seed=state.seed, epoch=epoch,
                              global_batch=self.global_batch, shuffle=self.shuffle, drop_last=self.drop_last)

    def steps(self, state: SamplerState) -> Iterator[Step]:
        """Every step from ``state`` on, across epochs; ResumeStateMismatch if state is inside a step."""
        layout = self.epoch(state, state.epoch)
        first = layout.step_at(state.consumed)
        while True:
            for step in range(first, layout.num_steps):
                state = self.advance(state, layout, step)
                yield Step(bucket=int(layout.step_bucket[step]), state_after=state,
                           select=functools.partial(layout.step_indices, step))
            layout, first = self.epoch(state, state.epoch), 0

    def check(self, state: SamplerState) -> None:
        """Refuse a state whose position is not a step boundary of this schedule."""
        self.epoch(state, state.epoch).step_at(state.consumed)

    def batching_state(self) -> dict[str, Any]:
        # The layout depends on the global batch, and on drop_last: whether each bucket's remainder is
        # a step changes the shuffled step list.
        return {"policy": self.policy, "global_batch": self.global_batch, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

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


# ---------------------------------------------------------------------------------------------
# The one registry of batching policies, and the sample order every data source holds.

BATCHING: dict[str, Callable[..., Schedule]] = {
    UniformSchedule.policy: UniformSchedule.for_buckets,
    BucketedSchedule.policy: BucketedSchedule.for_buckets,
}
"""Policy name -> constructor taking (bucket_ids, num_buckets, global_batch, shuffle, drop_last)."""
BATCHING_POLICIES = ("auto", *BATCHING)


def resolve_batching(policy: str, shapes: Sequence[Any]) -> str:
    """The policy a run uses for data of these clip shapes: 'auto' is 'bucketed' exactly when there are several."""
    if policy not in BATCHING_POLICIES:
        raise ValueError(f"batching must be one of {BATCHING_POLICIES}, got {policy!r}")
    if policy == "auto":
        return "bucketed" if len(shapes) > 1 else "fixed_shape"
    if policy == "fixed_shape" and len(shapes) > 1:
        raise ValueError(f"batching 'fixed_shape' would mix the clip shapes {list(shapes)} in a batch; "
                         "use 'bucketed' (or 'auto')")
    return policy


# Batching keys that earlier writers left out of a state: the fixed-shape synthetic source saved a
# bare sampler state (no batching, so no shuffle), the bucketed one no drop_last (always on there).
# Those runs could not have checked them either, so a resume takes the current values.
_UNRECORDED_BY_OLD_WRITERS = ("shuffle", "drop_last")


def _recorded_batching(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> dict[str, Any]:
    """The saved batching in today's form; a state without one predates bucketing: fixed shape."""
    recorded = dict(saved) if saved is not None else {"policy": UniformSchedule.policy}
    for key in _UNRECORDED_BY_OLD_WRITERS:
        if key in current and key not in recorded:
            recorded[key] = current[key]
    return recorded


class SampleOrder:
    """A schedule and the run's place in it: the one sample-order object under every data source.

    The state moves only by `take`, once the consumer finished a step; `steps()` walks from the
    current state on without moving it, so a DataLoader worker can walk its own copy.
    """

    def __init__(self, schedule: Schedule, state: SamplerState) -> None:
        self.schedule, self.state = schedule, state

    def steps(self) -> Iterator[Step]:
        """Every step from the current state on, across epochs."""
        return self.schedule.steps(self.state)

    def take(self, step: Step) -> None:
        """Advance past a finished step (one of `steps()`, taken in order)."""
        self.state = step.state_after

    def describe(self) -> dict[str, Any]:
        return {"batching": self.schedule.policy, "global_batch": self.schedule.global_batch}

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strs, identical on every rank: ``{"sampler": ..., "batching": ...}``."""
        return {"sampler": self.state.state_dict(), "batching": self.schedule.batching_state()}

    def load_state_dict(self, data_state: Mapping[str, Any]) -> None:
        """Resume; a state for another dataset or another batching is refused, never applied."""
        state = nested_state(data_state)
        current = self.schedule.batching_state()
        saved = _recorded_batching(state.get("batching"), current)
        if saved != current:
            raise ResumeStateMismatch(
                f"data state was saved with batching {saved}, but this source batches with {current}: the sample "
                "order is a function of these (the bucketed layout of the global batch, ranks x per-rank batch), "
                "so resuming would replay or skip samples. Resume with the saved settings (any number of ranks and "
                "workers), or start the sampler fresh"
                + (" (a state without batching was written before Trainyard recorded it)"
                   if state.get("batching") is None else ""))
        restored = SamplerState.from_state_dict(state["sampler"], expected_dataset_version=self.state.dataset_version,
                                                expected_num_samples=self.state.num_samples)
        self.schedule.check(restored)  # a position inside a step would split a bucket's batch
        self.state = restored
