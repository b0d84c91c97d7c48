"""Golden losses: the exact per-step losses, grad norms and sample keys of six tiny CPU runs,
recorded from the code at one commit (tests/data/golden_losses.json names it) and held bit for
bit. A change of structure only (issue 10) must not move a single bit of any of them.

The runs cover synthetic clips (one shape, and buckets), real shards (H.264 from the demo media,
one shape; decoded bucketed shards), two DDP ranks under torchrun, and a two-rank run that dies
at step 5 and resumes from its step-3 DCP checkpoint. They go through the same helpers as the
trainer's own tests (test_trainer_loop.run, test_trainer_distributed.torchrun).

Losses depend on the torch build and on the CPU kernels it picks (AVX2, AVX512, ...), so the file
holds one record per environment, all from the same commit, and the test compares with the
record of this machine's environment; it skips, naming what is recorded, where there is none.
In-process runs are pinned to one thread, and torchrun gives each rank one, so the thread count
of the machine does not matter.

Regenerating is deliberate: only for a change that is meant to move the numbers, said so in its
commit. It checks the commit out into a temporary worktree and records the runs with its code,
for this machine's environment (the records of other environments are dropped when the commit
changes, kept when it is the same commit):
    .venv/bin/python tests/test_golden_losses.py --regenerate --ref <commit>
Run: python -m pytest tests/test_golden_losses.py -q   (~20 s on 2 cores)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import DEMO_MAX_QUARANTINE_FRACTION, NUM_GOOD_CLIPS, write_shards
from test_trainer_data import SHARD_BUCKETS, write_bucketed_shards
from test_trainer_distributed import torchrun
from test_trainer_loop import BUCKETS, make_config, run

from ops.clips.plan import ShardConfig
from tools.demo_media import generate_demo_media
from ops.curation.manifest import ManifestConfig, build_manifest
from ops.media.codec import ClipShape
from ops.curation.validation import ValidationConfig, validate

GOLDEN_PATH = Path(__file__).resolve().parent / "data" / "golden_losses.json"
# One shape for the H.264 shards, the tiny preset's 4 x 16 x 16; 2048 Hz gives 1024 audio
# samples a clip, a multiple of the tiny model's 64-sample audio frame.
FIXED_SHAPE = ClipShape(num_frames=4, fps=8.0, width=16, height=16, audio_rate=2048)
SHARDS = ("data.source=shards", "data.num_workers=0")
# Each config: what it runs, as readable text for the record's header.
CONFIGS = {
    "synthetic_fixed": "in process: preset=tiny_cpu (8 steps, one clip shape)",
    "synthetic_bucketed": f"in process: preset=tiny_cpu {BUCKETS} train.steps=6",
    "shards_fixed": "in process: tiny_cpu on H.264 shards of the demo media (seed 0, 8 good clips), "
                    "clips 4x16x16 at 8 fps, 2048 Hz audio, data.audio_samples=1024, train.steps=6",
    "shards_bucketed": f"in process: tiny_cpu on test_trainer_data.write_bucketed_shards, data.buckets={SHARD_BUCKETS}, "
                       "data.batch_size=4, data.audio_samples=8000, train.steps=5",
    "ddp_bucketed": f"torchrun 2 ranks: preset=tiny_cpu train.parallelism=ddp {BUCKETS} (8 steps)",
    "ddp_resumed": "ddp_bucketed with stage.checkpoint=true train.checkpoint_every=3; rank 1 dies at step 5 "
                   "(faults.exit_rank=1 exit_at_step=5), and relaunched without the fault the run resumes its "
                   "step-3 checkpoint and runs to step 8",
}


# ---------------------------------------------------------------------------------------------
# The runs (shared by the test and by --record)

def outcome(run_dir: Path, final: dict[str, Any]) -> dict[str, Any]:
    """What the record holds of a run: status, losses, grad norms, and each rank's sample keys."""
    keys = {path.stem: [[step, list(step_keys)] for step, step_keys in json.loads(path.read_text())["steps"]]
            for path in sorted((run_dir / "samples").glob("rank_*.json"))}
    return {"status": final["status"], "final_step": final["final_step"], "losses": final["losses"],
            "grad_norms": final["grad_norms"], "sample_keys": keys}


def in_process(run_dir: Path, *overrides: str) -> dict[str, Any]:
    return outcome(run_dir, run(make_config(run_dir, *overrides)))


def shard_overrides(index) -> list[str]:
    return [*SHARDS, f"data.shard_index={index.directory}", f"data.manifest_version={index.manifest_version}"]


def fixed_shards(validation, root: Path):
    config = ShardConfig(encoding="compressed", shape=FIXED_SHAPE, clips_per_shard=8, splits=("train",))
    return write_shards(validation, config, root)[1]


def demo_validation_at(root: Path):
    """The conftest's demo_validation, built here for --record (no pytest fixtures there)."""
    demo = generate_demo_media(root / "media", seed=0, num_good=NUM_GOOD_CLIPS)
    config = ValidationConfig(max_quarantine_fraction=DEMO_MAX_QUARANTINE_FRACTION)
    return validate(build_manifest(demo.out_dir, ManifestConfig()), config)


