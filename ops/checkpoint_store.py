"""Checkpoint publication on disk: write to a tmp dir, commit with a record written last, verify.

Plain Python (no torch): the trainer's Checkpointer, the restore drill, Dagster checks and the
``trainyard checkpoint`` command all read and write checkpoints through this one module.

Layout (docs: DESIGN.md, "Checkpoint layout")::

    <run_dir>/checkpoints/
      .step_000200.tmp-<uuid>/   being written by every rank; never resumable
      step_000100/               committed: DCP files + COMMITTED.json, the record, written LAST
      latest -> step_000100      moved only after the record is fsynced and the dir renamed
      KNOWN_GOOD.json            the step a restore drill proved (pin_known_good)

The record (COMMITTED.json) holds the sha256 and size of every other file in the directory, the
step, world size, creation time, lineage (with ``run_id``), the model-config fingerprint, what
the caller adds under ``content``, and, when a key is given, an HMAC-SHA256 over the canonical
JSON of everything else. `verify` re-hashes every file against the record BEFORE anything is
unpickled, so a flipped byte, a missing or extra shard, a truncated record, a forged record or a
checkpoint copied from another run is refused by name instead of loaded.

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
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from ops.hashing import canonical_json, sha256_file
from ops.storage import fsync_path, write_file_atomic

HMAC_KEY_ENV = "TRAINYARD_CHECKPOINT_HMAC_KEY"
"""Where deployments put the signing key (a Dagster secret resource reads it through EnvVar)."""
RECORD_NAME = "COMMITTED.json"
KNOWN_GOOD_NAME = "KNOWN_GOOD.json"
LATEST_NAME = "latest"
RECORD_FORMAT = 1
HMAC_ALGORITHM = "hmac-sha256"

STATUS_COMMITTED = "committed"
STATUS_INCOMPLETE = "incomplete"
STATUS_CORRUPT = "corrupt"

_STEP_DIR = re.compile(r"^step_(\d+)$")
# tmp: being written; deleting: retention removing it; superseded: a corrupt step moved aside.
_HIDDEN_DIR = re.compile(r"^\.step_(\d+)\.(tmp|deleting|superseded)-[0-9a-f]+$")
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# Writes at least this large hash on a helper thread while the OS writes them (both drop the GIL).
_OVERLAP_HASH_BYTES = 1 << 20
_NUM_VERIFY_THREADS = 4


class CheckpointStoreError(RuntimeError):
    """A checkpoint could not be committed, pinned or read as the protocol requires."""


@dataclass(frozen=True, slots=True)
class FileDigest:
    sha256: str
    size_bytes: int

    def as_json(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size_bytes": self.size_bytes}


# --------------------------------------------------------------------------------------------
# Names and small durable-I/O helpers
# --------------------------------------------------------------------------------------------

def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:06d}"


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
# Hashing while writing
# --------------------------------------------------------------------------------------------

class DigestingFile:
    """A binary file wrapper that sha256-hashes the bytes written through it.

    Large writes are hashed on a helper thread while the OS writes them, so hashing costs about
    nothing on top of the write (the record needs the digests; re-reading 500 MB costs ~0.5 s).
    Supports what DCP's writer uses: write, tell, flush, fileno, close.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._digest = hashlib.sha256()
        self._size_bytes = 0
        self._hasher: concurrent.futures.ThreadPoolExecutor | None = None
        self._result: FileDigest | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= _OVERLAP_HASH_BYTES:
            if self._hasher is None:
                self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash")
            hashed = self._hasher.submit(self._digest.update, view)
            written = self._raw.write(view)
            hashed.result()
        else:
            self._digest.update(view)
            written = self._raw.write(view)
        if written != view.nbytes:
            raise OSError(f"short write: {written} of {view.nbytes} bytes")
        self._size_bytes += view.nbytes
        return written

    def tell(self) -> int:
        return self._raw.tell()

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
            self._hasher = None
        self._raw.close()

    def finish(self) -> FileDigest:
        """Close, and return the digest of everything written."""
        if self._result is None:
            self.close()
            self._result = FileDigest(self._digest.hexdigest(), self._size_bytes)
        return self._result


