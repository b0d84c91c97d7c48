"""Tests of ops/clips/plan.py: clip start times, the shard plan, sample keys, plan versions, configs.

Plans are built from small hand-made validated tables (no media needed); clips are 1 s long
(8 frames at 8 fps) so the expected start times are easy to read.
"""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from helpers import manifest_row

from ops.clips.plan import ClipPlan, ShardConfig, clip_starts, plan_clips, read_plan, sample_key, write_plan
from ops.curation.manifest import MANIFEST_SCHEMA
from ops.media.codec import ClipShape

SHAPE = ClipShape(num_frames=8, fps=8.0, width=64, height=64, audio_rate=16_000)  # 1.0 s clips


def _config(**changes) -> ShardConfig:
    return ShardConfig(**{"shape": SHAPE, **changes})


def _validated(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=MANIFEST_SCHEMA)


def _plan(rows: list[dict], config: ShardConfig | None = None, *, validated_version: str = "validated-1",
          code_version: str = "") -> ClipPlan:
    return plan_clips(_validated(rows), config or _config(), manifest_version="manifest-1",
                      validated_version=validated_version, code_version=code_version)


def _sources() -> list[dict]:
    """Sources in three splits; b.mp4 and e.mp4 are shorter than one clip."""
    return [
        manifest_row("a.mp4", split="train", duration_s=3.5, audio_codec="aac"),
        manifest_row("b.mp4", split="train", duration_s=0.9),
        manifest_row("c.mp4", split="train", duration_s=5.0),
        manifest_row("d.mp4", split="val", duration_s=2.0),
        manifest_row("e.mp4", split="test", duration_s=0.5),
        manifest_row("f.mp4", split="test", duration_s=30.0),
    ]


# --- start times -------------------------------------------------------------------------

@pytest.mark.parametrize(("duration_s", "starts"), [
    (3.5, [0.0, 1.0, 2.0]),
    (3.0, [0.0, 1.0, 2.0]),       # a clip that ends exactly at the end of the source is kept
    (2.999, [0.0, 1.0]),
    (1.0, [0.0]),
    (0.999, []),                   # shorter than one clip: none
])
def test_clips_are_cut_back_to_back(duration_s: float, starts: list[float]) -> None:
    assert clip_starts(duration_s, _config()) == starts


def test_stride_sets_the_gap_between_starts() -> None:
    assert clip_starts(2.0, _config(stride_s=0.5)) == [0.0, 0.5, 1.0]
    assert clip_starts(5.0, _config(stride_s=2.0)) == [0.0, 2.0, 4.0]
    # A stride that is not a whole number of milliseconds is rounded per start, never accumulated.
    assert clip_starts(2.0, _config(stride_s=1 / 3)) == [0.0, 0.333, 0.667, 1.0]


def test_max_clips_per_source_caps_each_source() -> None:
    assert clip_starts(30.0, _config(max_clips_per_source=4)) == [0.0, 1.0, 2.0, 3.0]
    plan = _plan(_sources(), _config(max_clips_per_source=2))
    per_uri = {uri: plan.table.column("uri").to_pylist().count(uri) for uri in ("a.mp4", "c.mp4", "f.mp4")}
    assert per_uri == {"a.mp4": 2, "c.mp4": 2, "f.mp4": 2}


# --- the plan ----------------------------------------------------------------------------

def test_sources_shorter_than_one_clip_are_counted_not_dropped_silently() -> None:
    plan = _plan(_sources())
    assert plan.num_sources_too_short == 2
    assert {"b.mp4", "e.mp4"}.isdisjoint(plan.table.column("uri").to_pylist())
    # 3 + 5 train clips, 2 val, 16 test (capped by the default max_clips_per_source).
    assert plan.table.num_rows == 3 + 5 + 2 + 16


def test_rows_follow_split_uri_start_order_with_clip_ends() -> None:
    plan = _plan(list(reversed(_sources())))
    rows = plan.table.to_pylist()
    order = {split: rank for rank, split in enumerate(plan.config.splits)}
    assert [(order[r["split"]], r["uri"], r["start_s"]) for r in rows] == sorted(
        (order[r["split"]], r["uri"], r["start_s"]) for r in rows)
    assert all(math.isclose(r["end_s"] - r["start_s"], SHAPE.duration_s) for r in rows)
    assert {r["uri"]: r["has_audio"] for r in rows} == {"a.mp4": True, "c.mp4": False, "d.mp4": False,
                                                        "f.mp4": False}


def test_shards_hold_one_split_and_at_most_clips_per_shard() -> None:
    plan = _plan(_sources(), _config(clips_per_shard=3))
    rows = plan.table.to_pylist()
    for shard in plan.shards:
        shard_rows = plan.rows_for(shard)
        assert 1 <= len(shard_rows) <= 3, shard
        assert {row["split"] for row in shard_rows} == {shard.split("-")[0]}, shard
    counts = {split: sum(r["split"] == split for r in rows) for split in ("train", "val", "test")}
    assert counts == {"train": 8, "val": 2, "test": 16}
    assert plan.shards == sorted([f"test-{k:05d}" for k in range(6)] + ["train-00000", "train-00001", "train-00002",
                                                                         "val-00000"])
    # Every shard but the last of its split is full.
    assert [len(plan.rows_for(f"train-{k:05d}")) for k in range(3)] == [3, 3, 2]


