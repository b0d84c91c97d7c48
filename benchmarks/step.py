"""Training step performance: phase breakdown, throughput, data-wait fraction, DDP scaling.

    python -m benchmarks.step [--steps 30] [--encoding decoded] [--buckets demo|none] [--batch-per-rank 4]

Self-contained: builds the demo shards (benchmarks.loader.build_shards; in the demo's four clip
buckets unless --buckets none), then runs the demo
experiment (configs/demo.yaml: the demo_cpu model on real shards through the real loader)
under torchrun with 1 and with 2 ranks, same batch per rank, side by side in one run. Reads
each run's measured performance (trainer/metrics.py, steady-state medians after warm-up).

- data_wait_fraction: data_wait / step_time of the 1-rank run (target <= 0.05, decoded shards, CPU).
- ddp_scaling_efficiency: samples/s at 2 ranks / (2 x samples/s at 1 rank) (weak scaling).
- On CUDA, mfu: achieved FLOP/s / the device's bf16 peak (--peak-tflops, default H200 989);
  pick the model with --set (e.g. the model fields of trainer.model.one_b and train.precision=bf16).

Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.loader import BUCKETS, build_shards
from ops.paths import REPO_ROOT


def run(work: Path, *, nproc: int, steps: int, batch_per_rank: int, index_dir: Path, manifest_version: str,
        device: str, overrides: list[str]) -> dict:
    run_dir = work / f"run_{nproc}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainer.train", "--config", str(REPO_ROOT / "configs" / "demo.yaml"),
               "--set", "data.source=shards", "--set", f"data.shard_index={index_dir}",
               "--set", f"data.manifest_version={manifest_version}", "--set", f"data.batch_size={batch_per_rank * nproc}",
               "--set", f"train.steps={steps}", "--set", f"train.run_dir={run_dir}", "--set", f"train.device={device}",
               "--set", f"train.parallelism={'ddp' if nproc > 1 else 'none'}", "--set", "stage.checkpoint=false",
               "--set", "stage.mlflow=false", "--set", "train.metrics_warmup_steps=5",
               *[item for override in overrides for item in ("--set", override)]]
    env = {key: value for key, value in os.environ.items() if not key.startswith("DAGSTER_PIPES")}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if completed.returncode != 0:
        raise RuntimeError(f"{nproc}-rank run failed:\n{completed.stderr[-3000:]}")
    return json.loads((run_dir / "final.json").read_text())["performance"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--encoding", choices=("decoded", "compressed"), default="decoded")
    parser.add_argument("--buckets", choices=("demo", "none"), default="demo",
                        help="clip shapes of the shards: the demo's four buckets (as make demo cuts them) or one shape")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak of the GPU")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="config override for both runs, e.g. a bigger model and train.precision=bf16 on a GPU")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as work:
        buckets = BUCKETS if args.buckets == "demo" else ()
        index, plan, _media = build_shards(Path(work), num_good=40, encoding=args.encoding, buckets=buckets)
        # As the Dagster stages do (assets/training.py): the index's shapes become data.buckets.
        shapes = [list(size) for size in buckets]
        overrides = [*([f"data.buckets={json.dumps(shapes)}"] if shapes else []), *args.overrides]
        one, two = (run(Path(work), nproc=n, steps=args.steps, batch_per_rank=args.batch_per_rank,
                        index_dir=index.directory, manifest_version=index.manifest_version, device=device,
                        overrides=overrides)
                    for n in (1, 2))
    phases = one["phase_medians_s"]
    result = {
        "benchmark": "step", "device": device, "encoding": args.encoding, "buckets": args.buckets,
        "clip_shapes": one["clip_shapes"], "batch_per_rank": args.batch_per_rank,
        "phases_s": {name: round(value, 5) for name, value in phases.items()},
        "step_time_s": round(one["step_time_s"], 5), "samples_per_s": round(one["samples_per_s"], 2),
        "frames_per_s": round(one["frames_per_s"], 1), "tokens_per_s": round(one["tokens_per_s"], 1),
        "peak_memory_bytes": one["peak_memory_bytes"], "verdict": one["verdict"],
        "data_wait_fraction": round(phases["data_wait"] / one["step_time_s"], 4),
        "samples_per_s_2_ranks": round(two["samples_per_s"], 2),
        "ddp_scaling_efficiency": round(two["samples_per_s"] / (2 * one["samples_per_s"]), 3),
        "verdict_2_ranks": two["verdict"],
    }
    if device == "cuda":
        result["mfu"] = round(one["achieved_flops_per_s"] / (args.peak_tflops * 1e12), 4)
    result["targets_met"] = result["data_wait_fraction"] <= 0.05
    print(json.dumps(result))


if __name__ == "__main__":
    main()
