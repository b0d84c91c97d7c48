"""Tests of ops/loading/sampling.py: determinism, exactly-once coverage, elastic resumption, tail policy,
the two schedules behind one interface, the batching registry and the saved-state layout.

Ranks are simulated in one process (one IndexStream per rank, tests/sample_streams.py); workers
are real, through torch's DataLoader. Run: python -m pytest tests/test_sampling.py -q
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from sample_streams import IndexStream, num_local_samples, uniform_plan, worker_global_positions
from torch.utils.data import DataLoader

from ops.loading.sampling import (BATCHING, BATCHING_POLICIES, STATE_FORMAT, BucketedSchedule, ResumeStateMismatch, SampleOrder,
                                  SamplerState, UniformSchedule, World, epoch_order, resolve_batching)

NUM_SAMPLES = 37  # prime, so every world size and batch size below leaves an uneven tail
BATCH_SIZE = 4
SEED = 1234
VERSION = "manifest-v1"


def fresh_state(**overrides) -> SamplerState:
    fields = dict(seed=SEED, num_samples=NUM_SAMPLES, dataset_version=VERSION)
    return SamplerState(**(fields | overrides))


def take_steps(state: SamplerState, *, world_size: int, num_steps: int, drop_last: bool = False) -> SamplerState:
    """The state after num_steps global steps of world_size ranks of BATCH_SIZE, as a trainer takes them."""
    schedule = UniformSchedule(global_batch=world_size * BATCH_SIZE, drop_last=drop_last)
    for _, step in zip(range(num_steps), schedule.steps(state), strict=False):
        state = step.state_after
    return state


def rank_batches(
    state: SamplerState,
    *,
    rank: int,
    world_size: int,
    num_workers: int,
    max_steps: int | None = None,
    drop_last: bool = False,
    shuffle: bool = True,
) -> list[list[int]]:
    """What one rank's DataLoader returns, batch by batch (at most max_steps batches)."""
    stream = IndexStream(
        state=state,
        rank=rank,
        world_size=world_size,
        batch_size=BATCH_SIZE,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    loader = DataLoader(stream, batch_size=BATCH_SIZE, num_workers=num_workers)
    batches = []
    for batch in loader:
        if max_steps is not None and len(batches) == max_steps:
            break
        batches.append(batch.tolist())
    return batches


def all_rank_batches(state, *, world_size, num_workers, **kwargs) -> list[list[list[int]]]:
    return [
        rank_batches(state, rank=r, world_size=world_size, num_workers=num_workers, **kwargs)
        for r in range(world_size)
    ]


def interleave_step(per_rank: list[list[list[int]]], step: int) -> list[int]:
    """Global step `step` in global position order: element j of every rank, rank by rank."""
    batches = [b[step] if step < len(b) else [] for b in per_rank]
    return [batch[j] for j in range(BATCH_SIZE) for batch in batches if j < len(batch)]


def assert_steps_follow_order(per_rank, *, order, start, world_size, num_steps) -> None:
    """Every global step, interleaved across ranks, is the next slice of the epoch order."""
    global_batch = world_size * BATCH_SIZE
    for step in range(num_steps):
        begin = start + step * global_batch
        expected = order[begin : begin + global_batch].tolist()
        assert interleave_step(per_rank, step) == expected, f"global step {step}"
    assert all(len(batches) <= num_steps for batches in per_rank)


# --- global order ---------------------------------------------------------------------------


def test_epoch_order_is_a_deterministic_int64_permutation():
    order = epoch_order(1000, seed=7, epoch=3)
    assert order.dtype == np.int64
    assert np.array_equal(np.sort(order), np.arange(1000))
    assert np.array_equal(order, epoch_order(1000, seed=7, epoch=3))


def test_epoch_order_changes_with_epoch_and_seed():
    base = epoch_order(1000, seed=7, epoch=3)
    assert not np.array_equal(base, epoch_order(1000, seed=7, epoch=4))
    assert not np.array_equal(base, epoch_order(1000, seed=8, epoch=3))
    # [seed, epoch] must not collide with [epoch, seed]
    assert not np.array_equal(base, epoch_order(1000, seed=3, epoch=7))


def test_epoch_order_pinned_values():
    # Checkpoints resume by position into this order: if a numpy upgrade changes it, resumed
    # runs would silently replay and skip samples. This test is the tripwire.
    assert epoch_order(12, seed=1234, epoch=0).tolist() == [5, 6, 3, 9, 7, 4, 1, 10, 11, 2, 8, 0]
    assert epoch_order(12, seed=1234, epoch=1).tolist() == [9, 2, 0, 7, 10, 11, 6, 1, 8, 4, 5, 3]


def test_epoch_order_without_shuffle_is_identity():
    assert epoch_order(10, seed=7, epoch=3, shuffle=False).tolist() == list(range(10))


def test_epoch_order_rejects_negative_inputs():
    with pytest.raises(ValueError):
        epoch_order(-1, seed=0, epoch=0)
    with pytest.raises(ValueError):
        epoch_order(10, seed=-1, epoch=0)


# --- World ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rank=2, world_size=2),
        dict(rank=-1, world_size=2),
        dict(rank=0, world_size=0),
        dict(rank=0, world_size=1, worker_id=2, num_workers=2),
        dict(rank=0, world_size=1, worker_id=-1, num_workers=2),
        dict(rank=0, world_size=1, worker_id=0, num_workers=0),
        dict(rank=0, world_size=1, local_rank=-1),
    ],
)
def test_world_rejects_out_of_range(kwargs):
    with pytest.raises(ValueError):
        World(**kwargs)


