"""Tests of ops/clips/shards.py (and the loader's handling of bad shards) on real shards of the demo media.

A module fixture plans the validated demo set and writes every shard in both encodings; the
tests read the shards back with plain WebDataset and PyAV, rerun partitions, and damage
private copies to check what the index, ``verify`` and ``ClipLoader`` do with bad inputs.
"""

from __future__ import annotations

import gc
import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset
from helpers import write_shards

from ops.media import codec
from ops.clips import profile
from ops.clips.plan import ENCODINGS, ClipPlan, ShardConfig
from ops.publish.hashing import sha256_file
from ops.loading.loader import ClipLoader, EmptySplitError, LoaderConfig
from ops.loading.sampling import ResumeStateMismatch
from ops.clips.shards import (SHARD_INDEX_SCHEMA, ShardIndex, ShardIntegrityError, build_index, decode_members, member_index,
                              read_index, read_members, write_shard)

REPO = Path(__file__).resolve().parent.parent
CLIPS_PER_SHARD = 4  # several shards per split, and a partial last one
MEMBERS = {"compressed": {"clip.mkv", "meta.json"}, "decoded": {"audio.npy", "meta.json", "video.npy"}}
META_FROM_PLAN = ("asset_id", "uri", "start_s", "end_s", "split", "caption", "has_audio")


@pytest.fixture(scope="module")
def built(demo_validation, tmp_path_factory) -> dict[str, tuple[ClipPlan, ShardIndex]]:
    """encoding -> (plan, index) of every demo shard, written once; read-only for the tests."""
    return {encoding: write_shards(demo_validation, ShardConfig(encoding=encoding, clips_per_shard=CLIPS_PER_SHARD),
                                   tmp_path_factory.mktemp(f"shards_{encoding}"))
            for encoding in ENCODINGS}


@pytest.fixture(params=ENCODINGS)
def shard_set(request, built) -> tuple[ClipPlan, ShardIndex]:
    return built[request.param]


def _rows(index: ShardIndex, shard: str) -> list[dict]:
    return [row for row in index.table.to_pylist() if row["shard"] == shard]


def _config(**changes) -> LoaderConfig:
    return LoaderConfig(**{"batch_size": 3, "num_workers": 0, "verify_shards": False, **changes})


def _epoch(loader: ClipLoader) -> list[dict]:
    """One epoch of batches (every rank takes the same number of steps)."""
    num_steps = loader.schedule.plan(loader.state).num_global_steps  # one clip shape: a UniformSchedule
    iterator = iter(loader)
    batches = [next(iterator) for _ in range(num_steps)]
    iterator.close()
    return batches


def _copy(index: ShardIndex, destination: Path) -> ShardIndex:
    """A private copy of a shard set that a test may damage."""
    shutil.copytree(index.directory, destination)
    return read_index(destination)


def _member_data(path: Path) -> dict[str, tuple[int, int]]:
    """member name -> (byte offset of its data, size)."""
    with tarfile.open(path, "r:") as archive:
        return {member.name: (member.offset_data, member.size) for member in archive}


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(data)


def _reseal(plan: ClipPlan, directory: Path, shard: str) -> ShardIndex:
    """Re-hash and re-index a shard changed on purpose, as a rewrite of it would, then merge the index."""
    path = directory / f"{shard}.tar"
    entries = member_index(path, shard=shard, split=shard.split("-")[0], sha256=sha256_file(path))
    pq.write_table(pa.Table.from_pylist(entries, schema=SHARD_INDEX_SCHEMA), directory / f"{shard}.index.parquet")
    return build_index(plan, directory)


def _plain_decode(sample: dict) -> tuple[np.ndarray, np.ndarray, dict]:
    """Decode one WebDataset sample with json, numpy and PyAV only (no Trainyard code)."""
    meta = json.loads(sample["meta.json"])
    if "clip.mkv" not in sample:
        return np.load(io.BytesIO(sample["video.npy"])), np.load(io.BytesIO(sample["audio.npy"])), meta
    with av.open(io.BytesIO(sample["clip.mkv"])) as container:
        video = np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
    with av.open(io.BytesIO(sample["clip.mkv"])) as container:
        pcm = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
    return video, np.concatenate(pcm).astype(np.float32) / 32768.0, meta


# --- round trip --------------------------------------------------------------------------

