"""``trainyard checkpoint sign``: checkpoints committed unsigned stay resumable (review finding 5).

Before records were signed by default, a checkpoint's COMMITTED.json had no signature. Now that
a signing key exists, resume refuses such a record ("record is unsigned, but a signing key was
given"). These tests write a real checkpoint with the toy trainer's Checkpointer, remove its
signature (exactly the record the old code wrote: the signature was the only field added), and
run the real command and a resume as their own processes: the unsigned checkpoint is refused,
signed by the command, then resumed bit-identically to an uninterrupted run. A checkpoint whose
files or ``.metadata`` were tampered with is refused by the command and left unsigned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import test_checkpoint_toy as toy
from ops.checkpoints import store as store
from ops.publish.paths import REPO_ROOT
from ops.loading.sampling import World
from test_checkpoint_forgery import TouchOnUnpickle, forge

WORLD = World(rank=0, world_size=1)
NUM_STEPS, SAVE_AT = 5, 3
TIMEOUT_S = 120


def sign_cli(*args: str) -> subprocess.CompletedProcess:
    """``trainyard checkpoint sign ...`` as its own process (the test's TRAINYARD_HOME, so its key file)."""
    return subprocess.run([sys.executable, "-m", "cli.checkpoint", "checkpoint", "sign", *args], cwd=REPO_ROOT,
                          env=dict(os.environ), capture_output=True, text=True, timeout=TIMEOUT_S)


def resume_toy(run_dir: Path, out: Path, dump: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, toy.__file__, "train", "--run-dir", str(run_dir), "--resume",
                           "--steps", str(NUM_STEPS), "--out", str(out), "--dump", str(dump)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def unsign(checkpoint_dir: Path) -> bytes:
    """Rewrite the record without its signature, as records were written before signing; its bytes."""
    path = checkpoint_dir / store.RECORD_NAME
    record = json.loads(path.read_bytes())
    record.pop("signature")
    path.write_text(json.dumps(record, indent=1, sort_keys=True))
    return path.read_bytes()


def train_and_save(run_dir: Path, *, num_steps: int = SAVE_AT) -> tuple[dict[int, float], dict]:
    """Train the toy run ``num_steps`` steps, saving at SAVE_AT (signed with the configured key)."""
    app_state = toy.build("none")
    ckpt = toy.checkpointer(run_dir)
    losses = {}
    for step in range(1, num_steps + 1):
        losses[step] = toy.train_step(app_state, WORLD)
        if step == SAVE_AT:
            ckpt.save(step, app_state)
    ckpt.close()
    return losses, toy.full_state(app_state)


def test_an_unsigned_checkpoint_is_refused_then_signed_then_resumes_bit_identically(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    losses, uninterrupted = train_and_save(run_dir, num_steps=NUM_STEPS)
    checkpoint = store.checkpoints_dir(run_dir) / store.step_dir_name(SAVE_AT)
    unsign(checkpoint)
    out, dump = tmp_path / "resumed.json", tmp_path / "resumed.pt"

    refused = resume_toy(run_dir, out, dump)
    assert refused.returncode != 0
    assert "record is unsigned, but a signing key was given" in refused.stderr, refused.stderr[-3000:]

    signed = sign_cli(str(run_dir))
    assert signed.returncode == 0, signed.stdout + signed.stderr
    assert f"SIGNED {checkpoint}" in signed.stdout
    assert store.verify(checkpoint).ok and "signature" in store.read_record(checkpoint)
    again = sign_cli(str(checkpoint))  # idempotent: a signed record is checked, never re-signed
    assert again.returncode == 0 and f"ALREADY SIGNED {checkpoint}" in again.stdout

    resumed = resume_toy(run_dir, out, dump)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["start"] == SAVE_AT
    assert {int(step): loss for step, loss in result["losses"].items()} == \
        {step: loss for step, loss in losses.items() if step > SAVE_AT}
    resumed_state = torch.load(dump, weights_only=True)
    for name, value in uninterrupted["model"].items():
        assert torch.equal(resumed_state["model"][name], value), name
    for key, per_param in uninterrupted["optimizer"].items():
        for name, value in per_param.items():
            assert torch.equal(resumed_state["optimizer"][key][name], value), (key, name)


def _flip_a_shard_byte(checkpoint: Path) -> str:
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return shard.name


@pytest.mark.parametrize("tamper", ["flipped_shard_byte", "extra_file", "forged_metadata"])
def test_a_tampered_unsigned_checkpoint_is_refused_by_the_command_and_stays_unsigned(
        tmp_path: Path, tamper: str) -> None:
    run_dir, marker = tmp_path / "run", tmp_path / "PWNED"
    train_and_save(run_dir)
    checkpoint = store.checkpoints_dir(run_dir) / store.step_dir_name(SAVE_AT)
    if tamper == "flipped_shard_byte":
        unsign(checkpoint)
        expected = f"{_flip_a_shard_byte(checkpoint)}: sha256 mismatch"
    elif tamper == "extra_file":
        unsign(checkpoint)
        (checkpoint / "__9_0.distcp").write_bytes(b"planted")
        expected = "__9_0.distcp: extra file not in the record"
    else:  # a pickle that runs code, with an unsigned record made to agree with it
        forge(checkpoint, TouchOnUnpickle(marker), signing="strip")
        expected = ".metadata: refused: it names pathlib.Path.touch"
    record_bytes = (checkpoint / store.RECORD_NAME).read_bytes()

    refused = sign_cli(str(run_dir))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"REFUSED {checkpoint}" in refused.stdout and expected in refused.stdout, refused.stdout
    assert (checkpoint / store.RECORD_NAME).read_bytes() == record_bytes  # not signed, not rewritten
    assert not marker.exists()


def test_a_record_signed_with_another_key_is_refused_not_re_signed(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    train_and_save(run_dir)
    checkpoint = store.checkpoints_dir(run_dir) / store.step_dir_name(SAVE_AT)
    record_bytes = (checkpoint / store.RECORD_NAME).read_bytes()
    monkeypatch.setenv("OTHER_KEY", "not-the-key-that-signed-it")
    refused = sign_cli(str(checkpoint), "--hmac-key-env", "OTHER_KEY", "--json")
    assert refused.returncode == 1
    (outcome,) = json.loads(refused.stdout)["checkpoints"]
    assert outcome["action"] == store.SIGN_REFUSED
    assert {"file": store.RECORD_NAME, "problem": "bad signature: wrong key, or the record was edited"} \
        in outcome["problems"]
    assert (checkpoint / store.RECORD_NAME).read_bytes() == record_bytes


def test_signing_keeps_the_known_good_pin_and_refuses_another_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train_and_save(run_dir)
    checkpoint = store.checkpoints_dir(run_dir) / store.step_dir_name(SAVE_AT)
    unsign(checkpoint)
    store.pin_known_good(run_dir, SAVE_AT, {"drill": "passed"})
    wrong_run = store.sign_unsigned(checkpoint, b"k" * 16, expected_run_id="another-run")
    assert wrong_run.action == store.SIGN_REFUSED
    assert (store.RECORD_NAME, f"lineage names run {toy.RUN_ID!r}, expected run 'another-run'") in wrong_run.problems
    assert store.sign_unsigned(checkpoint, b"k" * 16, expected_run_id=toy.RUN_ID).action == store.SIGN_SIGNED
    (info,) = store.list_checkpoints(run_dir, verify_files=True, hmac_key=b"k" * 16)
    assert info.known_good and info.status == store.STATUS_COMMITTED, info.reason


def test_the_command_refuses_a_folder_that_is_neither_a_run_nor_a_checkpoint(tmp_path: Path) -> None:
    done = sign_cli(str(tmp_path))
    assert done.returncode == 2 and "neither a checkpoint folder" in done.stderr
