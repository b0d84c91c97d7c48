"""Issue 9, item 1 (last part): a clip planned past the source's real end is a counted shard
failure, never a clip padded with the source's last frame repeated."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from helpers import manifest_row, write_clip

from ops.media import codec
from ops.clips import shards
from ops.clips.plan import ShardConfig, plan_clips
from ops.curation.manifest import MANIFEST_SCHEMA
from ops.publish.hashing import sha256_file

# 8 frames at 8 fps: one clip per second of source.
CONFIG = ShardConfig(encoding="decoded", clips_per_shard=8)


def _plan(media_root: Path, *, declared_s: float):
    """Plan clips of a 1 s source whose manifest row declares ``declared_s`` (a header that promised more)."""
    path = write_clip(media_root / "short.mp4", width=64, height=64, fps=25, num_frames=25)
    # The asset id is the file's sha256: write_shard cuts only the bytes that were probed.
    row = manifest_row("short.mp4", width=64, height=64, fps=25.0, num_frames=int(declared_s * 25),
                       duration_s=declared_s, split="train", sha256=sha256_file(path))
    accepted = pa.Table.from_pylist([row], schema=MANIFEST_SCHEMA)
    return plan_clips(accepted, CONFIG, manifest_version="m", validated_version="v")


def test_clips_past_the_sources_end_are_counted_failures(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "media", declared_s=3.0)
    assert plan.table.num_rows == 3, "the plan trusts the declared 3 s: clips at 0, 1 and 2 s"
    (shard,) = plan.shards
    result = shards.write_shard(plan, shard, tmp_path / "media", tmp_path / "out")
    assert result.num_samples == 1
    assert len(result.failures) == 2
    assert all(failure["reason"].startswith(shards.SOURCE_ENDED) for failure in result.failures)
    assert "repeat the last frame" in result.failures[0]["reason"]


def test_a_clip_that_fits_is_cut_and_moves(tmp_path: Path) -> None:
    plan = _plan(tmp_path / "media", declared_s=1.0)
    (shard,) = plan.shards
    result = shards.write_shard(plan, shard, tmp_path / "media", tmp_path / "out")
    assert (result.num_samples, result.failures) == (1, [])
    with open(result.path, "rb") as handle:
        (entry,) = shards.member_index(result.path, shard=shard, split="train", sha256=result.sha256)
        members = shards.read_members(handle, entry["offset"], entry["length"])
    video, _, _ = shards.decode_members(members, CONFIG.shape)
    # The source scrolls every frame: consecutive clip frames differ (none is a held copy).
    assert all(not np.array_equal(video[k], video[k + 1]) for k in range(len(video) - 1))


def test_decode_source_clips_reports_only_the_clips_that_run_out(tmp_path: Path) -> None:
    path = write_clip(tmp_path / "one_second.mkv", width=64, height=64, fps=25, num_frames=25, container="matroska")
    shape = CONFIG.shape
    # 0.0 s fits; 0.5 s needs a frame at 1.375 s; 0.1 s needs one at 0.975 s, inside the last frame
    # (0.96 to 1.0 s); 0.125 s needs one at 1.0 s, where the source has ended.
    decoded = codec.decode_source_clips(str(path), [0.0, 0.5, 0.1, 0.125], shape)
    assert sorted(decoded.short) == [1, 3]
    assert decoded.frames[2] is not None
    assert decoded.frames[1] is None
    assert decoded.frames[0].shape == (shape.num_frames, shape.height, shape.width, 3)
    with pytest.raises(codec.ClipDecodeError, match="repeat the last frame"):
        codec.decode_source_video(str(path), [0.5], shape)