def file_digest(path: Path) -> FileDigest:
    return FileDigest(sha256_file(path), path.stat().st_size)


# --------------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------------

def hmac_key_from_env(name: str = HMAC_KEY_ENV) -> bytes | None:
    """The signing key in ``$name``, or None when unset. Never log or write the result."""
    value = os.environ.get(name, "")
    return value.encode() if value else None


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
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return None, f"truncated or invalid JSON ({error})"
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
    adds format, created_unix_s, files and (with ``hmac_key``) signature. ``known_digests`` are
    digests computed while writing: those files are checked by size only, every other file is
    hashed here. ``supersede_existing`` moves an existing ``final_dir`` aside (to a hidden,
    never-resumable name) instead of refusing. Returns the record as written.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    if tmp_dir.parent.resolve() != final_dir.parent.resolve():
        raise ValueError(f"{tmp_dir} and {final_dir} must share a parent (rename must be atomic)")
    if (tmp_dir / RECORD_NAME).exists():
        raise CheckpointStoreError(f"{tmp_dir} already holds a {RECORD_NAME}")
    files = _digest_members(tmp_dir, dict(known_digests or {}))
    full = {**record, "format": RECORD_FORMAT, "created_unix_s": time.time(),
            "files": {name: digest.as_json() for name, digest in sorted(files.items())}}
    full.pop("signature", None)
    if problems := record_problems(full):
        raise ValueError(f"commit record for {final_dir.name} is malformed: {'; '.join(problems)}")
    if hmac_key is not None:
        full["signature"] = {"algorithm": HMAC_ALGORITHM, "hex": _signature(full, hmac_key)}
    for name in files:
        fsync_path(tmp_dir / name)
    _write_durably(tmp_dir / RECORD_NAME, json.dumps(full, indent=1, sort_keys=True).encode())
    fsync_path(tmp_dir)
    if final_dir.exists():
        if not supersede_existing:
            raise FileExistsError(f"{final_dir} already exists; refusing to overwrite a committed checkpoint")
        os.rename(final_dir, final_dir.parent / f".{final_dir.name}.superseded-{uuid.uuid4().hex}")
    os.rename(tmp_dir, final_dir)
    fsync_path(final_dir.parent)
    point_latest(final_dir.parent, final_dir.name)
    return full


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
        return latest.read_text().strip() or None
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
    """Re-hash every file against COMMITTED.json; nothing in the checkpoint is unpickled."""
    directory = Path(checkpoint_dir)
    report = VerifyReport(directory, None)
    if not directory.is_dir():
        report.problems.append((str(directory), "not a directory"))
        return report
    report.record, problem = _load_record(directory)
    if report.record is None:
        report.problems.append((RECORD_NAME, problem))
        return report
    record = report.record
    report.problems += _record_identity_problems(directory, record, hmac_key, expected_run_id)
    report.signature_checked = hmac_key is not None
    report.problems += _file_problems(directory, record["files"])
    return report


def _record_identity_problems(directory: Path, record: dict[str, Any], hmac_key: bytes | str | None,
                              expected_run_id: str | None) -> list[tuple[str, str]]:
    problems = []
    match = _STEP_DIR.match(directory.name)
    if match and int(match.group(1)) != record["step"]:
        problems.append((RECORD_NAME, f"record is for step {record['step']}, directory is {directory.name}"))
    if hmac_key is not None:
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
    return problems


# --------------------------------------------------------------------------------------------
# Listing
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    path: Path
    step: int
    status: str
    """committed, incomplete (tmp dir, no valid record) or corrupt (failed verify)."""
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
        """A tmp, deleting or superseded dir: never resumable, safe to clean up."""
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


