"""Training step performance: phase breakdown, throughput, data-wait fraction, DDP scaling, MFU.

    python -m benchmarks.step [--steps 30] [--encoding decoded] [--buckets demo|none] [--batch-per-rank 4]
    python -m benchmarks.step --preset 1b --clip 16,256,256 --batch-per-rank 4   # MFU on a GPU

Two modes, one runner (the real trainer under torchrun, steady-state medians after warm-up,
trainer/observe/metrics.py):

- ``--preset demo`` (the default): the demo experiment (configs/demo.yaml) on real demo shards
  through the real loader (benchmarks.loader.build_shards; the demo's four clip buckets unless
  ``--buckets none``). What it measures is the input pipeline against the step:
  data_wait_fraction = data_wait / step_time (target <= 0.05 on CPU, decoded shards).
- ``--preset tiny|small|base|1b`` with ``--clip T,H,W`` (default 16,256,256): that model on
  synthetic clips of that shape, so the figure is the model's, not the decoder's: MFU.

Precision follows the trainer's default ('auto': bf16 on CUDA, fp32 on CPU) unless
``--precision`` names one. MFU = achieved FLOP/s of the global batch (trainer/models/video.py:
flops_per_step, 6 x matmul weights per token plus attention) / (world size x ``--peak-tflops``,
default 989, the H200's dense bf16 peak). It is refused (null, with the reason) for fp32, since
the peak is a 16-bit tensor-core rate.

The 2-rank half (DDP, same batch per rank: weak scaling, ddp_scaling_efficiency) runs only
where two devices exist: two CUDA devices, or on CPU two cores. It prints the memory estimate
(trainer/launch/memory.py) beside the measured peak. Prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import torch

from ops.publish.paths import REPO_ROOT
from trainer.launch.config_sections import MODEL_PRESETS

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--steps", "7", "--buckets", "none", "--batch-per-rank", "2", "--num-good", "8"]

DEFAULT_CLIP = (16, 256, 256)
H200_BF16_PEAK_TFLOPS = 989.0
AUDIO_FRAMES_PER_CLIP = 25  # synthetic audio: a whole number of the model's audio frames


def model_overrides(preset: str) -> list[str]:
    """Every ModelConfig field of a model preset (trainer/launch/config_sections.py) as overrides."""
    config = MODEL_PRESETS[preset]()
    return [f"model.{field.name}={getattr(config, field.name)}" for field in fields(config)]


def synthetic_overrides(preset: str, clip: tuple[int, int, int]) -> list[str]:
    """A model preset on synthetic clips of one shape, with audio when the model takes it."""
    frames, height, width = clip
    audio = MODEL_PRESETS[preset]().audio_frame_samples * AUDIO_FRAMES_PER_CLIP
    return [*model_overrides(preset), "data.source=synthetic", f"data.clip_frames={frames}", f"data.height={height}",
            f"data.width={width}", f"data.audio_samples={audio}", "data.num_workers=0"]


def mfu(performance: dict, *, precision: str, world_size: int, peak_tflops: float) -> tuple[float | None, str]:
    """(MFU, how it was computed) of a run's performance summary; None with the reason for fp32."""
    if precision == "fp32":
        return None, "refused: fp32 runs on fp32/TF32 units, not against the 16-bit tensor-core peak"
    value = performance["achieved_flops_per_s"] / (world_size * peak_tflops * 1e12)
    return float(f"{value:.4g}"), f"achieved FLOP/s of the global batch / ({world_size} x {peak_tflops} TFLOP/s)"


def run(work: Path, *, nproc: int, steps: int, batch_per_rank: int, device: str, overrides: list[str]) -> dict:
    """One torchrun job of the demo experiment with overrides; its final.json."""
    run_dir = work / f"run_{nproc}"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "trainer.train", "--config", str(REPO_ROOT / "configs" / "demo.yaml"),
               "--set", f"data.batch_size={batch_per_rank * nproc}",
               "--set", f"train.steps={steps}", "--set", f"train.run_dir={run_dir}", "--set", f"train.device={device}",
               "--set", f"train.parallelism={'ddp' if nproc > 1 else 'none'}", "--set", "stage.checkpoint=false",
               "--set", "stage.mlflow=false", "--set", "train.metrics_warmup_steps=5",
               "--set", "train.eval_every=0",  # the demo config evaluates; a step benchmark measures steps
               *[item for override in overrides for item in ("--set", override)]]
    env = {key: value for key, value in os.environ.items() if not key.startswith("DAGSTER_PIPES")}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if completed.returncode != 0:
        raise RuntimeError(f"{nproc}-rank run failed:\n{completed.stderr[-3000:]}{completed.stdout[-3000:]}")
    return json.loads((run_dir / "final.json").read_text())


