"""Resumption tests of ops/loading/loader.py in the style of MosaicML Streaming, on real shards.

Stop mid-epoch, rebuild a new ClipLoader, load its state and resume with the same or another
world size (ranks simulated in this process, one ClipLoader per rank) and worker count; then
check that no sample is missing or repeated and that the ranks' batches, interleaved as the
ops/sampling contract says, give the uninterrupted run's order, into the next epoch too.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import write_shards

from ops.clips.plan import ShardConfig
from ops.loading.loader import ClipLoader, LoaderConfig
from ops.loading.sampling import ResumeStateMismatch, epoch_order
from ops.clips.shards import ShardIndex, decode_members, read_members

SPLIT = "test"  # 33 clips in the demo set: uneven for every world and batch size used here
BATCH_SIZE = 3
SEED = 7


@pytest.fixture(scope="module")
def index(demo_validation, tmp_path_factory) -> ShardIndex:
    _, shard_index = write_shards(demo_validation, ShardConfig(encoding="decoded", clips_per_shard=8),
                                  tmp_path_factory.mktemp("loader_shards"))
    return shard_index


def _loaders(index: ShardIndex, *, world_size: int, num_workers: int, batch_size: int = BATCH_SIZE,
             state: dict | None = None) -> list[ClipLoader]:
    config = LoaderConfig(batch_size=batch_size, split=SPLIT, num_workers=num_workers, seed=SEED,
                          verify_shards=False)
    loaders = [ClipLoader(index, config, rank=rank, world_size=world_size) for rank in range(world_size)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    return loaders


def _take(loader: ClipLoader, num_steps: int) -> list[dict]:
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(num_steps)]
    iterator.close()  # shuts the DataLoader workers down
    return batches


def _run(loaders: list[ClipLoader], num_steps: int) -> tuple[list[list[dict]], dict]:
    """num_steps batches from every rank, and the (common) state after them."""
    per_rank = [_take(loader, num_steps) for loader in loaders]
    states = [loader.state_dict() for loader in loaders]
    assert all(state == states[0] for state in states), "ranks disagree on where the run is"
    assert not [f for batches in per_rank for batch in batches for f in batch["failed"]]
    return per_rank, states[0]


def _interleave(per_rank: list[list[dict]]) -> list[int]:
    """Global order from per-rank batches: step by step, element j of every rank (j-major, r-minor)."""
    order = []
    for step in zip(*per_rank, strict=True):
        for j in range(max(len(batch["indices"]) for batch in step)):
            order += [batch["indices"][j] for batch in step if j < len(batch["indices"])]
    return order


def _steps_left(loader: ClipLoader) -> int:
    return loader.schedule.plan(loader.state).num_global_steps  # fixed-shape data: a UniformSchedule


def _steps_per_epoch(index: ShardIndex, world_size: int) -> int:
    return -(-index.split(SPLIT).num_rows // (world_size * BATCH_SIZE))


@pytest.fixture(scope="module")
def uninterrupted(index) -> list[list[int]]:
    """Global order of epochs 0 and 1 read by one rank without a stop."""
    (loader,) = _loaders(index, world_size=1, num_workers=0)
    steps = _steps_per_epoch(index, 1)
    (batches,), _ = _run([loader], 2 * steps)
    return [_interleave([batches[:steps]]), _interleave([batches[steps:]])]


def test_uninterrupted_run_follows_the_sampling_order(index, uninterrupted) -> None:
    num_samples = index.split(SPLIT).num_rows
    for epoch, order in enumerate(uninterrupted):
        assert order == epoch_order(num_samples, SEED, epoch).tolist()
        assert sorted(order) == list(range(num_samples)), "every sample exactly once per epoch"
    assert uninterrupted[0] != uninterrupted[1], "each epoch has its own permutation"


def test_batches_hold_the_samples_they_name(index) -> None:
    (loader,) = _loaders(index, world_size=1, num_workers=0)
    (batch,) = _take(loader, 1)
    assert batch["video"].shape == (BATCH_SIZE, 8, 64, 64, 3) and batch["audio"].shape == (BATCH_SIZE, 16_000)
    rows = index.split(SPLIT).to_pylist()
    for j, position in enumerate(batch["indices"]):
        row = rows[position]
        assert batch["keys"][j] == row["sample_key"]
        with open(index.directory / f"{row['shard']}.tar", "rb") as handle:
            video, audio, meta = decode_members(read_members(handle, row["offset"], row["length"]), index.config.shape)
        assert np.array_equal(batch["video"][j].numpy(), video) and np.array_equal(batch["audio"][j].numpy(), audio)
        assert bool(batch["has_audio"][j]) == meta["has_audio"]


@pytest.mark.parametrize(("stop_after", "world_before", "workers_before", "world_after", "workers_after"), [
    (1, 1, 0, 2, 0),
    (3, 2, 0, 1, 0),
    (5, 1, 0, 1, 0),
    (2, 2, 0, 2, 0),
    (11, 1, 0, 2, 0),   # stopped exactly at the end of epoch 0
    (3, 1, 0, 2, 2),    # more workers after the stop
    (2, 2, 2, 1, 0),    # fewer workers and ranks after the stop
])
def test_resume_with_other_world_and_workers_reproduces_the_order(
        index, uninterrupted, stop_after: int, world_before: int, workers_before: int,
        world_after: int, workers_after: int) -> None:
    before, saved = _run(_loaders(index, world_size=world_before, num_workers=workers_before), stop_after)
    resumed = _loaders(index, world_size=world_after, num_workers=workers_after, state=saved)
    assert [loader.state_dict()["sampler"] for loader in resumed] == [saved["sampler"]] * world_after
    left = _steps_left(resumed[0])
    stopped_mid_epoch_0 = saved["sampler"]["epoch"] == 0
    # Finish the epoch of the stop, then (if that was epoch 0) read all of epoch 1 under the new world.
    after, state = _run(resumed, left + (_steps_per_epoch(index, world_after) if stopped_mid_epoch_0 else 0))

    if stopped_mid_epoch_0:
        epoch_0 = _interleave(before) + _interleave([batches[:left] for batches in after])
        epoch_1 = _interleave([batches[left:] for batches in after])
    else:
        epoch_0, epoch_1 = _interleave(before), _interleave(after)
    num_samples = index.split(SPLIT).num_rows
    assert sorted(epoch_0) == sorted(epoch_1) == list(range(num_samples)), "none missing, none repeated"
    assert epoch_0 == uninterrupted[0]
    assert epoch_1 == uninterrupted[1]
    assert (state["sampler"]["epoch"], state["sampler"]["consumed"]) == (2, 0)


def test_every_rank_takes_the_same_steps_with_an_empty_batch_in_the_uneven_tail(index) -> None:
    num_samples = index.split(SPLIT).num_rows
    loaders = _loaders(index, world_size=2, num_workers=0, batch_size=2)
    steps = -(-num_samples // 4)
    assert num_samples % 4 == 1, "the last step holds one sample, so rank 1 has none"
    per_rank, state = _run(loaders, steps + 1)
    last, after = [batches[steps - 1] for batches in per_rank], [batches[steps] for batches in per_rank]
    assert [len(batch["keys"]) for batch in last] == [1, 0]
    assert tuple(last[1]["video"].shape) == (0, 8, 64, 64, 3) and tuple(last[1]["audio"].shape) == (0, 16_000)
    assert last[1]["failed"] == [] and last[1]["has_audio"].shape == (0,)
    assert _interleave([[batch] for batch in after]) == epoch_order(num_samples, SEED, 1)[:4].tolist(), (
        "both ranks go on into the next epoch together")
    epoch_0 = _interleave([batches[:steps] for batches in per_rank])
    assert epoch_0 == epoch_order(num_samples, SEED, 0).tolist()
    assert (state["sampler"]["epoch"], state["sampler"]["consumed"]) == (1, 4)


def test_state_is_the_position_after_the_last_yielded_batch_with_workers_prefetching(index) -> None:
    (loader,) = _loaders(index, world_size=1, num_workers=2)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    saved = loader.state_dict()  # workers have prefetched further; the state must not count that
    iterator.close()
    assert (saved["sampler"]["epoch"], saved["sampler"]["consumed"]) == (0, 2 * BATCH_SIZE)


def test_a_loader_state_as_written_before_issue_10_resumes_and_another_batching_is_refused(index, uninterrupted) -> None:
    """The layout every checkpoint so far holds, spelled out: it must keep loading unchanged."""
    sampler = {"format": 1, "seed": SEED, "num_samples": index.split(SPLIT).num_rows,
               "dataset_version": f"{index.version}/{SPLIT}", "epoch": 0, "consumed": 2 * BATCH_SIZE, "num_dropped": 0}
    old = {"sampler": sampler, "manifest_version": index.manifest_version, "shard_index_version": index.version,
           "split": SPLIT, "batching": {"policy": "fixed_shape", "shuffle": True}}
    (loader,) = _loaders(index, world_size=1, num_workers=0, state=old)
    assert loader.state_dict() == old
    (batches,), _ = _run([loader], 2)
    assert _interleave([batches]) == uninterrupted[0][2 * BATCH_SIZE:4 * BATCH_SIZE]
    with pytest.raises(ResumeStateMismatch, match="'shuffle': False"):
        _loaders(index, world_size=1, num_workers=0, state={**old, "batching": {**old["batching"], "shuffle": False}})


def test_a_drop_last_resume_onto_a_larger_world_rolls_the_stepless_rest_over(index) -> None:
    num_samples = index.split(SPLIT).num_rows  # 33: one rank of 3 stops at 30, 3 left for a global batch of 6
    config = LoaderConfig(batch_size=BATCH_SIZE, split=SPLIT, num_workers=0, seed=SEED, drop_last=True,
                          verify_shards=False)
    (single,) = [ClipLoader(index, config)]
    _, saved = _run([single], 10)
    assert saved["sampler"]["consumed"] == 30
    pair = [ClipLoader(index, config, rank=rank, world_size=2) for rank in range(2)]
    for loader in pair:
        loader.load_state_dict(saved)
    per_rank, state = _run(pair, 1)
    assert _interleave(per_rank) == epoch_order(num_samples, SEED, 1)[:6].tolist()
    assert (state["sampler"]["epoch"], state["sampler"]["consumed"], state["sampler"]["num_dropped"]) == (1, 6, 3)
