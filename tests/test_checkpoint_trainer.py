"""trainer.checkpointing.checkpointer.Checkpointer in one process: what it saves, what it refuses, how it fails.

Uses the toy trainer of test_checkpoint_toy.py; multi-rank behaviour is in
test_checkpoint_distributed.py.
"""

from __future__ import annotations

import errno
import json
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

import test_checkpoint_toy as toy
from ops.checkpoints import store as store
from ops.checkpoints.digesting import DigestingFile
from ops.loading.sampling import SamplerState, World
from trainer.checkpointing.checkpointer import (CheckpointCorrupt, CheckpointIncompatible, CheckpointSaveError,
                                                NoVerifiedCheckpoint, derive_rng)
from trainer.parallel import restore_determinism, seed_everything

WORLD = World(rank=0, world_size=1)


def trained(steps: int, **build_kwargs) -> dict:
    app_state = toy.build("none", **build_kwargs)
    for _ in range(steps):
        toy.train_step(app_state, WORLD)
    return app_state


def params(app_state: dict) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in app_state["model"].state_dict().items()}


def assert_params_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def step_dir(run_dir: Path, step: int) -> Path:
    return store.checkpoints_dir(run_dir) / store.step_dir_name(step)


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


# --------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------

def test_round_trip_restores_every_part_and_the_rng(tmp_path):
    app_state = trained(4)
    ckpt = toy.checkpointer(tmp_path)
    ckpt.save(4, app_state)
    expected_state, expected_draws = toy.full_state(app_state), draws()
    expected_parts = {name: app_state[name].state_dict()
                      for name in ("lr_scheduler", "grad_scaler", "data", "progress")}
    toy.train_step(app_state, WORLD)  # move on, so that loading has something to undo

    fresh = toy.build("none")
    assert ckpt.load(fresh) == 4
    assert draws() == expected_draws
    actual = toy.full_state(fresh)
    assert_params_equal(actual["model"], expected_state["model"])
    for key, per_param in expected_state["optimizer"].items():
        for name, value in per_param.items():
            assert torch.equal(actual["optimizer"][key][name], value), (key, name)
    assert {name: fresh[name].state_dict() for name in expected_parts} == expected_parts
    record = store.read_record(step_dir(tmp_path, 4))
    assert record["content"]["progress"] == {"step": 4, "epoch": 0, "consumed_samples": 16}
    assert record["content"]["references"]["dataset_version"] == toy.DATASET_VERSION
    assert record["content"]["model_tensors"]["inp.weight"] == {"shape": [32, 8], "dtype": "float32"}
    ckpt.close()


@pytest.mark.parametrize("seed, rank", [(0, 0), (99, 1), (2**40 + 7, 3)])
def test_a_re_derived_rank_draws_what_a_freshly_seeded_rank_draws(seed, rank):
    # A checkpoint from fewer ranks holds no RNG state for this rank: it must continue as the
    # trainer seeds it at a fresh start, not from a second derivation of (seed, rank).
    restore_determinism(seed_everything(seed, rank, deterministic=False, device_type="cpu"))
    fresh = [draws() for _ in range(3)]
    derive_rng(seed, rank)
    assert [draws() for _ in range(3)] == fresh
    derive_rng(seed, rank + 1)
    assert draws() != fresh[0]


def test_a_flat_data_state_of_an_older_checkpoint_still_names_its_dataset(tmp_path):
    class FlatSampler:  # a fixed-shape synthetic source saved the bare sampler state before the layout was one
        def state_dict(self):
            return SamplerState(seed=3, num_samples=16, dataset_version="flat-v1", epoch=0, consumed=8).state_dict()

    app_state = {**trained(1), "data": FlatSampler()}
    ckpt = toy.checkpointer(tmp_path)
    ckpt.save(1, app_state)
    ckpt.close()
    record = store.read_record(step_dir(tmp_path, 1))
    assert record["content"]["references"]["dataset_version"] == "flat-v1"
