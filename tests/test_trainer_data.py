"""Tests of trainer/data.py: SyntheticClips follows ops/loading/sampling.py's global order (rank r takes
positions r, r+W, ...), so a global step holds the same samples for every world size, and its
state resumes under another world size with nothing missing or repeated. With buckets (several
clip shapes) every global step is one bucket, in the synthetic source and through ShardClips on
real bucketed shards, which the trainer then trains on.

Run: python -m pytest tests/test_trainer_data.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import write_clip, write_shards

from ops.clips.plan import ShardConfig
from ops.curation.manifest import ManifestConfig, build_manifest
from ops.loading.sampling import ResumeStateMismatch, World, epoch_order
from ops.clips.shards import ShardIndex
from ops.curation.validation import ValidationConfig, validate
from trainer.launch.config import load_config
from trainer.launch.preflight import preflight
from trainer.data import DataConfig, ShardClips, SyntheticClips
from trainer.train import Trainer

GLOBAL_BATCH = 8
NUM_SAMPLES = 30  # not a multiple of 8: each epoch drops a tail of 6


def config(**overrides) -> DataConfig:
    fields = dict(batch_size=GLOBAL_BATCH, clip_frames=4, height=16, width=16, audio_samples=128,
                  num_samples=NUM_SAMPLES, seed=5)
    return DataConfig(**(fields | overrides))


def sources(world_size: int, cfg: DataConfig | None = None) -> list[SyntheticClips]:
    cfg = cfg or config()
    return [SyntheticClips(cfg, world=World(rank=rank, world_size=world_size),
                           local_batch_size=GLOBAL_BATCH // world_size) for rank in range(world_size)]


def global_steps(world_size: int, num_steps: int) -> list[list[int]]:
    """Each step's samples, ranks interleaved element by element (j-major, r-minor)."""
    ranks = sources(world_size)
    steps = []
    for _ in range(num_steps):
        per_rank = [source.next_indices() for source in ranks]
        steps.append([index for column in zip(*per_rank, strict=True) for index in column])
    return steps


def test_ranks_take_interleaved_positions_of_the_epoch_order() -> None:
    order = epoch_order(NUM_SAMPLES, 5, 0)
    rank0, rank1 = sources(2)
    assert rank0.next_indices() == order[[0, 2, 4, 6]].tolist()
    assert rank1.next_indices() == order[[1, 3, 5, 7]].tolist()


def test_global_steps_are_the_same_for_every_world_size() -> None:
    reference = global_steps(1, 9)  # crosses two epoch boundaries
    assert global_steps(2, 9) == reference
    assert global_steps(4, 9) == reference
    first_epoch = [index for step in reference[:3] for index in step]
    assert len(set(first_epoch)) == 24  # 3 full steps, no repeats; the 6 left over are dropped


def test_batches_have_the_contract_shapes_and_are_deterministic() -> None:
    (first,), (again,) = sources(1), sources(1)
    batch, repeat = first.next_batch(), again.next_batch()
    assert batch["video"].shape == (8, 4, 16, 16, 3) and batch["video"].dtype == torch.uint8
    assert batch["audio"].shape == (8, 128) and batch["audio"].dtype == torch.float32
    assert batch["has_audio"].dtype == torch.bool and len(batch["keys"]) == 8
    assert torch.equal(batch["video"], repeat["video"]) and batch["keys"] == repeat["keys"]
    silent = ~batch["has_audio"]
    assert bool((batch["audio"][silent] == 0).all()) and bool((batch["audio"][~silent] != 0).any())


def test_resume_on_another_world_size_continues_the_same_order() -> None:
    reference = global_steps(1, 6)
    (single,) = sources(1)
    for _ in range(4):
        single.next_indices()
    state = single.state_dict()
    resumed = sources(4)
    for source in resumed:
        source.load_state_dict(state)
    for expected in reference[4:]:
        per_rank = [source.next_indices() for source in resumed]
        assert [index for column in zip(*per_rank, strict=True) for index in column] == expected


def test_state_is_nested_like_the_loaders_and_an_old_flat_state_still_resumes() -> None:
    reference = global_steps(1, 6)
    (single,) = sources(1)
    for _ in range(4):
        single.next_indices()
    state = single.state_dict()
    assert state["batching"] == {"policy": "fixed_shape", "shuffle": True}
    flat = state["sampler"]  # how checkpoints before issue 10 saved a fixed-shape synthetic source
    resumed = sources(2)
    for source in resumed:
        source.load_state_dict(flat)
    for expected in reference[4:]:
        per_rank = [source.next_indices() for source in resumed]
        assert [index for column in zip(*per_rank, strict=True) for index in column] == expected


