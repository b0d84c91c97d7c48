"""Clip plan: which clips are cut from which validated source, at which shape, into which shard.

Every clip has the shape of one bucket. Without ``buckets`` there is one, ``shape``; with
buckets (frames x height x width, sharing ``shape``'s frame and audio rates) each source goes
to one bucket (`assign_bucket`): the buckets whose aspect ratio is closest to the source's,
then, among those, the longest clip that fits the source's duration. So a portrait source is
cut to a portrait bucket and a long one to the long-clip bucket, instead of every source being
cropped and trimmed to one shape; the loader batches each bucket separately (ops/loading/sampling.py).

Clips are cut back to back (or at ``stride_s``) from the start of each source, at most
``max_clips_per_source`` per source. Sources shorter than their bucket's clip yield none and
are counted, never silently dropped. Shards hold clips of one split, ``clips_per_shard`` at most, in
(split, uri, start) order, so the plan, and so every shard, is a pure function of the
validated manifest and this config.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ops.publish.hashing import digest_json, table_digest
from ops.media.codec import ClipShape
from ops.publish.durable import write_file_atomic
from ops.publish.storage import PublishedFileCorrupt, read_verified, write_record

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
    ("bucket", pa.string()),
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
    buckets: tuple[tuple[int, int, int], ...] = ()
    """Clip shapes (frames, height, width) to cut, each source to one (module docstring);
    empty: every clip has ``shape``. Frame rate and audio rate are ``shape``'s."""

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
        for frames, height, width in self.buckets:  # ClipShape checks each bucket's values
            replace(self.shape, num_frames=frames, height=height, width=width)
        if len(set(self.buckets)) != len(self.buckets):
            raise ValueError(f"buckets must be distinct, got {self.buckets}")
        if self.stride_s is None and self.buckets and min(
                frames for frames, _, _ in self.buckets) / self.shape.fps < _KEY_RESOLUTION_S:
            raise ValueError(f"bucket clip durations must be >= {_KEY_RESOLUTION_S} s")
        if not self.splits or len(set(self.splits)) != len(self.splits):
            raise ValueError(f"splits must be non-empty and distinct (a repeated split plans its clips twice), "
                             f"got {self.splits}")

    @property
    def stride(self) -> float:
        """Gap between clip starts for clips of ``shape`` (`stride_for` for a bucket)."""
        return self.stride_for(self.shape)

    def stride_for(self, shape: ClipShape) -> float:
        return self.stride_s if self.stride_s is not None else shape.duration_s

    @property
    def bucket_shapes(self) -> dict[str, ClipShape]:
        """Bucket name ("TxHxW") -> clip shape, in config order (the bucket ids the loader uses)."""
        sizes = self.buckets or ((self.shape.num_frames, self.shape.height, self.shape.width),)
        return {bucket_name(*size): replace(self.shape, num_frames=size[0], height=size[1], width=size[2])
                for size in sizes}

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ShardConfig:
        """Inverse of `as_dict` (after a JSON round trip, which turns tuples into lists)."""
        data = dict(data)
        data["shape"] = ClipShape(**data["shape"])
        data["splits"] = tuple(data["splits"])
        data["buckets"] = tuple(tuple(size) for size in data.get("buckets", ()))
        return cls(**data)


def bucket_name(num_frames: int, height: int, width: int) -> str:
    return f"{num_frames}x{height}x{width}"


def parse_bucket(name: str) -> tuple[int, int, int]:
    """(frames, height, width) of a bucket name "TxHxW"; ValueError naming the expected form."""
    parts = name.lower().split("x")
    if len(parts) != 3 or not all(part.strip().isdigit() for part in parts):
        raise ValueError(f"bucket {name!r} is not FRAMESxHEIGHTxWIDTH, e.g. '8x64x64'")
    frames, height, width = (int(part) for part in parts)
    return frames, height, width


def assign_bucket(*, width: int, height: int, duration_s: float, config: ShardConfig) -> str | None:
    """The bucket a source's clips are cut to, or None when its duration fits none of them.

    Closest aspect ratio first (distance of log(width / height)), then the longest clip that
    fits; ties go to the bucket listed first. A source whose width or height is unknown is
    treated as square.
    """
    shapes = config.bucket_shapes
    aspect = math.log(width / height) if width and height and width > 0 and height > 0 else 0.0
    distance = {name: abs(math.log(shape.width / shape.height) - aspect) for name, shape in shapes.items()}
    nearest = min(distance.values())
    fitting = [name for name, shape in shapes.items()
               if distance[name] <= nearest + 1e-9 and shape.duration_s <= duration_s + 1e-9]
    return max(fitting, key=lambda name: shapes[name].num_frames, default=None)


