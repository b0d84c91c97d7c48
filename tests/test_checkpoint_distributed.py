"""Checkpoints across processes: resharding between world sizes and wrappings, SIGKILL mid-save.

Multi-rank runs are real ``torch.distributed.run`` launches (gloo, CPU) of the toy worker in
test_checkpoint_toy.py. One launch saves from DDP and from FSDP2 on 2 ranks and loads every
source (those two and a 1-rank checkpoint) into FSDP2 and DDP; the tests then compare the
loaded states with the saved ones, and load the 2-rank checkpoints in this (1-rank) process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import test_checkpoint_toy as toy
from ops.checkpoints import store as store

TOY = Path(toy.__file__)
LAUNCH_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TOY.parent.parent)}


def torchrun(*args: str, nproc: int = 2) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               "--master-port", str(free_port()), str(TOY), *args]
    done = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def assert_states_equal(actual: dict, expected: dict) -> None:
    assert actual["model"].keys() == expected["model"].keys()
    for key, tensor in expected["model"].items():
        assert torch.equal(actual["model"][key], tensor), key
    assert actual["optimizer"].keys() == expected["optimizer"].keys()
    for key, per_param in expected["optimizer"].items():
        for name, value in per_param.items():
            assert torch.equal(actual["optimizer"][key][name], value), (key, name)


def load_dump(path: Path) -> dict:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module", autouse=True)
def module_signing_key():
    """One signing key for the module: `reshard` saves under the first test's TRAINYARD_HOME (whose
    key file later tests, each with their own home, do not have), as a deployment shares its key."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(store.HMAC_KEY_ENV, "checkpoint-distributed-module-key")
        yield


@pytest.fixture(scope="module")
def reshard(tmp_path_factory) -> tuple[Path, dict]:
    """One torchrun launch: DDP and FSDP2 saves on 2 ranks, every source loaded into both wrappings."""
    work = tmp_path_factory.mktemp("reshard")
    app_state = toy.build("none")
    app_state["grad_scaler"] = None  # the 2-rank wrappings run without one
    world = toy.current_world()
    for _ in range(3):
        toy.train_step(app_state, world)
    ckpt = toy.checkpointer(work / "single")
    ckpt.save(3, app_state)
    ckpt.close()
    torch.save(toy.full_state(app_state), work / "single.pt")
    torchrun("reshard-matrix", "--run-dir", str(work), "--checkpoint",
             str(work / "single" / "checkpoints" / "step_000003"), "--out", str(work / "results.json"))
    return work, json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("source", ["ddp", "fsdp"])
def test_two_rank_checkpoint_loads_on_one_rank(reshard, source):
    work, _ = reshard
    checkpoint_dir = work / source / "checkpoints" / "step_000003"
    record = store.read_record(checkpoint_dir)
    assert record["world_size"] == 2 and record["content"]["rng_ranks"] == [0, 1]
    assert {name.split("_")[2] for name in record["files"] if name.endswith(".distcp")} == {"0", "1"}

    app_state = toy.build("none")
    app_state["grad_scaler"] = None
    ckpt = toy.checkpointer(work / "loads-here")
    assert ckpt.load(app_state, checkpoint_dir) == 3
    assert ckpt.last_load.notes == []  # rank 0's RNG state was in the checkpoint
    assert_states_equal(toy.full_state(app_state), load_dump(work / f"{source}.pt"))
    assert app_state["progress"].state_dict() == {"step": 3, "epoch": 0, "consumed_samples": 24}
    assert app_state["data"].position == 3


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_one_rank_checkpoint_loads_on_two_ranks(reshard, mode):
    work, results = reshard
    assert_states_equal(load_dump(work / f"single_into_{mode}.pt"), load_dump(work / "single.pt"))
    result = results[f"single_into_{mode}"]
    assert result["step"] == 3 and result["progress"]["step"] == 3 and result["data"]["sampler"]["position"] == 3
    rank0_notes, rank1_notes = result["notes_per_rank"]
    assert rank0_notes == []
    assert len(rank1_notes) == 1 and "re-derived every generator from (seed=99, rank=1)" in rank1_notes[0]


@pytest.mark.parametrize("source, mode", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_checkpoint_moves_between_ddp_and_fsdp2(reshard, source, mode):
    work, results = reshard
    assert_states_equal(load_dump(work / f"{source}_into_{mode}.pt"), load_dump(work / f"{source}.pt"))
    assert results[f"{source}_into_{mode}"]["notes_per_rank"] == [[], []]
    # Loading replaced the fresh model's parameters (so the equality above is not vacuous).
    initial = toy.full_state(toy.build("none"))["model"]
    loaded = load_dump(work / f"{source}_into_{mode}.pt")["model"]
    assert not any(torch.equal(initial[key], loaded[key]) for key in initial)


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    """Kill a process that saves in a loop while a tmp dir is being written, then resume."""
    width = 400_000  # ~70 MB per checkpoint, so most of the loop is spent writing
    for _ in range(3):  # the kill can land between two saves; then try again
        run_dir = tmp_path / f"run{_}"
        saver = subprocess.Popen([sys.executable, str(TOY), "save-loop", "--run-dir", str(run_dir),
                                  "--width", str(width)], env=worker_env(),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        partial = _wait_for_tmp_dir_after_a_commit(run_dir, saver)
        saver.send_signal(signal.SIGKILL)
        saver.wait(timeout=30)
        if partial.exists():
            break
    else:
        pytest.fail("the saver was never killed while writing a checkpoint")

    infos = store.list_checkpoints(run_dir)
    committed = [info for info in infos if info.status == store.STATUS_COMMITTED]
    assert committed, infos
    assert [info.status for info in infos if info.path == partial] == [store.STATUS_INCOMPLETE]
    latest = store.read_latest(run_dir)
    assert latest in {info.name for info in committed}
    assert store.verify(store.checkpoints_dir(run_dir) / latest).ok

    chosen, notes = store.resolve_resume(run_dir)
    assert chosen == committed[-1].path and any(partial.name in note for note in notes)
    app_state = toy.build("none", width=width)
    assert toy.checkpointer(run_dir).load(app_state) == committed[-1].step
    assert app_state["progress"].step == committed[-1].step


def _wait_for_tmp_dir_after_a_commit(run_dir: Path, saver: subprocess.Popen) -> Path:
    checkpoints = store.checkpoints_dir(run_dir)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if saver.poll() is not None:
            pytest.fail(f"saver exited early: {saver.stderr.read().decode()[-3000:]}")
        if store.read_latest(run_dir) is not None:
            partial = [p for p in checkpoints.iterdir() if p.name.startswith(".step_") and ".tmp-" in p.name]
            if partial:
                time.sleep(0.02)  # let it write some bytes into the tmp dir
                return partial[0]
        time.sleep(0.002)
    saver.kill()
    pytest.fail("no tmp dir appeared after a commit within 120 s")
