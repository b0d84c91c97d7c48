"""Data profile: what the validated media look like, and what reading the shards costs.

Source-level distributions (object size, duration, resolution, codec, audio presence,
invalid-file rate) come from the validated manifest and quarantine; clip-level decode time and
read throughput are measured on a sample of shard clips with the loader's own read path.
"""

from __future__ import annotations

import io
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ops.clips import shards
from ops.clips.shards import ShardIndex

DECODE_SCHEMA = pa.schema([
    ("sample_key", pa.string()),
    ("shard", pa.string()),
    ("bytes", pa.int64()),
    ("read_s", pa.float64()),
    ("decode_s", pa.float64()),
])


@dataclass(kw_only=True, slots=True)
class Profile:
    summary: dict
    """Scalar figures: counts, rates, quantiles, throughput."""
    distributions: dict[str, dict[str, int]]
    """Name -> {bucket: count}: resolution, codec, audio, duration and size buckets."""
    decode: pa.Table
    """Per-clip read and decode times (DECODE_SCHEMA)."""


def _quantiles(values: np.ndarray, prefix: str) -> dict[str, float]:
    if values.size == 0:
        return {}
    return {f"{prefix}_p{q}": round(float(np.percentile(values, q)), 4) for q in (0, 50, 90, 100)}


def _buckets(values: np.ndarray, edges: list[float], unit: str) -> dict[str, int]:
    counts = np.histogram(values, bins=[*edges, np.inf])[0]
    return {f"[{lo:g}, {hi:g}) {unit}": int(n) for lo, hi, n in zip(edges, [*edges[1:], np.inf], counts)}


def source_profile(validated: pa.Table, *, num_quarantined: int) -> tuple[dict, dict]:
    rows = validated.to_pylist()
    durations = np.array([row["duration_s"] for row in rows], float)
    sizes = np.array([row["size_bytes"] for row in rows], float)
    total = len(rows) + num_quarantined
    summary = {"num_sources": len(rows), "num_quarantined": num_quarantined,
               "invalid_file_rate": round(num_quarantined / total, 4) if total else 0.0,
               "total_duration_s": round(float(durations.sum()), 3), "total_bytes": int(sizes.sum()),
               **_quantiles(durations, "duration_s"), **_quantiles(sizes, "size_bytes")}
    distributions = {
        "resolution": dict(sorted(Counter(f"{r['width']}x{r['height']}" for r in rows).items())),
        "orientation": dict(sorted(Counter(
            "portrait" if r["height"] > r["width"] else "square" if r["height"] == r["width"] else "landscape"
            for r in rows).items())),
        "video_codec": dict(sorted(Counter(r["video_codec"] for r in rows).items())),
        "audio": dict(sorted(Counter(r["audio_codec"] or "none" for r in rows).items())),
        "fps": dict(sorted(Counter(f"{r['fps']:g}" for r in rows).items())),
        "container": dict(sorted(Counter(r["container"] for r in rows).items())),
        "split": dict(sorted(Counter(r["split"] for r in rows).items())),
        "duration": _buckets(durations, [0, 1, 2, 4, 8, 16], "s"),
        "size": _buckets(sizes / 1e3, [0, 10, 50, 100, 500, 1000], "kB"),
    }
    return summary, distributions


def decode_profile(index: ShardIndex, *, max_clips: int = 64, seed: int = 0) -> tuple[pa.Table, dict]:
    """Read and decode up to ``max_clips`` clips (a seeded sample), timing each phase."""
    table = index.table
    chosen = sorted(np.random.default_rng(seed).choice(table.num_rows, min(max_clips, table.num_rows),
                                                       replace=False).tolist()) if table.num_rows else []
    rows = [table.slice(i, 1).to_pylist()[0] for i in chosen]
    records, handles = [], {}
    try:
        for row in rows:
            if row["shard"] not in handles:  # setdefault would open (and leak) a file per clip
                handles[row["shard"]] = index.open_shard(row["shard"])
            handle = handles[row["shard"]]
            started = time.perf_counter()
            members = shards.read_members(handle, row["offset"], row["length"])
            read_s = time.perf_counter() - started
            shards.decode_members(members, index.bucket_shapes[row["bucket"]])
            records.append({"sample_key": row["sample_key"], "shard": row["shard"], "bytes": row["length"],
                            "read_s": read_s, "decode_s": time.perf_counter() - started - read_s,
                            "frames": index.bucket_shapes[row["bucket"]].num_frames})
    finally:
        for handle in handles.values():
            handle.close()
    decode = pa.Table.from_pylist(records, schema=DECODE_SCHEMA)
    frames = sum(record.pop("frames") for record in records)
    decode_s = np.array([r["decode_s"] for r in records])
    read_s = sum(r["read_s"] for r in records)
    summary = {"num_clips_timed": len(records), "encoding": index.config.encoding,
               "decode_frames_per_s_one_process": round(float(frames / decode_s.sum()), 1) if records else 0.0,
               "read_MBps": round(sum(r["bytes"] for r in records) / 1e6 / read_s, 1) if read_s else 0.0,
               **_quantiles(decode_s * 1e3, "decode_ms_per_clip")}
    return decode, summary


def build_profile(validated: pa.Table, index: ShardIndex, *, num_quarantined: int, max_clips: int = 64) -> Profile:
    summary, distributions = source_profile(validated, num_quarantined=num_quarantined)
    decode, decode_summary = decode_profile(index, max_clips=max_clips)
    distributions["clips_per_split"] = dict(sorted(Counter(index.table.column("split").to_pylist()).items()))
    distributions["clips_per_bucket"] = {  # config order: the loader's bucket ids
        name: count for name, count in ((name, Counter(index.table.column("bucket").to_pylist())[name])
                                        for name in index.bucket_shapes) if count}
    return Profile(summary={**summary, **decode_summary, "num_clips": index.table.num_rows},
                   distributions=distributions, decode=decode)


def plot_profile(profile: Profile, validated: pa.Table) -> bytes:
    """PNG with duration and size histograms, resolutions, and per-clip decode time."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    rows = validated.to_pylist()
    figure, axes = plt.subplots(2, 2, figsize=(10, 7))
    axes[0, 0].hist([r["duration_s"] for r in rows], bins=20)
    axes[0, 0].set(title="source duration", xlabel="s", ylabel="sources")
    axes[0, 1].hist([r["size_bytes"] / 1e3 for r in rows], bins=20)
    axes[0, 1].set(title="object size", xlabel="kB")
    axes[1, 0].scatter([r["width"] for r in rows], [r["height"] for r in rows], alpha=0.6)
    axes[1, 0].set(title="resolution", xlabel="width", ylabel="height")
    axes[1, 1].hist(np.array(profile.decode.column("decode_s").to_pylist()) * 1e3, bins=20)
    axes[1, 1].set(title="decode time per clip", xlabel="ms")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80)
    plt.close(figure)
    return buffer.getvalue()
