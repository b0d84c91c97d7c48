"""The on-disk checkpoint protocol (ops.checkpoints.store) and ``trainyard checkpoint``, without torch.

Checkpoints here are plain files committed through the same `commit` the trainer uses.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from cli import checkpoint as checkpoint_cli
from ops.checkpoints import store as store
from ops.checkpoints.digesting import DigestingFile

RUN_ID = "run-a"


def make_checkpoint(run_dir: Path, step: int, *, hmac_key: bytes | None = None, run_id: str = RUN_ID,
                    files: dict[str, bytes] | None = None) -> Path:
    tmp_dir = store.new_tmp_dir(run_dir, step)
    for name, data in (files or {"__0_0.distcp": os.urandom(4096) + bytes([step % 256]),
                                 "__1_0.distcp": os.urandom(1000), "plan.json": b"{}"}).items():
        (tmp_dir / name).write_bytes(data)
    final = store.checkpoints_dir(run_dir) / store.step_dir_name(step)
    store.commit(tmp_dir, final, {"step": step, "world_size": 2, "lineage": {"run_id": run_id},
                                  "model_fingerprint": "fp", "content": {"progress": {"step": step}}}, hmac_key)
    return final


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------
# commit and latest
# --------------------------------------------------------------------------------------------

def test_commit_publishes_record_and_moves_latest(tmp_path):
    first = make_checkpoint(tmp_path, 100)
    assert os.readlink(store.checkpoints_dir(tmp_path) / "latest") == "step_000100"
    second = make_checkpoint(tmp_path, 200)
    record = store.read_record(second)
    assert record["step"] == 200 and record["lineage"]["run_id"] == RUN_ID
    assert set(record["files"]) == {"__0_0.distcp", "__1_0.distcp", "plan.json"}
    assert record["files"]["__1_0.distcp"]["size_bytes"] == 1000
    assert store.read_latest(tmp_path) == "step_000200"
    assert [p.name for p in store.checkpoints_dir(tmp_path).iterdir() if p.name.startswith(".")] == []
    assert store.verify(first).ok and store.verify(second).ok


def test_commit_trusts_known_digests_only_when_sizes_match(tmp_path):
    tmp_dir = store.new_tmp_dir(tmp_path, 1)
    (tmp_dir / "__0_0.distcp").write_bytes(b"x" * 10)
    final = store.checkpoints_dir(tmp_path) / "step_000001"
    record = {"step": 1, "world_size": 1, "lineage": {"run_id": RUN_ID}, "model_fingerprint": "fp", "content": {}}
    with pytest.raises(store.CheckpointStoreError, match="10 bytes on disk, 11 written"):
        store.commit(tmp_dir, final, record, known_digests={"__0_0.distcp": store.FileDigest(sha256="0" * 64, size_bytes=11)})
    with pytest.raises(store.CheckpointStoreError, match="now missing"):
        store.commit(tmp_dir, final, record, known_digests={"__9_0.distcp": store.FileDigest(sha256="0" * 64, size_bytes=1)})
    assert not final.exists() and store.read_latest(tmp_path) is None


def test_commit_refuses_to_overwrite_a_committed_step(tmp_path):
    make_checkpoint(tmp_path, 100)
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        make_checkpoint(tmp_path, 100)
    assert store.verify(store.checkpoints_dir(tmp_path) / "step_000100").ok


def test_digesting_file_hashes_exactly_what_it_writes(tmp_path):
    chunks = [b"header", os.urandom(3 << 20), memoryview(os.urandom(5000)), os.urandom(2 << 20)]
    with open(tmp_path / "shard.distcp", "wb") as raw:
        stream = DigestingFile(raw)
        for chunk in chunks:  # small writes hash inline, large ones on the helper thread
            stream.write(chunk)
        digest = stream.finish()
    assert digest == store.file_digest(tmp_path / "shard.distcp")
    assert digest.size_bytes == sum(len(bytes(chunk)) for chunk in chunks)


def test_latest_is_a_file_where_symlinks_are_unavailable(tmp_path, monkeypatch):
    def no_symlinks(*args, **kwargs):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 200)
    latest = store.checkpoints_dir(tmp_path) / "latest"
    assert latest.is_file() and not latest.is_symlink()
    assert store.read_latest(tmp_path) == "step_000200"
    assert [info.name for info in store.list_checkpoints(tmp_path) if info.is_latest] == ["step_000200"]


# --------------------------------------------------------------------------------------------
# verify
# --------------------------------------------------------------------------------------------

def _flip(ckpt: Path) -> None:
    flip_byte(ckpt / "__0_0.distcp")


def _remove(ckpt: Path) -> None:
    (ckpt / "__1_0.distcp").unlink()


def _append(ckpt: Path) -> None:
    with open(ckpt / "__1_0.distcp", "ab") as handle:
        handle.write(b"!")


def _extra(ckpt: Path) -> None:
    (ckpt / "__2_0.distcp").write_bytes(b"stray")


def _truncate_record(ckpt: Path) -> None:
    record = ckpt / store.RECORD_NAME
    record.write_bytes(record.read_bytes()[:40])


def _edit_record_step(ckpt: Path) -> None:
    record = json.loads((ckpt / store.RECORD_NAME).read_bytes())
    record["step"] = 999
    (ckpt / store.RECORD_NAME).write_text(json.dumps(record))


@pytest.mark.parametrize("damage, expected", [
    (_flip, ("__0_0.distcp", "sha256 mismatch")),
    (_remove, ("__1_0.distcp", "missing")),
    (_append, ("__1_0.distcp", "size 1001 bytes, record says 1000")),
    (_extra, ("__2_0.distcp", "extra file not in the record")),
    (_truncate_record, (store.RECORD_NAME, "truncated or invalid JSON")),
    (_edit_record_step, (store.RECORD_NAME, "record is for step 999, directory is step_000100")),
])
def test_verify_names_the_failing_file(tmp_path, damage, expected):
    ckpt = make_checkpoint(tmp_path, 100)
    damage(ckpt)
    report = store.verify(ckpt)
    assert not report.ok
    assert any(name == expected[0] and problem.startswith(expected[1]) for name, problem in report.problems), \
        report.problems


def test_verify_refuses_a_checkpoint_of_another_run(tmp_path):
    ckpt = make_checkpoint(tmp_path, 100, run_id="someone-elses-run")
    assert store.verify(ckpt).ok
    report = store.verify(ckpt, expected_run_id=RUN_ID)
    assert report.problems == [(store.RECORD_NAME, "lineage names run 'someone-elses-run', expected run 'run-a'")]


def test_verify_refuses_file_names_that_escape_the_directory(tmp_path):
    ckpt = make_checkpoint(tmp_path, 100)
    record = json.loads((ckpt / store.RECORD_NAME).read_bytes())
    record["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "size_bytes": 1}
    (ckpt / store.RECORD_NAME).write_text(json.dumps(record))
    report = store.verify(ckpt)
    assert report.problems[0][0] == store.RECORD_NAME and "escapes the checkpoint directory" in report.problems[0][1]


def strip_signature(checkpoint_dir: Path) -> None:
    record = json.loads((checkpoint_dir / store.RECORD_NAME).read_bytes())
    del record["signature"]
    (checkpoint_dir / store.RECORD_NAME).write_text(json.dumps(record))


def test_hmac_signed_checkpoint_verifies_only_with_its_key(tmp_path):
    key = b"correct horse battery staple"
    signed = make_checkpoint(tmp_path, 100, hmac_key=key)
    unsigned = make_checkpoint(tmp_path, 200, hmac_key=key)
    strip_signature(unsigned)
    assert store.verify(signed, key).ok and store.verify(signed, key).signature_checked
    assert store.verify(signed, "wrong key").problems == [
        (store.RECORD_NAME, "bad signature: wrong key, or the record was edited")]
    assert store.verify(unsigned, key).problems == [
        (store.RECORD_NAME, "record is unsigned, but a signing key was given")]
    # Re-hashing a tampered shard into the record does not help without the key.
    flip_byte(signed / "__0_0.distcp")
    record = json.loads((signed / store.RECORD_NAME).read_bytes())
    record["files"]["__0_0.distcp"]["sha256"] = store.file_digest(signed / "__0_0.distcp").sha256
    (signed / store.RECORD_NAME).write_text(json.dumps(record))
    assert not store.verify(signed, key).ok
    assert key.decode() not in (signed / store.RECORD_NAME).read_text()


def test_records_are_signed_by_default_with_a_0600_key_file_under_the_home(tmp_path, isolated_locations, monkeypatch):
    monkeypatch.delenv(store.HMAC_KEY_ENV, raising=False)  # conftest's session key: this tests the key file
    key_file = isolated_locations / "keys" / "checkpoint_hmac.key"
    assert not key_file.exists()
    ckpt = make_checkpoint(tmp_path, 100)  # no key given: the configured key, created now
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert (key_file.parent.stat().st_mode & 0o077) == 0
    record = store.read_record(ckpt)
    assert record["signature"]["algorithm"] == store.HMAC_ALGORITHM
    report = store.verify(ckpt)  # the same key is found again, not re-created
    assert report.ok and report.signature_checked
    assert key_file.read_bytes().strip() not in (ckpt / store.RECORD_NAME).read_bytes()
    # An edited record no longer matches the key in the file.
    record["content"]["progress"]["step"] = 999
    (ckpt / store.RECORD_NAME).write_text(json.dumps(record))
    assert store.verify(ckpt).problems == [(store.RECORD_NAME, "bad signature: wrong key, or the record was edited")]


def test_environment_key_overrides_the_key_file(tmp_path, monkeypatch, isolated_locations):
    monkeypatch.setenv(store.HMAC_KEY_ENV, "from-a-dagster-resource")
    ckpt = make_checkpoint(tmp_path, 100)
    assert not (isolated_locations / "keys").exists()  # a supplied key is never written anywhere
    assert store.verify(ckpt, b"from-a-dagster-resource").ok
    monkeypatch.delenv(store.HMAC_KEY_ENV)
    assert not store.verify(ckpt).ok  # now the key file (created by nobody yet) is the configured key


def test_a_signed_record_checked_without_a_key_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.delenv(store.HMAC_KEY_ENV, raising=False)  # conftest's session key: this tests the key file
    ckpt = make_checkpoint(tmp_path, 100, hmac_key=b"the-key-stays-at-the-source")
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "another-machine"))  # no key file, no env var
    assert store.configured_key() is None
    report = store.verify(ckpt)
    assert not report.ok and not report.signature_checked
    assert report.problems == [(store.RECORD_NAME, report.problems[0][1])]
    assert report.problems[0][1].startswith("record is signed, but no signing key is configured")
    assert store.HMAC_KEY_ENV in report.problems[0][1]


def test_a_key_file_readable_by_others_is_refused(tmp_path, isolated_locations, monkeypatch):
    monkeypatch.delenv(store.HMAC_KEY_ENV, raising=False)  # conftest's session key: this tests the key file
    make_checkpoint(tmp_path, 100)
    key_file = isolated_locations / "keys" / "checkpoint_hmac.key"
    key_file.chmod(0o644)
    with pytest.raises(store.SigningKeyError, match="chmod 600"):
        store.configured_key()
    key_file.chmod(0o600)
    key_file.write_bytes(b"")
    with pytest.raises(store.SigningKeyError, match="is empty"):
        store.signing_key()


# --------------------------------------------------------------------------------------------
# listing, known good, resume
# --------------------------------------------------------------------------------------------

def test_list_classifies_committed_incomplete_corrupt_and_known_good(tmp_path):
    make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 200)
    corrupt = make_checkpoint(tmp_path, 300)
    _flip(corrupt)
    store.new_tmp_dir(tmp_path, 400)
    (store.checkpoints_dir(tmp_path) / "step_000500").mkdir()  # no record: never committed
    store.pin_known_good(tmp_path, 100, {"drill": "restore on 1 rank", "loss_delta": 0.0})

    quick = {info.name: info for info in store.list_checkpoints(tmp_path)}
    assert quick["step_000300"].status == store.STATUS_COMMITTED  # without re-hashing, it looks fine
    verified = store.list_checkpoints(tmp_path, verify_files=True)
    statuses = [(info.step, info.status, info.known_good, info.is_latest) for info in verified]
    assert statuses == [(100, "committed", True, False), (200, "committed", False, False),
                        (300, "corrupt", False, True), (400, "incomplete", False, False),
                        (500, "corrupt", False, False)]  # a step dir without a record was damaged
    assert "sha256 mismatch" in verified[2].reason and "missing" in verified[4].reason


def test_known_good_pin_names_the_exact_record(tmp_path):
    make_checkpoint(tmp_path, 100)
    pin = json.loads(store.pin_known_good(tmp_path, 100, {"drill": "ok"}).read_text())
    assert pin["step"] == 100 and pin["evidence"] == {"drill": "ok"}
    with pytest.raises(store.CheckpointStoreError, match="never committed"):
        store.pin_known_good(tmp_path, 200, {})
    # A checkpoint that verifies is never superseded...
    record = {"step": 100, "world_size": 1, "lineage": {"run_id": RUN_ID}, "model_fingerprint": "fp", "content": {}}
    tmp_dir = store.new_tmp_dir(tmp_path, 100)
    (tmp_dir / "__0_0.distcp").write_bytes(b"new")
    with pytest.raises(FileExistsError, match="verifies; refusing to supersede"):
        store.commit(tmp_dir, store.checkpoints_dir(tmp_path) / "step_000100", record, supersede_existing=True)
    # ...a damaged one is moved to quarantine, and the new commit of the same step is not the
    # checkpoint the evidence is about.
    _flip(store.checkpoints_dir(tmp_path) / "step_000100")
    store.commit(tmp_dir, store.checkpoints_dir(tmp_path) / "step_000100", record, supersede_existing=True)
    assert [info.known_good for info in store.list_checkpoints(tmp_path) if info.step == 100] == [False]
    moved = store.checkpoints_dir(tmp_path) / store.QUARANTINE_NAME / "step_000100"
    reason = json.loads((moved / store.REASON_NAME).read_text())
    assert reason["by"] == "supersede" and "__0_0.distcp: sha256 mismatch" in reason["reason"]


def test_resolve_resume_falls_back_past_a_corrupt_newest_and_says_so(tmp_path):
    assert store.resolve_resume(tmp_path) == (None, [])
    make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 200)
    _flip(make_checkpoint(tmp_path, 300))
    partial = store.new_tmp_dir(tmp_path, 400)

    chosen, notes = store.resolve_resume(tmp_path, expected_run_id=RUN_ID)
    assert chosen == store.checkpoints_dir(tmp_path) / "step_000200"
    assert any(partial.name in note for note in notes)
    assert any("step_000300 failed verification" in note and "__0_0.distcp: sha256 mismatch" in note
               for note in notes)
    assert any("latest points to step_000300" in note for note in notes)


def test_resolve_resume_returns_none_when_nothing_verifies(tmp_path):
    _remove(make_checkpoint(tmp_path, 100))
    chosen, notes = store.resolve_resume(tmp_path)
    assert chosen is None and "step_000100 failed verification" in notes[0]


# --------------------------------------------------------------------------------------------
# retention
# --------------------------------------------------------------------------------------------

STEPS = list(range(100, 1100, 100))


@pytest.mark.parametrize("keep_last_k, keep_every_m, pinned, latest, expected", [
    (2, 0, (), None, {900, 1000}),
    (1, 500, (), None, {500, 1000}),
    (3, 300, (200,), None, {200, 300, 600, 800, 900, 1000}),
    (1, 0, (100,), None, {100, 1000}),
    (1, 0, (), 700, {700, 1000}),      # latest points at an older step: kept
    (20, 0, (), None, set(STEPS)),     # K larger than the run: everything
])
def test_retention_keeps_exactly_the_expected_set(tmp_path, keep_last_k, keep_every_m, pinned, latest, expected):
    for step in STEPS:
        make_checkpoint(tmp_path, step, files={"__0_0.distcp": b"x"})
    if latest is not None:
        store.point_latest(store.checkpoints_dir(tmp_path), store.step_dir_name(latest))
    old_tmp, new_tmp = store.new_tmp_dir(tmp_path, 500), store.new_tmp_dir(tmp_path, 1100)

    plan = store.apply_retention(tmp_path, keep_last_k, keep_every_m, pinned)
    keep, delete = plan.keep, plan.delete

    committed = {info.step for info in store.list_checkpoints(tmp_path) if info.status == store.STATUS_COMMITTED}
    assert committed == expected
    assert {info.step for info in keep if info.status == store.STATUS_COMMITTED} == expected
    assert not old_tmp.exists() and new_tmp.exists()  # stale tmp removed; one newer than the newest commit kept
    assert {info.step for info in delete} == (set(STEPS) - expected) | {500}
    assert not [p for p in store.checkpoints_dir(tmp_path).iterdir() if ".deleting-" in p.name]


def test_retention_keeps_known_good_and_quarantines_corrupt_evidence(tmp_path):
    for step in (100, 200, 300, 400, 500):
        make_checkpoint(tmp_path, step)
    store.pin_known_good(tmp_path, 100, {"drill": "ok"})
    damaged_record = store.checkpoints_dir(tmp_path) / "step_000200"
    (damaged_record / store.RECORD_NAME).write_text("{")  # unreadable record
    _flip(store.checkpoints_dir(tmp_path) / "step_000300")  # looks committed until re-hashed
    files_before = {name: sorted(p.name for p in (store.checkpoints_dir(tmp_path) / name).iterdir())
                    for name in ("step_000200", "step_000300")}
    plan = store.apply_retention(tmp_path, 1, 0)
    assert [info.name for info in plan.quarantine] == ["step_000200"]
    assert [info.name for info in plan.delete] == ["step_000300", "step_000400"]
    remaining = {info.name: info.status for info in store.list_checkpoints(tmp_path)}
    assert remaining == {"step_000100": "committed", "step_000500": "committed"}
    # Nothing that failed verification was deleted: both are in quarantine with every file and a reason.
    quarantine = store.checkpoints_dir(tmp_path) / store.QUARANTINE_NAME
    assert sorted(p.name for p in quarantine.iterdir()) == ["step_000200", "step_000300"]
    for name, why in (("step_000200", "COMMITTED.json: truncated or invalid JSON"),
                      ("step_000300", "__0_0.distcp: sha256 mismatch")):
        assert sorted(p.name for p in (quarantine / name).iterdir()) == sorted([*files_before[name], "REASON.json"])
        reason = json.loads((quarantine / name / store.REASON_NAME).read_text())
        assert reason["checkpoint"].endswith(name) or ".deleting-" in reason["checkpoint"]
        assert reason["by"] == "retention" and why in reason["reason"], reason
    assert not [p for p in store.checkpoints_dir(tmp_path).iterdir() if p.name.startswith(".step_")]


def test_retention_rejects_settings_that_would_delete_the_newest():
    with pytest.raises(ValueError, match="keep_last_k must be >= 1"):
        store.plan_retention([], 0, 0)
    with pytest.raises(ValueError, match="keep_every_m must be >= 0"):
        store.plan_retention([], 1, -1)


# --------------------------------------------------------------------------------------------
# trainyard checkpoint
# --------------------------------------------------------------------------------------------

def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="trainyard")
    checkpoint_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.handler(args)


def test_cli_verify_ok_prints_the_summary(tmp_path, capsys, monkeypatch):
    ckpt = make_checkpoint(tmp_path, 100, hmac_key=b"k3y")
    monkeypatch.setenv("CKPT_KEY", "k3y")
    assert run_cli("checkpoint", "verify", str(ckpt), "--hmac-key-env", "CKPT_KEY") == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "step               100" in out and "run-a" in out
    assert "k3y" not in out


def test_cli_verify_fails_naming_each_file(tmp_path, capsys, monkeypatch):
    ckpt = make_checkpoint(tmp_path, 100)
    _flip(ckpt)
    _remove(ckpt)
    assert run_cli("checkpoint", "verify", str(ckpt)) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "__0_0.distcp: sha256 mismatch" in out and "__1_0.distcp: missing" in out
    monkeypatch.setenv("CKPT_KEY", "k3y")
    unsigned = make_checkpoint(tmp_path, 200, hmac_key=b"k3y")
    strip_signature(unsigned)
    assert run_cli("checkpoint", "verify", str(unsigned), "--hmac-key-env", "CKPT_KEY") == 1
    assert "unsigned, but a signing key was given" in capsys.readouterr().out


def test_cli_bad_input_exits_2(tmp_path, capsys):
    assert run_cli("checkpoint", "verify", str(tmp_path / "nope")) == 2
    assert run_cli("checkpoint", "list", str(tmp_path / "nope")) == 2
    ckpt = make_checkpoint(tmp_path, 100)
    assert run_cli("checkpoint", "verify", str(ckpt), "--hmac-key-env", "TRAINYARD_TEST_UNSET_VAR") == 2
    assert "TRAINYARD_TEST_UNSET_VAR is not set" in capsys.readouterr().err


def test_cli_list_shows_statuses_and_steps(tmp_path, capsys):
    make_checkpoint(tmp_path, 100)
    make_checkpoint(tmp_path, 200)
    store.pin_known_good(tmp_path, 100, {})
    partial = store.new_tmp_dir(tmp_path, 300)
    assert run_cli("checkpoint", "list", str(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 committed, 1 incomplete, 0 corrupt; latest -> step_000200" in lines[0]
    assert lines[1].split() == ["100", "committed", "known-good", "step_000100"]
    assert lines[2].split() == ["200", "committed", "latest", "step_000200"]
    assert lines[3].split()[:3] == ["300", "incomplete", partial.name]
    assert run_cli("checkpoint", "list", str(tmp_path), "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["status"]) for c in listed["checkpoints"]] == [
        (100, "committed"), (200, "committed"), (300, "incomplete")]


# --------------------------------------------------------------------------------------------
# Damaged run records and step dirs that are links (issue 32, item 9)
# --------------------------------------------------------------------------------------------

def _pin(run_dir: Path) -> Path:
    return store.checkpoints_dir(run_dir) / store.KNOWN_GOOD_NAME


def _pin_holding(run_dir: Path, data: bytes) -> Path:
    _pin(run_dir).write_bytes(data)
    return _pin(run_dir)


def _latest_file(run_dir: Path, data: bytes) -> Path:
    """``latest`` as the one-line file written where symlinks are unavailable, holding ``data``."""
    latest = store.checkpoints_dir(run_dir) / store.LATEST_NAME
    latest.unlink()
    latest.write_bytes(data)
    return latest


# (damage, the file it leaves damaged); every one is a record list, sign and resume read.
DAMAGED_RUN_RECORDS = {
    "known_good_truncated": lambda run: _pin_holding(run, _pin(run).read_bytes()[:17]),
    "known_good_not_json": lambda run: _pin_holding(run, b"\xff\xfe garbage"),
    "known_good_nested_deep": lambda run: _pin_holding(run, b"[" * 200_000),
    "known_good_a_list": lambda run: _pin_holding(run, b"[1, 2]"),
    "known_good_without_fields": lambda run: _pin_holding(run, b'{"step": "100"}'),
    "latest_not_utf8": lambda run: _latest_file(run, b"\xffstep_000100\n"),
    "latest_names_no_checkpoint": lambda run: _latest_file(run, b"../../other-run/checkpoints/step_000100\n"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGED_RUN_RECORDS))
@pytest.mark.parametrize("command", [("list",), ("list", "--verify"), ("list", "--json"), ("sign",)])
def test_a_damaged_run_record_exits_2_naming_the_file(tmp_path, capsys, damage, command):
    make_checkpoint(tmp_path, 100)
    store.pin_known_good(tmp_path, 100, {"drill": "ok"})
    damaged = DAMAGED_RUN_RECORDS[damage](tmp_path)
    assert run_cli("checkpoint", command[0], str(tmp_path), *command[1:]) == 2  # no traceback: a named error
    err = capsys.readouterr().err
    assert err.startswith("trainyard: error: damaged checkpoint record: ") and str(damaged) in err
    with pytest.raises(store.CheckpointRecordCorrupt, match=str(damaged.name)):
        store.resolve_resume(tmp_path)  # the trainer's read: the named error (trainer/endings.py: record_corrupt)


@pytest.mark.parametrize("damage", ["truncated", "nested_deep", "a_directory"])
def test_a_damaged_commit_record_is_a_named_failure_not_a_traceback(tmp_path, capsys, damage):
    ckpt = make_checkpoint(tmp_path, 100)
    record = ckpt / store.RECORD_NAME
    if damage == "truncated":
        record.write_bytes(record.read_bytes()[:40])
    elif damage == "nested_deep":
        record.write_bytes(b'{"a":' * 200_000)
    else:
        record.unlink()
        record.mkdir()
    assert run_cli("checkpoint", "verify", str(ckpt)) == 1
    assert f"{store.RECORD_NAME}: " in capsys.readouterr().out
    assert run_cli("checkpoint", "list", str(tmp_path)) == 1
    assert "step_000100" in capsys.readouterr().err
    assert store.resolve_resume(tmp_path)[0] is None


def _linked_run(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """Run "mine" with step 100, and step_000200 a symlink into run "other" (same run id: a copied
    run), with ``latest`` naming the link. Returns (mine, other's step dir, its files)."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    make_checkpoint(mine, 100)
    theirs = make_checkpoint(other, 200)
    link = store.checkpoints_dir(mine) / "step_000200"
    link.symlink_to(theirs)
    store.point_latest(store.checkpoints_dir(mine), link.name)
    return mine, theirs, {path.name: path.read_bytes() for path in theirs.iterdir()}


@pytest.mark.parametrize("verifying", [False, True])
def test_a_step_dir_that_links_into_another_run_is_flagged_by_list(tmp_path, capsys, verifying):
    mine, theirs, _ = _linked_run(tmp_path)
    assert run_cli("checkpoint", "list", str(mine), *(["--verify"] if verifying else [])) == 1
    captured = capsys.readouterr()
    assert "1 committed, 0 incomplete, 1 corrupt; latest -> step_000200" in captured.out
    assert f"a symlink to {theirs}" in captured.out
    assert "1 checkpoint(s) failed: step_000200" in captured.err
    linked = [info for info in store.list_checkpoints(mine, verify_files=verifying) if info.step == 200]
    assert [(info.status, info.is_latest) for info in linked] == [(store.STATUS_CORRUPT, True)]


def test_resume_sign_and_retention_never_follow_a_linked_step_dir(tmp_path, capsys):
    mine, theirs, files = _linked_run(tmp_path)
    link = store.checkpoints_dir(mine) / "step_000200"
    chosen, notes = store.resolve_resume(mine, expected_run_id=RUN_ID)
    assert chosen == store.checkpoints_dir(mine) / "step_000100"  # not the other run's, through the link
    assert any("step_000200" in note and "a symlink to" in note for note in notes)
    assert not store.verify(link).ok
    assert run_cli("checkpoint", "sign", str(link)) == 1
    assert "a symlink to" in capsys.readouterr().out
    store.apply_retention(mine, keep_last_k=3, keep_every_m=0)
    moved = store.checkpoints_dir(mine) / store.QUARANTINE_NAME / "step_000200"
    assert json.loads((moved / store.REASON_NAME).read_text())["symlink_to"] == str(theirs)
    assert (moved / "step_000200").is_symlink() and not link.exists()
    assert store.read_latest(mine) is None  # latest named the link: it names nothing now
    assert {path.name: path.read_bytes() for path in theirs.iterdir()} == files  # nothing written through it
