"""How metadata tables scale: read + row checks + join for 10k, 100k and 1M rows, Parquet and CSV.

    python -m benchmarks.metadata_table [--sizes 10000 100000 1000000] [--formats parquet csv]

Each table has a key, caption, license, consent, source_group, split and sha256 column, with
a 1% share of bad rows (duplicate keys, keys without an object, bad checksums, unknown splits).
The listing is synthetic (ops.media.scan.ListedFile records built directly: nothing is scanned or
probed), so the figure is the table's own cost: ``load_table`` (read the bytes, decode, check
every row) plus ``join`` (match rows to listed objects). Prints one JSON line.
Target: a 1M-row table joins in seconds, growing linearly with rows.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv
import pyarrow.parquet as pq

from ops.media import scan
from ops.media.metadata_table import MetadataTableSpec, join, load_table

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--sizes", "1000", "2000"]

COLUMNS = {name: name for name in ("key", "caption", "license", "consent", "source_group", "split", "sha256")}
SPLITS = ("train", "val", "test")


def synthetic(num_rows: int, *, bad_fraction: float = 0.01, seed: int = 0) -> tuple[pa.Table, list[scan.ListedFile]]:
    """A table of ``num_rows`` rows and the listing of the objects they name."""
    rng = np.random.default_rng(seed)
    index = np.arange(num_rows)
    keys = np.char.zfill(index.astype(str), 9).astype(object)
    bad = np.flatnonzero(rng.random(num_rows) < bad_fraction)
    kind = rng.integers(0, 4, len(bad))
    keys[bad[kind == 0]] = keys[np.maximum(bad[kind == 0] - 1, 0)]           # duplicate key
    sha = np.full(num_rows, "ab" * 32, dtype=object)
    sha[bad[kind == 1]] = "not-a-checksum"                                   # malformed checksum
    splits = np.array(SPLITS, dtype=object)[rng.integers(0, 3, num_rows)]
    splits[bad[kind == 2]] = "holdout"                                       # unknown split
    listed_keys = np.char.zfill(index.astype(str), 9)
    missing = bad[kind == 3]                                                 # row without an object
    listed_keys = np.delete(listed_keys, missing)
    table = pa.table({"key": keys.astype(str), "caption": np.char.add("a synthetic clip ", index.astype(str)),
                      "license": np.full(num_rows, "CC-BY-4.0"), "consent": np.full(num_rows, "granted"),
                      "source_group": np.char.add("group_", (index // 8).astype(str)),
                      "split": splits.astype(str), "sha256": sha.astype(str)})
    listing = [scan.ListedFile(uri=f"videos/{key}.mp4", kind=scan.KIND_MEDIA, size_bytes=1000, sha256="")
               for key in listed_keys.tolist()]
    return table, listing


def measure(num_rows: int, fmt: str, folder: Path) -> dict:
    table, listing = synthetic(num_rows)
    path = folder / f"meta_{num_rows}.{fmt}"
    if fmt == "parquet":
        pq.write_table(table, path)
    else:
        pyarrow.csv.write_csv(table, path)
    spec = MetadataTableSpec(location=str(path), columns=COLUMNS, key_template="videos/{key}.mp4")
    objects = {item.uri for item in listing}
    started = time.perf_counter()
    loaded = load_table(spec, SPLITS)
    read_s = time.perf_counter() - started
    joined = join(loaded, objects)
    total_s = time.perf_counter() - started
    return {"rows": num_rows, "format": fmt, "bytes": path.stat().st_size, "read_check_s": round(read_s, 3),
            "join_s": round(total_s - read_s, 3), "total_s": round(total_s, 3),
            "rows_per_s": round(num_rows / total_s), "num_joined": len(joined.row_of),
            "num_object_problems": len(joined.object_problems), "num_orphans": len(joined.orphans)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--formats", nargs="+", choices=("parquet", "csv"), default=["parquet", "csv"])
    args = harness.parse(parser, argv, SMOKE_ARGS)
    with tempfile.TemporaryDirectory() as folder:
        results = [measure(size, fmt, Path(folder)) for size in sorted(args.sizes) for fmt in args.formats]
    summary = {"benchmark": "metadata_table", "results": results,
               "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}
    for fmt in args.formats:
        mine = [r for r in results if r["format"] == fmt]
        if len(mine) >= 2:
            summary[f"{fmt}_growth"] = round(mine[-1]["total_s"] / mine[0]["total_s"], 2)
            summary[f"{fmt}_size_ratio"] = mine[-1]["rows"] / mine[0]["rows"]
    harness.emit(summary, args)


if __name__ == "__main__":
    main()
