"""Reused shared-memory batch slots (ops/loading/loader.py, _SlotLeases): a batch, or any view or array
of it, that the consumer still holds is never overwritten, and slots nobody holds are reused.

Real DataLoader workers over real (decoded-encoding) demo shards; the content of every held
batch is checked against its samples decoded afresh from the shard, after the loader has moved on.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from helpers import write_shards

from ops.clips.plan import ShardConfig
from ops.loading.loader import ClipLoader, LoaderConfig
from ops.clips.shards import ShardIndex, decode_members, read_members

NUM_WORKERS, PREFETCH = 2, 2
SLOTS_PER_WORKER = PREFETCH + 2  # what ClipLoader gives each worker


@pytest.fixture(scope="module")
def index(demo_validation, tmp_path_factory) -> ShardIndex:
    _, shard_index = write_shards(demo_validation, ShardConfig(encoding="decoded", clips_per_shard=8),
                                  tmp_path_factory.mktemp("slot_shards"))
    return shard_index


def _loader(index: ShardIndex, **overrides) -> ClipLoader:
    config = LoaderConfig(**{"batch_size": 4, "num_workers": NUM_WORKERS, "prefetch_factor": PREFETCH,
                             "verify_shards": False, **overrides})
    return ClipLoader(index, config)


def _truth(index: ShardIndex, indices: list[int]) -> np.ndarray:
    table = index.split("train").to_pylist()
    frames = []
    for position in indices:
        row = table[position]
        with open(index.directory / f"{row['shard']}.tar", "rb") as handle:
            members = read_members(handle, row["offset"], row["length"])
        frames.append(decode_members(members, index.bucket_shapes[row["bucket"]])[0])
    return np.stack(frames)


def test_held_batches_views_and_arrays_keep_their_content_while_the_loader_runs_on(index) -> None:
    held, steps = [], 4 * NUM_WORKERS * SLOTS_PER_WORKER  # more held batches than slots: fresh ones take over
    iterator = iter(_loader(index))
    for step in range(steps):
        batch = next(iterator)
        if step % 3 == 0:
            held.append(("tensor", batch["video"], batch["indices"]))
        elif step % 3 == 1:  # a view alone (the batch dict and its tensor dropped)
            held.append(("view", batch["video"][:, ::2].permute(0, 4, 1, 2, 3), batch["indices"]))
        else:  # a numpy array alone
            held.append(("numpy", batch["video"].numpy(), batch["indices"]))
        del batch
    iterator.close()
    for kind, value, indices in held:
        truth = _truth(index, indices)
        if kind == "view":
            truth = np.transpose(truth[:, ::2], (0, 4, 1, 2, 3))
        got = value.numpy() if isinstance(value, torch.Tensor) else value
        assert np.array_equal(got, truth), f"a held {kind} was overwritten"


def _segments(index: ShardIndex, num_batches: int, **overrides) -> set[int]:
    """The shared-memory segments (tmpfs inodes) the batches arrived in. Not addresses: a freed
    segment's address is often given to the next one."""
    iterator = iter(_loader(index, **overrides))
    segments = set()
    for _ in range(num_batches):
        batch = next(iterator)
        fd, _size = batch["video"].untyped_storage()._share_fd_cpu_()
        segments.add(os.fstat(fd).st_ino)
        assert "slot" not in batch  # bookkeeping stays inside the loader
    iterator.close()
    return segments


def test_slots_nobody_holds_are_reused_instead_of_allocating_every_batch(index) -> None:
    assert len(_segments(index, 30)) <= NUM_WORKERS * SLOTS_PER_WORKER
    # The same count tells the difference: fresh memory is one segment per batch.
    assert len(_segments(index, 30, reuse_batch_memory=False)) == 30


def test_without_workers_or_with_one_every_batch_is_still_right(index) -> None:
    for workers in (0, 1):
        iterator = iter(_loader(index, num_workers=workers, shuffle=False))
        batches = [next(iterator) for _ in range(6)]
        iterator.close()
        for batch in batches:
            assert np.array_equal(batch["video"].numpy(), _truth(index, batch["indices"]))