@dataclass(kw_only=True, slots=True)
class ClipPlan:
    table: pa.Table
    version: str
    config: ShardConfig
    manifest_version: str
    validated_version: str
    num_sources_too_short: int
    code_version: str = ""
    """The shard code's version, part of ``version`` (`plan_version`): recorded so a reader recomputes it."""
    erased: dict | None = None
    """For a plan an erasure made (ops.curation.erasure): ``{"from_plan": version, "assets": [ids], "erasure_id": id}``,
    the plan whose rows it is, less the erased assets' clips. Part of ``version``; None for a planned one."""

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.table.column("shard").to_pylist()))

    def rows_for(self, shard: str) -> list[dict]:
        return [row for row in self.table.to_pylist() if row["shard"] == shard]


def clip_starts(duration_s: float, config: ShardConfig, shape: ClipShape | None = None) -> list[float]:
    """Start times of the whole clips of ``shape`` (default ``config.shape``) in ``duration_s``, in ms."""
    shape = shape or config.shape
    clip_s, stride = shape.duration_s, config.stride_for(shape)
    if duration_s + 1e-9 < clip_s:
        return []
    count = min(config.max_clips_per_source, 1 + math.floor((duration_s - clip_s) / stride + 1e-9))
    return [round(k * stride, 3) for k in range(count)]


def sample_key(asset_id: str, start_s: float) -> str:
    # No dots: WebDataset splits member names at the first dot into key and extension.
    return f"{asset_id[:16]}-{int(round(start_s * 1000)):09d}"


def usable_duration_s(source: dict) -> float:
    """Seconds of ``source`` that clips may cover: the declared duration, or less when its video
    packets end sooner (``measured_duration_s``), so no clip is planned past the last real frame."""
    measured = source.get("measured_duration_s")
    return source["duration_s"] if measured is None else min(source["duration_s"], measured)


def plan_clips(validated: pa.Table, config: ShardConfig, *, manifest_version: str,
               validated_version: str, code_version: str = "") -> ClipPlan:
    """Plan every clip; the version covers the validated set, the config and the shard code."""
    rows, too_short = [], 0
    ordered = sorted(validated.to_pylist(), key=lambda row: (row["split"], row["uri"]))
    for split in config.splits:
        split_rows = []
        for source in (row for row in ordered if row["split"] == split):
            duration_s = usable_duration_s(source)
            bucket = assign_bucket(width=source["width"], height=source["height"], duration_s=duration_s,
                                   config=config)
            shape = config.bucket_shapes[bucket] if bucket else None
            starts = clip_starts(duration_s, config, shape) if shape else []
            too_short += not starts
            split_rows.extend({
                "sample_key": sample_key(source["asset_id"], start), "split": split,
                "asset_id": source["asset_id"], "uri": source["uri"], "start_s": start,
                "end_s": round(start + shape.duration_s, 6), "caption": source["caption"],
                "has_audio": source["audio_codec"] is not None, "bucket": bucket,
            } for start in starts)
        for index, row in enumerate(split_rows):
            row["shard"] = f"{split}-{index // config.clips_per_shard:05d}"
        rows.extend(split_rows)
    table = pa.Table.from_pylist(rows, schema=PLAN_SCHEMA)
    version = plan_version(validated_version, config, code_version, table, manifest_version=manifest_version,
                           num_sources_too_short=too_short)
    return ClipPlan(table=table, version=version, config=config, manifest_version=manifest_version,
                    validated_version=validated_version, num_sources_too_short=too_short, code_version=code_version)


def plan_version(validated_version: str, config: ShardConfig, code_version: str, table: pa.Table, *,
                 manifest_version: str, num_sources_too_short: int, erased: dict | None = None) -> str:
    """The plan version: everything plan.json and plan.parquet say (`plan_facts`), every column of
    every clip included (ops.publish.hashing.table_digest), so no field a reader relies on (the asset id the
    revocation checks read, the caption, the span, the shard) can change without changing it."""
    return digest_json(plan_facts(validated_version, config, code_version, table, manifest_version=manifest_version,
                                  num_sources_too_short=num_sources_too_short, erased=erased))[:20]


