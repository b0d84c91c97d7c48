"""How manifest build and validation scale: 100k and 1M synthetic rows, metadata only.

    python -m benchmarks.manifest_scale [--sizes 100000 1000000] [--bad-fraction 0.01] [--smoke]

Rows look like probed demo clips (no media is decoded: probing is per-file work that scales
out across processes, measured elsewhere). A share of rows carry each kind of defect, so the
quarantine paths are exercised, not only the happy path. ``build_s`` is table assembly,
version hash and Parquet publication; ``validate_s`` is row schema, set rules and every gate.
Targets: 1M rows validated in under 60 s; 1M at most 12x the 100k time.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import pyarrow as pa

from benchmarks import harness
from ops.curation import manifest, validation
from ops.curation.splits import SplitConfig

SMOKE_ARGS = ["--sizes", "1000", "2000"]


def synthetic_table(num_rows: int, *, bad_fraction: float, seed: int = 0) -> pa.Table:
    """Probe-like rows; ``bad_fraction`` of them split across five defect kinds."""
    rng = np.random.default_rng(seed)
    index = np.arange(num_rows)
    sha = np.char.add("sha", index.astype(str))
    num_groups = max(1, num_rows // 8)
    group_ids = rng.integers(0, num_groups, num_rows)
    # Groups spread 80/10/10 over train/val/test by a multiplicative hash of their id.
    bucket = group_ids * 2654435761 % 10
    splits = np.array(["train", "val", "test"])[(bucket >= 8).astype(int) + (bucket == 9)]
    duration = rng.uniform(0.5, 12.0, num_rows)
    consent = np.full(num_rows, "granted", dtype=object)
    probe_error = np.full(num_rows, None, dtype=object)
    bad = rng.random(num_rows) < bad_fraction
    kind = rng.integers(0, 5, num_rows)
    duration[bad & (kind == 0)] = 0.1                                    # invalid duration
    consent[bad & (kind == 1)] = "revoked"                               # consent revoked
    probe_error[bad & (kind == 2)] = "truncated_file"                    # ingest error
    dup = np.flatnonzero(bad & (kind == 3))
    sha[dup] = sha[np.maximum(dup - 1, 0)]                               # duplicate content
    leak = bad & (kind == 4)
    splits = np.where(leak, np.where(splits == "train", "test", "train"), splits)  # pinned elsewhere
    columns = {
        "asset_id": sha, "uri": np.char.add(np.char.add("clips/clip_", index.astype(str)), ".mp4"),
        "size_bytes": rng.integers(10_000, 5_000_000, num_rows), "sha256": sha, "expected_sha256": sha,
        "container": np.full(num_rows, "mp4"), "video_codec": np.full(num_rows, "h264"),
        "width": np.full(num_rows, 320, np.int32), "height": np.full(num_rows, 180, np.int32),
        "fps": np.full(num_rows, 25.0), "num_frames": (duration * 25).astype(np.int64), "duration_s": duration,
        "measured_duration_s": duration,  # the demuxed length agrees with the header (no truncation)
        "audio_codec": np.full(num_rows, "aac"), "sample_rate": np.full(num_rows, 48_000, np.int32),
        "channels": np.full(num_rows, 2, np.int32), "num_streams": np.full(num_rows, 2, np.int32),
        "caption": np.full(num_rows, "a synthetic clip"), "license": np.full(num_rows, "CC-BY-4.0"),
        "consent": consent, "source_group": np.char.add("group_", group_ids.astype(str)),
        "split": splits, "split_source": np.where(leak, "sidecar", "group_hash"),
        "provenance": np.full(num_rows, "{}"), "probe_error": probe_error,
        "probe_error_detail": np.where(probe_error == None, None, "cut"),  # noqa: E711 (elementwise)
        "sidecar_error": np.full(num_rows, None, dtype=object),
        "sidecar_error_detail": np.full(num_rows, None, dtype=object),
        "probe_attempts": np.ones(num_rows, np.int32),
        "license_source": np.full(num_rows, "sidecar"), "consent_source": np.full(num_rows, "sidecar"),
        "metadata_row": np.full(num_rows, None, dtype=object),
    }
    return pa.table({name: pa.array(columns[name], type=manifest.MANIFEST_SCHEMA.field(name).type)
                     for name in manifest.MANIFEST_SCHEMA.names})


def measure(num_rows: int, *, bad_fraction: float) -> dict:
    table = synthetic_table(num_rows, bad_fraction=bad_fraction)
    config = manifest.ManifestConfig(splits=SplitConfig())
    with tempfile.TemporaryDirectory() as out_dir:
        started = time.perf_counter()
        built = manifest.manifest_from_table(table, config=config.transform_config(), media_root="/synthetic")
        manifest.write_manifest(built, out_dir)
        build_s = time.perf_counter() - started
    started = time.perf_counter()
    result = validation.validate(built, validation.ValidationConfig(verify_objects="off"))
    gate_results = validation.gates(result)
    validate_s = time.perf_counter() - started
    return {"rows": num_rows, "build_s": round(build_s, 3), "validate_s": round(validate_s, 3),
            "num_quarantined": len(result.rejected), "gates_passed": all(g.passed for g in gate_results),
            "reason_counts": result.reason_counts()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--bad-fraction", type=float, default=0.01)
    args = harness.parse(parser, argv, SMOKE_ARGS)
    results = [measure(size, bad_fraction=args.bad_fraction) for size in sorted(args.sizes)]
    summary = {"benchmark": "manifest_scale", "results": results}
    if len(results) >= 2:
        small, large = results[0], results[-1]
        size_ratio = large["rows"] / small["rows"]
        summary["validate_growth"] = round(large["validate_s"] / small["validate_s"], 2)
        summary["build_growth"] = round(large["build_s"] / small["build_s"], 2)
        summary["size_ratio"] = size_ratio
        summary["targets_met"] = bool(large["validate_s"] < 60 and summary["validate_growth"] <= 1.2 * size_ratio
                                      and summary["build_growth"] <= 1.2 * size_ratio)
    harness.emit(summary, args)


if __name__ == "__main__":
    main()