def num_devices(device: str) -> int:
    return torch.cuda.device_count() if device == "cuda" else (os.cpu_count() or 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--preset", choices=("demo", *MODEL_PRESETS), default="demo",
                        help="demo: the demo experiment on demo shards; a model preset: synthetic clips of --clip")
    parser.add_argument("--clip", default=",".join(map(str, DEFAULT_CLIP)), metavar="T,H,W",
                        help="clip shape for a model preset (synthetic clips)")
    parser.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16", "fp16"))
    parser.add_argument("--encoding", choices=("decoded", "compressed"), default="decoded")
    parser.add_argument("--buckets", choices=("demo", "none"), default="demo",
                        help="demo preset: the demo's four buckets (as make demo cuts them) or one shape")
    parser.add_argument("--max-ranks", type=int, default=2, choices=(1, 2), help="1 skips the 2-rank (DDP) half")
    parser.add_argument("--num-good", type=int, default=40, help="demo preset: good demo sources to cut shards from")
    parser.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS, help="16-bit dense peak of one device")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="config override for every run")
    args = harness.parse(parser, argv, SMOKE_ARGS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as work:
        overrides = list(args.overrides)
        if args.precision != "auto":  # 'auto' is the trainer's default; naming it would not move a thing
            overrides.insert(0, f"train.precision={args.precision}")
        if args.preset == "demo":
            from benchmarks.loader import BUCKETS, PRESETS, build_shards  # PyAV: only the demo mode decodes media

            buckets = BUCKETS if args.buckets == "demo" else ()
            index, _plan, _media = build_shards(Path(work), preset=PRESETS["demo"], num_good=args.num_good,
                                                encoding=args.encoding, buckets=buckets)
            # As the Dagster stages do (assets/training.py): the index's shapes become data.buckets.
            shapes = [list(size) for size in buckets]
            overrides = ["data.source=shards", f"data.shard_index={index.directory}",
                         f"data.manifest_version={index.manifest_version}",
                         *([f"data.buckets={json.dumps(shapes)}"] if shapes else []), *overrides]
        else:
            clip = tuple(int(size) for size in args.clip.split(","))
            overrides = [*synthetic_overrides(args.preset, clip), *overrides]
        ranks = (1, 2) if num_devices(device) >= 2 and args.max_ranks >= 2 else (1,)
        finals = {n: run(Path(work), nproc=n, steps=args.steps, batch_per_rank=args.batch_per_rank, device=device,
                         overrides=overrides) for n in ranks}
    harness.emit(summarize(finals, args=args, device=device), args)


def summarize(finals: dict[int, dict], *, args: argparse.Namespace, device: str) -> dict:
    """The benchmark's JSON line from the final.json of each world size."""
    one = finals[1]["performance"]
    phases = one["phase_medians_s"]
    plan = finals[1]["launch_plan"]
    precision = finals[1]["precision"]["policy"]
    result = {
        "benchmark": "step", "device": device, "preset": args.preset, "precision": precision,
        "clip_shapes": one["clip_shapes"], "batch_per_rank": args.batch_per_rank,
        "phases_s": {name: round(value, 5) for name, value in phases.items()},
        "step_time_s": round(one["step_time_s"], 5), "samples_per_s": round(one["samples_per_s"], 2),
        "frames_per_s": round(one["frames_per_s"], 1), "tokens_per_s": round(one["tokens_per_s"], 1),
        "peak_memory_bytes": one["peak_memory_bytes"], "peak_memory_kind": one.get("peak_memory_kind"),
        "memory_estimate_bytes": plan["memory"]["total_bytes"],
        "verdict": one["verdict"], "data_wait_fraction": round(phases["data_wait"] / one["step_time_s"], 4),
    }
    if args.preset == "demo":
        result |= {"encoding": args.encoding, "buckets": args.buckets}
    result["mfu"], result["mfu_formula"] = mfu(one, precision=precision, world_size=1, peak_tflops=args.peak_tflops)
    if 2 in finals:
        two = finals[2]["performance"]
        result |= {"samples_per_s_2_ranks": round(two["samples_per_s"], 2),
                   "ddp_scaling_efficiency": round(two["samples_per_s"] / (2 * one["samples_per_s"]), 3),
                   "verdict_2_ranks": two["verdict"],
                   "mfu_2_ranks": mfu(two, precision=precision, world_size=2, peak_tflops=args.peak_tflops)[0]}
    else:
        result["two_rank_half"] = ("skipped: --max-ranks 1" if args.max_ranks < 2 else f"skipped: one {device} device")
    result["targets_met"] = result["data_wait_fraction"] <= 0.05
    return result


if __name__ == "__main__":
    main()
