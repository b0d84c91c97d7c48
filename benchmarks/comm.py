"""Collective communication at the model's gradient-bucket sizes: all_reduce, all_gather, reduce_scatter.

    python -m benchmarks.comm [--config configs/demo.yaml] [--sizes 4096,1048576] [--iterations 20]

Two spawned ranks (gloo on CPU, NCCL where CUDA has two devices) on a free local port; each size is
timed ``--iterations`` times after ``--warmup`` (slowest rank per iteration, median reported).
algbw = bytes / time; busbw follows nccl-tests' doc/PERFORMANCE.md (ops/drills/reports.py:bus_bandwidth).
Default sizes: the buckets DDP forms for the config's model, its total gradient bytes and 25 MiB.
Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse

from ops.drills import reports

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--sizes", "4096,65536", "--iterations", "2", "--warmup", "1"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/demo.yaml", help="experiment whose model gives the bucket sizes")
    parser.add_argument("--sizes", default="", help="comma-separated message sizes in bytes (overrides the model's)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = harness.parse(parser, argv, SMOKE_ARGS)
    from assets.reports import model_gradient_sizes  # noqa: PLC0415 (the one place the model's sizes are read)

    model = model_gradient_sizes(args.config)
    sizes = ([int(size) for size in args.sizes.split(",")] if args.sizes else
             sorted({*model["bucket_bytes"], model["gradient_bytes"], reports.DDP_BUCKET_CAP_BYTES}))
    settings = reports.CommSettings(sizes_bytes=tuple(sizes), world_size=args.world_size, iterations=args.iterations,
                                    warmup=args.warmup)
    result = reports.time_collectives(settings)
    rows = [{**row, "time_s": float(f"{row['time_s']:.4g}"), "algbw_gbps": float(f"{row['algbw_gbps']:.4g}"),
             "busbw_gbps": float(f"{row['busbw_gbps']:.4g}")} for row in result["rows"]]
    harness.emit({"benchmark": "comm", "config": args.config, "model": model, **result, "rows": rows}, args)


if __name__ == "__main__":
    main()
