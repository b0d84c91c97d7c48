"""Batching by duration and shape bucket, from the clip plan to the loader's resumable steps.

The layout (ops/loading/sampling.py, bucketed section) is checked on synthetic bucket ids over many
sizes; the plan, shards and loader on real shards cut from the demo media in four buckets
(square long, square short, landscape, portrait) with real PyAV decoding.
"""

from __future__ import annotations

import io
import itertools
import json
import logging

import av
import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset
from helpers import manifest_row, write_shards

from assets.clips import ShardBuildConfig
from ops.clips import shards as shards_ops
from ops.clips.plan import ShardConfig, assign_bucket, parse_bucket, plan_clips
from ops.loading.loader import ClipLoader, LoaderConfig
from ops.curation.manifest import MANIFEST_SCHEMA
from ops.media.codec import ClipShape
from ops.loading.sampling import BucketedSchedule, ResumeStateMismatch, SamplerState, World, bucketed_epoch
from ops.clips.shards import ShardIndex, read_index

BUCKETS = ((8, 64, 64), (16, 64, 64), (8, 48, 80), (8, 80, 48))
SPLIT = "test"  # 25 clips: 17 portrait, 7 long square, 1 landscape (fewer than any batch here)
SEED = 3


# --- the layout -----------------------------------------------------------------------------


def _random_ids(num_samples: int, num_buckets: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, num_buckets, num_samples)


@pytest.mark.parametrize(("num_samples", "num_buckets", "global_batch", "drop_last"),
                         list(itertools.product([1, 7, 64, 257], [1, 3, 5], [1, 4, 16], [False, True])))
def test_every_step_is_one_bucket_and_every_sample_is_read_once_or_counted_as_dropped(
        num_samples, num_buckets, global_batch, drop_last) -> None:
    ids = _random_ids(num_samples, num_buckets, seed=num_samples)
    layout = bucketed_epoch(ids, num_buckets=num_buckets, seed=SEED, epoch=2, global_batch=global_batch,
                            drop_last=drop_last)
    sizes = np.diff(layout.bounds)
    for step in range(layout.num_steps):
        members = layout.order[layout.bounds[step]:layout.bounds[step + 1]]
        assert set(ids[members].tolist()) == {layout.step_bucket[step]}
    counts = np.bincount(ids, minlength=num_buckets)
    assert sorted(layout.order.tolist()) == sorted(set(layout.order.tolist())), "a sample repeated"
    if drop_last:
        assert (sizes == global_batch).all()
        assert layout.dropped == {b: int(c % global_batch) for b, c in enumerate(counts) if c % global_batch}
        assert len(layout.order) + layout.num_dropped == num_samples
    else:
        assert sorted(layout.order.tolist()) == list(range(num_samples))
        short = sizes < global_batch
        assert short.sum() == sum(1 for c in counts if c % global_batch), "one short step per bucket remainder"


def test_layout_is_a_function_of_seed_and_epoch_and_buckets_interleave() -> None:
    ids = _random_ids(400, 3, seed=0)
    layouts = [bucketed_epoch(ids, num_buckets=3, seed=SEED, epoch=epoch, global_batch=8) for epoch in (0, 0, 1)]
    assert np.array_equal(layouts[0].order, layouts[1].order)
    assert not np.array_equal(layouts[0].order, layouts[2].order)
    assert len(set(layouts[0].step_bucket[:10].tolist())) > 1, "full steps of different buckets are shuffled together"
    unshuffled = bucketed_epoch(ids, num_buckets=3, seed=SEED, epoch=0, global_batch=8, shuffle=False)
    assert list(unshuffled.step_bucket) == sorted(unshuffled.step_bucket), "no shuffle: bucket-major"
    assert unshuffled.order.tolist() == sorted(range(400), key=lambda i: ids[i]), "and sample order within"
    short = np.flatnonzero(np.diff(layouts[0].bounds) < 8)
    num_short = sum(1 for count in np.bincount(ids) if count % 8)
    assert len(short) == num_short and short.tolist() != list(range(layouts[0].num_steps - num_short,
                                                                     layouts[0].num_steps)), \
        "short steps are shuffled in with the full ones, not left at the end of the epoch"


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_ranks_split_each_step_and_interleave_back_to_it(world_size) -> None:
    ids = _random_ids(101, 3, seed=1)
    layout = bucketed_epoch(ids, num_buckets=3, seed=SEED, epoch=0, global_batch=6)
    for step in range(layout.num_steps):
        parts = [layout.step_indices(step, World(rank=r, world_size=world_size)).tolist()
                 for r in range(world_size)]
        interleaved = [part[j] for j in range(max(map(len, parts))) for part in parts if j < len(part)]
        assert interleaved == layout.order[layout.bounds[step]:layout.bounds[step + 1]].tolist()