def test_world_from_env_reads_torchruns_variables():
    assert World.from_env({}) == World(rank=0, world_size=1)
    assert World.from_env({"WORLD_SIZE": "2"}) == World(rank=0, world_size=2)
    launched = World.from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert launched == World(rank=3, world_size=4, local_rank=1, launched=True)
    assert not launched.is_main and World(rank=0, world_size=4).is_main


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "one"}, "environment variable RANK must be an integer, got 'one'"),
        ({"WORLD_SIZE": ""}, "environment variable WORLD_SIZE must be an integer, got ''"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"\(RANK=2, WORLD_SIZE=2, LOCAL_RANK=0\) do not describe a rank: rank must be in \[0"),
        ({"WORLD_SIZE": "0"}, "world_size must be >= 1, got 0"),
        ({"LOCAL_RANK": "-1"}, "local_rank must be >= 0, got -1"),
    ],
)
def test_world_from_env_names_a_bad_variable(env, message):
    with pytest.raises(ValueError, match=message):
        World.from_env(env)


def test_world_in_main_process_is_worker_zero_of_one():
    assert World.from_worker_info(rank=1, world_size=3) == World(rank=1, world_size=3)


def test_workers_own_whole_batches_round_robin():
    num_local, batch_size = 23, 4
    worlds = [World(rank=0, world_size=1, worker_id=w, num_workers=3) for w in range(3)]
    parts = [worker_global_positions(w, start=0, end=num_local, batch_size=batch_size) for w in worlds]
    assert parts[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert parts[1].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert parts[2].tolist() == [8, 9, 10, 11, 20, 21, 22]
    for j in range(num_local):
        assert j in parts[(j // batch_size) % 3]
    assert [[n for n in range(7) if w.owns(n)] for w in worlds] == [[0, 3, 6], [1, 4], [2, 5]]


def test_world_global_batch_is_ranks_times_per_rank_and_must_split_evenly():
    world = World(rank=1, world_size=3)
    assert (world.global_batch(4), world.local_batch(12)) == (12, 4)
    with pytest.raises(ValueError, match="does not split into 3"):
        world.local_batch(10)
    with pytest.raises(ValueError, match="per-rank batch"):
        world.global_batch(0)


# --- one epoch through real DataLoaders -----------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_epoch_covers_every_sample_once_in_global_order(world_size, num_workers):
    state = fresh_state()
    per_rank = all_rank_batches(state, world_size=world_size, num_workers=num_workers)

    seen = [index for batches in per_rank for batch in batches for index in batch]
    assert sorted(seen) == list(range(NUM_SAMPLES))  # exactly once: no padding, no loss

    plan = uniform_plan(state, world_size=world_size, batch_size=BATCH_SIZE)
    order = epoch_order(NUM_SAMPLES, SEED, 0)
    assert_steps_follow_order(
        per_rank, order=order, start=0, world_size=world_size, num_steps=plan.num_global_steps
    )
    for rank, batches in enumerate(per_rank):
        world = World(rank=rank, world_size=world_size)
        local = sum(len(b) for b in batches)
        assert local == num_local_samples(plan, world)
        # only a rank's last batch may be short
        assert all(len(b) == BATCH_SIZE for b in batches[:-1])


def test_uneven_tail_counts():
    # 37 = 3 full steps of 3 x 4, then one sample: only rank 0 reads in the last step.
    state = fresh_state()
    plan = uniform_plan(state, world_size=3, batch_size=BATCH_SIZE)
    assert plan.num_global_steps == 4
    counts = [num_local_samples(plan, World(rank=r, world_size=3)) for r in range(3)]
    assert counts == [13, 12, 12]
    streams = [
        IndexStream(state=state, rank=r, world_size=3, batch_size=BATCH_SIZE) for r in range(3)
    ]
    assert [len(s) for s in streams] == counts
    assert [len(DataLoader(s, batch_size=BATCH_SIZE)) for s in streams] == [4, 3, 3]


def test_without_shuffle_ranks_read_strided_positions():
    per_rank = all_rank_batches(fresh_state(), world_size=2, num_workers=2, shuffle=False)
    flat = [[i for batch in batches for i in batch] for batches in per_rank]
    assert flat[0] == list(range(0, NUM_SAMPLES, 2))
    assert flat[1] == list(range(1, NUM_SAMPLES, 2))


def test_index_stream_survives_pickling():
    stream = IndexStream(state=fresh_state(consumed=8), rank=1, world_size=2, batch_size=4)
    clone = pickle.loads(pickle.dumps(stream))
    assert list(clone) == list(stream)
    assert len(list(stream)) == len(stream)


def test_spawned_workers_read_the_same_stream():
    # Spawned workers (the default on macOS, like forkserver on Python 3.14 Linux) unpickle
    # the stream instead of inheriting it from a fork.
    stream = IndexStream(state=fresh_state(consumed=8), rank=1, world_size=2, batch_size=4)
    spawned = DataLoader(stream, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    in_process = DataLoader(stream, batch_size=4, num_workers=0)
    assert [b.tolist() for b in spawned] == [b.tolist() for b in in_process]


# --- resumption -----------------------------------------------------------------------------

RESUME_CASES = [
    # (old world size, new world size, old workers, new workers)
    (1, 1, 0, 2),
    (2, 2, 2, 0),
    (1, 2, 0, 2),
    (1, 2, 2, 0),
    (2, 1, 2, 0),
    (2, 1, 0, 2),
    (2, 3, 2, 2),
    (2, 3, 0, 0),
    (3, 2, 2, 0),
]


# Stop after 1 step, mid-epoch, and just before the uneven last step of the old world
# (37 samples: 10 steps for one rank of 4, 5 for two, 4 for three).
RESUME_PARAMS = [
    (*case, stop)
    for case in RESUME_CASES
    for stop in sorted({1, 2, -(-NUM_SAMPLES // (case[0] * BATCH_SIZE)) - 1})
]


@pytest.mark.parametrize("old_ws,new_ws,old_workers,new_workers,stop_after_steps", RESUME_PARAMS)
def test_resume_continues_the_same_global_sequence(
    old_ws, new_ws, old_workers, new_workers, stop_after_steps
):
    state = fresh_state()

    # Run the old world for a few steps, advancing the state as a trainer would.
    before = all_rank_batches(
        state, world_size=old_ws, num_workers=old_workers, max_steps=stop_after_steps
    )
    state = take_steps(state, world_size=old_ws, num_steps=stop_after_steps)
    assert state.consumed == stop_after_steps * old_ws * BATCH_SIZE

    # Save, reload through JSON (proves the dict is plain), resume on the new world.
    saved = json.loads(json.dumps(state.state_dict()))
    resumed = SamplerState.from_state_dict(
        saved, expected_dataset_version=VERSION, expected_num_samples=NUM_SAMPLES
    )
    assert resumed == state
    after = all_rank_batches(resumed, world_size=new_ws, num_workers=new_workers)

    order = epoch_order(NUM_SAMPLES, SEED, 0)
    new_plan = uniform_plan(resumed, world_size=new_ws, batch_size=BATCH_SIZE)
    assert_steps_follow_order(
        before, order=order, start=0, world_size=old_ws, num_steps=stop_after_steps
    )
    assert_steps_follow_order(
        after,
        order=order,
        start=resumed.consumed,
        world_size=new_ws,
        num_steps=new_plan.num_global_steps,
    )
    # Nothing missing, nothing repeated, over the whole epoch.
    seen = [i for per_rank in (before, after) for b in per_rank for batch in b for i in batch]
    assert sorted(seen) == list(range(NUM_SAMPLES))

    # Stepping the resumed state through its plan ends the epoch exactly.
    resumed = take_steps(resumed, world_size=new_ws, num_steps=new_plan.num_global_steps)
    assert (resumed.epoch, resumed.consumed) == (1, 0)


def test_resume_at_an_unaligned_position_on_a_new_world():
    # consumed need not be a multiple of the new global batch: rank r starts at consumed + r.
    state = fresh_state(consumed=5)
    per_rank = all_rank_batches(state, world_size=3, num_workers=2)
    order = epoch_order(NUM_SAMPLES, SEED, 0)
    plan = uniform_plan(state, world_size=3, batch_size=BATCH_SIZE)
    assert_steps_follow_order(
        per_rank, order=order, start=5, world_size=3, num_steps=plan.num_global_steps
    )
    seen = sorted(i for b in per_rank for batch in b for i in batch)
    assert seen == sorted(order[5:].tolist())


def test_resume_refuses_other_dataset_version():
    saved = fresh_state(consumed=8).state_dict()
    with pytest.raises(ResumeStateMismatch, match="manifest-v1.*manifest-v2"):
        SamplerState.from_state_dict(
            saved, expected_dataset_version="manifest-v2", expected_num_samples=NUM_SAMPLES
        )


def test_resume_refuses_other_sample_count():
    saved = fresh_state(consumed=8).state_dict()
    with pytest.raises(ResumeStateMismatch, match="37 samples.*38 samples"):
        SamplerState.from_state_dict(
            saved, expected_dataset_version=VERSION, expected_num_samples=38
        )


def test_resume_mismatch_is_a_value_error():
    assert issubclass(ResumeStateMismatch, ValueError)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda d: d.pop("consumed"),
        lambda d: d.update(format=STATE_FORMAT + 1),
        lambda d: d.update(extra=1),
        lambda d: d.update(consumed="8"),
        lambda d: d.update(consumed=NUM_SAMPLES),
    ],
)
def test_from_state_dict_rejects_malformed_state(corrupt):
    saved = fresh_state(consumed=8).state_dict()
    corrupt(saved)
    with pytest.raises(ValueError):
        SamplerState.from_state_dict(
            saved, expected_dataset_version=VERSION, expected_num_samples=NUM_SAMPLES
        )


def test_state_dict_is_plain():
    saved = fresh_state(epoch=2, consumed=8, num_dropped=3).state_dict()
    assert saved == {
        "format": STATE_FORMAT,
        "seed": SEED,
        "num_samples": NUM_SAMPLES,
        "dataset_version": VERSION,
        "epoch": 2,
        "consumed": 8,
        "num_dropped": 3,
    }


# --- advancing and epochs -------------------------------------------------------------------


def test_uniform_steps_take_the_uneven_tail_and_start_the_next_epoch():
    state = fresh_state()
    sizes = []
    while state.epoch == 0:
        before = state.consumed
        state = take_steps(state, world_size=3, num_steps=1)
        sizes.append((state.consumed or NUM_SAMPLES) - before)
    assert sizes == [12, 12, 12, 1]
    assert (state.epoch, state.consumed, state.num_dropped) == (1, 0, 0)

    # The next epoch reads a new order, again exactly once.
    per_rank = all_rank_batches(state, world_size=3, num_workers=0)
    flat = [i for b in per_rank for batch in b for i in batch]
    assert sorted(flat) == list(range(NUM_SAMPLES))
    assert interleave_step(per_rank, 0) == epoch_order(NUM_SAMPLES, SEED, 1)[:12].tolist()


# --- drop_last ------------------------------------------------------------------------------


def test_drop_last_drops_the_partial_global_step_and_records_it():
    state = fresh_state()
    plan = uniform_plan(state, world_size=2, batch_size=BATCH_SIZE, drop_last=True)
    assert (plan.end, plan.num_dropped, plan.num_global_steps) == (32, 5, 4)

    per_rank = all_rank_batches(state, world_size=2, num_workers=2, drop_last=True)
    assert [len(b) for b in per_rank] == [4, 4]
    assert all(len(batch) == BATCH_SIZE for b in per_rank for batch in b)
    order = epoch_order(NUM_SAMPLES, SEED, 0)
    assert_steps_follow_order(per_rank, order=order, start=0, world_size=2, num_steps=4)
    seen = sorted(i for b in per_rank for batch in b for i in batch)
    assert seen == sorted(order[:32].tolist())
    assert num_local_samples(plan, World(rank=1, world_size=2)) == 16

    state = take_steps(state, world_size=2, num_steps=plan.num_global_steps, drop_last=True)
    assert (state.epoch, state.consumed, state.num_dropped) == (1, 0, 5)


def test_drop_last_after_resuming_onto_a_larger_world():
    # 37 - 32 = 5 left: a world of 3 x 4 cannot fill a step, so the epoch has none left.
    state = fresh_state(consumed=32)
    stream = IndexStream(state=state, rank=0, world_size=3, batch_size=4, drop_last=True)
    assert (stream.num_dropped, len(stream), list(stream)) == (5, 0, [])
    # The schedule rolls the stepless rest over, counting its drops, and goes on in epoch 1.
    step = next(UniformSchedule(global_batch=12, drop_last=True).steps(state))
    assert (step.state_after.epoch, step.state_after.consumed, step.state_after.num_dropped) == (1, 12, 5)
    parts = [step.indices(World(rank=r, world_size=3)) for r in range(3)]
    assert [part[j] for j in range(4) for part in parts] == epoch_order(NUM_SAMPLES, SEED, 1)[:12].tolist()


# --- config validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(seed=-1),
        dict(num_samples=0),
        dict(dataset_version=""),
        dict(epoch=-1),
        dict(consumed=-1),
        dict(consumed=NUM_SAMPLES),
        dict(num_dropped=-1),
    ],
)
def test_sampler_state_rejects_bad_fields(overrides):
    with pytest.raises(ValueError):
        fresh_state(**overrides)


def test_uniform_schedule_rejects_bad_global_batch():
    with pytest.raises(ValueError):
        UniformSchedule(global_batch=0)


# --- the two schedules, the registry, the saved state ---------------------------------------


def test_uniform_steps_are_pinned():
    # Values from the code before both schedules shared one interface (issue 10): a change of
    # step order would make every resumed run replay and skip samples, and every loss differ.
    schedule = UniformSchedule(global_batch=4)
    steps = schedule.steps(SamplerState(seed=3, num_samples=10, dataset_version=VERSION))
    got = [[step.indices(World(rank=r, world_size=2)) for r in range(2)] for _, step in zip(range(7), steps, strict=False)]
    assert got == [[[0, 9], [4, 7]], [[1, 6], [5, 3]], [[8], [2]], [[0, 2], [6, 1]], [[3, 4], [7, 9]], [[8], [5]],
                   [[4, 8], [0, 5]]]


@pytest.mark.parametrize(("num_samples", "expected"), [
    (12, [(1, [1, 10]), (2, [8, 2]), (0, [6, 3]), (1, [4, 7]), (2, [5, 11]), (0, [0, 9]), (1, [4, 10]), (1, [1, 7])]),
    (13, [(1, [4, 7]), (2, [5, 11]), (0, [12, 6]), (0, [3]), (1, [1, 10]), (2, [8, 2]), (0, [0, 9]), (1, [1, 7])]),
])
def test_bucketed_steps_are_pinned(num_samples, expected):
    schedule = BucketedSchedule(bucket_ids=np.arange(num_samples) % 3, num_buckets=3, global_batch=2)
    steps = schedule.steps(SamplerState(seed=3, num_samples=num_samples, dataset_version=VERSION))
    assert [(step.bucket, step.indices(World(rank=0, world_size=1))) for _, step in zip(range(8), steps, strict=False)] \
        == expected


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_uniform_schedule_steps_are_the_index_streams_batches_across_epochs(world_size, drop_last):
    """The persistent form (one walk over epochs) and the plain per-epoch stream agree."""
    state, steps = fresh_state(consumed=5), UniformSchedule(global_batch=world_size * BATCH_SIZE,
                                                            drop_last=drop_last).steps(fresh_state(consumed=5))
    while state.epoch < 2:
        per_rank = all_rank_batches(state, world_size=world_size, num_workers=2, drop_last=drop_last)
        num_steps = uniform_plan(state, world_size=world_size, batch_size=BATCH_SIZE, drop_last=drop_last).num_global_steps
        for number in range(num_steps):
            step = next(steps)
            assert [step.indices(World(rank=r, world_size=world_size)) for r in range(world_size)] == \
                [batches[number] if number < len(batches) else [] for batches in per_rank]
        state = step.state_after
    assert (state.epoch, state.consumed) == (2, 0)


def test_registry_names_the_policies_and_auto_resolves_by_shape_count():
    assert BATCHING_POLICIES == ("auto", "fixed_shape", "bucketed")
    one, two = ["8x64x64"], ["8x64x64", "16x64x64"]
    assert (resolve_batching("auto", one), resolve_batching("auto", two)) == ("fixed_shape", "bucketed")
    assert resolve_batching("bucketed", one) == "bucketed"
    with pytest.raises(ValueError, match=r"would mix the clip shapes \['8x64x64', '16x64x64'\]"):
        resolve_batching("fixed_shape", two)
    with pytest.raises(ValueError, match="must be one of"):
        resolve_batching("padded", one)
    ids = np.arange(NUM_SAMPLES) % 2
    for policy, kind in (("fixed_shape", UniformSchedule), ("bucketed", BucketedSchedule)):
        schedule = BATCHING[policy](bucket_ids=ids, num_buckets=2, global_batch=8, shuffle=False, drop_last=True)
        assert type(schedule) is kind and schedule.batching_state()["policy"] == policy


def _order(policy: str, *, global_batch: int = 8, shuffle: bool = True, drop_last: bool = False) -> SampleOrder:
    schedule = BATCHING[policy](bucket_ids=np.arange(NUM_SAMPLES) % 2, num_buckets=2, global_batch=global_batch,
                                shuffle=shuffle, drop_last=drop_last)
    return SampleOrder(schedule, fresh_state())


@pytest.mark.parametrize("policy", ["fixed_shape", "bucketed"])
def test_sample_order_state_is_nested_and_resumes_the_same_steps(policy):
    order = _order(policy)
    uninterrupted = [step.indices(World(rank=0, world_size=1)) for _, step in zip(range(12), order.steps(), strict=False)]
    for _, step in zip(range(5), order.steps(), strict=False):
        order.take(step)
    saved = json.loads(json.dumps(order.state_dict()))
    assert set(saved) == {"sampler", "batching"} and saved["batching"]["policy"] == policy
    resumed = _order(policy)
    resumed.load_state_dict(saved)
    assert resumed.state == order.state
    rest = [step.indices(World(rank=0, world_size=1)) for _, step in zip(range(7), resumed.steps(), strict=False)]
    assert rest == uninterrupted[5:]
    assert resumed.describe() == {"batching": policy, "global_batch": 8}


def test_an_old_flat_state_loads_and_takes_the_current_shuffle():
    """The fixed-shape synthetic source saved the bare sampler state, without its batching."""
    order = _order("fixed_shape", shuffle=False)
    order.load_state_dict(fresh_state(epoch=1, consumed=8).state_dict())
    assert (order.state.epoch, order.state.consumed) == (1, 8)
    with pytest.raises(ResumeStateMismatch, match="written before Trainyard recorded it"):
        _order("bucketed").load_state_dict(fresh_state().state_dict())


def test_an_old_bucketed_state_without_drop_last_loads_when_drop_last_is_on():
    saved = {"sampler": fresh_state().state_dict(), "batching": {"policy": "bucketed", "global_batch": 8, "shuffle": True}}
    order = _order("bucketed", drop_last=True)
    order.load_state_dict(saved)
    assert order.state == fresh_state()
    with pytest.raises(ResumeStateMismatch, match="'drop_last': True"):
        _order("bucketed", drop_last=True).load_state_dict(
            {**saved, "batching": {**saved["batching"], "drop_last": False}})


@pytest.mark.parametrize(("policy", "change"), [
    ("fixed_shape", {"shuffle": False}),
    ("fixed_shape", {"policy": "bucketed"}),
    ("bucketed", {"global_batch": 4}),
    ("bucketed", {"shuffle": False}),
    ("bucketed", {"drop_last": True}),
])
def test_a_nested_state_with_another_recorded_batching_is_refused(policy, change):
    saved = _order(policy).state_dict()
    saved["batching"].update(change)
    order = _order(policy)
    with pytest.raises(ResumeStateMismatch, match="saved with batching"):
        order.load_state_dict(saved)
    assert order.state == fresh_state(), "a refused state is never applied"


def test_a_bucketed_state_inside_a_step_is_refused():
    order = _order("bucketed", global_batch=8)
    inside = {"sampler": fresh_state(consumed=3).state_dict(), "batching": order.schedule.batching_state()}
    with pytest.raises(ResumeStateMismatch, match="not a step boundary"):
        order.load_state_dict(inside)