def plan_facts(validated_version: str, config: ShardConfig, code_version: str, table: pa.Table, *,
               manifest_version: str, num_sources_too_short: int, erased: dict | None = None) -> dict:
    """What the plan version hashes; plan.json holds these same facts (but the table) plus the version.
    ``erased`` only where an erasure made the plan, so every planned plan keeps its version."""
    facts = {"validated_version": validated_version, "config": config.as_dict(), "code_version": code_version,
             "manifest_version": manifest_version, "num_sources_too_short": num_sources_too_short,
             "clips": table_digest(table)}
    return {**facts, "erased": erased} if erased else facts


PLAN_FILE = "plan.parquet"
PLAN_INFO_FILE = "plan.json"
PLAN_RECORD_FILE = "plan.digests.json"
"""sha256 and size of the plan's two files as its version, signed, written last (ops.publish.storage.write_record)."""
_PLAN_INFO_KEYS = {"version", "config", "manifest_version", "validated_version", "num_sources_too_short",
                   "code_version"}
"""plan.json's keys: each is in the plan version (`plan_facts`) but ``version`` itself."""


def write_plan(plan: ClipPlan, directory: Path) -> Path:
    """Publish the plan next to its shards (plan.parquet, plan.json, then its digest record).

    Idempotent per version: writing it again replaces damaged files with the plan's own bytes.
    """
    buffer = io.BytesIO()
    pq.write_table(plan.table, buffer)
    write_file_atomic(directory / PLAN_FILE, buffer.getvalue())
    info = {"version": plan.version, "config": plan.config.as_dict(), "manifest_version": plan.manifest_version,
            "validated_version": plan.validated_version, "num_sources_too_short": plan.num_sources_too_short,
            "code_version": plan.code_version, **({"erased": plan.erased} if plan.erased else {})}
    write_file_atomic(directory / PLAN_INFO_FILE, json.dumps(info, indent=2, sort_keys=True).encode())
    write_record(directory, version=plan.version, files=[PLAN_FILE, PLAN_INFO_FILE], record=PLAN_RECORD_FILE)
    return directory


def config_of(info: dict, path: Path) -> ShardConfig:
    """The shard config a published plan.json or index.json states; PublishedFileCorrupt naming the file
    when it is not one (an unknown or missing field, a bad value)."""
    try:
        return ShardConfig.from_dict(info["config"])
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise PublishedFileCorrupt(f"{path}: its config is not a shard config ({type(error).__name__}: {error}); "
                                   "rebuild the clip plan and its shards") from error


def read_plan(directory: Path) -> ClipPlan:
    """The plan in ``directory``, read once and verified against its digest record (ops.publish.storage.PublishedFileError).

    The record only binds bytes; the version binds meaning: validated version, config, code version
    and every clip must hash to it, so rows rewritten together with the record are refused.
    """
    directory = Path(directory)
    version, files = read_verified(directory, record=PLAN_RECORD_FILE)  # read once, parsed from these bytes
    info = json.loads(files[PLAN_INFO_FILE])
    if info["version"] != version:
        raise PublishedFileCorrupt(f"{directory / PLAN_INFO_FILE}: says plan version {info['version']!r}, but "
                                   f"{PLAN_RECORD_FILE} published it as {version}; rebuild the clip plan")
    if "code_version" not in info:
        raise PublishedFileCorrupt(f"{directory / PLAN_INFO_FILE}: plan {version} was published before plans recorded "
                                   "their code version, so it cannot be checked; rebuild the clip plan")
    plan = ClipPlan(table=pq.read_table(pa.BufferReader(files[PLAN_FILE]), schema=PLAN_SCHEMA), version=version,
                    config=config_of(info, directory / PLAN_INFO_FILE), manifest_version=info["manifest_version"],
                    validated_version=info["validated_version"], num_sources_too_short=info["num_sources_too_short"],
                    code_version=info["code_version"], erased=info.get("erased"))
    recomputed = plan_version(plan.validated_version, plan.config, plan.code_version, plan.table,
                              manifest_version=plan.manifest_version, num_sources_too_short=plan.num_sources_too_short,
                              erased=plan.erased)
    if recomputed != version or set(info) - {"erased"} != _PLAN_INFO_KEYS:
        raise PublishedFileCorrupt(f"{directory / PLAN_FILE}: its clips (every column) and the facts in {PLAN_INFO_FILE} "
                                   f"hash to {recomputed}, not to plan version {version} (or {PLAN_INFO_FILE} holds "
                                   f"keys {sorted((set(info) - {'erased'}) ^ _PLAN_INFO_KEYS)} it should not): rows were "
                                   "rewritten; rebuild the clip plan")
    return plan