def _walk(schedule: BucketedSchedule, state: SamplerState, num_steps: int) -> tuple[list[list[int]], SamplerState]:
    steps, taken = schedule.steps(state), []
    for _ in range(num_steps):
        step = next(steps)
        taken.append(step.indices(World(rank=0, world_size=1)))
        state = step.state_after
    return taken, state


@pytest.mark.parametrize("drop_last", [False, True])
def test_schedule_resumes_from_any_step_across_epochs(drop_last) -> None:
    ids = _random_ids(50, 3, seed=2)
    schedule = BucketedSchedule(bucket_ids=ids, num_buckets=3, global_batch=4, drop_last=drop_last)
    start = SamplerState(seed=SEED, num_samples=50, dataset_version="v")
    uninterrupted, end = _walk(schedule, start, 40)  # about three epochs
    assert end.epoch >= 2
    for stop in (1, 7, 13, 29):
        first, middle = _walk(schedule, start, stop)
        schedule.check(middle)
        rest, after = _walk(schedule, SamplerState.from_state_dict(
            middle.state_dict(), expected_dataset_version="v", expected_num_samples=50), 40 - stop)
        assert first + rest == uninterrupted and after == end
    if drop_last:
        assert end.num_dropped == end.epoch * bucketed_epoch(
            ids, num_buckets=3, seed=SEED, epoch=0, global_batch=4, drop_last=True).num_dropped


def test_a_state_off_the_step_boundaries_is_refused() -> None:
    """A position that is no step boundary of this layout (here: saved under another global batch).

    A position that happens to be a boundary of both layouts passes this check; the loaders also
    record the global batch in their state and refuse a change outright (tests below).
    """
    ids = _random_ids(50, 3, seed=2)
    other = BucketedSchedule(bucket_ids=ids, num_buckets=3, global_batch=5)
    boundaries = set(other.epoch(SamplerState(seed=SEED, num_samples=50, dataset_version="v"), 0).bounds.tolist())
    state = SamplerState(seed=SEED, num_samples=50, dataset_version="v")
    schedule = BucketedSchedule(bucket_ids=ids, num_buckets=3, global_batch=4)
    while state.consumed in boundaries:
        _, state = _walk(schedule, state, 1)
    schedule.check(state)
    with pytest.raises(ResumeStateMismatch, match="not a step boundary"):
        other.check(state)


def test_drop_last_with_no_bucket_filling_a_batch_is_refused_up_front() -> None:
    with pytest.raises(ValueError, match="no bucket fills a global batch of 8"):
        BucketedSchedule(bucket_ids=np.array([0, 1, 1, 2]), num_buckets=3, global_batch=8, drop_last=True)


# --- the plan ---------------------------------------------------------------------------------


def _config(**overrides) -> ShardConfig:
    return ShardConfig(buckets=BUCKETS, **overrides)


@pytest.mark.parametrize(("width", "height", "duration_s", "bucket"), [
    (128, 128, 5.0, "16x64x64"),   # square, long enough for the long clip
    (128, 128, 1.5, "8x64x64"),    # square, too short for 2 s: the short clip
    (160, 90, 3.0, "8x48x80"),     # 16:9 -> the landscape bucket
    (90, 160, 3.0, "8x80x48"),     # 9:16 -> the portrait bucket
    (96, 128, 3.0, "8x80x48"),     # 3:4 is nearer 3:5 than 1:1
    (160, 90, 0.5, None),          # shorter than its bucket's 1 s clip: no clip, counted
    (0, 0, 3.0, "16x64x64"),       # unknown size: treated as square
])
def test_sources_go_to_the_nearest_aspect_then_the_longest_clip_that_fits(width, height, duration_s,
                                                                          bucket) -> None:
    assert assign_bucket(width=width, height=height, duration_s=duration_s, config=_config()) == bucket


