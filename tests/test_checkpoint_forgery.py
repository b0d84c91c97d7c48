"""A checkpoint folder cannot run code (issue 9, item 4; item 11's "verification covers .metadata").

DCP writes ``.metadata`` with pickle, and its own reader loads it with ``pickle.load``. Each test
here replaces the ``.metadata`` of a real DCP checkpoint by a pickle that creates a marker file
when unpickled (a real DCP Metadata object carrying the payload), makes the commit record agree
with it the way an attacker would (unsigned; signed without the reader having a key; re-signed
with the right key), and then checks, through the real ``trainyard checkpoint`` processes and a
resume (in this process and under torchrun), that the forgery is refused by name and that the
marker is never created.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pathlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import test_checkpoint_toy as toy
from ops.checkpoints import store as store
from ops.checkpoints import dcp_metadata
from ops.publish.hashing import canonical_json
from ops.publish.paths import REPO_ROOT
from ops.loading.sampling import World
from test_checkpoint_distributed import free_port, worker_env
from trainer.checkpointing.checkpointer import CheckpointCorrupt, NoVerifiedCheckpoint
from trainer.launch.redact import Redactor

WORLD = World(rank=0, world_size=1)
TIMEOUT_S = 240


class TouchOnUnpickle:
    """Unpickling this object runs ``pathlib.Path(marker).touch()`` (what an attacker's code would be)."""

    global_name = "pathlib.Path.touch"

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


class SystemOnUnpickle(TouchOnUnpickle):
    """The classic: ``os.system(...)``."""

    global_name = "posix.system"

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def forged_metadata(genuine: bytes, payload: object) -> bytes:
    """The genuine DCP Metadata, re-pickled with the payload riding in planner_data."""
    metadata = pickle.loads(genuine)  # our own, freshly written file: safe to load plainly
    metadata.planner_data = {"innocent": payload}
    return pickle.dumps(metadata)


def sign(record: dict, key: bytes) -> dict:
    """Sign a record exactly as an attacker who holds the key would (HMAC-SHA256 of canonical JSON)."""
    unsigned = {name: value for name, value in record.items() if name != "signature"}
    digest = hmac.new(key, canonical_json(unsigned).encode(), hashlib.sha256).hexdigest()
    return {**unsigned, "signature": {"algorithm": store.HMAC_ALGORITHM, "hex": digest}}


def save_one_checkpoint(run_dir: Path, key: bytes | None = None) -> Path:
    app_state = toy.build("none")
    toy.train_step(app_state, WORLD)
    ckpt = toy.checkpointer(run_dir, hmac_key=key)
    ckpt.save(1, app_state)
    ckpt.close()
    return store.checkpoints_dir(run_dir) / "step_000001"


def forge(checkpoint_dir: Path, payload: object, *, signing: str, key: bytes | None = None) -> None:
    """Replace .metadata by the forgery and rewrite COMMITTED.json to match it.

    signing: "strip" (an unsigned record), "keep" (the old, now wrong, signature stays) or
    "resign" (signed again with ``key``: the attacker holds the key).
    """
    metadata_path = checkpoint_dir / dcp_metadata.DCP_METADATA_NAME
    forged = forged_metadata(metadata_path.read_bytes(), payload)
    metadata_path.write_bytes(forged)
    record_path = checkpoint_dir / store.RECORD_NAME
    record = json.loads(record_path.read_bytes())
    record["files"][dcp_metadata.DCP_METADATA_NAME] = {"sha256": hashlib.sha256(forged).hexdigest(),
                                                       "size_bytes": len(forged)}
    if signing == "strip":
        record.pop("signature", None)
    elif signing == "resign":
        record = sign(record, key)
    record_path.write_text(json.dumps(record, indent=1, sort_keys=True))


def cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    """``trainyard checkpoint ...`` as its own process, with TRAINYARD_HOME=home and no key variable."""
    env = {name: value for name, value in os.environ.items() if name != store.HMAC_KEY_ENV}
    env["TRAINYARD_HOME"] = str(home)
    return subprocess.run([sys.executable, "-m", "cli.checkpoint", "checkpoint", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(autouse=True)
def key_file_only(monkeypatch) -> None:
    """These tests sign with the key file under the test's home and read without it (another home):
    conftest's session key variable would make both one key."""
    monkeypatch.delenv(store.HMAC_KEY_ENV, raising=False)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


def test_the_payload_is_live_when_unpickled_plainly(tmp_path, marker):
    """The precondition that makes the other tests able to fail: plain pickle runs the payload."""
    genuine = (save_one_checkpoint(tmp_path / "run") / dcp_metadata.DCP_METADATA_NAME).read_bytes()
    for payload_type in (TouchOnUnpickle, SystemOnUnpickle):
        probe = tmp_path / f"probe-{payload_type.__name__}"
        pickle.loads(forged_metadata(genuine, payload_type(probe)))
        assert probe.exists()
    assert not marker.exists()


def test_genuine_dcp_metadata_loads_through_the_allowlist(tmp_path):
    """The allowlist is complete for what this torch writes (dtypes, layouts, paths, sizes)."""
    checkpoint_dir = save_one_checkpoint(tmp_path / "run")
    data = (checkpoint_dir / dcp_metadata.DCP_METADATA_NAME).read_bytes()
    loaded = dcp_metadata.load_metadata(data)
    assert loaded.state_dict_metadata.keys() == pickle.loads(data).state_dict_metadata.keys()
    with pytest.raises(dcp_metadata.MetadataRefused, match="sha256 differs"):
        dcp_metadata.load_metadata(data, expected_sha256="0" * 64)
    assert dcp_metadata.metadata_problem(data[: len(data) // 2]).startswith("refused: not a readable pickle")


@pytest.mark.parametrize("payload_type", [TouchOnUnpickle, SystemOnUnpickle])
def test_unsigned_forged_record_and_metadata_are_refused_without_running_the_payload(
        tmp_path, marker, isolated_locations, payload_type):
    """(a) The attacker strips the signature and rewrites the record to the forged file's sha256."""
    run_dir = tmp_path / "run"
    checkpoint_dir = save_one_checkpoint(run_dir)
    forge(checkpoint_dir, payload_type(marker), signing="strip")

    # With the key configured (this home): refused as unsigned and for the pickle itself.
    done = cli("verify", str(checkpoint_dir), home=isolated_locations)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "COMMITTED.json: record is unsigned, but a signing key was given" in done.stdout
    assert ".metadata: refused: it names" in done.stdout
    # On a machine without any key, the sha256 of every file matches the forged record: the
    # allowlist unpickler alone refuses it.
    done = cli("verify", str(checkpoint_dir), home=tmp_path / "no-key-home")
    assert done.returncode == 1, done.stdout + done.stderr
    problems = [line.strip() for line in done.stdout.splitlines()[1:]]
    assert len(problems) == 1 and problems[0].startswith(f".metadata: refused: it names {payload_type.global_name}")
    listed = cli("list", str(run_dir), "--verify", home=isolated_locations)
    assert listed.returncode == 1 and "step_000001" in listed.stderr, listed.stdout + listed.stderr
    assert "corrupt" in listed.stdout

    with pytest.raises(NoVerifiedCheckpoint, match=r"\.metadata: refused"):
        toy.checkpointer(run_dir).load(toy.build("none"))
    with pytest.raises(CheckpointCorrupt, match=r"\.metadata: refused"):
        toy.checkpointer(run_dir).load(toy.build("none"), checkpoint_dir)
    assert not marker.exists()


def test_signed_record_checked_without_a_key_is_refused_by_name(tmp_path, marker, isolated_locations):
    """(b) The record keeps a signature; the reader has no key: refused by name, never skipped."""
    run_dir = tmp_path / "run"
    checkpoint_dir = save_one_checkpoint(run_dir)
    forge(checkpoint_dir, TouchOnUnpickle(marker), signing="keep")
    done = cli("verify", str(checkpoint_dir), home=tmp_path / "no-key-home")
    assert done.returncode == 1
    assert "COMMITTED.json: record is signed, but no signing key is configured" in done.stdout
    assert ".metadata: refused" in done.stdout
    listed = cli("list", str(run_dir), "--verify", home=tmp_path / "no-key-home")
    assert listed.returncode == 1 and "no signing key is configured" in listed.stdout
    assert not marker.exists()


def test_a_record_resigned_with_the_right_key_still_cannot_load_the_forged_pickle(
        tmp_path, marker, isolated_locations):
    """(c) The attacker holds the key: the signature matches, the allowlist unpickler still refuses."""
    key = b"the-attacker-stole-this-key"
    run_dir = tmp_path / "run"
    checkpoint_dir = save_one_checkpoint(run_dir, key)
    forge(checkpoint_dir, TouchOnUnpickle(marker), signing="resign", key=key)
    report = store.verify(checkpoint_dir, key)
    assert report.signature_checked
    assert [name for name, _ in report.problems] == [".metadata"]  # the signature itself matches
    assert "pathlib.Path.touch" in report.problems[0][1]

    env = {**os.environ, store.HMAC_KEY_ENV: key.decode(), "TRAINYARD_HOME": str(isolated_locations)}
    done = subprocess.run([sys.executable, "-m", "cli.checkpoint", "checkpoint", "verify", str(checkpoint_dir)],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 1 and ".metadata: refused" in done.stdout and key.decode() not in done.stdout
    assert "COMMITTED.json" not in done.stdout  # only the pickle is wrong
    listed = subprocess.run([sys.executable, "-m", "cli.checkpoint", "checkpoint", "list", str(run_dir), "--verify"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert listed.returncode == 1, listed.stdout + listed.stderr

    with pytest.raises(NoVerifiedCheckpoint, match=r"\.metadata: refused"):
        toy.checkpointer(run_dir, hmac_key=key).load(toy.build("none"))
    assert not marker.exists()


def test_the_resume_reader_refuses_the_pickle_even_if_verification_let_it_through(
        tmp_path, marker, monkeypatch):
    """Defence in depth: DCP's read of .metadata goes through the allowlist, not pickle.load."""
    key = b"k" * 16
    run_dir = tmp_path / "run"
    checkpoint_dir = save_one_checkpoint(run_dir, key)
    forge(checkpoint_dir, TouchOnUnpickle(marker), signing="resign", key=key)
    monkeypatch.setattr(dcp_metadata, "metadata_problem", lambda data: "")  # a verify that skips .metadata
    assert store.verify(checkpoint_dir, key).ok
    fresh = toy.build("none")
    with pytest.raises(CheckpointCorrupt, match=r"\.metadata: refused: it names pathlib.Path.touch"):
        toy.checkpointer(run_dir, hmac_key=key).load(fresh)
    assert not marker.exists()


def test_swapping_metadata_after_verification_is_refused_by_the_reader(tmp_path, marker, monkeypatch):
    """The reader re-checks .metadata's sha256 against the record it was verified with."""
    run_dir = tmp_path / "run"
    checkpoint_dir = save_one_checkpoint(run_dir)
    ckpt = toy.checkpointer(run_dir)
    verify = store.verify

    def verify_then_swap(*args, **kwargs):
        report = verify(*args, **kwargs)
        path = checkpoint_dir / dcp_metadata.DCP_METADATA_NAME
        path.write_bytes(forged_metadata(path.read_bytes(), TouchOnUnpickle(marker)))
        return report

    monkeypatch.setattr(store, "verify", verify_then_swap)
    with pytest.raises(CheckpointCorrupt, match=r"\.metadata: refused: sha256 differs from the commit record"):
        ckpt.load(toy.build("none"), checkpoint_dir)
    assert not marker.exists()


def test_flipping_a_byte_of_metadata_fails_verification(tmp_path):
    """Item 11: verification must cover .metadata (a verify that skipped it would pass this)."""
    checkpoint_dir = save_one_checkpoint(tmp_path / "run")
    path = checkpoint_dir / dcp_metadata.DCP_METADATA_NAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.verify(checkpoint_dir).problems == [(".metadata", "sha256 mismatch")]
    path.unlink()
    assert store.verify(checkpoint_dir).problems == [(".metadata", "missing")]


def test_forged_checkpoint_is_refused_by_a_two_rank_resume_under_torchrun(tmp_path, marker, isolated_locations):
    """A resume under torchrun (2 ranks, gloo) refuses the re-signed forgery and never runs it."""
    run_dir = tmp_path / "run"
    checkpoint_dir = save_one_checkpoint(run_dir)
    key = store.configured_key()  # the key this home created on the first save
    forge(checkpoint_dir, TouchOnUnpickle(marker), signing="resign", key=key)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port",
               str(free_port()), toy.__file__, "train", "--run-dir", str(run_dir), "--resume", "--steps", "3"]
    done = subprocess.run(command, env=worker_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode != 0
    assert "NoVerifiedCheckpoint" in done.stderr and ".metadata: refused" in done.stderr, done.stderr[-4000:]
    assert not marker.exists()
    # Nothing was deleted or moved: the evidence stays where it was.
    assert sorted(p.name for p in checkpoint_dir.iterdir()) == sorted(
        [store.RECORD_NAME, *store.read_record(checkpoint_dir)["files"]])


def test_the_signing_key_is_redacted_from_records_when_it_is_in_the_environment(monkeypatch):
    """trainer/launch/redact.py scrubs the key's value from anything the trainer logs or records."""
    monkeypatch.setenv(store.HMAC_KEY_ENV, "a-long-signing-key-value")
    redactor = Redactor.for_config()
    assert redactor.text("key=a-long-signing-key-value!") == "key=***!"