def ddp_resumed(root: Path) -> dict[str, Any]:
    """Launch, lose rank 1 at step 5, launch again into the same run folder (the later
    train.run_dir override wins over the helper's, so each launch keeps its own config folder)."""
    run_dir = root / "run"
    common = ("train.parallelism=ddp", BUCKETS, "stage.checkpoint=true", "train.checkpoint_every=3", f"train.run_dir={run_dir}")
    died = torchrun(root / "launch_1", *common, "faults.exit_rank=1", "faults.exit_at_step=5")
    assert died.returncode != 0, died.output
    resumed = torchrun(root / "launch_2", *common)
    assert resumed.returncode == 0, resumed.output
    return outcome(run_dir, json.loads((run_dir / "final.json").read_text()))


def ddp_bucketed(root: Path) -> dict[str, Any]:
    job = torchrun(root / "run", "train.parallelism=ddp", BUCKETS)
    assert job.returncode == 0, job.output
    return outcome(job.run_dir, job.final)


def runners(fixed_index, bucketed_index) -> dict[str, Callable[[Path], dict[str, Any]]]:
    """Config name -> run it under a fresh folder; the shard indexes are built once by the caller."""
    return {
        "synthetic_fixed": lambda root: in_process(root),
        "synthetic_bucketed": lambda root: in_process(root, BUCKETS, "train.steps=6"),
        "shards_fixed": lambda root: in_process(root, *shard_overrides(fixed_index), "data.audio_samples=1024",
                                                "train.steps=6"),
        "shards_bucketed": lambda root: in_process(root, *shard_overrides(bucketed_index), f"data.buckets={SHARD_BUCKETS}",
                                                   "data.batch_size=4", "data.audio_samples=8000", "train.steps=5"),
        "ddp_bucketed": ddp_bucketed,
        "ddp_resumed": ddp_resumed,
    }


def cpu_vendor() -> str:
    """The CPU's vendor (``vendor_id``): at one capability, the BLAS and oneDNN kernels torch picks differ
    between AMD and Intel (an AMD EPYC with AVX512 misses the first AVX512 record by one ulp in grad norms),
    and so does libx264's output for the demo media."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("vendor_id")), "unknown")


def environment() -> dict[str, str]:
    """What the numbers depend on besides the code: the torch build, its CPU kernels and the CPU's vendor."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_vendor": cpu_vendor()}


class one_thread:
    """torch.set_num_threads(1) for the block: fp32 sums split over threads round differently."""

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.before)


# ---------------------------------------------------------------------------------------------
# The test

def load_golden() -> dict[str, Any]:
    return json.loads(GOLDEN_PATH.read_text())


def golden_configs() -> dict[str, Any] | None:
    """The recorded outcomes for this machine's environment, or None where none was recorded.

    Records made before the vendor was part of the environment do not name it: they stand for their
    torch build and capability wherever no record names this machine's vendor."""
    records, here = load_golden()["records"], environment()
    unnamed = {key: value for key, value in here.items() if key != "cpu_vendor"}
    for wanted in (here, unnamed):
        found = next((record["configs"] for record in records if record["environment"] == wanted), None)
        if found is not None:
            return found
    return None


@pytest.fixture(scope="module")
def golden_runners(demo_validation, tmp_path_factory) -> dict[str, Callable[[Path], dict[str, Any]]]:
    if golden_configs() is None:
        recorded = [record["environment"] for record in load_golden()["records"]]
        pytest.skip(f"golden losses were recorded with {recorded}, this is {environment()}: "
                    "bits differ across torch builds and CPU kernels, so there is nothing exact to compare")
    return runners(fixed_shards(demo_validation, tmp_path_factory.mktemp("golden_fixed")),
                   write_bucketed_shards(tmp_path_factory.mktemp("golden_bucketed")))


def first_difference(actual: dict[str, Any], expected: dict[str, Any]) -> str:
    """The first field, step (and rank) where two outcomes part: the assertion message."""
    for field in ("status", "final_step"):
        if actual[field] != expected[field]:
            return f"{field} {actual[field]!r} != {expected[field]!r}"
    for rank in sorted(set(actual["sample_keys"]) | set(expected["sample_keys"])):
        mine, theirs = actual["sample_keys"].get(rank, []), expected["sample_keys"].get(rank, [])
        if mine != theirs:
            step = _first_unequal(mine, theirs)
            return f"sample keys of {rank} differ first at entry {step}: {mine[step:step + 1]} != {theirs[step:step + 1]}"
    for field in ("losses", "grad_norms"):
        mine, theirs = actual[field], expected[field]
        if mine != theirs:
            step = _first_unequal(mine, theirs)
            return f"{field} differ first at step {step + 1}: {mine[step:step + 1]} != {theirs[step:step + 1]}"
    return ""


