"""The step and loader benchmarks of a base commit and of this checkout, side by side in one run.

    python -m benchmarks.compare [--base REF] [--head REF] [--rounds 3] [--quick]

Checks the base (and --head, if given; else this working tree as it is, uncommitted edits
included) out into temporary worktrees, then runs `benchmarks.step` and `benchmarks.loader` in
each as subprocesses (cwd and PYTHONPATH the tree), interleaved round by round: on 2 cores the
machine's own drift is as large as what we look for, so the sides alternate and each round
flips which goes first. Both sides run this checkout's benchmarks/ (copied into each tree):
only the code under test differs, and an old commit's harness may not run against today's
published-file checks (1473b84's could not build a plan record).
The base defaults to HEAD when tracked files have uncommitted edits (what they change), else
HEAD~1 (what the last commit changed). Since both sides import today's benchmarks/, a base from
before a re-layout of the modules they import (1473b84 has ``ops/clips.py``) is refused by name
before any round runs.

Per metric it prints the medians of each side, head / base, the spread (largest relative
distance of a round from its side's median, over both sides), and a verdict. The difference
of two medians can be off by up to one spread each way from noise alone, so head counts as no
regression while it is worse by at most 2 x spread (and never less than MIN_TOLERANCE, since
two or three rounds can under-state the noise). Past MAX_SPREAD the band is so wide that passing it
says nothing, and the verdict is "too_noisy" instead (rerun on a quiet machine). Prints one JSON object as its last line; exits
non-zero if any benchmark run fails. Default ~8 min on 2 cores, --quick ~3 min.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--base", "HEAD", "--rounds", "1"]

HARNESS = Path(__file__).resolve().parent
CHECKOUT = HARNESS.parent
MIN_TOLERANCE = 0.02
MAX_SPREAD = 0.10
LOADER_VARIANTS = ("compressed", "decoded", "compressed_bucketed")
# name -> (benchmark, key path in its JSON, which way is better)
METRICS = {
    "step.step_time_s": ("step", ("step_time_s",), "lower"),
    "step.samples_per_s": ("step", ("samples_per_s",), "higher"),
    "step.data_wait_fraction": ("step", ("data_wait_fraction",), "lower"),
    **{f"loader.{variant}.{key}": ("loader", (variant, key), "higher")
       for variant in LOADER_VARIANTS for key in ("loader_frames_per_s", "ratio_vs_ceiling")},
}
# One clip shape for the step benchmark: every steady step does the same work, so a median over
# few steps is not a mix of bucket sizes.
ARGS = {
    "default": {"step": ["--steps", "20", "--buckets", "none"],
                "loader": ["--num-good", "20", "--epochs", "3", "--rounds", "1", "--scaling", "0", "--hwaccel", "none"]},
    "quick": {"step": ["--steps", "12", "--buckets", "none"],
              "loader": ["--num-good", "12", "--epochs", "2", "--rounds", "1", "--scaling", "0", "--hwaccel", "none"]},
    # CI's check that the harness still runs both benchmarks on both sides (figures meaningless).
    "smoke": {"step": ["--smoke", "--max-ranks", "1"], "loader": ["--smoke", "--no-object-store", "--scaling", "0"]},
}


class BenchmarkFailed(RuntimeError):
    """A benchmark run of one side exited non-zero or printed no JSON."""


# ---------------------------------------------------------------------------------------------
# Arithmetic (tests/test_benchmarks_compare.py)

def spread(*sides: list[float]) -> float:
    """Largest relative distance of one round from its side's median, over every side."""
    return max(abs(value - statistics.median(side)) / abs(statistics.median(side))
               for side in sides for value in side if statistics.median(side))


def judge(base: list[float], head: list[float], better: str) -> dict:
    """Medians, head / base, spread, tolerance and the verdict of one metric."""
    base_median, head_median = statistics.median(base), statistics.median(head)
    ratio = head_median / base_median if base_median else float("inf")
    worse_by = ratio - 1 if better == "lower" else 1 - ratio
    noise = spread(base, head)
    tolerance = max(MIN_TOLERANCE, 2 * noise)
    return {"better": better, "base_median": base_median, "head_median": head_median,
            "head_over_base": round(ratio, 4), "spread": round(noise, 4), "tolerance": round(tolerance, 4),
            "verdict": "regression" if worse_by > tolerance else "too_noisy" if noise > MAX_SPREAD else "no_regression",
            "base_rounds": base, "head_rounds": head}


def summarize(rounds: dict[str, list[dict]]) -> dict:
    """Every metric judged from the per-round results of each side ({"base": [...], "head": [...]})."""
    metrics = {}
    for name, (benchmark, path, better) in METRICS.items():
        values = {side: [_dig(result[benchmark], path) for result in results] for side, results in rounds.items()}
        metrics[name] = judge(values["base"], values["head"], better)
    verdicts = {metric["verdict"] for metric in metrics.values()}
    verdict = next(kind for kind in ("regression", "too_noisy", "no_regression") if kind in verdicts)
    regressed = sorted(name for name, metric in metrics.items() if metric["verdict"] == "regression")
    return {"verdict": verdict, "regressed": regressed, "metrics": metrics}


