"""The prepared GPU check: what a lent GPU machine must tell us in its first minutes.

    python3 -m benchmarks.gpu_check              # on the GPU machine: every check, about 8 minutes
    python3 -m benchmarks.gpu_check --dry        # the same plumbing on CPU with tiny sizes (CI runs it)
    python3 -m benchmarks.gpu_check --only gemm,attention

Made for the machine as it is lent (docs/status.md, "GPU check", says how to launch it with the
device tool): its own python3 with a preinstalled CUDA torch, older than ours, and no network.
It needs torch, numpy, pyarrow and pyyaml, which that image has, and imports nothing of PyAV,
webdataset, MLflow, Dagster or pandera (the training runs read synthetic clips), so no wheel
has to travel; tests/test_gpu_check.py runs --dry with those packages made unimportable.

Each check runs in its own process under its own timeout (a hang or a crash costs that check,
not the rest) and prints one JSON line as it finishes; a last line sums them up. In order:

- environment: python, torch, CUDA, device, memory, bf16, SDPA backends, which packages exist.
- gemm: bf16 matmul TFLOP/s at the 1b preset's shapes (qkv, proj, fc1, fc2 over 16k tokens), and
  fp32 with and without TF32 at one of them.
- attention: each SDPA backend (flash, cudnn, efficient, math) forward + backward at the 1b
  preset's heads (16 x 128) over one 16x256x256 clip (8192 tokens), TFLOP/s by 4 B H N^2 D
  forward and 2.5x that backward (FlashAttention-2's count); a backend torch refuses is named.
- empty_micro_batch: a micro-batch of zero clips through forward and backward on the device.
- mfu_eager: the 1b preset in bf16 on 16x256x256 synthetic clips at the largest batch that fits
  (the memory estimate's guess, halved on out-of-memory): MFU against --peak-tflops (989, H200
  dense bf16), measured peak memory beside the estimate, and the batches tried.
- two_device: a 2-rank DDP and FSDP2 run under torchrun (NCCL), only where 2 GPUs exist; in --dry,
  2 CPU ranks on gloo.
- mfu_compile: mfu_eager's run at its batch with train.compile=true.

The whole check stays inside --budget-s (480): a check that would start with less time left
than its timeout is skipped, and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--dry", "--only", "environment,gemm,attention,empty_micro_batch"]

REPO_ROOT = Path(__file__).resolve().parent.parent
PEAK_TFLOPS = 989.0
CLIP = (16, 256, 256)
DRY_CLIP = (4, 16, 16)
OPTIONAL_PACKAGES = ("av", "webdataset", "mlflow", "dagster", "pandera", "pyarrow", "yaml", "numpy")
# 1b preset (trainer/launch/config_sections.py: one_b): dim 2048, 16 heads of 128, MLP 8192.
GEMM_SHAPES = {"qkv": (2048, 6144), "proj": (2048, 2048), "fc1": (2048, 8192), "fc2": (8192, 2048)}
GEMM_TOKENS = 16384


# ---------------------------------------------------------------------------------------------
# Timing


def timed(fn: Callable[[], Any], *, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of fn() after warmup calls: CUDA events on a GPU, perf_counter on CPU."""
    import statistics

    import torch

    for _ in range(warmup):
        fn()
    durations = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            durations.append(start.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            fn()
            durations.append(time.perf_counter() - started)
    return statistics.median(durations)


# ---------------------------------------------------------------------------------------------
# The checks (each returns its JSON record; raising marks it failed)


def check_environment(dry: bool) -> dict[str, Any]:
    import torch

    record: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "cpu_count": os.cpu_count(), "cuda_available": torch.cuda.is_available(),
        "packages": {name: _importable(name) for name in OPTIONAL_PACKAGES},
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        record |= {"device_count": torch.cuda.device_count(), "device_name": props.name,
                   "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory,
                   "bf16": torch.cuda.is_bf16_supported(),
                   "sdpa_enabled": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                    "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                    "math": torch.backends.cuda.math_sdp_enabled()}}
    elif not dry:
        raise RuntimeError(f"torch {torch.__version__} sees no CUDA device; run with --dry on a CPU machine")
    return record


def _importable(name: str) -> bool:
    """Whether ``import name`` would find the package (an import hook that refuses it: no)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses the name, as tests/test_gpu_check.py installs
        return False


def check_gemm(dry: bool) -> dict[str, Any]:
    import torch

    device = _device(dry)
    tokens, scale = (64, 32) if dry else (GEMM_TOKENS, 1)
    rates = {}
    for name, (k, n) in GEMM_SHAPES.items():
        k, n = k // scale, n // scale
        a = torch.randn(tokens, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        seconds = timed(lambda a=a, b=b: a @ b, device=device, warmup=3, repeats=10)
        rates[f"bf16_{name}_tflops"] = _figure(2 * tokens * k * n / seconds / 1e12)
    k, n = GEMM_SHAPES["fc1"][0] // scale, GEMM_SHAPES["fc1"][1] // scale
    a, b = torch.randn(tokens, k, device=device), torch.randn(k, n, device=device)
    from trainer.precision import restore_tf32, set_tf32

    for tf32 in (False, True):
        previous = set_tf32(tf32)
        try:
            seconds = timed(lambda: a @ b, device=device, warmup=3, repeats=10)
        finally:
            restore_tf32(previous)
        rates[f"fp32_fc1_tf32_{'on' if tf32 else 'off'}_tflops"] = _figure(2 * tokens * k * n / seconds / 1e12)
    return {"tokens": tokens, **rates}


def check_attention(dry: bool) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from trainer.precision import attention_context

    device = _device(dry)
    heads, head_dim = (2, 32) if dry else (16, 128)
    frames, height, width = DRY_CLIP if dry else CLIP
    tokens = (frames // 2) * (height // 8) * (width // 8)  # the 1b preset's 2x8x8 patches
    forward_flops = 4 * heads * tokens * tokens * head_dim
    results: dict[str, Any] = {"heads": heads, "head_dim": head_dim, "tokens": tokens}
    for backend in ("flash", "cudnn", "efficient", "math"):
        q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))

        def step(q=q, k=k, v=v, backend=backend) -> None:
            with attention_context(backend):
                F.scaled_dot_product_attention(q, k, v).sum().backward()

        try:
            seconds = timed(step, device=device, warmup=2, repeats=5)
        except RuntimeError as error:
            results[backend] = {"available": False, "reason": str(error).splitlines()[0][:300]}
            continue
        results[backend] = {"available": True, "fwd_bwd_s": round(seconds, 6),
                            "fwd_bwd_tflops": _figure(3.5 * forward_flops / seconds / 1e12)}
    return results


def check_mfu(dry: bool, *, compile: bool, batch_hint: int | None = None) -> dict[str, Any]:
    """The 1b preset (tiny in --dry) in bf16 at the largest batch that fits; halve on out-of-memory."""
    import torch

    device = _device(dry)
    preset, clip = ("tiny", DRY_CLIP) if dry else ("1b", CLIP)
    budget = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 2 * 2**30
    batch = batch_hint or _largest_fitting_batch(preset, clip, device=device, budget_bytes=int(0.9 * budget),
                                                 compile=compile)
    tried = []
    while batch >= 1:
        tried.append(batch)
        try:
            final = _train(preset, clip, batch=batch, device=device, compile=compile, steps=4 if dry else 8)
        except torch.OutOfMemoryError:
            batch //= 2
            _free_device_memory()
            continue
        performance, estimate = final["performance"], final["launch_plan"]["memory"]  # the trainer's preflight
        from benchmarks.step import mfu

        value, formula = mfu(performance, precision=final["precision"]["policy"], world_size=1, peak_tflops=PEAK_TFLOPS)
        # Synthetic clips are generated on the host inside the step (data_wait): the model's own
        # rate is the step without that wait, reported beside the honest whole-step figure.
        step_s, wait_s = performance["step_time_s"], performance["phase_medians_s"]["data_wait"]
        compute_only = value * step_s / (step_s - wait_s) if value is not None and step_s > wait_s else None
        return {"preset": preset, "clip": list(clip), "batch": batch, "batches_tried": tried, "compile": compile,
                "precision": final["precision"]["policy"], "kernels": final["kernels"],
                "mfu": value, "mfu_formula": formula, "peak_tflops": PEAK_TFLOPS,
                "mfu_without_data_wait": None if compute_only is None else _figure(compute_only),
                "data_wait_fraction": round(wait_s / step_s, 4),
                "achieved_tflops": _figure(performance["achieved_flops_per_s"] / 1e12),
                "step_time_s": round(performance["step_time_s"], 4), "phases_s": performance["phase_medians_s"],
                "peak_memory_bytes": performance["peak_memory_bytes"],
                "peak_memory_kind": performance["peak_memory_kind"], "memory_estimate": estimate,
                "peak_over_estimate": round(performance["peak_memory_bytes"] / estimate["total_bytes"], 3),
                "time_to_first_step_s": final["startup"].get("time_to_first_step_s")}
    raise RuntimeError(f"out of memory at every batch tried: {tried}")


def check_empty_micro_batch(dry: bool) -> dict[str, Any]:
    """Zero clips through the model's forward and backward, as an empty micro-batch takes them."""
    import torch

    from trainer.models.video import VideoFlowModel, sample_noise_and_time
    from trainer.launch.config_sections import MODEL_PRESETS

    device = torch.device(_device(dry))
    config = MODEL_PRESETS["tiny" if dry else "small"]()
    clip = DRY_CLIP if dry else (4, 64, 64)
    model = VideoFlowModel(config, video_shape=clip)
    model.init_weights(seed=0)
    model.to(device)
    video = torch.zeros((0, *clip, 3), dtype=torch.uint8, device=device)
    audio = torch.zeros((0, config.audio_frame_samples), device=device)
    noise, t = sample_noise_and_time([], seed=0, step=1, video_shape=clip, device=device)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        loss = model(video, audio, torch.zeros(0, dtype=torch.bool, device=device), noise, t).sum()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    if not finite or float(loss) != 0.0:
        raise RuntimeError(f"empty micro-batch gave loss {float(loss)} and finite gradients {finite}")
    return {"loss": float(loss), "num_grads": len(grads), "grads_finite": finite, "device": str(device)}


def check_two_device(dry: bool) -> dict[str, Any]:
    import torch

    if not dry and torch.cuda.device_count() < 2:
        return {"skipped": f"{torch.cuda.device_count()} CUDA device(s): the 2-rank NCCL check needs 2"}
    device = _device(dry)
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for parallelism in ("ddp", "fsdp"):
            run_dir = Path(work) / parallelism
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                       "-m", "trainer.train", "--config", str(REPO_ROOT / "configs" / "test_tiny.yaml"),
                       *_sets(f"train.run_dir={run_dir}", f"train.device={device}", f"train.parallelism={parallelism}",
                              "train.steps=4", "train.checkpoint_every=0", "stage.checkpoint=false",
                              "stage.mlflow=false", "data.source=synthetic", "data.num_workers=0",
                              "train.collective_timeout_s=60")]
            done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
            if done.returncode != 0:
                raise RuntimeError(f"2-rank {parallelism} exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
            final = json.loads((run_dir / "final.json").read_text())
            results[parallelism] = {"status": final["status"], "losses": final["losses"],
                                    "precision": final["precision"]["policy"]}
    ddp, fsdp = results["ddp"]["losses"], results["fsdp"]["losses"]
    results["max_loss_rel_diff_fsdp_vs_ddp"] = max(abs(a - b) / abs(a) for a, b in zip(ddp, fsdp, strict=True))
    results["backend"] = "gloo" if dry else "nccl"
    return results


CHECKS: dict[str, tuple[Callable[..., dict[str, Any]], float]] = {
    # name -> (check, timeout in seconds on the GPU machine); --dry uses DRY_TIMEOUT_S for each
    # Cheap and decisive first; compile, the slowest and the least likely to decide anything, last.
    "environment": (check_environment, 60),
    "gemm": (check_gemm, 60),
    "attention": (check_attention, 60),
    "empty_micro_batch": (check_empty_micro_batch, 45),
    "mfu_eager": (lambda dry, **kw: check_mfu(dry, compile=False, **kw), 150),
    "two_device": (check_two_device, 150),
    "mfu_compile": (lambda dry, **kw: check_mfu(dry, compile=True, **kw), 210),
}
DRY_TIMEOUT_S = 240.0


# ---------------------------------------------------------------------------------------------
# Training runs for the MFU checks (in this process: one device, no torchrun)


def _experiment(preset: str, clip: tuple[int, int, int], *, batch: int, device: str, compile: bool,
                steps: int = 8, run_dir: str = "unused"):
    from benchmarks.step import synthetic_overrides
    from trainer.launch.config import load_config

    return load_config(REPO_ROOT / "configs" / "demo.yaml", [
        *synthetic_overrides(preset, clip), f"data.batch_size={batch}", f"data.num_samples={max(64, 4 * batch)}",
        "train.precision=bf16", f"train.device={device}", "train.parallelism=none", f"train.steps={steps}",
        "train.metrics_warmup_steps=3", f"train.compile={str(compile).lower()}", "train.checkpoint_every=0",
        "stage.checkpoint=false", "stage.mlflow=false", "optim.warmup_steps=0", f"train.run_dir={run_dir}",
        "train.eval_every=0"])  # the demo config evaluates (and encodes MP4s with PyAV, absent there)


def _largest_fitting_batch(preset: str, clip: tuple[int, int, int], *, device: str, budget_bytes: int,
                           compile: bool) -> int:
    """The largest batch (up to 64) whose memory estimate fits budget_bytes; at least 1 (a bisection)."""
    from trainer.launch.memory import estimate_memory_bytes

    def fits(batch: int) -> bool:
        config = _experiment(preset, clip, batch=batch, device=device, compile=compile)
        return estimate_memory_bytes(config, 1, device_type=device) <= budget_bytes

    low, high = 1, 64  # fits(low) is assumed (batch 1 always runs: an out-of-memory halves from there)
    if fits(high):
        return high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _train(preset: str, clip: tuple[int, int, int], *, batch: int, device: str, compile: bool, steps: int) -> dict:
    from trainer.loop import Trainer

    with tempfile.TemporaryDirectory() as run_dir:
        config = _experiment(preset, clip, batch=batch, device=device, compile=compile, steps=steps, run_dir=run_dir)
        trainer = Trainer(config)
        try:
            result = trainer.train()
        finally:
            trainer.close()
        if result.status != "completed":
            raise RuntimeError(f"training ended {result.status}: {result.error}")
        final = json.loads((Path(run_dir) / "final.json").read_text())
        final["startup"] = json.loads((Path(run_dir) / "samples" / "rank_0.json").read_text())["startup"]
        return final


def _free_device_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _figure(value: float) -> float:
    """Four significant digits: TFLOP/s of an H200 and of --dry's tiny CPU sizes both stay readable."""
    return float(f"{value:.4g}")


def _device(dry: bool) -> str:
    return "cpu" if dry else "cuda"


def _sets(*overrides: str) -> list[str]:
    return [item for override in overrides for item in ("--set", override)]


# ---------------------------------------------------------------------------------------------
# Running: each check in its own process


def run_one(name: str, *, dry: bool, batch_hint: int | None) -> dict[str, Any]:
    """Run check ``name`` here; its record, with ok and elapsed_s (an exception: ok false and why)."""
    started = time.monotonic()
    check, _timeout = CHECKS[name]
    kwargs = {"batch_hint": batch_hint} if name == "mfu_compile" and batch_hint else {}
    try:
        record = {"check": name, "ok": True, **check(dry, **kwargs)}
    except Exception as error:  # noqa: BLE001 - the check failed: its record says how, the others still run
        record = {"check": name, "ok": False, "error": f"{type(error).__name__}: {error}"[:2000]}
    record["elapsed_s"] = round(time.monotonic() - started, 2)
    return record


def run_all(names: list[str], *, dry: bool, budget_s: float) -> dict[str, Any]:
    """Every check in a child process under its timeout, printed as it finishes; the summary."""
    started = time.monotonic()
    records: dict[str, dict[str, Any]] = {}
    for name in names:
        timeout = DRY_TIMEOUT_S if dry else CHECKS[name][1]
        left = budget_s - (time.monotonic() - started)
        if left < min(timeout, 30):
            record = {"check": name, "ok": False, "skipped": f"budget: {left:.0f} s left, the check may take {timeout} s"}
        else:
            record = _child(name, dry=dry, timeout_s=min(timeout, left), records=records)
        records[name] = record
        print(json.dumps(record), flush=True)
    return {"benchmark": "gpu_check", "dry": dry, "elapsed_s": round(time.monotonic() - started, 1),
            "ok": {name: record["ok"] for name, record in records.items()},
            "mfu_eager": records.get("mfu_eager", {}).get("mfu"), "mfu_compile": records.get("mfu_compile", {}).get("mfu"),
            "peak_over_estimate": records.get("mfu_eager", {}).get("peak_over_estimate"),
            "all_ok": all(record["ok"] for record in records.values())}


def _child(name: str, *, dry: bool, timeout_s: float, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--check", name, *(["--dry"] if dry else [])]
    batch = records.get("mfu_eager", {}).get("batch")
    if name == "mfu_compile" and batch:  # the batch eager mode fitted: compile needs no new search
        command += ["--batch", str(batch)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                        "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        tail = (expired.stdout or b"")[-800:]
        return {"check": name, "ok": False, "error": f"timed out after {timeout_s:.0f} s",
                "output_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    with contextlib.suppress(IndexError, json.JSONDecodeError):
        return json.loads(lines[-1])
    return {"check": name, "ok": False, "error": f"exited {done.returncode} without a record",
            "output_tail": (done.stdout + done.stderr)[-1500:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny sizes: the plumbing, not the figures")
    parser.add_argument("--only", help="comma-separated checks (default: all, in order)")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--check", choices=list(CHECKS), help=argparse.SUPPRESS)  # one check, in this process
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = harness.parse(parser, argv, SMOKE_ARGS)
    if args.check:
        print(json.dumps(run_one(args.check, dry=args.dry, batch_hint=args.batch)), flush=True)
        return 0
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        parser.error(f"unknown checks {unknown}; known: {list(CHECKS)}")
    summary = run_all(names, dry=args.dry, budget_s=args.budget_s)
    harness.emit(summary, args)
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