def test_only_configured_splits_are_planned() -> None:
    plan = _plan(_sources(), _config(splits=("train",)))
    assert set(plan.table.column("split").to_pylist()) == {"train"}
    assert plan.num_sources_too_short == 1  # b.mp4; e.mp4 is in a split that is not sharded


def test_sample_keys_have_no_dots_and_are_unique() -> None:
    plan = _plan(_sources(), _config(stride_s=0.25))
    keys = plan.table.column("sample_key").to_pylist()
    assert len(keys) == len(set(keys)) == plan.table.num_rows
    assert not any("." in key for key in keys)
    row = plan.table.to_pylist()[1]
    assert row["sample_key"] == sample_key(row["asset_id"], row["start_s"]) == f"{row['asset_id'][:16]}-000000250"


def test_stride_finer_than_the_key_resolution_is_refused() -> None:
    # Keys carry the start in whole milliseconds: two starts in one millisecond would share a key.
    with pytest.raises(ValueError, match="stride_s"):
        _config(stride_s=0.0004)


def test_empty_validated_set_gives_an_empty_plan() -> None:
    plan = _plan([])
    assert plan.table.num_rows == 0 and plan.shards == [] and plan.num_sources_too_short == 0


# --- plan version ------------------------------------------------------------------------

def test_plan_version_is_stable_for_the_same_inputs() -> None:
    first = _plan(_sources())
    assert _plan(_sources()).version == first.version
    assert _plan(list(reversed(_sources()))).version == first.version  # input row order does not matter


@pytest.mark.parametrize("change", [
    {"config": _config(clips_per_shard=4)},
    {"config": _config(encoding="decoded")},
    {"config": _config(stride_s=0.5)},
    {"config": _config(max_clips_per_source=3)},
    {"config": _config(shape=ClipShape(num_frames=8, fps=8.0, width=32, height=32, audio_rate=16_000))},
    {"validated_version": "validated-2"},
    {"code_version": "shards-code-2"},
])
def test_plan_version_changes_with_config_validated_version_and_code(change: dict) -> None:
    assert _plan(_sources(), **change).version != _plan(_sources()).version


def test_plan_round_trips_through_its_files(tmp_path) -> None:
    plan = _plan(_sources(), _config(clips_per_shard=5, stride_s=0.5))
    back = read_plan(write_plan(plan, tmp_path))
    assert back.table.equals(plan.table)
    assert (back.version, back.config, back.manifest_version, back.validated_version, back.num_sources_too_short) == (
        plan.version, plan.config, plan.manifest_version, plan.validated_version, plan.num_sources_too_short)
    assert not [path.name for path in tmp_path.iterdir() if path.name.startswith(".")]


# --- config validation -------------------------------------------------------------------

@pytest.mark.parametrize(("changes", "match"), [
    ({"width": 63}, "even"),
    ({"height": 33}, "even"),
    ({"width": 0}, "even"),
    ({"num_frames": 0}, "num_frames"),
    ({"fps": 0.0}, "fps"),
    ({"audio_rate": 0}, "audio_rate"),
])
def test_clip_shape_rejects_bad_values(changes: dict, match: str) -> None:
    fields = {"num_frames": 8, "fps": 8.0, "width": 64, "height": 64, "audio_rate": 16_000, **changes}
    with pytest.raises(ValueError, match=match):
        ClipShape(**fields)


@pytest.mark.parametrize(("changes", "match"), [
    ({"encoding": "jpeg"}, "encoding"),
    ({"clips_per_shard": 0}, "clips_per_shard"),
    ({"max_clips_per_source": 0}, "max_clips_per_source"),
    ({"stride_s": 0.0}, "stride_s"),
    ({"stride_s": -1.0}, "stride_s"),
    ({"splits": ()}, "splits"),
    ({"splits": ("train", "train")}, "splits"),
])
def test_shard_config_rejects_bad_values(changes: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _config(**changes)


def test_clip_shape_derived_sizes() -> None:
    shape = ClipShape(num_frames=12, fps=8.0, width=64, height=32, audio_rate=16_000)
    assert shape.duration_s == 1.5 and shape.num_audio_samples == 24_000


# --- measured duration (review nit) ------------------------------------------------------

def test_clips_stay_within_the_measured_duration_when_the_packets_end_sooner() -> None:
    # Declared 3.0 s, but the video packets end at 2.2 s (within the probe's tolerance, or a
    # container whose audio runs longer): a clip at 2.0 s would reach past the last real frame
    # and fail its shard with source_ended, predictably.
    plan = _plan([manifest_row("a.mp4", split="train", duration_s=3.0, measured_duration_s=2.2)])
    assert plan.table.column("start_s").to_pylist() == [0.0, 1.0]
    assert max(plan.table.column("end_s").to_pylist()) <= 2.2


def test_a_measured_duration_longer_than_declared_never_adds_clips() -> None:
    plan = _plan([manifest_row("a.mp4", split="train", duration_s=2.0, measured_duration_s=3.0)])
    assert plan.table.column("start_s").to_pylist() == [0.0, 1.0]


def test_a_source_measured_shorter_than_one_clip_is_counted_too_short() -> None:
    plan = _plan([manifest_row("a.mp4", split="train", duration_s=1.5, measured_duration_s=0.8)])
    assert plan.table.num_rows == 0 and plan.num_sources_too_short == 1
