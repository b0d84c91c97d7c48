"""Test-only views of ops/loading/sampling.py's uniform order: the plain per-epoch index stream.

`IndexStream` is the simplest reader of the sampling contract (points 3 and 4): one epoch of one
rank's global sample indices, split into whole local batches round-robin over DataLoader
workers, as torch's DataLoader expects. The shard loader keeps its workers across epochs
instead (ops/loading/loader.py); the tests use this stream to check the contract against torch itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch.utils.data

from ops.loading.sampling import EpochPlan, SamplerState, UniformSchedule, World, epoch_order


def uniform_plan(state: SamplerState, *, world_size: int, batch_size: int, drop_last: bool = False) -> EpochPlan:
    """The rest of state's epoch for world_size ranks of batch_size samples each."""
    return UniformSchedule(global_batch=World(rank=0, world_size=world_size).global_batch(batch_size),
                           drop_last=drop_last).plan(state)


def num_local_samples(plan: EpochPlan, world: World) -> int:
    """Samples left in the plan for world's rank; ranks differ by at most one, in the last step."""
    return len(world.rank_positions(start=plan.start, end=plan.end))


def worker_global_positions(world: World, *, start: int, end: int, batch_size: int) -> np.ndarray:
    """Global positions in [start, end) that world's rank and worker yield, in order.

    Local position j (the j-th of the rank's positions) goes to worker (j // batch_size) % K: the
    worker owns whole local batches k, k + K, ...
    """
    rank_positions = world.rank_positions(start=start, end=end)
    batch_starts = np.arange(world.worker_id * batch_size, len(rank_positions), world.num_workers * batch_size,
                             dtype=np.int64)
    local = (batch_starts[:, None] + np.arange(batch_size, dtype=np.int64)[None, :]).ravel()
    local = local[local < len(rank_positions)]
    return rank_positions.start + local * rank_positions.step


class IndexStream(torch.utils.data.IterableDataset):
    """Global sample indices of one epoch for one rank and, inside a DataLoader, for the current worker.

    Wrap it in DataLoader(batch_size=batch_size, drop_last=False, in_order=True): the DataLoader's
    own drop_last would cut each worker's partial batch. Immutable: build a new one per epoch.
    """

    def __init__(self, *, state: SamplerState, rank: int, world_size: int, batch_size: int, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        super().__init__()
        self.state, self.batch_size, self.shuffle = state, batch_size, shuffle
        self.world = World(rank=rank, world_size=world_size)
        self.plan = uniform_plan(state, world_size=world_size, batch_size=batch_size, drop_last=drop_last)

    @property
    def num_dropped(self) -> int:
        return self.plan.num_dropped

    def __len__(self) -> int:
        return num_local_samples(self.plan, self.world)

    def __iter__(self) -> Iterator[int]:
        world = World.from_worker_info(rank=self.world.rank, world_size=self.world.world_size)
        positions = worker_global_positions(world, start=self.plan.start, end=self.plan.end,
                                            batch_size=self.batch_size)
        if positions.size == 0:
            return  # a worker with no batch skips the O(N log N) order
        order = epoch_order(self.state.num_samples, self.state.seed, self.state.epoch, shuffle=self.shuffle)
        yield from order[positions].tolist()