def test_loading_a_state_after_batches_rewinds_to_it() -> None:
    reference = global_steps(1, 4)
    (source,) = sources(1)
    source.next_indices()
    state = source.state_dict()
    source.next_indices(), source.next_indices()
    source.load_state_dict(state)
    assert [source.next_indices() for _ in range(3)] == reference[1:]


def test_an_old_bucketed_state_without_drop_last_still_resumes() -> None:
    reference = bucketed_steps(bucketed_sources(1), 5)
    (single,) = bucketed_sources(1)
    bucketed_steps([single], 2)
    state = single.state_dict()
    del state["batching"]["drop_last"]  # not recorded before issue 10: always on in this source
    (resumed,) = bucketed_sources(1)
    resumed.load_state_dict(state)
    assert bucketed_steps([resumed], 3) == reference[2:]


def test_state_for_another_dataset_is_refused() -> None:
    (small,) = sources(1)
    (other,) = sources(1, config(num_samples=64))
    with pytest.raises(ResumeStateMismatch):
        other.load_state_dict(small.state_dict())


def test_content_depends_on_the_sample_not_the_epoch() -> None:
    (source,) = sources(1)
    seen: dict[str, np.ndarray] = {}
    for _ in range(8):  # more than two epochs
        batch = source.next_batch()
        for key, video in zip(batch["keys"], batch["video"], strict=True):
            if key in seen:
                assert np.array_equal(seen[key], video.numpy())
            seen[key] = video.numpy()
    assert len(seen) <= NUM_SAMPLES


# ---------------------------------------------------------------------------------------------
# Bucketed synthetic clips: one clip shape per global step

BUCKETS = [[4, 16, 16], [8, 16, 16], [4, 16, 24]]
BUCKETED_BATCH = 4  # 30 samples: 10 a bucket, 2 full steps each and 2 dropped, 6 steps an epoch


def bucketed_config(**overrides) -> DataConfig:
    return config(**({"buckets": BUCKETS, "batch_size": BUCKETED_BATCH} | overrides))