def test_plan_cuts_each_source_to_its_bucket_duration() -> None:
    rows = [manifest_row("wide.mp4", width=160, height=90, duration_s=3.0),
            manifest_row("square.mp4", width=128, height=128, duration_s=4.5),
            manifest_row("tiny.mp4", width=128, height=128, duration_s=0.4)]
    table = MANIFEST_SCHEMA.empty_table().from_pylist(rows, schema=MANIFEST_SCHEMA)
    plan = plan_clips(table, _config(), manifest_version="m", validated_version="v")
    by_uri = {}
    for row in plan.table.to_pylist():
        by_uri.setdefault(row["uri"], []).append((row["bucket"], row["start_s"], row["end_s"]))
    assert by_uri["wide.mp4"] == [("8x48x80", 0.0, 1.0), ("8x48x80", 1.0, 2.0), ("8x48x80", 2.0, 3.0)]
    assert by_uri["square.mp4"] == [("16x64x64", 0.0, 2.0), ("16x64x64", 2.0, 4.0)]
    assert "tiny.mp4" not in by_uri and plan.num_sources_too_short == 1
    unbucketed = plan_clips(table, ShardConfig(), manifest_version="m", validated_version="v")
    assert set(unbucketed.table.column("bucket").to_pylist()) == {"8x64x64"}
    assert unbucketed.version != plan.version, "the buckets are part of the plan's version"


@pytest.mark.parametrize(("buckets", "message"), [
    (((8, 64, 64), (8, 64, 64)), "distinct"),
    (((8, 64, 63),), "even"),
    (((0, 64, 64),), "num_frames"),
])
def test_bad_bucket_configs_are_refused(buckets, message) -> None:
    with pytest.raises(ValueError, match=message):
        ShardConfig(buckets=buckets)


def test_dagster_config_with_a_clip_shape_means_one_shape_and_both_together_are_refused() -> None:
    assert list(ShardBuildConfig().to_ops().bucket_shapes) == ["8x64x64", "16x64x64", "8x48x80", "8x80x48"]
    assert list(ShardBuildConfig(num_frames=16, width=96, height=96).to_ops().bucket_shapes) == ["16x96x96"]
    assert list(ShardBuildConfig(buckets=[]).to_ops().bucket_shapes) == ["8x64x64"]
    with pytest.raises(ValueError, match=r"\['num_frames'\] set the one clip shape"):
        ShardBuildConfig(num_frames=16, buckets=["8x64x64"]).to_ops()


def test_dagster_config_parses_bucket_names_and_refuses_bad_ones() -> None:
    config = ShardBuildConfig(buckets=["8x64x64", "16X48x80"]).to_ops()
    assert config.buckets == ((8, 64, 64), (16, 48, 80))
    assert list(config.bucket_shapes) == ["8x64x64", "16x48x80"]
    assert parse_bucket("8x48x80") == (8, 48, 80)
    with pytest.raises(ValueError, match="FRAMESxHEIGHTxWIDTH"):
        ShardBuildConfig(buckets=["8x64"]).to_ops()


# --- shards and the loader ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def bucketed(demo_validation, tmp_path_factory) -> dict[str, ShardIndex]:
    return {encoding: write_shards(demo_validation, _config(encoding=encoding, clips_per_shard=8),
                                   tmp_path_factory.mktemp(f"bucketed_{encoding}"))[1]
            for encoding in ("compressed", "decoded")}


def test_index_and_samples_carry_their_bucket_and_plain_webdataset_reads_its_shape(bucketed) -> None:
    index = bucketed["compressed"]
    counts = {name: index.table.column("bucket").to_pylist().count(name) for name in index.bucket_shapes}
    assert sum(1 for count in counts.values() if count) >= 3, counts
    buckets = dict(zip(index.table.column("sample_key").to_pylist(), index.table.column("bucket").to_pylist()))
    shards = sorted({str(index.directory / f"{shard}.tar") for shard in index.table.column("shard").to_pylist()})
    seen = 0
    for sample in webdataset.WebDataset(shards, shardshuffle=False, empty_check=False):
        meta = json.loads(sample["meta.json"])
        shape = index.bucket_shapes[meta["bucket"]]
        assert meta["bucket"] == buckets[sample["__key__"]]
        assert (meta["num_frames"], meta["height"], meta["width"]) == (shape.num_frames, shape.height, shape.width)
        with av.open(io.BytesIO(sample["clip.mkv"])) as container:
            frames = [frame for frame in container.decode(video=0)]
        assert (len(frames), frames[0].height, frames[0].width) == (shape.num_frames, shape.height, shape.width)
        seen += 1
    assert seen == index.table.num_rows