def test_every_shard_reads_back_with_plain_webdataset(shard_set) -> None:
    plan, index = shard_set
    planned = {row["sample_key"]: row for row in plan.table.to_pylist()}
    seen = []
    for shard in plan.shards:
        path = index.directory / f"{shard}.tar"
        samples = list(webdataset.WebDataset(str(path), shardshuffle=False))
        rows = _rows(index, shard)
        assert [s["__key__"] for s in samples] == [r["sample_key"] for r in rows] == [
            r["sample_key"] for r in plan.rows_for(shard)], shard
        with open(path, "rb") as handle:
            for sample, row in zip(samples, rows):
                members = read_members(handle, row["offset"], row["length"])
                assert members == {name: data for name, data in sample.items() if not name.startswith("__")}
                assert set(members) == MEMBERS[plan.config.encoding]
                video, audio, meta = decode_members(members, plan.config.shape)
                plain_video, plain_audio, plain_meta = _plain_decode(sample)
                np.testing.assert_array_equal(plain_video, video)
                np.testing.assert_array_equal(plain_audio, audio)
                assert plain_meta == meta
                assert {name: meta[name] for name in META_FROM_PLAN} == {
                    name: planned[row["sample_key"]][name] for name in META_FROM_PLAN}
                assert (meta["manifest_version"], meta["plan_version"], meta["encoding"]) == (
                    plan.manifest_version, plan.version, plan.config.encoding)
        seen += [s["__key__"] for s in samples]
    assert sorted(seen) == sorted(planned)


def test_tar_headers_carry_nothing_that_varies_between_runs(shard_set) -> None:
    plan, index = shard_set
    with tarfile.open(index.directory / f"{plan.shards[0]}.tar", "r:") as archive:
        members = archive.getmembers()
    assert members and all(m.isreg() and m.mtime == 0 and m.uname == m.gname == "" and not m.pax_headers
                           for m in members)


def test_index_matches_the_shards_and_the_plan(shard_set) -> None:
    plan, index = shard_set
    assert index.table.column("sample_key").to_pylist() == [
        key for shard in plan.shards for key in (r["sample_key"] for r in plan.rows_for(shard))]
    for shard in plan.shards:
        (sha,) = {row["shard_sha256"] for row in _rows(index, shard)}
        assert sha == sha256_file(index.directory / f"{shard}.tar")
    index.verify()
    again = read_index(index.directory)
    assert (again.version, again.plan_version, again.manifest_version, again.config) == (
        index.version, plan.version, plan.manifest_version, plan.config)
    assert again.table.equals(index.table)
    assert not [p.name for p in index.directory.iterdir() if p.name.startswith(".")], "temporary files left"


# --- reproducible, atomic writes ---------------------------------------------------------

def test_rerun_of_a_shard_is_byte_identical(shard_set, demo_validation, tmp_path) -> None:
    plan, index = shard_set
    for shard in (plan.shards[0], plan.shards[-1]):
        again = write_shard(plan, shard, demo_validation.media_root, tmp_path)
        assert again.sha256 == sha256_file(index.directory / f"{shard}.tar") == _rows(index, shard)[0]["shard_sha256"]
        assert (tmp_path / f"{shard}.index.parquet").read_bytes() == (
            index.directory / f"{shard}.index.parquet").read_bytes()


_WRITE_ONE_SHARD = """
import sys
from ops.clips.plan import read_plan
from ops.clips.shards import write_shard
print(write_shard(read_plan(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]).sha256)
"""


