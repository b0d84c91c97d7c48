"""Building a manifest from a bucket against the same media in a folder, side by side in one run.

    python -m benchmarks.media_store [--num-good 40] [--rounds 5] [--s3-url s3://bucket/prefix]

The demo media are generated once, uploaded to an S3 store (a local SeaweedFS unless
``--s3-url`` names one), and the manifest is built (scan, hash, probe, sidecars) in paired
rounds, the three sides in a seeded random order each round:

- ``folder``: the media root is the folder (the embedded default);
- ``bucket_cold``: the media root is the bucket, with an empty media cache: every object is
  streamed and hashed, media and sidecars kept, probes read the cache;
- ``bucket_warm``: the same with the cache left from the round before. The scan still streams
  and hashes every object (a listing's sha256 is of the store's bytes now, never a cached
  copy's), so this differs from cold only in what the cache holds.

The last line is one JSON object: seconds per side (median of rounds), the median per-round
ratio bucket/folder with its interquartile range, objects, bytes, and the cache's counters.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from ops.publish import content_cache
from ops.media import roots
from ops.curation import manifest as manifest_ops

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--num-good", "4", "--rounds", "1"]


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def _build_s(location: str) -> tuple[float, manifest_ops.Manifest]:
    started = time.perf_counter()
    manifest = manifest_ops.build_manifest(location, manifest_ops.ManifestConfig())
    return time.perf_counter() - started, manifest


def measure(folder: Path, url: str, cache_dir: Path, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    seconds: dict[str, list[float]] = {"folder": [], "bucket_cold": [], "bucket_warm": []}
    rows, num_bytes = {}, 0
    for _ in range(rounds):
        sides = list(seconds)
        rng.shuffle(sides)
        for side in sides:
            if side == "bucket_cold":
                shutil.rmtree(cache_dir, ignore_errors=True)
            elif side == "bucket_warm" and not cache_dir.exists():
                _build_s(url)  # warm it first (not timed)
            took, manifest = _build_s(str(folder) if side == "folder" else url)
            seconds[side].append(took)
            rows[side] = manifest.table.num_rows
            num_bytes = sum(manifest.table.column("size_bytes").to_pylist())
    ratios = {side: [b / f for b, f in zip(seconds[side], seconds["folder"])] for side in ("bucket_cold", "bucket_warm")}
    return {
        "benchmark": "media_store", "rounds": rounds, "rows": rows, "media_mb": round(num_bytes / 1e6, 2),
        **{f"{side}_s": round(statistics.median(values), 3) for side, values in seconds.items()},
        **{f"ratio_{side}": round(statistics.median(values), 3) for side, values in ratios.items()},
        **{f"ratio_{side}_iqr": [round(q, 3) for q in _quartiles(values)] for side, values in ratios.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-good", type=int, default=40, help="good demo sources (plus the edge cases)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--s3-url", help="s3://bucket/prefix to upload to (default: a local SeaweedFS)")
    args = harness.parse(parser, argv, SMOKE_ARGS)
    from tools.demo_media import generate_demo_media
    from tools.s3_server import LocalS3

    with tempfile.TemporaryDirectory(prefix="bench-media-") as work, contextlib.ExitStack() as stack:
        work = Path(work)
        cache_dir = work / "media_cache"
        os.environ["TRAINYARD_MEDIA_CACHE"] = str(cache_dir)
        generate_demo_media(work / "media", num_good=args.num_good)
        url = args.s3_url or stack.enter_context(LocalS3(work / "s3")).url("bench-media")
        uploaded, left_out = roots.upload_folder(work / "media", url)
        result = measure(work / "media", url, cache_dir, args.rounds, args.seed)
        result.update(objects=uploaded, left_out=len(left_out), cache=content_cache.stats(roots.CACHE_NAME),
                      cpus=os.cpu_count())
    harness.emit(result, args)


if __name__ == "__main__":
    main()