def test_async_save_commits_the_same_content_as_sync_and_latest_only_moves_on_commit(tmp_path):
    app_state = trained(2)
    sync_ckpt = toy.checkpointer(tmp_path / "sync")
    async_ckpt = toy.checkpointer(tmp_path / "async", async_mode="async")
    sync_ckpt.save(2, app_state)
    async_ckpt.save(2, app_state)
    toy.train_step(app_state, WORLD)  # mutates parameters while the async write may be in flight
    assert store.read_latest(tmp_path / "async") in (None, "step_000002")
    async_ckpt.save(3, app_state)  # waits for step 2's commit, then stages step 3
    assert store.verify(step_dir(tmp_path / "async", 2)).ok
    seen = set()
    while async_ckpt.save_in_flight():  # while step 3 is written and committed in the background
        latest = store.read_latest(tmp_path / "async")
        seen.add(latest)
        assert (store.checkpoints_dir(tmp_path / "async") / latest / store.RECORD_NAME).exists()
    async_ckpt.wait()
    assert seen <= {"step_000002", "step_000003"}
    assert store.read_latest(tmp_path / "async") == "step_000003"
    async_ckpt.close()

    from_sync, from_async = toy.build("none"), toy.build("none")
    assert sync_ckpt.load(from_sync) == 2
    assert toy.checkpointer(tmp_path / "async").load(from_async, step_dir(tmp_path / "async", 2)) == 2
    assert_params_equal(params(from_async), params(from_sync))
    state_sync, state_async = toy.full_state(from_sync), toy.full_state(from_async)
    for key, per_param in state_sync["optimizer"].items():
        for name, value in per_param.items():
            assert torch.equal(state_async["optimizer"][key][name], value)
    assert not torch.equal(params(from_sync)["inp.weight"], params(app_state)["inp.weight"])