def _first_unequal(mine: list, theirs: list) -> int:
    return next((i for i, (a, e) in enumerate(zip(mine, theirs, strict=False)) if a != e), min(len(mine), len(theirs)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_losses_are_bit_identical_to_the_recorded_commit(name: str, golden_runners, tmp_path: Path) -> None:
    expected = golden_configs()[name]
    with one_thread():
        actual = golden_runners[name](tmp_path)
    assert actual == expected, f"{name}: {first_difference(actual, expected)}"


def test_the_record_covers_every_config_and_names_its_commit() -> None:
    golden = load_golden()
    assert golden["config_text"] == CONFIGS and golden["records"]
    assert len(golden["commit"]) == 40 and golden["regenerate"].startswith(".venv/bin/python tests/test_golden_losses.py")
    environments = [json.dumps(record["environment"], sort_keys=True) for record in golden["records"]]
    assert len(set(environments)) == len(environments)  # one record per environment
    for record in golden["records"]:
        assert set(record["configs"]) == set(CONFIGS)
        resumed, straight = record["configs"]["ddp_resumed"], record["configs"]["ddp_bucketed"]
        # The record must not hold a broken resume: it equals the same run uninterrupted.
        assert resumed["status"] == "completed" and resumed["final_step"] == 8
        assert resumed["losses"] == straight["losses"] and resumed["grad_norms"] == straight["grad_norms"]


# ---------------------------------------------------------------------------------------------
# Recording (python tests/test_golden_losses.py ...)

def record_here(out: Path) -> None:
    """Run every config with the code importable here (a worktree's, through PYTHONPATH)."""
    import trainer

    root = Path(tempfile.mkdtemp(prefix="golden-record-"))
    home = root / "home"
    os.environ |= {"TRAINYARD_HOME": str(home), "DAGSTER_HOME": str(home / "dagster_home"),
                   "TRAINYARD_DATA_ROOT": str(home / "data"), "MLFLOW_TRACKING_URI": f"sqlite:///{home / 'mlflow.db'}"}
    (home / "dagster_home").mkdir(parents=True)
    fixed = fixed_shards(demo_validation_at(root / "demo"), root / "fixed_shards")
    by_name = runners(fixed, write_bucketed_shards(root / "bucketed"))
    with one_thread():
        configs = {name: by_name[name](root / name) for name in CONFIGS}
    out.write_text(json.dumps({"code": trainer.__file__, "environment": environment(), "configs": configs}))
    shutil.rmtree(root)


def regenerate(ref: str) -> None:
    """Record every config from ``ref``'s code in a temporary worktree; write GOLDEN_PATH."""
    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "rev-parse", f"{ref}^{{commit}}"], cwd=repo, check=True, capture_output=True,
                            text=True).stdout.strip()
    with worktree(repo, commit) as tree:
        script = tree / "tests" / Path(__file__).name  # beside that commit's helpers, which it imports
        shutil.copy(__file__, script)
        out = tree / "golden.json"
        env = os.environ | {"PYTHONPATH": str(tree)}
        subprocess.run([sys.executable, str(script), "--record", str(out)], cwd=tree, env=env, check=True)
        recorded = json.loads(out.read_text())
    assert Path(recorded["code"]).is_relative_to(tree), f"recorded {recorded['code']}, not {commit}'s code"
    records = []
    if GOLDEN_PATH.exists() and load_golden()["commit"] == commit:  # same code: other environments' records stay
        records = [record for record in load_golden()["records"] if record["environment"] != recorded["environment"]]
    records.append({"environment": recorded["environment"], "configs": recorded["configs"]})
    GOLDEN_PATH.parent.mkdir(exist_ok=True)
    GOLDEN_PATH.write_text(json.dumps({
        "about": "Exact per-step losses, grad norms and sample keys of tiny CPU runs (tests/test_golden_losses.py), "
                 "one record per torch build and CPU capability. Floats are JSON reprs of the values the trainer "
                 "wrote, which round-trip exactly.",
        "commit": commit, "regenerate": f".venv/bin/python tests/test_golden_losses.py --regenerate --ref {commit}",
        "config_text": CONFIGS, "records": records}, indent=1) + "\n")
    print(f"wrote {GOLDEN_PATH} from {commit} for {recorded['environment']}")


class worktree:
    """A detached git worktree of ``commit`` in a temporary folder, removed on exit."""

    def __init__(self, repo: Path, commit: str) -> None:
        self.repo, self.commit = repo, commit
        self.path = Path(tempfile.mkdtemp(prefix="trainyard-worktree-")) / "tree"

    def __enter__(self) -> Path:
        subprocess.run(["git", "worktree", "add", "--detach", str(self.path), self.commit], cwd=self.repo, check=True,
                       capture_output=True)
        return self.path

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["git", "worktree", "remove", "--force", str(self.path)], cwd=self.repo, check=True)


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--regenerate", action="store_true", help="record --ref's losses into tests/data")
    group.add_argument("--record", type=Path, help="run the configs with the importable code, write JSON here")
    parser.add_argument("--ref", help="commit to record from (--regenerate needs it: name it on purpose)")
    args = parser.parse_args(argv)
    if args.regenerate and not args.ref:
        parser.error("--regenerate needs --ref <commit>")
    if args.record:
        record_here(args.record)
    else:
        regenerate(args.ref)


if __name__ == "__main__":
    _main()