def _classify(path: Path, step: int, *, latest: str | None, pin: dict[str, Any] | None,
              verify_files: bool, hmac_key: bytes | str | None) -> CheckpointInfo:
    is_latest = path.name == latest
    record, problem = _load_record(path)
    if record is None:
        return CheckpointInfo(path=path, step=step, status=STATUS_INCOMPLETE,
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
    try:
        pin = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointStoreError(f"{path}: truncated or invalid JSON ({error})") from error
    return pin if isinstance(pin, dict) else None


def resolve_resume(run_dir: str | Path, hmac_key: bytes | str | None = None,
                   expected_run_id: str | None = None) -> tuple[Path | None, list[str]]:
    """The newest committed checkpoint that verifies, and notes on everything passed over."""
    infos = list_checkpoints(run_dir)
    notes = [f"ignored {info.name}: {info.reason}" for info in infos if info.status != STATUS_COMMITTED]
    latest = read_latest(run_dir)
    for info in sorted((i for i in infos if i.status == STATUS_COMMITTED), key=lambda i: i.step, reverse=True):
        report = verify(info.path, hmac_key, expected_run_id)
        if report.ok:
            if latest != info.name:
                notes.append(f"resuming from {info.name}, although latest points to {latest}")
            return info.path, notes
        notes.append(f"{info.name} failed verification ({report.summary()}); falling back to an older checkpoint")
    return None, notes


def plan_retention(infos: Iterable[CheckpointInfo], keep_last_k: int, keep_every_m: int,
                   pinned: Iterable[int] = ()) -> tuple[list[CheckpointInfo], list[CheckpointInfo]]:
    """Split ``infos`` into (keep, delete).

    Keeps the last ``keep_last_k`` committed, every step divisible by ``keep_every_m`` (0: none),
    the ``pinned`` steps, anything known good, the newest committed and whatever ``latest``
    points to. Deletes other committed checkpoints and hidden (tmp, deleting, superseded) dirs
    whose step is at or below the newest commit; keeps corrupt dirs and invalid ``step_`` dirs
    as evidence for a person to look at.
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
    keep, delete = [], []
    for info in infos:
        if info.status == STATUS_COMMITTED:
            wanted = (info.name in protected or info.step in pinned or info.known_good or info.is_latest
                      or (keep_every_m > 0 and info.step % keep_every_m == 0))
        else:
            wanted = not info.is_hidden or newest_step is None or info.step > newest_step
        (keep if wanted else delete).append(info)
    return keep, delete


def apply_retention(run_dir: str | Path, keep_last_k: int, keep_every_m: int, pinned: Iterable[int] = (), *,
                    remove: Callable[[Path], object] = shutil.rmtree,
                    ) -> tuple[list[CheckpointInfo], list[CheckpointInfo]]:
    """Plan retention over the run's checkpoints (known good pinned) and delete the rest.

    Each doomed committed dir is first renamed to a hidden ``.deleting-`` name (atomic, so a
    crash mid-delete never leaves a ``step_`` dir with files missing), then passed to ``remove``;
    the Checkpointer passes one that deletes on a background thread (rmtree of 500 MB: ~0.1 s).
    """
    keep, delete = plan_retention(list_checkpoints(run_dir), keep_last_k, keep_every_m, pinned)
    for info in delete:
        doomed = info.path
        if not info.is_hidden:
            doomed = info.path.parent / f".{step_dir_name(info.step)}.deleting-{uuid.uuid4().hex}"
            os.rename(info.path, doomed)
            fsync_path(info.path.parent)
        remove(doomed)
    return keep, delete


def remove_incomplete(tmp_dir: str | Path) -> None:
    """Delete an uncommitted tmp dir (after a failed save). Refuses to touch a committed one."""
    tmp_dir = Path(tmp_dir)
    if not _HIDDEN_DIR.match(tmp_dir.name):
        raise ValueError(f"{tmp_dir} is not a tmp checkpoint dir; refusing to delete it")
    if tmp_dir.exists():
        shutil.rmtree(tmp_dir)