def _dig(result: dict, path: tuple[str, ...]) -> float:
    for key in path:
        result = result[key]
    return float(result)


# ---------------------------------------------------------------------------------------------
# Running

def add_worktree(stack: ExitStack, ref: str) -> Path:
    """A detached worktree of ``ref`` holding this checkout's benchmarks/; removed when the stack closes."""
    path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trainyard-compare-"))) / "tree"
    try:
        _git("worktree", "add", "--detach", str(path), ref)
    except subprocess.CalledProcessError as error:
        raise BenchmarkFailed(f"no worktree of {ref!r}: {(error.stderr or '').strip()}") from error
    stack.callback(_git, "worktree", "remove", "--force", str(path))
    shutil.rmtree(path / "benchmarks")
    shutil.copytree(HARNESS, path / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    return path


def run_benchmark(tree: Path, name: str, args: list[str], env: dict[str, str]) -> dict:
    """``python -m benchmarks.<name>`` with ``tree``'s code; its JSON line."""
    command = [sys.executable, "-m", f"benchmarks.{name}", *args]
    done = subprocess.run(command, cwd=tree, env=env | {"PYTHONPATH": str(tree)}, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BenchmarkFailed(f"benchmarks.{name} in {tree} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def check_imports(tree: Path, env: dict[str, str]) -> None:
    """Fail before measuring if ``tree`` cannot run this checkout's benchmarks, or if the venv's
    editable install, not ``tree``, would be imported.

    Both sides run this checkout's benchmarks/, which import today's modules: a base from before a
    re-layout (1473b84 has ``ops/clips.py``, not ``ops/clips/plan.py``) cannot run them, and is
    refused here by name instead of failing minutes into a round.
    """
    probe = ("import ops, trainer; import benchmarks.loader, benchmarks.step; "
             "print(ops.__file__); print(trainer.__file__)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=env | {"PYTHONPATH": str(tree)},
                          capture_output=True, text=True)
    if done.returncode != 0:
        error = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise BenchmarkFailed(f"{tree} cannot run this checkout's benchmarks ({error}): compare commits that "
                              "have today's module layout")
    for path in done.stdout.split():
        if not Path(path).resolve().is_relative_to(tree.resolve()):
            raise BenchmarkFailed(f"{tree} would import {path}, not its own code")


def measure(trees: dict[str, Path], num_rounds: int, args: dict[str, list[str]], env: dict[str, str]) -> tuple:
    """Each round runs both benchmarks on each side; odd rounds put head first (drift cancels)."""
    rounds: dict[str, list[dict]] = {side: [] for side in trees}
    order = []
    for index in range(num_rounds):
        for side in (("base", "head") if index % 2 == 0 else ("head", "base")):
            rounds[side].append({name: run_benchmark(trees[side], name, args[name], env) for name in ("loader", "step")})
            order.append(side)
    return rounds, order


def default_base() -> str:
    """HEAD when tracked files have uncommitted edits (what they change), else HEAD~1 (what HEAD changed)."""
    return "HEAD" if _git("status", "--porcelain", "--untracked-files=no") else "HEAD~1"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=CHECKOUT, check=True, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="commit to compare against (default: HEAD when tracked files have uncommitted "
                                       "edits, else HEAD~1: the change being made, or the one the last commit made)")
    parser.add_argument("--head", help="commit to measure instead of this working tree as it is")
    parser.add_argument("--rounds", type=int, help="rounds per side (default 3, --quick 2)")
    parser.add_argument("--quick", action="store_true", help="fewer steps, clips and rounds (~3 min)")
    args = harness.parse(parser, argv, SMOKE_ARGS)
    num_rounds = args.rounds or (2 if args.quick else 3)
    started = time.monotonic()
    with ExitStack() as stack:
        home = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="trainyard-compare-home-")))
        # Nothing lands in the checkout's .trainyard/, and no Dagster Pipes session leaks in.
        env = {key: value for key, value in os.environ.items() if not key.startswith("DAGSTER_PIPES")}
        env |= {"TRAINYARD_HOME": str(home), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}"}
        args.base = args.base or default_base()
        try:
            trees = {"base": add_worktree(stack, args.base),
                     "head": add_worktree(stack, args.head) if args.head else CHECKOUT}
            for tree in trees.values():
                check_imports(tree, env)
            rounds, order = measure(trees, num_rounds, ARGS["smoke" if args.smoke else "quick" if args.quick else "default"],
                                    env)
        except BenchmarkFailed as error:
            print(error, file=sys.stderr)
            return 1
    head = _git("rev-parse", args.head) if args.head else f"working tree at {_git('rev-parse', 'HEAD')}" + (
        " (with uncommitted changes)" if _git("status", "--porcelain", "--untracked-files=no") else "")
    harness.emit({"benchmark": "compare", "base": _git("rev-parse", args.base), "head": head, "rounds": num_rounds,
                "quick": args.quick, "order": order, **summarize(rounds),
                "wall_s": round(time.monotonic() - started, 1)}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
