"""A run's progress is never thrown away (issue 9, item 5), with the real trainer under torchrun.

A 2-rank tiny_cpu run commits checkpoints at steps 2 and 4; every commit record is then
truncated (the data files intact). Resuming must refuse to start from step 0, name each
checkpoint and what failed, exit non-zero and leave every folder where it was. Only the explicit
``stage.start_over=true`` starts over, and it moves the failed checkpoints to
``checkpoints/quarantine/`` with REASON.json instead of deleting them; the run it then trains is
bit-identical to the first (same seed, CPU, deterministic).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from ops.checkpoints import store as store
from ops.publish.paths import REPO_ROOT
from test_checkpoint_distributed import free_port

TIMEOUT_S = 240
STEPS = ("train.parallelism=ddp", "train.steps=4", "train.checkpoint_every=2", "stage.checkpoint=true",
         "train.dump_final_params=true")


def trainer_torchrun(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The trainer on 2 local ranks (gloo, CPU), as the pretrain asset launches it."""
    config_path = run_dir.parent / f"{run_dir.name}.yaml"
    config_path.write_text(yaml.safe_dump({"preset": "tiny_cpu"}))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
               str(free_port()), "-m", "trainer.train", "--config", str(config_path),
               "--set", f"train.run_dir={run_dir}", *(arg for item in (*STEPS, *overrides) for arg in ("--set", item))]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def files_of(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_unverifiable_checkpoints_stop_the_run_until_start_over_is_explicit(tmp_path):
    run_dir = tmp_path / "run"
    first = trainer_torchrun(run_dir)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    checkpoints = store.checkpoints_dir(run_dir)
    names = ["step_000002", "step_000004"]
    assert [info.name for info in store.list_checkpoints(run_dir)] == names
    first_params = torch.load(run_dir / "final_params.pt")
    for name in names:  # every commit record unreadable; the DCP data intact
        record = checkpoints / name / store.RECORD_NAME
        record.write_bytes(record.read_bytes()[:100])
    evidence = {name: files_of(checkpoints / name) for name in names}

    refused = trainer_torchrun(run_dir)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-6000:]
    assert "none verifies" in output and "stage.start_over=true" in output, output[-6000:]
    for name in names:
        assert f"{name}: {store.RECORD_NAME}: truncated or invalid JSON" in output
        assert files_of(checkpoints / name) == evidence[name]  # nothing deleted, nothing rewritten
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "failed" and "none verifies" in final["error"]
    assert not (checkpoints / store.QUARANTINE_NAME).exists()

    restarted = trainer_torchrun(run_dir, "stage.start_over=true")
    assert restarted.returncode == 0, restarted.stdout[-3000:] + restarted.stderr[-6000:]
    for name in names:
        moved = checkpoints / store.QUARANTINE_NAME / name
        reason = json.loads((moved / store.REASON_NAME).read_text())
        assert reason["by"] == "start_over" and "truncated or invalid JSON" in reason["reason"]
        assert {key: value for key, value in files_of(moved).items() if key != store.REASON_NAME} == evidence[name]
    assert [info.name for info in store.list_checkpoints(run_dir)] == names
    assert all(store.verify(checkpoints / name).ok for name in names)
    restarted_params = torch.load(run_dir / "final_params.pt")
    assert restarted_params.keys() == first_params.keys()
    for key, value in first_params.items():  # started over from step 0: the same run again
        assert torch.equal(restarted_params[key], value), key