def bucketed_sources(world_size: int, cfg: DataConfig | None = None) -> list[SyntheticClips]:
    cfg = cfg or bucketed_config()
    return [SyntheticClips(cfg, world=World(rank=rank, world_size=world_size),
                           local_batch_size=cfg.batch_size // world_size) for rank in range(world_size)]


def bucketed_steps(ranks: list[SyntheticClips], num_steps: int) -> list[tuple[str, list[str]]]:
    """(bucket, keys) of each global step, ranks interleaved; checks every rank's batch on the way."""
    steps = []
    for _ in range(num_steps):
        batches = [source.next_batch() for source in ranks]
        (bucket,) = {batch["bucket"] for batch in batches}  # every rank holds the same bucket
        frames, height, width = map(int, bucket.split("x"))
        for batch in batches:
            assert batch["video"].shape[1:] == (frames, height, width, 3)
            assert batch["audio"].shape[1] == 128 * frames // 4  # the reference clip's audio rate
        steps.append((bucket, [key for column in zip(*(b["keys"] for b in batches), strict=True)
                               for key in column]))
    return steps


def test_bucketed_steps_hold_one_shape_each_sample_at_most_once_an_epoch() -> None:
    reference = bucketed_steps(bucketed_sources(1), 12)  # two epochs
    for epoch in (reference[:6], reference[6:]):
        keys = [key for _, step in epoch for key in step]
        assert len(keys) == len(set(keys)) == 24  # 2 full steps of each bucket; 2 a bucket dropped
        for bucket, step in epoch:  # sample i lives in bucket i % 3
            assert {int(key.removeprefix("synthetic-")) % 3 for key in step} == {BUCKETS.index(
                [int(size) for size in bucket.split("x")])}
        assert sorted(bucket for bucket, _ in epoch) == sorted(["4x16x16", "8x16x16", "4x16x24"] * 2)
    assert [bucket for bucket, _ in reference[:6]] != [bucket for bucket, _ in reference[6:]]  # reshuffled
    assert bucketed_steps(bucketed_sources(2), 12) == reference
    assert bucketed_steps(bucketed_sources(4), 12) == reference


def test_bucketed_resume_mid_epoch_on_another_world_size_continues_the_same_stream() -> None:
    reference = bucketed_steps(bucketed_sources(1), 10)
    (single,) = bucketed_sources(1)
    bucketed_steps([single], 3)
    state = single.state_dict()
    assert state["batching"] == {"policy": "bucketed", "global_batch": BUCKETED_BATCH, "shuffle": True,
                                 "drop_last": True}
    resumed = bucketed_sources(2)
    for source in resumed:
        source.load_state_dict(state)
    assert bucketed_steps(resumed, 7) == reference[3:]


def test_bucketed_state_of_another_layout_is_refused() -> None:
    (source,) = bucketed_sources(1)
    bucketed_steps([source], 1)
    state = source.state_dict()
    (other_batch,) = bucketed_sources(1, bucketed_config(batch_size=8))
    with pytest.raises(ResumeStateMismatch, match="global_batch"):
        other_batch.load_state_dict(state)
    (other_buckets,) = bucketed_sources(1, bucketed_config(buckets=BUCKETS[:2]))
    with pytest.raises(ResumeStateMismatch, match="dataset version"):
        other_buckets.load_state_dict(state)
    (unshuffled,) = bucketed_sources(1, bucketed_config(shuffle=False))
    with pytest.raises(ResumeStateMismatch, match="'shuffle': True"):
        unshuffled.load_state_dict(state)
    (fixed,) = sources(1)
    with pytest.raises(ResumeStateMismatch, match="batching"):
        fixed.load_state_dict(state)
    inside_a_step = {**state, "sampler": {**state["sampler"], "consumed": state["sampler"]["consumed"] + 1}}
    with pytest.raises(ResumeStateMismatch, match="not a step boundary"):
        bucketed_sources(1)[0].load_state_dict(inside_a_step)


def test_batching_policies_are_the_loaders() -> None:
    import ops.loading.loader
    import trainer.launch.config_sections

    # The config's choice list (what a YAML may name) is the loader's, which is the sample order's.
    assert trainer.launch.config_sections.BATCHING_POLICIES == ops.loading.loader.BATCHING_POLICIES


def test_describe_reports_the_resolved_batching_and_buckets() -> None:
    (source,) = bucketed_sources(1)
    assert source.describe() == {
        "source": "synthetic", "batching": "bucketed", "global_batch": 4,
        "bucket_counts": {"4x16x16": 10, "8x16x16": 10, "4x16x24": 10},
        "bucket_shapes": {"4x16x16": [4, 16, 16], "8x16x16": [8, 16, 16], "4x16x24": [4, 16, 24]}}
    assert sources(1)[0].describe() == {"source": "synthetic", "batching": "fixed_shape", "global_batch": 8,
                                        "bucket_counts": {"4x16x16": NUM_SAMPLES},
                                        "bucket_shapes": {"4x16x16": [4, 16, 16]}}


# ---------------------------------------------------------------------------------------------
# Real bucketed shards through ShardClips

SHARD_BUCKETS = [[4, 16, 16], [8, 16, 16], [4, 16, 24]]  # 0.5 s, 1 s, 0.5 s at 8 fps
# name -> (width, height, frames at 10 fps, with audio): square sources of 4 s are cut into four
# 1 s clips (8x16x16), square ones of 0.9 s into one 0.5 s clip (4x16x16), the 3:2 one into
# four 0.5 s clips (4x16x24): 8, 4 and 4 samples.
SOURCES = {"square_long_a": (32, 32, 40, True), "square_long_b": (32, 32, 40, False),
           **{f"square_short_{k}": (32, 32, 9, k == 0) for k in range(4)}, "wide": (48, 32, 20, True)}


def write_bucketed_shards(root: Path) -> ShardIndex:
    """SOURCES, validated and cut into decoded shards of SHARD_BUCKETS under root (test_dry_run uses it too)."""
    for seed, (name, (width, height, frames, audio)) in enumerate(SOURCES.items()):
        write_clip(root / "media" / f"{name}.mp4", width=width, height=height, fps=10, num_frames=frames,
                   audio=audio, seed=seed)
        (root / "media" / f"{name}.mp4.json").write_text(json.dumps({
            "caption": name, "license": "CC-BY-4.0", "consent": "granted", "source_group": name, "split": "train"}))
    validation = validate(build_manifest(root / "media", ManifestConfig()), ValidationConfig())
    assert validation.accepted.num_rows == len(SOURCES)
    config = ShardConfig(encoding="decoded", buckets=tuple(map(tuple, SHARD_BUCKETS)), splits=("train",))
    return write_shards(validation, config, root / "shards")[1]


@pytest.fixture(scope="module")
def bucketed_index(tmp_path_factory) -> ShardIndex:
    return write_bucketed_shards(tmp_path_factory.mktemp("bucketed"))


def shard_config(index: ShardIndex, **overrides) -> DataConfig:
    fields = dict(source="shards", shard_index=str(index.directory), manifest_version=index.manifest_version,
                  batch_size=4, clip_frames=4, height=16, width=16, audio_samples=8000, buckets=SHARD_BUCKETS,
                  num_workers=0)
    return DataConfig(**(fields | overrides))


def test_shard_clips_give_one_bucket_per_global_step(bucketed_index) -> None:
    ranks = [ShardClips(shard_config(bucketed_index), world=World(rank=rank, world_size=2), local_batch_size=2)
             for rank in range(2)]
    described = ranks[0].describe()
    assert (described["source"], described["batching"], described["global_batch"]) == ("shards", "bucketed", 4)
    assert described["bucket_counts"] == {"4x16x16": 4, "8x16x16": 8, "4x16x24": 4}
    assert described["bucket_shapes"] == {"4x16x16": [4, 16, 16], "8x16x16": [8, 16, 16], "4x16x24": [4, 16, 24]}
    seen = []
    for _ in range(4):  # one epoch
        batches = [source.next_batch() for source in ranks]
        (bucket,) = {batch["bucket"] for batch in batches}
        frames, height, width = map(int, bucket.split("x"))
        for batch in batches:
            assert batch["video"].shape == (2, frames, height, width, 3) and not batch["failed"]
            assert batch["audio"].shape == (2, 8000 * frames // 4)
        seen += [key for batch in batches for key in batch["keys"]]
    assert sorted(seen) == sorted(bucketed_index.table.column("sample_key").to_pylist())


@pytest.mark.parametrize(("overrides", "needle"), [
    ({"buckets": SHARD_BUCKETS[:2]}, r"clip shapes \(data.buckets\) \[\(4, 16, 16\), \(8, 16, 16\)\] != index bucket "
                                     r"shapes \[\(4, 16, 16\), \(4, 16, 24\), \(8, 16, 16\)\]"),
    ({"buckets": []}, r"clip shapes \(data.buckets\) \[\(4, 16, 16\)\] != index bucket shapes"),
    ({"audio_samples": 4000},
     "bucket 8x16x16 holds 16000 audio samples, but audio_samples 4000 per 4 frames means 8000"),
])
def test_a_config_that_does_not_match_the_index_buckets_is_refused(bucketed_index, overrides, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        ShardClips(shard_config(bucketed_index, **overrides), world=World(rank=0, world_size=1), local_batch_size=4)


def test_preflight_refuses_a_config_that_does_not_match_the_index_before_any_process_starts(
        bucketed_index, tmp_path: Path) -> None:
    base = ["preset=tiny_cpu", f"train.run_dir={tmp_path}", "data.source=shards",
            f"data.shard_index={bucketed_index.directory}", f"data.manifest_version={bucketed_index.manifest_version}",
            "data.batch_size=4", "data.audio_samples=8000", "train.parallelism=ddp"]
    assert preflight(load_config(None, [*base, f"data.buckets={SHARD_BUCKETS}"]), world_size=2).world_size == 2
    with pytest.raises(ValueError, match=r"clip shapes \(data.buckets\)"):
        preflight(load_config(None, [*base, f"data.buckets={SHARD_BUCKETS[:2]}"]), world_size=2)


def test_trainer_trains_on_bucketed_shards_one_bucket_a_step(bucketed_index, tmp_path: Path) -> None:
    config = load_config(None, [
        "preset=tiny_cpu", f"train.run_dir={tmp_path}", "train.steps=5", "data.source=shards",
        f"data.shard_index={bucketed_index.directory}", f"data.manifest_version={bucketed_index.manifest_version}",
        "data.batch_size=4", "data.audio_samples=8000", "data.num_workers=0", f"data.buckets={SHARD_BUCKETS}"])
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    final = json.loads((tmp_path / "final.json").read_text())
    assert final["status"] == "completed" and all(np.isfinite(final["losses"]))
    assert final["data"]["batching"] == "bucketed" and final["data"]["shard_index_version"] == bucketed_index.version
    bucket_of = dict(zip(bucketed_index.table.column("sample_key").to_pylist(),
                         bucketed_index.table.column("bucket").to_pylist(), strict=True))
    steps = json.loads((tmp_path / "samples" / "rank_0.json").read_text())["steps"]
    assert [len({bucket_of[key] for key in keys}) for _, keys in steps] == [1] * 5  # an epoch is 4 steps
