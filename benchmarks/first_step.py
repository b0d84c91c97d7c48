"""Time from a stage's request to its first valid step, and where it goes, side by side in one run.

    python -m benchmarks.first_step [--num-good 8] [--repeats 3] [--steps 12] [--slurm auto|on|off]

The demo's data graph is materialized once (demo media, manifest, shards, shard index) into a
fresh Trainyard home. Then ``pretrain`` on the demo config is requested the way a user requests it
from a shell, ``dagster asset materialize --select pretrain`` (a new process: code location load,
run creation, the step, preflight, torchrun, the ranks), ``--repeats`` times per side, each with
its own seed (a new run folder: nothing resumes):

- ``no_cache``: the memory estimate measured on every launch (``TRAINYARD_MEMORY_CACHE=off``), as
  before the cut (trainer/launch/memory.py);
- ``local``: the launcher of this machine with the estimate's cache warm (the default);
- ``slurm``: the same through SLURM (``TRAINYARD_ENV=slurm``), when a cluster answers ``scontrol
  ping`` (``--slurm auto``); its queue wait is reported apart.

Every figure comes from the run's own final.json (``startup``: trainer/observe/startup.py), from
the run's request (Dagster creating it) to its first optimizer step, queue waits left out; the
command's own start (Python and Dagster imports before the run exists) is ``command_s``. The
last line is one JSON object: ``sides``, per side the median of each phase, the median to the first
step and whether it meets the goal (10 s on the demo config on CPU); ``cache_saves_s``, the memory
estimate's cache (no_cache less local); ``reason``, why a side is missing.
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
from pathlib import Path

from benchmarks import harness

# The smoke run requests one pretrain (the local side, cache cold): the request path and the schema.
SMOKE_ARGS = ["--num-good", "8", "--repeats", "1", "--steps", "1", "--slurm", "off", "--sides", "local",
              "--set", "train.eval_every=0"]
GOAL_S = 10.0
SIDES = ("no_cache", "local", "slurm")


def _prepare(home: Path, num_good: int) -> None:
    """Demo media through shard_index, in a child process with the benchmark's Trainyard home."""
    code = ("from benchmarks.first_step import _materialize_data; import sys; _materialize_data(int(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, str(num_good)], check=True, env=_env(home, "local"),
                   cwd=harness.BENCHMARKS_DIR.parent, stdout=subprocess.DEVNULL)


def _materialize_data(num_good: int) -> None:
    import dagster as dg

    from pipelines import demo
    from pipelines.definitions import defs
    from pipelines.instance import ensure_dagster_home

    ensure_dagster_home()
    demo._ensure_demo_media(num_good)
    instance = dg.DagsterInstance.get()
    job = defs.resolve_implicit_global_asset_job_def()
    before, _ = demo._stages(defs)

    def run(selection, ops=None, **kwargs) -> None:
        result = job.execute_in_process(instance=instance, asset_selection=selection, raise_on_error=False,
                                        run_config={**demo._QUIET, "ops": ops or {}}, **kwargs)
        if not result.success:
            raise SystemExit(f"first_step: preparing {selection} failed")

    # A few sources beside the demo's fixed edge cases quarantine more than the default gate allows.
    run(before, ops={"validated_manifest_and_quarantine": {"config": {"max_quarantine_fraction": 0.9}}})
    for partition in instance.get_dynamic_partitions("clip_shards"):
        run([demo.SHARDS], partition_key=partition)
    run([dg.AssetKey("shard_index")])


def _env(home: Path, side: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("TRAINYARD_", "DAGSTER_", "MLFLOW_"))}
    env["TRAINYARD_HOME"], env["DAGSTER_HOME"] = str(home), str(home / "dagster_home")
    if side == "no_cache":
        env["TRAINYARD_MEMORY_CACHE"] = "off"
    if side == "slurm":
        env |= {"TRAINYARD_ENV": "slurm", "TRAINYARD_SLURM_NPROC_PER_NODE": "2", "TRAINYARD_SLURM_CPUS_PER_TASK": "2",
                "TRAINYARD_SLURM_TIME_LIMIT": "00:10:00"}
    return env