def test_resume_in_a_new_process_equals_uninterrupted_bit_for_bit(tmp_path):
    num_steps, save_at = 7, 3
    run_dir = tmp_path / "run"
    app_state = toy.build("none")
    ckpt = toy.checkpointer(run_dir, async_mode="async")
    losses = {}
    for step in range(1, num_steps + 1):
        losses[step] = toy.train_step(app_state, WORLD)
        if step == save_at:
            ckpt.save(step, app_state)
    ckpt.close()
    uninterrupted = toy.full_state(app_state)

    out, dump = tmp_path / "resumed.json", tmp_path / "resumed.pt"
    done = subprocess.run([sys.executable, toy.__file__, "train", "--run-dir", str(run_dir), "--resume",
                           "--steps", str(num_steps), "--out", str(out), "--dump", str(dump)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    resumed = json.loads(out.read_text())
    assert resumed["start"] == save_at
    assert {int(step): loss for step, loss in resumed["losses"].items()} == \
        {step: loss for step, loss in losses.items() if step > save_at}
    resumed_state = torch.load(dump, weights_only=True)
    assert_params_equal(resumed_state["model"], uninterrupted["model"])
    for key, per_param in uninterrupted["optimizer"].items():
        for name, value in per_param.items():
            assert torch.equal(resumed_state["optimizer"][key][name], value), (key, name)


class ModelStateful:
    """The trainer's style of app_state entry: a Stateful wrapper instead of the module itself."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        return get_model_state_dict(self.model)

    def load_state_dict(self, state):
        set_model_state_dict(self.model, dict(state))


class OptimizerStateful:
    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        return get_optimizer_state_dict(self.model, self.optimizer)

    def load_state_dict(self, state):
        set_optimizer_state_dict(self.model, self.optimizer, dict(state))


class TrainState:
    def __init__(self):
        self.step, self.losses = 0, []

    def state_dict(self):
        return {"step": self.step, "epoch": 0, "consumed_samples": 4 * self.step, "losses": list(self.losses)}

    def load_state_dict(self, state):
        self.step, self.losses = state["step"], list(state["losses"])


def wrapped(app_state: dict) -> dict:
    """app_state as trainer.train.Trainer.app_state() shapes it: wrappers and a train_state part."""
    model, optimizer = app_state["model"], app_state["optimizer"]
    train_state = TrainState()
    train_state.step, train_state.losses = app_state["progress"].step, [0.5] * app_state["progress"].step
    return {"model": ModelStateful(model), "optimizer": OptimizerStateful(model, optimizer),
            "lr_scheduler": app_state["lr_scheduler"], "data": app_state["data"], "train_state": train_state}


def test_stateful_wrappers_and_train_state_round_trip(tmp_path):
    app_state = trained(3)
    ckpt = toy.checkpointer(tmp_path)
    ckpt.save(3, wrapped(app_state))
    expected = toy.full_state(app_state)
    record = store.read_record(step_dir(tmp_path, 3))
    assert record["content"]["progress"] == {"step": 3, "epoch": 0, "consumed_samples": 12}  # no loss list
    assert record["content"]["model_tensors"]["out.weight"] == {"shape": [4, 32], "dtype": "float32"}

    fresh = toy.build("none")
    fresh_wrapped = wrapped(fresh)
    assert ckpt.load(fresh_wrapped) == 3
    assert fresh_wrapped["train_state"].losses == [0.5] * 3
    actual = toy.full_state(fresh)
    assert_params_equal(actual["model"], expected["model"])
    assert torch.equal(actual["optimizer"]["inp.weight"]["exp_avg"], expected["optimizer"]["inp.weight"]["exp_avg"])
    with pytest.raises(CheckpointIncompatible, match="model.inp.weight"):
        ckpt.load(wrapped(toy.build("none", width=16)))


# --------------------------------------------------------------------------------------------
# refusing to load
# --------------------------------------------------------------------------------------------

@pytest.fixture
def two_checkpoints(tmp_path) -> tuple[Path, dict]:
    app_state = trained(1)
    ckpt = toy.checkpointer(tmp_path)
    ckpt.save(1, app_state)
    at_step_1 = params(app_state)
    toy.train_step(app_state, WORLD)
    ckpt.save(2, app_state)
    ckpt.close()
    return tmp_path, at_step_1


def _flip_shard(checkpoint_dir: Path) -> str:
    shard = sorted(checkpoint_dir.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard.name


def _remove_shard(checkpoint_dir: Path) -> str:
    shard = sorted(checkpoint_dir.glob("*.distcp"))[-1]
    shard.unlink()
    return shard.name


def _truncate_record(checkpoint_dir: Path) -> str:
    record = checkpoint_dir / store.RECORD_NAME
    record.write_bytes(record.read_bytes()[: len(record.read_bytes()) // 2])
    return store.RECORD_NAME


@pytest.mark.parametrize("damage, problem", [(_flip_shard, "sha256 mismatch"), (_remove_shard, "missing"),
                                             (_truncate_record, "truncated or invalid JSON")])
def test_load_refuses_a_damaged_checkpoint_naming_the_file(two_checkpoints, damage, problem):
    run_dir, _ = two_checkpoints
    bad_file = damage(step_dir(run_dir, 2))
    fresh = toy.build("none")
    before = params(fresh)
    with pytest.raises(CheckpointCorrupt) as refused:
        toy.checkpointer(run_dir).load(fresh, step_dir(run_dir, 2))
    assert any(name == bad_file and why.startswith(problem) for name, why in refused.value.problems)
    assert bad_file in str(refused.value)
    assert_params_equal(params(fresh), before)  # nothing was loaded


def test_resume_falls_back_to_the_previous_good_checkpoint_and_says_so(two_checkpoints):
    run_dir, at_step_1 = two_checkpoints
    bad_file = _flip_shard(step_dir(run_dir, 2))
    fresh = toy.build("none")
    ckpt = toy.checkpointer(run_dir)
    assert ckpt.load(fresh) == 1
    assert_params_equal(params(fresh), at_step_1)
    assert any("step_000002 failed verification" in note and bad_file in note for note in ckpt.last_load.notes)
    # Training on from step 1 and saving step 2 again supersedes the corrupt one.
    toy.train_step(fresh, WORLD)
    ckpt.save(2, fresh)
    assert store.read_latest(run_dir) == "step_000002" and store.verify(step_dir(run_dir, 2)).ok
    with pytest.raises(CheckpointSaveError, match="already committed"):
        ckpt.save(2, fresh)


def test_resume_refuses_to_start_fresh_when_no_checkpoint_verifies(two_checkpoints):
    run_dir, _ = two_checkpoints
    flipped = _flip_shard(step_dir(run_dir, 1))
    removed = _remove_shard(step_dir(run_dir, 2))
    with pytest.raises(NoVerifiedCheckpoint) as refused:
        toy.checkpointer(run_dir).load(toy.build("none"))
    assert refused.value.problems == [("step_000001", f"{flipped}: sha256 mismatch"),
                                      ("step_000002", f"{removed}: missing")]
    assert "none verifies" in str(refused.value) and "stage.start_over=true" in str(refused.value)
    assert sorted(p.name for p in store.checkpoints_dir(run_dir).iterdir()) == ["latest", "step_000001",
                                                                               "step_000002"]
    assert toy.checkpointer(run_dir / "empty").load(toy.build("none")) is None


def test_start_over_quarantines_every_failed_checkpoint_and_starts_from_scratch(two_checkpoints):
    run_dir, _ = two_checkpoints
    _truncate_record(step_dir(run_dir, 1))
    _truncate_record(step_dir(run_dir, 2))
    files_before = {step: sorted(p.name for p in step_dir(run_dir, step).iterdir()) for step in (1, 2)}
    ckpt = toy.checkpointer(run_dir, start_over=True)
    fresh = toy.build("none")
    assert ckpt.load(fresh) is None
    assert fresh["progress"].step == 0
    quarantine = store.checkpoints_dir(run_dir) / store.QUARANTINE_NAME
    for step in (1, 2):
        moved = quarantine / store.step_dir_name(step)
        assert sorted(p.name for p in moved.iterdir()) == sorted([*files_before[step], store.REASON_NAME])
        reason = json.loads((moved / store.REASON_NAME).read_text())
        assert reason["by"] == "start_over" and "COMMITTED.json: truncated or invalid JSON" in reason["reason"]
    assert store.read_latest(run_dir) is None  # latest named a quarantined dir
    assert any("start_over" in note and "step_000002" in note for note in ckpt.last_load.notes)
    toy.train_step(fresh, WORLD)
    ckpt.save(1, fresh)  # a new step_000001 beside the quarantined one
    ckpt.close()
    assert store.read_latest(run_dir) == "step_000001" and store.verify(step_dir(run_dir, 1)).ok


def test_start_over_ahead_of_load_moves_nothing_while_one_checkpoint_verifies(two_checkpoints):
    """train.py quarantines before deciding whether the run has its own checkpoint (vs a parent's)."""
    run_dir, at_step_1 = two_checkpoints
    _truncate_record(step_dir(run_dir, 2))
    assert toy.checkpointer(run_dir).start_over_if_none_verifies() == []  # start_over not set
    ckpt = toy.checkpointer(run_dir, start_over=True)
    assert ckpt.start_over_if_none_verifies() == []  # step 1 verifies: nothing is thrown away
    assert not (store.checkpoints_dir(run_dir) / store.QUARANTINE_NAME).exists()
    fresh = toy.build("none")
    assert ckpt.load(fresh) == 1
    assert_params_equal(params(fresh), at_step_1)
    _flip_shard(step_dir(run_dir, 1))
    notes = ckpt.start_over_if_none_verifies()
    assert [note.split(";")[1].split()[1] for note in notes] == ["step_000001", "step_000002"]
    assert store.list_checkpoints(run_dir) == [] and store.read_latest(run_dir) is None
    assert ckpt.load(toy.build("none")) is None


def test_load_refuses_a_checkpoint_whose_lineage_names_another_run(tmp_path):
    app_state = trained(1)
    other = toy.checkpointer(tmp_path / "other", run_id="another-run")
    other.save(1, app_state)
    checkpoint_dir = step_dir(tmp_path / "other", 1)
    with pytest.raises(CheckpointCorrupt, match="lineage names run 'another-run', expected run 'toy-run'"):
        toy.checkpointer(tmp_path / "mine").load(toy.build("none"), checkpoint_dir)
    # Starting from a parent run is allowed when the caller names it.
    assert toy.checkpointer(tmp_path / "mine").load(toy.build("none"), checkpoint_dir,
                                                    expected_run_id="another-run") == 1


def test_incompatible_model_config_is_refused_naming_the_keys(tmp_path):
    ckpt = toy.checkpointer(tmp_path)
    ckpt.save(1, trained(1))
    wider = toy.build("none", width=48)
    before = params(wider)
    with pytest.raises(CheckpointIncompatible) as refused:
        toy.checkpointer(tmp_path, fingerprint="toy-model-wide").load(wider)
    mismatches = refused.value.mismatches
    assert {"model_fingerprint", "model.inp.weight", "model.inp.bias", "model.norm.weight", "model.out.weight"} \
        <= mismatches.keys()
    assert "model.out.bias" not in mismatches  # same shape in both
    assert mismatches["model.inp.weight"] == "checkpoint float32[32, 8], live model float32[48, 8]"
    assert_params_equal(params(wider), before)
    # Same shapes but another config fingerprint is refused too.
    with pytest.raises(CheckpointIncompatible, match="model_fingerprint"):
        toy.checkpointer(tmp_path, fingerprint="toy-model-v2").load(toy.build("none"))


def test_hmac_signed_checkpoints_need_the_right_key(tmp_path):
    key = b"secret-key-from-a-dagster-resource"
    signed = toy.checkpointer(tmp_path / "signed", hmac_key=key)
    signed.save(1, trained(1))
    assert key.decode() not in repr(signed)
    assert key not in (step_dir(tmp_path / "signed", 1) / store.RECORD_NAME).read_bytes()
    assert toy.checkpointer(tmp_path / "signed", hmac_key=key).load(toy.build("none")) == 1
    with pytest.raises(CheckpointCorrupt, match="bad signature"):
        toy.checkpointer(tmp_path / "signed", hmac_key=b"wrong").load(toy.build("none"),
                                                                       step_dir(tmp_path / "signed", 1))
    toy.checkpointer(tmp_path / "unsigned", hmac_key=key).save(1, trained(1))
    record_path = step_dir(tmp_path / "unsigned", 1) / store.RECORD_NAME
    record = json.loads(record_path.read_text())
    del record["signature"]  # stripping the signature does not get a record past the key
    record_path.write_text(json.dumps(record))
    with pytest.raises(CheckpointCorrupt, match="unsigned, but a signing key was given"):
        toy.checkpointer(tmp_path / "unsigned", hmac_key=key).load(toy.build("none"),
                                                                   step_dir(tmp_path / "unsigned", 1))


# --------------------------------------------------------------------------------------------
# disk full
# --------------------------------------------------------------------------------------------

def _assert_previous_checkpoint_intact(run_dir: Path, expected_params: dict) -> None:
    assert store.read_latest(run_dir) == "step_000001"
    assert [p.name for p in store.checkpoints_dir(run_dir).iterdir() if p.name.startswith(".step_")] == []
    fresh = toy.build("none", width=expected_params["inp.weight"].shape[0])
    assert toy.checkpointer(run_dir).load(fresh) == 1
    assert_params_equal(params(fresh), expected_params)


# DCP's helper writer threads let an OSError escape the thread (only logged there; we refuse the commit).
THREAD_ERROR_IS_EXPECTED = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


@THREAD_ERROR_IS_EXPECTED
@pytest.mark.parametrize("async_mode", ["off", "async"])
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, async_mode):
    app_state = trained(1)
    ckpt = toy.checkpointer(tmp_path, async_mode=async_mode)
    ckpt.save(1, app_state)
    ckpt.wait()
    at_step_1 = params(app_state)
    toy.train_step(app_state, WORLD)

    write = DigestingFile.write

    def fill_disk_after_some_bytes(self, data):
        if self._size_bytes > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, data)

    monkeypatch.setattr(DigestingFile, "write", fill_disk_after_some_bytes)
    with pytest.raises(CheckpointSaveError, match="disk full") as failed:
        ckpt.save(2, app_state)
        ckpt.wait()  # async: the error surfaces when the save is committed
    assert "previous checkpoint (step_000001) is untouched" in str(failed.value)
    # Not monkeypatch.undo(): that would also undo the isolated TRAINYARD_HOME (and its signing key).
    monkeypatch.setattr(DigestingFile, "write", write)
    _assert_previous_checkpoint_intact(tmp_path, at_step_1)
    ckpt.save(2, app_state)  # the Checkpointer keeps working once there is space again
    ckpt.close()
    assert store.read_latest(tmp_path) == "step_000002"


@THREAD_ERROR_IS_EXPECTED
def test_disk_full_on_a_real_small_filesystem(tmp_path):
    mount_point = tmp_path / "small_disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        app_state = trained(1, width=12_000)  # ~2 MB per checkpoint: one fits, two do not
        ckpt = toy.checkpointer(mount_point, keep_last_k=1)
        ckpt.save(1, app_state)
        at_step_1 = params(app_state)
        toy.train_step(app_state, WORLD)
        with pytest.raises(CheckpointSaveError, match="disk full"):
            ckpt.save(2, app_state)
        _assert_previous_checkpoint_intact(mount_point, at_step_1)
    finally:
        subprocess.run(["umount", str(mount_point)], check=True)


@THREAD_ERROR_IS_EXPECTED
def test_a_write_error_in_one_writer_thread_refuses_the_commit(tmp_path, monkeypatch):
    """DCP only logs an exception raised in a helper writer thread; the commit must still fail."""
    app_state = trained(1)
    ckpt = toy.checkpointer(tmp_path, thread_count=2)
    ckpt.save(1, app_state)
    at_step_1 = params(app_state)
    toy.train_step(app_state, WORLD)
    write = DigestingFile.write

    def fail_off_the_main_thread(self, data):
        if threading.current_thread() is not threading.main_thread():
            raise OSError(errno.EIO, "Input/output error")
        return write(self, data)

    monkeypatch.setattr(DigestingFile, "write", fail_off_the_main_thread)
    with pytest.raises(CheckpointSaveError, match=r"not saved \(OSError: \[Errno 5\] Input/output error\)"):
        ckpt.save(2, app_state)
    # Not monkeypatch.undo(): that would also undo the isolated TRAINYARD_HOME (and its signing key).
    monkeypatch.setattr(DigestingFile, "write", write)
    _assert_previous_checkpoint_intact(tmp_path, at_step_1)
