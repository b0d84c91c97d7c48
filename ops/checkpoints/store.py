"""Checkpoint publication on disk: write to a tmp dir, commit with a record written last, verify.

Plain Python (no torch): the trainer's Checkpointer, the restore drill, Dagster checks and the
``trainyard checkpoint`` command all read and write checkpoints through this one module.

Layout (docs/design.md, "Checkpoints")::

    <run_dir>/checkpoints/
      .step_000200.tmp-<uuid>/   being written by every rank; never resumable
      step_000100/               committed: DCP files + COMMITTED.json, the record, written LAST
      latest -> step_000100      moved only after the record is fsynced and the dir renamed
      KNOWN_GOOD.json            the step a restore drill proved (pin_known_good)
      quarantine/step_000050/    a checkpoint that failed verification, moved here (never
                                 deleted) by retention, a superseding save or a start-over,
                                 with REASON.json saying why

The record (COMMITTED.json) holds the sha256 and size of every other file in the directory, the
step, world size, creation time, lineage (with ``run_id``), the model-config fingerprint, what
the caller adds under ``content``, and an HMAC-SHA256 over the canonical JSON of everything
else: records are signed by default (ops.checkpoints.keys). `verify` re-hashes every file against the
record and loads DCP's ``.metadata`` pickle only with an allowlist unpickler
(ops.checkpoints.dcp_metadata), so a flipped byte, a missing or extra shard, a truncated record, a forged
record or ``.metadata``, or a checkpoint copied from another run is refused by name instead of
loaded, and nothing in a checkpoint folder can run code. A signed record checked without a
key is refused by name, never passed unchecked.

Commit order, each step durable before the next: fsync the data files; write and fsync the
record; fsync the tmp dir; rename it to ``step_N``; fsync the parent; point ``latest`` at it
(a symlink under a temp name, ``os.replace``d over ``latest``; a plain file where symlinks are
unavailable); fsync the parent again. A crash at any point leaves either the previous
checkpoint as ``latest`` or the new one fully committed.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import hmac
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Re-exported: callers (assets, CLI, drill) use the key API through this module.
from ops.checkpoints.keys import HMAC_KEY_ENV, SigningKeyError, configured_key, signing_key  # noqa: F401
from ops.publish.hashing import canonical_json, sha256_file
from ops.publish.paths import checkpoint_key_file
# One FileDigest for every published file (ops.publish.durable); checkpoints record the same two fields.
from ops.publish.durable import FileDigest, digest_of, fsync_path, write_file_atomic

RECORD_NAME = "COMMITTED.json"
KNOWN_GOOD_NAME = "KNOWN_GOOD.json"
QUARANTINE_NAME = "quarantine"
"""checkpoints/quarantine/<step dir>/: checkpoints that failed verification, kept with REASON.json."""
REASON_NAME = "REASON.json"
LATEST_NAME = "latest"
RECORD_FORMAT = 1
HMAC_ALGORITHM = "hmac-sha256"

STATUS_COMMITTED = "committed"
STATUS_INCOMPLETE = "incomplete"
STATUS_CORRUPT = "corrupt"

_STEP_DIR = re.compile(r"^step_(\d+)$")
# tmp: being written; deleting: retention removing it; superseded: a corrupt step moved aside by
# older versions (now it goes to quarantine/, and retention moves old superseded dirs there too).
_HIDDEN_DIR = re.compile(r"^\.step_(\d+)\.(tmp|deleting|superseded)-[0-9a-f]+$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
_NUM_VERIFY_THREADS = 4

logger = logging.getLogger(__name__)


class CheckpointStoreError(RuntimeError):
    """A checkpoint could not be committed, pinned or read as the protocol requires."""


class CheckpointRecordCorrupt(CheckpointStoreError):
    """A record of the run's checkpoints (KNOWN_GOOD.json, the ``latest`` pointer file) is truncated,
    not JSON or not the shape it must be: corruption, which fails the same way on every read, so the
    trainer classifies it ``record_corrupt`` (never retried) and the CLI exits 2 naming the file."""

    def __init__(self, path: Path, problem: str) -> None:
        self.path = Path(path)
        super().__init__(f"{path}: {problem}")


# --------------------------------------------------------------------------------------------
# Names and small durable-I/O helpers
# --------------------------------------------------------------------------------------------

def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a committed checkpoint dir name (``step_000100``), else None."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def new_tmp_dir(run_dir: str | Path, step: int) -> Path:
    """Create and return ``checkpoints/.step_<step>.tmp-<uuid>/`` (the caller's ranks write into it)."""
    parent = checkpoints_dir(run_dir)
    parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = parent / f".{step_dir_name(step)}.tmp-{uuid.uuid4().hex}"
    tmp_dir.mkdir()
    fsync_path(parent)
    return tmp_dir


def _write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` (never over an existing one) and fsync it."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


# --------------------------------------------------------------------------------------------
# Digests (data files are hashed as they are written: ops.checkpoints.digesting)
# --------------------------------------------------------------------------------------------

def file_digest(path: Path) -> FileDigest:
    return digest_of(path)


def _digest_json(digest: FileDigest) -> dict[str, Any]:
    """A record's file entry."""
    return {"sha256": digest.sha256, "size_bytes": digest.size_bytes}


# --------------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------------

def _key_bytes(hmac_key: bytes | str) -> bytes:
    return hmac_key.encode() if isinstance(hmac_key, str) else bytes(hmac_key)


def _signature(record: Mapping[str, Any], hmac_key: bytes | str) -> str:
    unsigned = {key: value for key, value in record.items() if key != "signature"}
    return hmac.new(_key_bytes(hmac_key), canonical_json(unsigned).encode(), hashlib.sha256).hexdigest()


def _safe_member_name(name: str) -> bool:
    """A file name the record may list: relative, inside the dir, not the record itself."""
    parts = name.split("/")
    return bool(name) and name != RECORD_NAME and not name.startswith("/") and "\\" not in name \
        and all(part not in ("", ".", "..") for part in parts)


def record_problems(record: Any) -> list[str]:
    """Why ``record`` is not a well-formed commit record (empty when it is)."""
    if not isinstance(record, dict):
        return [f"record is a {type(record).__name__}, not a JSON object"]
    expected = {"format": int, "step": int, "world_size": int, "created_unix_s": (int, float),
                "files": dict, "lineage": dict, "model_fingerprint": str, "content": dict}
    problems = [f"missing or mistyped field {name!r}" for name, kind in expected.items()
                if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool)]
    if problems:
        return problems
    if record["format"] != RECORD_FORMAT:
        problems.append(f"record format {record['format']} is not supported (this code reads {RECORD_FORMAT})")
    for name, entry in record["files"].items():
        if not _safe_member_name(name):
            problems.append(f"file name {name!r} escapes the checkpoint directory")
        elif not (isinstance(entry, dict) and isinstance(entry.get("size_bytes"), int)
                  and _SHA256_HEX.match(str(entry.get("sha256", "")))):
            problems.append(f"file entry for {name!r} lacks a sha256 and size")
    return problems


def _load_record(checkpoint_dir: Path) -> tuple[dict[str, Any] | None, str]:
    """(record, "") or (None, why the record is unusable)."""
    try:
        record = json.loads((checkpoint_dir / RECORD_NAME).read_bytes())
    except FileNotFoundError:
        return None, "missing; the checkpoint was never committed"
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        return None, f"truncated or invalid JSON ({type(error).__name__}: {error})"
    except IsADirectoryError:
        return None, "a directory, not a record file"
    if problems := record_problems(record):
        return None, f"malformed record: {'; '.join(problems)}"
    return record, ""


def read_record(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The parsed COMMITTED.json of a checkpoint; CheckpointStoreError if missing or malformed."""
    record, problem = _load_record(Path(checkpoint_dir))
    if record is None:
        raise CheckpointStoreError(f"{Path(checkpoint_dir) / RECORD_NAME}: {problem}")
    return record


def _scan_files(directory: Path) -> list[str]:
    """Relative posix names of every file under ``directory`` except the record."""
    names = []
    for path in sorted(directory.rglob("*")):
        if path.is_symlink():
            names.append(path.relative_to(directory).as_posix())  # listed so verify flags it
        elif path.is_file() and path.name != RECORD_NAME:
            names.append(path.relative_to(directory).as_posix())
    return names


# --------------------------------------------------------------------------------------------
# Commit
# --------------------------------------------------------------------------------------------

def commit(tmp_dir: str | Path, final_dir: str | Path, record: Mapping[str, Any],
           hmac_key: bytes | str | None = None, *,
           known_digests: Mapping[str, FileDigest] | None = None,
           supersede_existing: bool = False) -> dict[str, Any]:
    """Publish ``tmp_dir`` as ``final_dir``: record written last, then rename, then ``latest``.

    ``record`` holds step, world_size, lineage, model_fingerprint and content; this function
    adds format, created_unix_s, files and the signature (with ``hmac_key``, else `signing_key`:
    every record is signed). ``known_digests`` are digests computed while writing: those files
    are checked by size only, every other file is hashed here. ``supersede_existing`` moves an
    existing ``final_dir`` that fails verification to the quarantine folder (with its reason)
    instead of refusing; one that verifies is never replaced. Returns the record as written.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    if tmp_dir.parent.resolve() != final_dir.parent.resolve():
        raise ValueError(f"{tmp_dir} and {final_dir} must share a parent (rename must be atomic)")
    if (tmp_dir / RECORD_NAME).exists():
        raise CheckpointStoreError(f"{tmp_dir} already holds a {RECORD_NAME}")
    key = signing_key() if hmac_key is None else hmac_key
    superseded = _supersedable(final_dir, key, supersede_existing) if final_dir.exists() else None
    files = _digest_members(tmp_dir, dict(known_digests or {}))
    full = signed_record(record, files, key, name=final_dir.name)
    for name in files:
        fsync_path(tmp_dir / name)
    _write_durably(tmp_dir / RECORD_NAME, json.dumps(full, indent=1, sort_keys=True).encode())
    fsync_path(tmp_dir)
    if superseded is not None:
        quarantine_checkpoint(final_dir, reason=f"superseded by a new save of the same step: {superseded.summary()}",
                              problems=superseded.problems, by="supersede")
    os.rename(tmp_dir, final_dir)
    fsync_path(final_dir.parent)
    point_latest(final_dir.parent, final_dir.name)
    return full


def signed_record(record: Mapping[str, Any], files: Mapping[str, FileDigest], hmac_key: bytes | str, *,
                  name: str) -> dict[str, Any]:
    """``record`` with format, created_unix_s, the files' digests and the HMAC signature: COMMITTED.json's body.
    The one place a record is completed and signed (a run folder's commit and a store's, trainer.checkpointing.object_store)."""
    full = {**record, "format": RECORD_FORMAT, "created_unix_s": time.time(),
            "files": {member: _digest_json(digest) for member, digest in sorted(files.items())}}
    full.pop("signature", None)
    if problems := record_problems(full):
        raise ValueError(f"commit record for {name} is malformed: {'; '.join(problems)}")
    full["signature"] = {"algorithm": HMAC_ALGORITHM, "hex": _signature(full, hmac_key)}
    return full


def _supersedable(final_dir: Path, hmac_key: bytes | str, allowed: bool) -> VerifyReport:
    """The failing verification of an existing ``final_dir`` that may be superseded; raise otherwise."""
    if not allowed:
        raise FileExistsError(f"{final_dir} already exists; refusing to overwrite a committed checkpoint")
    report = verify(final_dir, hmac_key)
    if report.ok:
        raise FileExistsError(f"{final_dir} verifies; refusing to supersede a good checkpoint")
    return report


def _digest_members(tmp_dir: Path, known: dict[str, FileDigest]) -> dict[str, FileDigest]:
    names = _scan_files(tmp_dir)
    if vanished := sorted(set(known) - set(names)):
        raise CheckpointStoreError(f"{tmp_dir}: files written but now missing: {vanished}")
    digests: dict[str, FileDigest] = {}
    for name in names:
        path = tmp_dir / name
        if path.is_symlink() or not _safe_member_name(name):
            raise CheckpointStoreError(f"{path}: a checkpoint may hold only regular files")
        if name in known:
            size_bytes = path.stat().st_size
            if size_bytes != known[name].size_bytes:
                raise CheckpointStoreError(
                    f"{path}: {size_bytes} bytes on disk, {known[name].size_bytes} written")
            digests[name] = known[name]
        else:
            digests[name] = file_digest(path)
    return digests


def point_latest(parent: Path, name: str) -> None:
    """Atomically point ``parent/latest`` at ``name`` (symlink, else a one-line file)."""
    latest = parent / LATEST_NAME
    tmp = parent / f".{LATEST_NAME}.tmp-{uuid.uuid4().hex}"
    try:
        os.symlink(name, tmp)
    except (OSError, NotImplementedError):
        # Filesystems without symlinks (some object-store mounts, Windows without privilege).
        write_file_atomic(latest, f"{name}\n".encode())
        return
    os.replace(tmp, latest)
    fsync_path(parent)


def read_latest(run_dir: str | Path) -> str | None:
    """The directory name ``latest`` points at, or None when there is no ``latest``."""
    latest = checkpoints_dir(run_dir) / LATEST_NAME
    if latest.is_symlink():
        return Path(os.readlink(latest)).name
    if latest.is_file():
        data = latest.read_bytes()
        name = data.decode("utf-8", "replace").strip()
        if name and checkpoint_step(name) is None:  # bytes that are not UTF-8 fail here too (U+FFFD)
            raise CheckpointRecordCorrupt(latest, f"names {name[:80]!r}, not a checkpoint folder (step_<N>)")
        return name or None
    return None


# --------------------------------------------------------------------------------------------
# Verify
# --------------------------------------------------------------------------------------------

@dataclass(slots=True)
class VerifyReport:
    checkpoint_dir: Path
    record: dict[str, Any] | None
    problems: list[tuple[str, str]] = field(default_factory=list)
    """(file, problem) pairs; file is the record's name for problems with the record itself."""
    signature_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        if self.ok:
            return f"{self.checkpoint_dir}: OK"
        return f"{self.checkpoint_dir}: " + "; ".join(f"{name}: {problem}" for name, problem in self.problems)


def verify(checkpoint_dir: str | Path, hmac_key: bytes | str | None = None,
           expected_run_id: str | None = None) -> VerifyReport:
    """Re-hash every file against COMMITTED.json and check the signature and DCP's ``.metadata``.

    ``hmac_key`` None means the configured key (`configured_key`); with none configured, a signed
    record is refused by name rather than passed unchecked. ``.metadata`` is loaded only with
    the allowlist unpickler (ops.checkpoints.dcp_metadata): nothing in the checkpoint can run code here.
    """
    directory = Path(checkpoint_dir)
    report = VerifyReport(directory, None)
    if directory.is_symlink():
        report.problems.append((str(directory), symlink_problem(directory)))
        return report
    if not directory.is_dir():
        report.problems.append((str(directory), "not a directory"))
        return report
    report.record, problem = _load_record(directory)
    if report.record is None:
        report.problems.append((RECORD_NAME, problem))
        return report
    record = report.record
    key = configured_key() if hmac_key is None else hmac_key
    report.problems += record_identity_problems(directory, record, key, expected_run_id)
    report.signature_checked = key is not None and "signature" in record
    report.problems += _file_problems(directory, record["files"])
    return report


def record_identity_problems(directory: Path, record: dict[str, Any], hmac_key: bytes | str | None,
                              expected_run_id: str | None) -> list[tuple[str, str]]:
    problems = []
    match = _STEP_DIR.match(directory.name)
    if match and int(match.group(1)) != record["step"]:
        problems.append((RECORD_NAME, f"record is for step {record['step']}, directory is {directory.name}"))
    if hmac_key is None and "signature" in record:
        problems.append((RECORD_NAME, f"record is signed, but no signing key is configured, so the signature "
                                      f"cannot be checked: set {HMAC_KEY_ENV} or restore {checkpoint_key_file()}"))
    elif hmac_key is not None:
        signature = record.get("signature")
        if not isinstance(signature, dict) or not isinstance(signature.get("hex"), str):
            problems.append((RECORD_NAME, "record is unsigned, but a signing key was given"))
        elif signature.get("algorithm") != HMAC_ALGORITHM:
            problems.append((RECORD_NAME, f"unsupported signature algorithm {signature.get('algorithm')!r}"))
        elif not hmac.compare_digest(signature["hex"], _signature(record, hmac_key)):
            problems.append((RECORD_NAME, "bad signature: wrong key, or the record was edited"))
    run_id = record["lineage"].get("run_id")
    if expected_run_id is not None and run_id != expected_run_id:
        problems.append((RECORD_NAME, f"lineage names run {run_id!r}, expected run {expected_run_id!r}"))
    return problems


def _file_problems(directory: Path, files: Mapping[str, Any]) -> list[tuple[str, str]]:
    on_disk = set(_scan_files(directory))
    problems = [(name, "extra file not in the record") for name in sorted(on_disk - set(files))]
    to_hash = []
    for name, entry in sorted(files.items()):
        path = directory / name
        if name not in on_disk:
            problems.append((name, "missing"))
        elif path.is_symlink():
            problems.append((name, "is a symlink, not a file"))
        elif (size_bytes := path.stat().st_size) != entry["size_bytes"]:
            problems.append((name, f"size {size_bytes} bytes, record says {entry['size_bytes']}"))
        else:
            to_hash.append(name)
    with concurrent.futures.ThreadPoolExecutor(_NUM_VERIFY_THREADS) as pool:
        actual = dict(zip(to_hash, pool.map(lambda name: sha256_file(directory / name), to_hash)))
    problems += [(name, "sha256 mismatch") for name in to_hash if actual[name] != files[name]["sha256"]]
    # DCP's .metadata is a pickle: prove it loads with the allowlist unpickler, whatever its hash.
    # Imported here: ops.checkpoints.dcp_metadata imports torch, which listing and committing do not need.
    from ops.checkpoints.dcp_metadata import is_dcp_metadata_name, metadata_problem

    for name in to_hash:
        if is_dcp_metadata_name(name) and actual[name] == files[name]["sha256"]:
            if problem := metadata_problem((directory / name).read_bytes()):
                problems.append((name, problem))
    return problems


# --------------------------------------------------------------------------------------------
# Signing a record written unsigned (before records were signed by default)
# --------------------------------------------------------------------------------------------

SIGN_SIGNED, SIGN_ALREADY_SIGNED, SIGN_REFUSED = "signed", "already_signed", "refused"


@dataclass(frozen=True, slots=True, kw_only=True)
class SignOutcome:
    checkpoint_dir: Path
    action: str
    """signed, already_signed (its signature checks with the key: nothing written) or refused."""
    problems: list[tuple[str, str]] = field(default_factory=list)
    """Why it was refused: (file, problem), as `verify` names them."""


def sign_unsigned(checkpoint_dir: str | Path, hmac_key: bytes | str,
                  expected_run_id: str | None = None) -> SignOutcome:
    """Sign the unsigned record of a committed checkpoint, after checking everything it vouches for.

    The migration path for checkpoints committed before records were signed by default: every
    file is re-hashed against the record (missing, extra and changed files refuse it), DCP's
    ``.metadata`` must be listed and load through the allowlist, the step must match the
    directory and, with ``expected_run_id``, the lineage must name that run. Only then is the
    record rewritten (atomically) with its signature; nothing else changes. A signed record is
    never re-signed: it is `verify`-ed with ``hmac_key`` and reported as already signed or refused.
    A KNOWN_GOOD pin that named the unsigned record is moved to the signed one (same content).
    """
    directory = Path(checkpoint_dir)
    if directory.is_symlink():  # signing through a link would vouch for whatever it names
        return SignOutcome(checkpoint_dir=directory, action=SIGN_REFUSED,
                           problems=[(str(directory), symlink_problem(directory))])
    record, problem = _load_record(directory) if directory.is_dir() else (None, "not a directory")
    if record is None:
        return SignOutcome(checkpoint_dir=directory, action=SIGN_REFUSED, problems=[(RECORD_NAME, problem)])
    if "signature" in record:  # re-signing would launder a record whose signature fails
        report = verify(directory, hmac_key, expected_run_id)
        return SignOutcome(checkpoint_dir=directory, action=SIGN_ALREADY_SIGNED if report.ok else SIGN_REFUSED,
                           problems=report.problems)
    problems = record_identity_problems(directory, record, None, expected_run_id)
    from ops.checkpoints.dcp_metadata import is_dcp_metadata_name

    if not any(is_dcp_metadata_name(name) for name in record["files"]):
        problems.append((RECORD_NAME, "lists no DCP .metadata file, so the checkpoint cannot be loaded"))
    problems += _file_problems(directory, record["files"])
    if problems:
        return SignOutcome(checkpoint_dir=directory, action=SIGN_REFUSED, problems=problems)
    old_record_sha256 = sha256_file(directory / RECORD_NAME)
    signed = {**record, "signature": {"algorithm": HMAC_ALGORITHM, "hex": _signature(record, hmac_key)}}
    _replace_record(directory, json.dumps(signed, indent=1, sort_keys=True).encode())
    _follow_pin(directory, old_record_sha256)
    return SignOutcome(checkpoint_dir=directory, action=SIGN_SIGNED)


def _replace_record(directory: Path, data: bytes) -> None:
    """Atomically replace ``directory``'s record; staged beside the dir, so a crash leaves no extra file in it."""
    staging = directory.parent / f".{directory.name}.{RECORD_NAME}.tmp-{uuid.uuid4().hex}"
    _write_durably(staging, data)
    os.replace(staging, directory / RECORD_NAME)
    fsync_path(directory)
    fsync_path(directory.parent)


def _follow_pin(directory: Path, old_record_sha256: str) -> None:
    pin_path = directory.parent / KNOWN_GOOD_NAME
    pin = read_known_good(directory.parent.parent) if pin_path.exists() else None
    if pin and pin.get("checkpoint") == directory.name and pin.get("record_sha256") == old_record_sha256:
        pin["record_sha256"] = sha256_file(directory / RECORD_NAME)
        pin["record_signed_unix_s"] = time.time()
        write_file_atomic(pin_path, json.dumps(pin, indent=1, sort_keys=True, default=str).encode())


# --------------------------------------------------------------------------------------------
# Listing
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    path: Path
    step: int
    status: str
    """committed, incomplete (a hidden tmp/deleting/superseded dir) or corrupt (a step dir whose
    record is unreadable, or, with verify_files, that fails verification)."""
    reason: str = ""
    """Why the checkpoint is not committed; empty when it is."""
    known_good: bool = False
    is_latest: bool = False
    created_unix_s: float | None = None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def is_hidden(self) -> bool:
        """A tmp, deleting or superseded dir: never resumable."""
        return self.path.name.startswith(".")


def list_checkpoints(run_dir: str | Path, *, verify_files: bool = False,
                     hmac_key: bytes | str | None = None) -> list[CheckpointInfo]:
    """Every checkpoint dir of the run, oldest step first, classified; verify_files re-hashes."""
    parent = checkpoints_dir(run_dir)
    if not parent.is_dir():
        return []
    latest, pin = read_latest(run_dir), read_known_good(run_dir)
    infos = []
    for path in sorted(parent.iterdir()):
        if path.is_symlink() and (match := _STEP_DIR.match(path.name)):
            # A step dir must be this run's own folder: a link (into another run, say) is flagged, never
            # followed, so `latest` naming it cannot make another run's checkpoint look like this one's.
            infos.append(CheckpointInfo(path=path, step=int(match.group(1)), status=STATUS_CORRUPT,
                                        reason=symlink_problem(path), is_latest=path.name == latest))
            continue
        if not path.is_dir() or path.is_symlink():
            continue
        if hidden := _HIDDEN_DIR.match(path.name):
            reason = {"tmp": "being written or abandoned (no commit)", "deleting": "being deleted",
                      "superseded": "superseded by a later commit of the same step"}[hidden.group(2)]
            infos.append(CheckpointInfo(path=path, step=int(hidden.group(1)), status=STATUS_INCOMPLETE,
                                        reason=reason, created_unix_s=path.stat().st_mtime))
        elif match := _STEP_DIR.match(path.name):
            infos.append(_classify(path, int(match.group(1)), latest=latest, pin=pin,
                                   verify_files=verify_files, hmac_key=hmac_key))
    return sorted(infos, key=lambda info: (info.step, info.is_hidden, info.name))


def symlink_problem(path: Path) -> str:
    """Why a checkpoint folder that is a symlink is refused (it names where it points)."""
    return (f"a symlink to {os.readlink(path)}, not a folder of this run: a checkpoint is never read through "
            "a link (it may be another run's)")


def _classify(path: Path, step: int, *, latest: str | None, pin: dict[str, Any] | None,
              verify_files: bool, hmac_key: bytes | str | None) -> CheckpointInfo:
    is_latest = path.name == latest
    record, problem = _load_record(path)
    if record is None:  # a step_ dir exists only after its record was written: this one was damaged
        return CheckpointInfo(path=path, step=step, status=STATUS_CORRUPT,
                              reason=f"{RECORD_NAME}: {problem}", is_latest=is_latest)
    status, reason = STATUS_COMMITTED, ""
    if verify_files and not (report := verify(path, hmac_key)).ok:
        status, reason = STATUS_CORRUPT, report.summary()
    known_good = bool(pin) and pin.get("checkpoint") == path.name \
        and pin.get("record_sha256") == sha256_file(path / RECORD_NAME)
    return CheckpointInfo(path=path, step=step, status=status, reason=reason, known_good=known_good,
                          is_latest=is_latest, created_unix_s=record["created_unix_s"])


# --------------------------------------------------------------------------------------------
# Known good, resume, retention
# --------------------------------------------------------------------------------------------

def pin_known_good(run_dir: str | Path, step: int, evidence: Mapping[str, Any]) -> Path:
    """Record that the committed checkpoint of ``step`` restored correctly (KNOWN_GOOD.json).

    The pin names the record's sha256, so a checkpoint re-committed later under the same step
    is not mistaken for the one the evidence is about.
    """
    checkpoint = checkpoints_dir(run_dir) / step_dir_name(step)
    read_record(checkpoint)  # raises unless committed
    pin = {"step": step, "checkpoint": checkpoint.name, "record_sha256": sha256_file(checkpoint / RECORD_NAME),
           "pinned_unix_s": time.time(), "evidence": dict(evidence)}
    path = checkpoints_dir(run_dir) / KNOWN_GOOD_NAME
    write_file_atomic(path, json.dumps(pin, indent=1, sort_keys=True, default=str).encode())
    return path


def read_known_good(run_dir: str | Path) -> dict[str, Any] | None:
    path = checkpoints_dir(run_dir) / KNOWN_GOOD_NAME
    if not path.exists():
        return None
    # Raised outside the except clause, with no __context__: the trainer reports an error by the last
    # link of its chain (trainer/checkpointing/checkpointer.py _root_cause), which must be this one, naming the file.
    pin, problem = None, ""
    try:
        pin = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        problem = f"truncated or invalid JSON ({type(error).__name__}: {error})"
    except IsADirectoryError:
        problem = "a directory, not a record file"
    if problem:
        raise CheckpointRecordCorrupt(path, problem)
    if not (isinstance(pin, dict) and isinstance(pin.get("checkpoint"), str) and isinstance(pin.get("step"), int)
            and isinstance(pin.get("record_sha256"), str)):
        raise CheckpointRecordCorrupt(path, "not a known-good pin (a JSON object with step, checkpoint and "
                                            "record_sha256)")
    return pin


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeSurvey:
    """What resume found in a run, each step dir verified at most once."""

    chosen: Path | None
    """The newest committed checkpoint that verifies; None when none does."""
    record: dict[str, Any] | None
    """The chosen checkpoint's record, as verified."""
    notes: list[str]
    """What was passed over (incomplete dirs, failed checkpoints) and why."""
    failed: list[tuple[CheckpointInfo, str]]
    """Step dirs newer than the chosen one that failed verification, oldest first, with why;
    with no checkpoint chosen, every step dir of the run."""


def survey_resume(run_dir: str | Path, hmac_key: bytes | str | None = None,
                  expected_run_id: str | None = None) -> ResumeSurvey:
    """Verify the run's step dirs newest first, stopping at the first that verifies.

    One pass serves both resume and start_over: each checkpoint is re-hashed once (re-hashing
    every shard is the cost of resuming a big run), and the failures it collects on the way are
    exactly what start_over quarantines when none verifies.
    """
    infos = list_checkpoints(run_dir)
    notes = [f"ignored {info.name}: {info.reason}" for info in infos if info.status != STATUS_COMMITTED]
    latest = read_latest(run_dir)
    failed: list[tuple[CheckpointInfo, str]] = []
    for info in sorted((i for i in infos if not i.is_hidden), key=lambda i: i.step, reverse=True):
        report = verify(info.path, hmac_key, expected_run_id)  # an unreadable record fails before any hashing
        if report.ok:
            if latest != info.name:
                notes.append(f"resuming from {info.name}, although latest points to {latest}")
            return ResumeSurvey(chosen=info.path, record=report.record, notes=notes, failed=failed[::-1])
        failed.append((info, "; ".join(f"{name}: {problem}" for name, problem in report.problems)))
        if info.status == STATUS_COMMITTED:
            notes.append(f"{info.name} failed verification ({report.summary()}); falling back to an older checkpoint")
    return ResumeSurvey(chosen=None, record=None, notes=notes, failed=failed[::-1])


def resolve_resume(run_dir: str | Path, hmac_key: bytes | str | None = None,
                   expected_run_id: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint that verifies, and notes on everything passed over."""
    survey = survey_resume(run_dir, hmac_key, expected_run_id)
    return survey.chosen, survey.notes


@dataclass(frozen=True, slots=True)
class RetentionPlan:
    keep: list[CheckpointInfo]
    delete: list[CheckpointInfo]
    """Committed dirs retention no longer wants, and stale tmp / deleting dirs."""
    quarantine: list[CheckpointInfo]
    """Dirs that failed verification (unreadable record, superseded): moved aside, never deleted."""


def plan_retention(infos: Iterable[CheckpointInfo], keep_last_k: int, keep_every_m: int,
                   pinned: Iterable[int] = ()) -> RetentionPlan:
    """Split ``infos`` into keep, delete and quarantine.

    Keeps the last ``keep_last_k`` committed, every step divisible by ``keep_every_m`` (0: none),
    the ``pinned`` steps, anything known good, the newest committed and whatever ``latest``
    points to, and tmp dirs newer than the newest commit (a save may be writing them). Deletes
    other committed checkpoints (`discard` verifies each first) and older tmp and deleting dirs.
    Quarantines corrupt step dirs and superseded dirs: evidence for a person to look at.
    """
    if keep_last_k < 1:
        raise ValueError(f"keep_last_k must be >= 1 (the newest commit is always kept), got {keep_last_k}")
    if keep_every_m < 0:
        raise ValueError(f"keep_every_m must be >= 0 (0 disables it), got {keep_every_m}")
    infos = sorted(infos, key=lambda info: (info.step, info.name))
    committed = [info for info in infos if info.status == STATUS_COMMITTED]
    newest_step = committed[-1].step if committed else None
    protected = {info.name for info in committed[-keep_last_k:]}
    pinned = set(pinned)
    plan = RetentionPlan([], [], [])
    for info in infos:
        if info.status == STATUS_COMMITTED:
            wanted = (info.name in protected or info.step in pinned or info.known_good or info.is_latest
                      or (keep_every_m > 0 and info.step % keep_every_m == 0))
            (plan.keep if wanted else plan.delete).append(info)
        elif not info.is_hidden or _hidden_kind(info.path) == "superseded":
            plan.quarantine.append(info)
        elif newest_step is None or info.step > newest_step:
            plan.keep.append(info)
        else:
            plan.delete.append(info)
    return plan


def _hidden_kind(path: Path) -> str | None:
    """tmp, deleting or superseded for a hidden checkpoint dir; None for any other name."""
    match = _HIDDEN_DIR.match(path.name)
    return match.group(2) if match else None


def apply_retention(run_dir: str | Path, keep_last_k: int, keep_every_m: int, pinned: Iterable[int] = (), *,
                    remove: Callable[[Path], object] | None = None,
                    hmac_key: bytes | str | None = None) -> RetentionPlan:
    """Plan retention over the run's checkpoints (known good pinned), quarantine and delete.

    Each doomed committed dir is first renamed to a hidden ``.deleting-`` name (atomic, so a
    crash mid-delete never leaves a ``step_`` dir with files missing), then passed to ``remove``
    (default: `discard` with ``hmac_key``), which verifies it and deletes it only if it verifies;
    the Checkpointer runs `discard` on a background thread (re-hashing 500 MB: ~0.5 s there).
    """
    remove = remove or (lambda path: discard(path, hmac_key))
    plan = plan_retention(list_checkpoints(run_dir), keep_last_k, keep_every_m, pinned)
    for info in plan.quarantine:
        reason = info.reason if not info.is_hidden else "superseded by a later commit of the same step"
        quarantine_checkpoint(info.path, reason=reason, by="retention")
    for info in plan.delete:
        doomed = info.path
        if not info.is_hidden:
            doomed = info.path.parent / f".{step_dir_name(info.step)}.deleting-{uuid.uuid4().hex}"
            os.rename(info.path, doomed)
            fsync_path(info.path.parent)
        remove(doomed)
    return plan


def discard(path: str | Path, hmac_key: bytes | str | None = None) -> Path | None:
    """Delete a dir retention let go of; one that fails verification goes to quarantine instead.

    A ``.tmp-`` dir was never committed and is deleted as is. A ``.deleting-`` dir (a committed
    checkpoint retention renamed) is verified first: retention never deletes a checkpoint that
    fails verification, since that is evidence of a fault. Returns the quarantine path, if any.
    """
    path = Path(path)
    kind = _hidden_kind(path)
    if kind is None or kind == "superseded":
        raise ValueError(f"{path} is not a tmp or deleting checkpoint dir; refusing to delete it")
    if kind == "deleting":
        report = verify(path, hmac_key)
        if not report.ok:
            return quarantine_checkpoint(path, reason=f"failed verification when retention let it go: "
                                         f"{report.summary()}", problems=report.problems, by="retention")
    shutil.rmtree(path)
    return None


def quarantine_checkpoint(checkpoint_dir: str | Path, *, reason: str, by: str,
                          problems: Iterable[tuple[str, str]] = ()) -> Path:
    """Move a checkpoint dir to ``checkpoints/quarantine/<step dir>/`` with REASON.json; return it.

    Nothing is deleted: the dir keeps every file it had (REASON.json is added). ``latest`` is
    removed if it pointed at the dir, so nothing names a checkpoint that is no longer there.
    """
    checkpoint_dir = Path(checkpoint_dir)
    parent = checkpoint_dir.parent
    match = _STEP_DIR.match(checkpoint_dir.name) or _HIDDEN_DIR.match(checkpoint_dir.name)
    if match is None:
        raise ValueError(f"{checkpoint_dir} is not a checkpoint dir; refusing to quarantine it")
    step = int(match.group(1))
    quarantine = parent / QUARANTINE_NAME
    quarantine.mkdir(exist_ok=True)
    target = quarantine / step_dir_name(step)
    if target.exists():
        target = quarantine / f"{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"
    reason_record = {"checkpoint": checkpoint_dir.name, "step": step, "reason": reason, "by": by,
                     "problems": [list(problem) for problem in problems], "quarantined_unix_s": time.time()}
    if checkpoint_dir.is_symlink():
        # Never write through the link (into the folder it names): the link itself is moved, into a
        # quarantine folder of its own beside its REASON.json.
        reason_record["symlink_to"] = os.readlink(checkpoint_dir)
        target.mkdir()
        write_file_atomic(target / REASON_NAME, json.dumps(reason_record, indent=1, sort_keys=True).encode())
        os.rename(checkpoint_dir, target / checkpoint_dir.name)
    else:
        write_file_atomic(checkpoint_dir / REASON_NAME, json.dumps(reason_record, indent=1, sort_keys=True).encode())
        os.rename(checkpoint_dir, target)
    fsync_path(parent)
    fsync_path(quarantine)
    if read_latest(parent.parent) == checkpoint_dir.name:
        (parent / LATEST_NAME).unlink()
        fsync_path(parent)
    logger.warning("checkpoint: moved %s to %s (%s)", checkpoint_dir.name, target, reason)
    return target


def failed_checkpoints(run_dir: str | Path, hmac_key: bytes | str | None = None,
                       expected_run_id: str | None = None) -> list[tuple[CheckpointInfo, str]]:
    """Every ``step_`` dir of the run that fails verification, with why (re-hashes them all)."""
    failed = []
    for info in list_checkpoints(run_dir):
        if info.is_hidden:
            continue
        report = verify(info.path, hmac_key, expected_run_id)
        if not report.ok:
            failed.append((info, "; ".join(f"{name}: {problem}" for name, problem in report.problems)))
    return failed


def remove_incomplete(tmp_dir: str | Path) -> None:
    """Delete an uncommitted tmp dir (after a failed save). Refuses to touch a committed one."""
    tmp_dir = Path(tmp_dir)
    if not _HIDDEN_DIR.match(tmp_dir.name):
        raise ValueError(f"{tmp_dir} is not a tmp checkpoint dir; refusing to delete it")
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