def test_an_index_written_before_buckets_reads_as_its_one_shape(demo_validation, tmp_path) -> None:
    _, index = write_shards(demo_validation, ShardConfig(encoding="decoded", splits=("train",)), tmp_path)
    table = pq.read_table(tmp_path / "index.parquet")
    pq.write_table(table.drop_columns(["bucket"]), tmp_path / "index.parquet")
    info = json.loads((tmp_path / "index.json").read_text())
    del info["config"]["buckets"]
    as_read = pq.read_table(tmp_path / "index.parquet", schema=shards_ops.SHARD_INDEX_SCHEMA)  # bucket: nulls
    info["version"] = shards_ops._index_version(info, as_read)  # every field is in the version
    (tmp_path / "index.json").write_text(json.dumps(info))
    from ops.publish.storage import write_record  # the old index as it was published then: its files under their record
    write_record(tmp_path, version=info["version"], files=["index.parquet", "index.json"], record="index.digests.json")
    old = read_index(tmp_path)
    assert old.table.column("bucket").to_pylist() == ["8x64x64"] * table.num_rows
    assert ClipLoader(old, LoaderConfig(batch_size=4)).batching == "fixed_shape"


def _loaders(index, *, world_size, batch_size, num_workers=0, drop_last=False, state=None, **overrides):
    config = LoaderConfig(batch_size=batch_size, split=SPLIT, num_workers=num_workers, seed=SEED,
                          drop_last=drop_last, verify_shards=False, **overrides)
    loaders = [ClipLoader(index, config, rank=rank, world_size=world_size) for rank in range(world_size)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    return loaders


def _global_steps(loaders, num_steps) -> tuple[list[tuple[str, list[int]]], dict]:
    """(bucket, global indices interleaved j-major over ranks) per step, and the common state after."""
    iterators = [iter(loader) for loader in loaders]
    steps = []
    for _ in range(num_steps):
        batches = [next(iterator) for iterator in iterators]
        assert len({batch["bucket"] for batch in batches}) == 1, "ranks disagree on the step's bucket"
        for batch in batches:
            shape = loaders[0].index.bucket_shapes[batch["bucket"]]
            assert tuple(batch["video"].shape[1:4]) == (shape.num_frames, shape.height, shape.width)
            assert tuple(batch["audio"].shape[1:]) == (shape.num_audio_samples,)
            assert not batch["failed"]
        width = max(len(batch["indices"]) for batch in batches)
        steps.append((batches[0]["bucket"], [batch["indices"][j] for j in range(width) for batch in batches
                                             if j < len(batch["indices"])]))
    for iterator in iterators:
        iterator.close()
    states = [loader.state_dict() for loader in loaders]
    assert all(state == states[0] for state in states)
    return steps, states[0]


def test_loader_batches_one_bucket_per_step_covering_the_epoch_once(bucketed) -> None:
    index = bucketed["decoded"]
    (loader,) = _loaders(index, world_size=1, batch_size=4)
    assert loader.batching == "bucketed"
    layout = loader.schedule.epoch(loader.state, 0)
    steps, state = _global_steps([loader], layout.num_steps)
    assert state["sampler"]["epoch"] == 1 and state["sampler"]["consumed"] == 0
    indices = [i for _, step in steps for i in step]
    assert sorted(indices) == list(range(index.split(SPLIT).num_rows))
    assert [bucket for bucket, _ in steps] == [list(index.bucket_shapes)[b] for b in layout.step_bucket]
    described = loader.describe()
    assert described["batching"] == "bucketed" and described["global_batch"] == 4
    assert described["bucket_counts"]["8x48x80"] == 1 and set(described["bucket_shapes"]) == set(index.bucket_shapes)


@pytest.mark.parametrize(("stop", "before", "after"), [
    (1, (1, 4, 0), (2, 2, 2)),   # (world size, per-rank batch, workers): global batch 4 throughout
    (4, (2, 2, 2), (1, 4, 0)),
    (6, (1, 4, 2), (4, 1, 0)),
    (9, (2, 2, 0), (2, 2, 2)),   # into the second epoch
])
def test_resume_on_another_world_and_worker_count_continues_the_same_steps(bucketed, stop, before, after) -> None:
    index = bucketed["decoded"]
    uninterrupted, _ = _global_steps(_loaders(index, world_size=1, batch_size=4), 14)
    world, batch, workers = before
    first, state = _global_steps(_loaders(index, world_size=world, batch_size=batch, num_workers=workers), stop)
    world, batch, workers = after
    rest, _ = _global_steps(_loaders(index, world_size=world, batch_size=batch, num_workers=workers, state=state),
                            14 - stop)
    assert first + rest == uninterrupted


def test_resume_with_another_global_batch_policy_shuffle_or_drop_last_is_refused(bucketed) -> None:
    """Each of these changes the step layout; many step boundaries coincide, so the position alone
    would not notice, and the resumed run would replay or skip samples."""
    index = bucketed["decoded"]
    _, state = _global_steps(_loaders(index, world_size=1, batch_size=4), 2)
    with pytest.raises(ResumeStateMismatch, match="global batch"):
        _loaders(index, world_size=1, batch_size=3, state=state)
    with pytest.raises(ResumeStateMismatch, match="global batch"):
        _loaders(index, world_size=2, batch_size=4, state=state)
    with pytest.raises(ResumeStateMismatch, match="'drop_last': False"):
        _loaders(index, world_size=1, batch_size=4, drop_last=True, state=state)
    with pytest.raises(ResumeStateMismatch, match="'shuffle': True"):
        _loaders(index, world_size=1, batch_size=4, shuffle=False, state=state)
    fixed_state = {**state, "batching": {"policy": "fixed_shape", "shuffle": True}}
    with pytest.raises(ResumeStateMismatch, match="batching"):
        _loaders(index, world_size=1, batch_size=4, state=fixed_state)
    unrecorded = {key: value for key, value in state.items() if key != "batching"}
    with pytest.raises(ResumeStateMismatch, match="written before Trainyard recorded it"):
        _loaders(index, world_size=1, batch_size=4, state=unrecorded)


def test_fixed_shape_batching_of_a_bucketed_index_is_refused(bucketed) -> None:
    with pytest.raises(ValueError, match="would mix the clip shapes"):
        _loaders(bucketed["decoded"], world_size=1, batch_size=4, batching="fixed_shape")


def test_a_bucket_smaller_than_a_batch_is_one_short_step_or_dropped_and_counted(bucketed, caplog) -> None:
    index = bucketed["decoded"]
    with caplog.at_level(logging.WARNING, logger="ops.loading.loader"):
        (kept,) = _loaders(index, world_size=1, batch_size=4)
    assert "bucket 8x48x80 of split 'test' has 1 samples, fewer than a global batch of 4" in caplog.text
    steps, _ = _global_steps([kept], kept.schedule.epoch(kept.state, 0).num_steps)
    assert ("8x48x80", [i for b, s in steps if b == "8x48x80" for i in s]) in steps and \
        len([s for b, s in steps if b == "8x48x80"]) == 1

    (dropping,) = _loaders(index, world_size=1, batch_size=4, drop_last=True)
    layout = dropping.schedule.epoch(dropping.state, 0)
    steps, state = _global_steps([dropping], layout.num_steps)
    assert "8x48x80" not in {bucket for bucket, _ in steps}
    assert all(len(step) == 4 for _, step in steps)
    counts = dropping.bucket_counts
    assert layout.dropped == {b: counts[name] % 4 for b, name in enumerate(index.bucket_shapes)
                              if counts[name] % 4}
    assert state["sampler"]["num_dropped"] == layout.num_dropped and state["sampler"]["epoch"] == 1


def test_compressed_bucketed_shards_decode_to_each_bucket_shape_in_workers(bucketed) -> None:
    index = bucketed["compressed"]
    (loader,) = _loaders(index, world_size=1, batch_size=2, num_workers=2)
    steps, _ = _global_steps([loader], 6)
    assert len({bucket for bucket, _ in steps}) >= 2


def test_shapes_of_buckets_come_from_one_clip_shape(bucketed) -> None:
    shapes = bucketed["decoded"].bucket_shapes
    assert shapes["16x64x64"] == ClipShape(num_frames=16, fps=8.0, width=64, height=64, audio_rate=16_000)
    assert shapes["16x64x64"].num_audio_samples == 2 * shapes["8x64x64"].num_audio_samples
