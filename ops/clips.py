"""Clip plan: which fixed-shape clips are cut from which validated source, into which shard.

Clips are cut back to back (or at ``stride_s``) from the start of each source, at most
``max_clips_per_source`` per source. Sources shorter than one clip yield none and are counted,
never silently dropped. Shards hold clips of one split, ``clips_per_shard`` at most, in
(split, uri, start) order, so the plan, and so every shard, is a pure function of the
validated manifest and this config.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ops.hashing import digest_json
from ops.media_io import ClipShape
from ops.storage import write_file_atomic

ENCODINGS = ("compressed", "decoded")
_KEY_RESOLUTION_S = 0.001

PLAN_SCHEMA = pa.schema([
    ("sample_key", pa.string()),
    ("shard", pa.string()),
    ("split", pa.string()),
    ("asset_id", pa.string()),
    ("uri", pa.string()),
    ("start_s", pa.float64()),
    ("end_s", pa.float64()),
    ("caption", pa.string()),
    ("has_audio", pa.bool_()),
])


def _default_shape() -> ClipShape:
    return ClipShape(num_frames=8, fps=8.0, width=64, height=64, audio_rate=16_000)


@dataclass(kw_only=True, slots=True, frozen=True)
class ShardConfig:
    shape: ClipShape = field(default_factory=_default_shape)
    """Frames, frame rate, resolution and audio rate of every clip."""
    encoding: str = "compressed"
    """"compressed": H.264 clip + FLAC audio, decoded at load; "decoded": uint8 frames + float PCM."""
    stride_s: float | None = None
    """Gap between clip starts; None means back to back (the clip duration)."""
    max_clips_per_source: int = 16
    clips_per_shard: int = 32
    splits: tuple[str, ...] = ("train", "val", "test")
    """Splits to shard; each shard holds one split."""

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"encoding must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.max_clips_per_source < 1 or self.clips_per_shard < 1:
            raise ValueError("max_clips_per_source and clips_per_shard must be >= 1")
        if self.stride_s is not None and self.stride_s <= 0:
            raise ValueError(f"stride_s must be positive, got {self.stride_s}")
        if self.stride < _KEY_RESOLUTION_S:
            # Sample keys carry the start in whole milliseconds: finer starts would share a key.
            raise ValueError(f"stride_s (or the clip duration when it is None) must be >= {_KEY_RESOLUTION_S} s, "
                             f"got {self.stride}")
        if not self.splits or len(set(self.splits)) != len(self.splits):
            raise ValueError(f"splits must be non-empty and distinct (a repeated split plans its clips twice), "
                             f"got {self.splits}")

    @property
    def stride(self) -> float:
        return self.stride_s if self.stride_s is not None else self.shape.duration_s

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(kw_only=True, slots=True)
class ClipPlan:
    table: pa.Table
    version: str
    config: ShardConfig
    manifest_version: str
    validated_version: str
    num_sources_too_short: int

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.table.column("shard").to_pylist()))

    def rows_for(self, shard: str) -> list[dict]:
        return [row for row in self.table.to_pylist() if row["shard"] == shard]


def clip_starts(duration_s: float, config: ShardConfig) -> list[float]:
    """Start times of the whole clips that fit in ``duration_s`` (millisecond-rounded)."""
    clip_s = config.shape.duration_s
    if duration_s + 1e-9 < clip_s:
        return []
    count = min(config.max_clips_per_source, 1 + math.floor((duration_s - clip_s) / config.stride + 1e-9))
    return [round(k * config.stride, 3) for k in range(count)]


def sample_key(asset_id: str, start_s: float) -> str:
    # No dots: WebDataset splits member names at the first dot into key and extension.
    return f"{asset_id[:16]}-{int(round(start_s * 1000)):09d}"


def plan_clips(validated: pa.Table, config: ShardConfig, *, manifest_version: str,
               validated_version: str, code_version: str = "") -> ClipPlan:
    """Plan every clip; the version covers the validated set, the config and the shard code."""
    rows, too_short = [], 0
    ordered = sorted(validated.to_pylist(), key=lambda row: (row["split"], row["uri"]))
    for split in config.splits:
        split_rows = []
        for source in (row for row in ordered if row["split"] == split):
            starts = clip_starts(source["duration_s"], config)
            too_short += not starts
            split_rows.extend({
                "sample_key": sample_key(source["asset_id"], start), "split": split,
                "asset_id": source["asset_id"], "uri": source["uri"], "start_s": start,
                "end_s": round(start + config.shape.duration_s, 6), "caption": source["caption"],
                "has_audio": source["audio_codec"] is not None,
            } for start in starts)
        for index, row in enumerate(split_rows):
            row["shard"] = f"{split}-{index // config.clips_per_shard:05d}"
        rows.extend(split_rows)
    table = pa.Table.from_pylist(rows, schema=PLAN_SCHEMA)
    version = digest_json({"validated": validated_version, "config": config.as_dict(), "code": code_version,
                           "keys": table.column("sample_key").to_pylist()})[:20]
    return ClipPlan(table=table, version=version, config=config, manifest_version=manifest_version,
                    validated_version=validated_version, num_sources_too_short=too_short)


PLAN_FILE = "plan.parquet"
PLAN_INFO_FILE = "plan.json"


def write_plan(plan: ClipPlan, directory: Path) -> Path:
    """Publish the plan next to its shards (plan.parquet, plan.json); idempotent per version."""
    buffer = io.BytesIO()
    pq.write_table(plan.table, buffer)
    write_file_atomic(directory / PLAN_FILE, buffer.getvalue())
    info = {"version": plan.version, "config": plan.config.as_dict(), "manifest_version": plan.manifest_version,
            "validated_version": plan.validated_version, "num_sources_too_short": plan.num_sources_too_short}
    write_file_atomic(directory / PLAN_INFO_FILE, json.dumps(info, indent=2, sort_keys=True).encode())
    return directory


def read_plan(directory: Path) -> ClipPlan:
    info = json.loads((Path(directory) / PLAN_INFO_FILE).read_text())
    config = dict(info["config"])
    config["shape"] = ClipShape(**config["shape"])
    config["splits"] = tuple(config["splits"])
    return ClipPlan(table=pq.read_table(Path(directory) / PLAN_FILE, schema=PLAN_SCHEMA), version=info["version"],
                    config=ShardConfig(**config), manifest_version=info["manifest_version"],
                    validated_version=info["validated_version"], num_sources_too_short=info["num_sources_too_short"])