def _cluster_up() -> bool:
    if shutil.which("scontrol") is None:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10).stdout.count("UP") > 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _request(home: Path, side: str, seed: int, steps: int, overrides: list[str]) -> dict:
    """One pretrain requested by command; its start-up breakdown plus the command's own start."""
    config = {"ops": {"pretrain": {"config": {"steps": steps, "overrides": [*overrides, f"train.seed={seed}"]}}}}
    dagster = Path(sys.executable).with_name("dagster")
    started = time.time()
    done = subprocess.run([str(dagster), "asset", "materialize", "-m", "pipelines.definitions", "--select", "pretrain",
                           "--config-json", json.dumps(config)], env=_env(home, side), capture_output=True, text=True,
                          cwd=harness.BENCHMARKS_DIR.parent, timeout=600)
    wall = time.time() - started
    if done.returncode:
        raise SystemExit(f"first_step: {side} pretrain failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    final = _latest_final(home, seed)
    breakdown = final["startup"]
    marks = breakdown["marks"]
    return {"to_first_step_s": breakdown["to_first_step_s"], "phases": breakdown["phases"],
            "queue_wait_s": breakdown.get("queue_wait", 0.0), "slurm_queue_wait_s": breakdown.get("slurm_queue_wait", 0.0),
            "command_s": round(marks["requested"] - started, 4) if "requested" in marks else None,
            "wall_s": round(wall, 3), "largest_phase": breakdown.get("largest_phase")}


def _latest_final(home: Path, seed: int) -> dict:
    """final.json of the run with this seed (each request's own folder)."""
    for path in sorted((home / "data" / "runs").glob("pretrain*/final.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        final = json.loads(path.read_text())
        if final["config"]["train"]["seed"] == seed:
            return final
    raise SystemExit(f"first_step: no final.json of the run with seed {seed} under {home / 'data' / 'runs'}")


def _median_side(runs: list[dict]) -> dict:
    phases = sorted({name for run in runs for name in run["phases"]})
    to_first = statistics.median(run["to_first_step_s"] for run in runs)
    median_phases = {name: round(statistics.median(run["phases"].get(name, 0.0) for run in runs), 4) for name in phases}
    before_first = {name: value for name, value in median_phases.items() if name != "first_checkpoint"}
    return {"to_first_step_s": round(to_first, 4), "meets_goal": to_first <= GOAL_S,
            "command_s": round(statistics.median(run["command_s"] or 0.0 for run in runs), 4),
            "queue_wait_s": round(statistics.median(run["queue_wait_s"] for run in runs), 4),
            "slurm_queue_wait_s": round(statistics.median(run["slurm_queue_wait_s"] for run in runs), 4),
            "wall_s": round(statistics.median(run["wall_s"] for run in runs), 3),
            "largest_phase": max(before_first, key=before_first.__getitem__), "phases": median_phases,
            "repeats": len(runs)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-good", type=int, default=16, help="demo media sources")
    parser.add_argument("--repeats", type=int, default=3, help="requests per side (the median is reported)")
    parser.add_argument("--steps", type=int, default=12, help="pretrain steps (>= 10 reaches the first checkpoint)")
    parser.add_argument("--slurm", choices=("auto", "on", "off"), default="auto",
                        help="the SLURM side: when a cluster answers (auto), always, or never")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="an override of the pretrain config (repeatable), e.g. train.eval_every=0")
    parser.add_argument("--sides", default="no_cache,local,slurm", help="which sides to run (comma-separated)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the Trainyard home here (default: a temp dir)")
    args = harness.parse(parser, argv, SMOKE_ARGS)
    slurm = args.slurm == "on" or (args.slurm == "auto" and _cluster_up())
    base = args.workdir or Path(tempfile.mkdtemp(prefix="first_step_"))
    home = base / "home"
    try:
        _prepare(home, args.num_good)
        wanted = set(args.sides.split(","))
        unknown = wanted - set(SIDES)
        if unknown:
            parser.error(f"--sides: {', '.join(sorted(unknown))} is not one of {', '.join(SIDES)}")
        sides = [side for side in SIDES if side in wanted and (side != "slurm" or slurm)]
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        if not args.smoke:  # warms the estimate's cache and the OS's file cache
            _request(home, "local", seed=1000, steps=args.steps, overrides=args.overrides)
        seed = 0
        for _ in range(args.repeats):
            for side in sides:  # interleaved: a slow minute of the machine falls on every side
                seed += 1
                runs[side].append(_request(home, side, seed=seed, steps=args.steps, overrides=args.overrides))
        summary = {side: _median_side(side_runs) for side, side_runs in runs.items()}
        cut = (round(summary["no_cache"]["to_first_step_s"] - summary["local"]["to_first_step_s"], 4)
               if {"no_cache", "local"} <= set(summary) else None)
        harness.emit({"benchmark": "first_step", "goal_s": GOAL_S, "steps": args.steps, "num_good": args.num_good,
                      "sides": summary, "cache_saves_s": cut,
                      "reason": None if slurm else "no SLURM side: no cluster answered scontrol ping (or --slurm off)"},
                     args)
    finally:
        if args.workdir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