def test_rerun_in_a_separate_process_is_byte_identical(shard_set, demo_validation, tmp_path) -> None:
    plan, index = shard_set
    shard = "train-00000"  # two sources, one with Opus and one with AAC audio
    completed = subprocess.run([sys.executable, "-c", _WRITE_ONE_SHARD, str(index.directory), shard,
                                demo_validation.media_root, str(tmp_path)],
                               cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip() == sha256_file(index.directory / f"{shard}.tar")


# A tar writer left open on failure flushes into its closed file when collected.
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_failed_write_publishes_nothing(built, demo_validation, tmp_path, monkeypatch) -> None:
    plan, index = built["compressed"]
    shard = "train-00000"
    fresh, existing = tmp_path / "fresh", tmp_path / "existing"
    existing.mkdir()
    for name in (f"{shard}.tar", f"{shard}.index.parquet"):
        shutil.copy(index.directory / name, existing / name)
    before = sha256_file(existing / f"{shard}.tar")
    real_encode, encoded = codec.encode_clip, []

    def encode_then_fail(*args, **kwargs) -> bytes:
        if len(encoded) == 3:
            raise RuntimeError("disk full")
        encoded.append(1)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(codec, "encode_clip", encode_then_fail)
    for directory in (fresh, existing):
        encoded.clear()
        with pytest.raises(RuntimeError, match="disk full"):
            write_shard(plan, shard, demo_validation.media_root, directory)
        assert len(encoded) == 3, "the failure must come after some samples were written"
    assert list(fresh.iterdir()) == [], "no final tar, index or temporary file after a failed write"
    assert sorted(p.name for p in existing.iterdir()) == [f"{shard}.index.parquet", f"{shard}.tar"]
    assert sha256_file(existing / f"{shard}.tar") == before, "a failed rewrite must leave the old shard as it was"
    gc.collect()


# --- content -----------------------------------------------------------------------------

def test_clips_hold_the_frames_and_audio_of_their_source(shard_set, demo_validation) -> None:
    """Each clip against its source decoded on its own: its content must not depend on its shard-mates."""
    plan, index = shard_set
    shape, lossless = plan.config.shape, plan.config.encoding == "decoded"
    planned_rows = {row["sample_key"]: row for row in plan.table.to_pylist()}
    handles = {shard: open(index.directory / f"{shard}.tar", "rb") for shard in plan.shards}
    try:
        for row in index.table.to_pylist():
            planned = planned_rows[row["sample_key"]]
            path = str(Path(demo_validation.media_root) / planned["uri"])
            (source_video,) = codec.decode_source_video(path, [planned["start_s"]], shape)
            (source_audio,) = codec.decode_source_audio(path, [planned["start_s"]], shape) or [
                np.zeros(shape.num_audio_samples, np.float32)]
            video, audio, _ = decode_members(read_members(handles[row["shard"]], row["offset"], row["length"]), shape)
            error = np.abs(video.astype(np.int16) - source_video.astype(np.int16))
            if lossless:
                assert error.max() == 0, row["sample_key"]
                np.testing.assert_array_equal(audio, source_audio, err_msg=row["sample_key"])
            else:
                assert error.mean() < 4, (row["sample_key"], error.mean())
                # FLAC keeps 16-bit samples exactly; only the int16 rounding remains.
                np.testing.assert_allclose(audio, source_audio, atol=1e-4, err_msg=row["sample_key"])
    finally:
        for handle in handles.values():
            handle.close()


@pytest.mark.parametrize("fps", [8.0, 12.5])
def test_compressed_clip_is_timed_at_the_clip_rate(fps: float) -> None:
    shape = codec.ClipShape(num_frames=10, fps=fps, width=32, height=32, audio_rate=16_000)
    frames = np.random.default_rng(0).integers(0, 256, (10, 32, 32, 3), dtype=np.uint8)
    data = codec.encode_clip(frames, np.zeros(shape.num_audio_samples, np.float32), shape)
    with av.open(io.BytesIO(data)) as container:
        times = [frame.time for frame in container.decode(video=0)]
    np.testing.assert_allclose(times, np.arange(10) / fps, atol=1e-3)  # Matroska keeps milliseconds
    video, audio = codec.decode_clip(data, shape)
    assert video.shape == (10, 32, 32, 3) and audio.shape == (shape.num_audio_samples,)


# --- bad inputs --------------------------------------------------------------------------

def test_truncated_shard_is_refused_or_its_cut_samples_reported(built, tmp_path) -> None:
    plan, clean = built["decoded"]
    index = _copy(clean, tmp_path / "shards")
    shard = "train-00001"
    rows = _rows(index, shard)
    cut = rows[1]["offset"] + 512 + 100  # inside the first member of the shard's second sample
    with open(index.directory / f"{shard}.tar", "r+b") as handle:
        handle.truncate(cut)
    with pytest.raises(ShardIntegrityError, match=f"{shard}.tar sha256"):
        index.verify()
    with pytest.raises(ShardIntegrityError, match=f"{shard}.tar sha256"):
        ClipLoader(index, _config(verify_shards=True))

    loader = ClipLoader(index, _config())
    batches = _epoch(loader)
    failed = [failure for batch in batches for failure in batch["failed"]]
    assert {f["sample_key"] for f in failed} == {r["sample_key"] for r in rows[1:]}
    for failure in failed:
        assert loader.rows["sample_key"][failure["index"]] == failure["sample_key"]
        assert "cut short" in failure["reason"]
    delivered = [key for batch in batches for key in batch["keys"]]
    assert sorted(delivered + [f["sample_key"] for f in failed]) == sorted(loader.rows["sample_key"])
    assert all(len(batch["keys"]) + len(batch["failed"]) == 3 for batch in batches)
    assert all(batch["video"].shape[0] == len(batch["keys"]) for batch in batches)
    assert loader.failures == failed
    # Failures are per rank, so they stay out of the state that checkpoints require to be replicated.
    assert "num_failed_samples" not in loader.state_dict()
    assert loader.state_dict()["sampler"]["epoch"] == 1, "the rank kept going to the end of the epoch"


@pytest.mark.parametrize(("encoding", "member", "where", "decodes"), [
    ("decoded", "video.npy", "last", True),      # one pixel changes
    ("decoded", "video.npy", "first", False),    # the .npy magic breaks
    ("compressed", "clip.mkv", "first", False),  # the Matroska (EBML) magic breaks
])
def test_flipped_byte_fails_verify_and_is_caught_when_it_breaks_decoding(
        built, tmp_path, encoding: str, member: str, where: str, decodes: bool) -> None:
    plan, clean = built[encoding]
    index = _copy(clean, tmp_path / "shards")
    shard, position = "train-00002", 2
    row = _rows(index, shard)[position]
    path = index.directory / f"{shard}.tar"
    data_offset, size = _member_data(path)[f"{row['sample_key']}.{member}"]
    offset = data_offset + (size - 1 if where == "last" else 0)
    with open(path, "rb") as handle:
        handle.seek(offset)
        original = handle.read(1)
    _patch(path, offset, bytes([original[0] ^ 0xFF]))
    with pytest.raises(ShardIntegrityError, match=f"{shard}.tar sha256"):
        index.verify()
    with pytest.raises(ShardIntegrityError):
        ClipLoader(index, _config(verify_shards=True))

    loader = ClipLoader(index, _config())
    batches = _epoch(loader)
    failed = [failure for batch in batches for failure in batch["failed"]]
    got = {key: video for batch in batches for key, video in zip(batch["keys"], batch["video"].numpy())}
    assert len(got) + len(failed) == loader.num_samples
    if decodes:
        assert failed == []
        with open(clean.directory / f"{shard}.tar", "rb") as handle:
            expected, _, _ = decode_members(read_members(handle, row["offset"], row["length"]), plan.config.shape)
        assert (got[row["sample_key"]] != expected).sum() == 1
    else:
        assert [(f["sample_key"], f["reason"].split(":")[0]) for f in failed] == [
            (row["sample_key"], "ClipDecodeError")]
        assert loader.rows["sample_key"][failed[0]["index"]] == row["sample_key"]


def test_undecodable_sample_is_skipped_the_same_way_after_a_restart(built, tmp_path) -> None:
    plan, clean = built["compressed"]
    directory = tmp_path / "shards"
    shutil.copytree(clean.directory, directory)
    shard = "train-00001"
    row = _rows(clean, shard)[1]
    path = directory / f"{shard}.tar"
    data_offset, size = _member_data(path)[f"{row['sample_key']}.clip.mkv"]
    _patch(path, data_offset, np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    index = _reseal(plan, directory, shard)
    index.verify()  # resealed: the damage is in the data, not in the shard's integrity

    loader = ClipLoader(index, _config(verify_shards=True))
    states, batches = [loader.state_dict()], []
    iterator = iter(loader)
    for _ in range(5):  # 15 train clips, 3 per step
        batches.append(next(iterator))
        states.append(loader.state_dict())
    iterator.close()
    (step,) = [t for t, batch in enumerate(batches) if batch["failed"]]
    (failure,) = batches[step]["failed"]
    assert failure["sample_key"] == row["sample_key"] and "ClipDecodeError" in failure["reason"]
    assert len(batches[step]["keys"]) == 2 and batches[step]["video"].shape[0] == 2, "the rest of the batch is kept"
    assert len(loader.failures) == 1

    restarted = ClipLoader(index, _config(verify_shards=True, num_workers=1))
    restarted.load_state_dict(states[step])
    iterator = iter(restarted)
    again = next(iterator)
    iterator.close()
    assert again["failed"] == batches[step]["failed"]
    assert again["keys"] == batches[step]["keys"] and again["indices"] == batches[step]["indices"]
    assert np.array_equal(again["video"].numpy(), batches[step]["video"].numpy())
    assert restarted.failures == [failure]


@pytest.mark.parametrize("split", ["val", "holdout"])
def test_empty_split_is_refused_with_a_clear_message(built, split: str) -> None:
    _, index = built["decoded"]
    with pytest.raises(EmptySplitError, match=rf"split '{split}' has no samples.*splits present: \['test', 'train'\]"):
        ClipLoader(index, _config(split=split))


def test_split_smaller_than_a_batch(built) -> None:
    _, index = built["decoded"]
    num_train = index.split("train").num_rows
    loader = ClipLoader(index, _config(batch_size=num_train + 1))
    first, second = _epoch(loader), _epoch(loader)
    assert [len(batch["keys"]) for batch in first + second] == [num_train, num_train]
    assert sorted(first[0]["keys"]) == sorted(second[0]["keys"]) == sorted(loader.rows["sample_key"])
    assert first[0]["keys"] != second[0]["keys"], "each epoch is shuffled anew"
    ranks = [ClipLoader(index, _config(batch_size=8), rank=rank, world_size=2) for rank in (0, 1)]
    assert [len(_epoch(rank)[0]["keys"]) for rank in ranks] == [8, num_train - 8]
    with pytest.raises(ValueError, match=rf"{num_train} samples, fewer than one global batch"):
        ClipLoader(index, _config(batch_size=num_train + 1, drop_last=True))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        ClipLoader(index, _config(batch_size=8, drop_last=True), rank=0, world_size=2)


def test_resume_state_from_other_data_is_refused(built) -> None:
    _, index = built["decoded"]
    _, other_index = built["compressed"]
    loader = ClipLoader(index, _config())
    iterator = iter(loader)
    next(iterator)
    iterator.close()
    saved = loader.state_dict()

    fresh = ClipLoader(index, _config())
    untouched = fresh.state_dict()
    moved = {**saved, "manifest_version": "0123456789abcdef"}
    with pytest.raises(ResumeStateMismatch) as refused:
        fresh.load_state_dict(moved)
    assert "0123456789abcdef" in str(refused.value) and index.manifest_version in str(refused.value)
    assert fresh.state_dict() == untouched, "a refused state must not be applied"

    cases = [(ClipLoader(index, _config(split="test")), f"{index.version}/train", f"{index.version}/test"),
             (ClipLoader(other_index, _config()), f"{index.version}/train", f"{other_index.version}/train")]
    for other, saved_version, this_version in cases:
        before = other.state_dict()
        with pytest.raises(ResumeStateMismatch) as refused:
            other.load_state_dict(saved)
        assert saved_version in str(refused.value) and this_version in str(refused.value)
        assert other.state_dict() == before

    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved


# --- the profile's read path ---------------------------------------------------------------

# A file opened per clip and dropped (not closed) surfaces as a ResourceWarning when collected.
@pytest.mark.filterwarnings("error::ResourceWarning", "error::pytest.PytestUnraisableExceptionWarning")
def test_decode_profile_times_a_seeded_sample_of_clips(shard_set) -> None:
    _, index = shard_set
    decode, summary = profile.decode_profile(index, max_clips=10, seed=3)
    gc.collect()
    keys = decode.column("sample_key").to_pylist()
    assert len(keys) == len(set(keys)) == summary["num_clips_timed"] == 10
    assert set(keys) <= set(index.table.column("sample_key").to_pylist())
    assert keys == profile.decode_profile(index, max_clips=10, seed=3)[0].column("sample_key").to_pylist()
    assert min(decode.column("decode_s").to_pylist()) > 0 and summary["decode_frames_per_s_one_process"] > 0
    everything, _ = profile.decode_profile(index, max_clips=1000)
    assert everything.num_rows == index.table.num_rows
