"""Immutable, atomically published directories and files under the data root, bound to their versions.

Writers fill a temporary sibling directory and rename it into place, so a reader never sees
a half-written version; an existing, intact version is never overwritten.

Every published file is bound to its version by a digest record written last: ``DIGESTS.json``
in a published directory (every file in it), or a named record beside files that share a
mutable folder (the clip plan and shard index live beside their shards). The record lists each
file's sha256 and size and the version it belongs to. Readers go through `verify_record`, which
raises `PublishedFileCorrupt` naming the file and the version on any difference, so an edited
row or a flipped byte is never read as the version it claims to be. A version folder written
before records existed has none: readers refuse it with `PublishedRecordMissing` (rebuilding
it repairs it; see `publish_dir`).

A record is HMAC-signed with the checkpoint signing key (ops.checkpoints.keys, the same key and
discipline as checkpoint records), so whoever can write the data root but not the key cannot
rewrite a file together with its record: a record that is unsigned (published before records
were signed: `PublishedRecordUnsigned`, rebuild it), signed with another key or edited
(`PublishedSignatureInvalid`), or signed where this reader has no key configured, is refused by
name, on every read. Readers then recompute each version from every field they rely on
(manifest rows, validated decisions, plan clips, index rows), so even a writer holding the key
cannot publish rows under a version they do not hash to.

Where the data root is an object-store URL (ops.publish.store_root), `publish_dir` also publishes each
version to the store before it returns, and a reader of a version folder the working copy lacks
gets it fetched from the store (`ensure_local`) and then checks it exactly as above.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

from ops.checkpoints.keys import HMAC_KEY_ENV, configured_key, signing_key
from ops.publish import paths
from ops.publish.durable import FileDigest, digest_of, fsync_path, fsync_tree, write_file_atomic
from ops.publish.errors import (PublishedFileCorrupt, PublishedFileError, PublishedRecordMissing,
                                PublishedRecordUnsigned, PublishedSignatureInvalid)
from ops.publish.hashing import canonical_json, sha256_file

LOGGER = logging.getLogger(__name__)
DIGESTS_FILE = "DIGESTS.json"
_RECORD_FORMAT = 2
"""2: signed (``signature``); 1: unsigned, refused as `PublishedRecordUnsigned`."""
SIGNATURE_ALGORITHM = "hmac-sha256"


def record_signature(body: dict, hmac_key: bytes) -> str:
    """HMAC-sha256 of a record's canonical JSON without its signature; its record name is signed
    too, so a plan's record never checks as an index's or a published folder's."""
    unsigned = {key: value for key, value in body.items() if key != "signature"}
    return hmac.new(hmac_key, canonical_json(unsigned).encode(), hashlib.sha256).hexdigest()


def signed_body(*, version: str, files: dict[str, FileDigest], record: str, hmac_key: bytes) -> dict:
    """A digest record's body: format, record name, version, files, and the signature over them."""
    body = {"format": _RECORD_FORMAT, "record": record, "version": version,
            "files": {name: {"sha256": d.sha256, "size_bytes": d.size_bytes} for name, d in sorted(files.items())}}
    body["signature"] = {"algorithm": SIGNATURE_ALGORITHM, "hex": record_signature(body, hmac_key)}
    return body


def write_record(directory: Path, *, version: str, files: Iterable[str], record: str = DIGESTS_FILE,
                 hmac_key: bytes | None = None) -> Path:
    """Record sha256 and size of ``files`` (names relative to ``directory``) as ``version``, signed
    with ``hmac_key`` (default: the signing key, ops.checkpoints.keys.signing_key); written last."""
    directory = Path(directory)
    entries = {name: digest_of(directory / name) for name in sorted(files)}
    body = signed_body(version=version, files=entries, record=record, hmac_key=hmac_key or signing_key())
    write_file_atomic(directory / record, json.dumps(body, indent=1, sort_keys=True).encode())
    return directory / record


def _check_signature(path: Path, body: dict, record: str, label: str) -> None:
    """Refuse a record that is unsigned, signed with another key, edited, or another record's."""
    signature = body.get("signature")
    if signature is None:
        raise PublishedRecordUnsigned(
            f"{path}: digest record of {label} is unsigned: it was published before Trainyard signed its "
            "records (or its signature was stripped), so a rewrite of its files together with the record "
            "could not be told apart. Rebuild this version (rerun the step that publishes it)")
    key = configured_key()
    if key is None:
        raise PublishedSignatureInvalid(
            f"{path}: digest record of {label} is signed, but no signing key is configured here, so it "
            f"cannot be checked: set {HMAC_KEY_ENV} to the deployment's key (or restore its key file)")
    if not isinstance(signature, dict) or signature.get("algorithm") != SIGNATURE_ALGORITHM \
            or not isinstance(signature.get("hex"), str):
        raise PublishedSignatureInvalid(f"{path}: digest record of {label} has a malformed signature "
                                        f"{signature!r:.80}; rebuild this version")
    if body.get("record") != record or not hmac.compare_digest(signature["hex"], record_signature(body, key)):
        raise PublishedSignatureInvalid(
            f"{path}: bad signature on the digest record of {label}: signed with another key, or the record "
            "was rewritten (with the files it lists) or copied from another record. Rebuild this version")


def ensure_local(directory: str | Path) -> bool:
    """Fetch a published version folder missing from the working copy of a data root in an object
    store (ops.publish.store_root.fetch_version); False when there is none to fetch, or the data root is a
    folder. PublishedFileCorrupt when the store's copy is refused."""
    if paths.data_store_url() is None or Path(directory).exists():
        return False
    from ops.publish import store_root  # fsspec: only where the data root is in a store

    return store_root.fetch_version(Path(directory))


def _publish_to_store(final: Path) -> None:
    if paths.data_store_url() is not None:
        from ops.publish import store_root

        store_root.publish_version(final)


def _load_record(directory: Path, record: str, version: str | None) -> dict:
    if record == DIGESTS_FILE:
        ensure_local(directory)
    path = directory / record
    if not path.is_file():
        raise PublishedRecordMissing(
            f"{directory}: no digest record {record} for version {version or directory.name}; it was published before "
            "Trainyard recorded digests, or the record was deleted. Rebuild this version (rerun the step that "
            "publishes it): the rebuild replaces the unverifiable folder")
    try:
        body = json.loads(path.read_text())
        files = {name: FileDigest(sha256=str(entry["sha256"]), size_bytes=int(entry["size_bytes"]))
                 for name, entry in body["files"].items()}
        recorded_version = str(body["version"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError,
            RecursionError) as error:
        raise PublishedFileCorrupt(f"{path}: digest record of version {version or directory.name} is unreadable "
                                   f"({type(error).__name__}: {error}); rebuild this version") from error
    _check_signature(path, body, record, f"version {recorded_version}")
    if version is not None and recorded_version != version:
        raise PublishedFileCorrupt(f"{path}: records version {recorded_version!r}, but it is read as version "
                                   f"{version!r}; rebuild this version")
    return {"version": recorded_version, "files": files}


def _check_digest(path: Path, data: bytes, expected: FileDigest, label: str) -> None:
    if len(data) != expected.size_bytes:
        raise PublishedFileCorrupt(f"{path}: {len(data)} bytes, but {label} published {expected.size_bytes}; "
                                   "it was edited or cut short after publication; rebuild this version")
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected.sha256:
        raise PublishedFileCorrupt(f"{path}: sha256 {actual[:12]}... != {expected.sha256[:12]}... published as "
                                   f"{label}; it was edited after publication; rebuild this version")


def read_verified(directory: str | Path, *, version: str | None = None, record: str = DIGESTS_FILE,
                  only: Iterable[str] | None = None, complete: bool = False) -> tuple[str, dict[str, bytes]]:
    """(recorded version, {name: bytes}) of files checked against the digest record in ``directory``.

    Each file is read once and hashed from that buffer, which the caller then parses: a file
    swapped between a check and a second open can never be what is parsed.
    ``version``: what the caller reads this folder as (the record must say the same).
    ``only``: check and return just these recorded files (each must be in the record).
    ``complete``: also refuse files in the folder that the record does not list (a published directory).
    Raises PublishedRecordMissing or PublishedFileCorrupt naming the file and the version.
    """
    directory = Path(directory)
    loaded = _load_record(directory, record, version)
    files: dict[str, FileDigest] = loaded["files"]
    names = sorted(files) if only is None else sorted(only)
    label = f"version {loaded['version']}"
    contents: dict[str, bytes] = {}
    for name in names:
        if name not in files:
            raise PublishedFileCorrupt(f"{directory / name}: not listed in {record} of {label}; rebuild this version")
        path = directory / name
        try:
            contents[name] = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError) as error:
            raise PublishedFileCorrupt(f"{path}: missing, but {record} of {label} lists it; "
                                       "rebuild this version") from error
        _check_digest(path, contents[name], files[name], label)
    if complete:
        _refuse_extra(directory, record, files, label)
    return loaded["version"], contents


def _refuse_extra(directory: Path, record: str, files: dict[str, FileDigest], label: str) -> None:
    extra = sorted(item.name for item in directory.iterdir() if item.name != record and item.name not in files)
    if extra:
        raise PublishedFileCorrupt(f"{directory}: files {extra} are not part of published {label}")


def verify_record(directory: str | Path, *, version: str | None = None, record: str = DIGESTS_FILE,
                  only: Iterable[str] | None = None, complete: bool = False) -> str:
    """Check files against the digest record in ``directory``; return the recorded version.

    Same checks as `read_verified`, streamed (nothing kept in memory): for a caller that only
    needs to know the files are intact. A caller that then parses a file uses `read_verified`.
    """
    directory = Path(directory)
    loaded = _load_record(directory, record, version)
    files: dict[str, FileDigest] = loaded["files"]
    label = f"version {loaded['version']}"
    for name in sorted(files) if only is None else sorted(only):
        if name not in files:
            raise PublishedFileCorrupt(f"{directory / name}: not listed in {record} of {label}; rebuild this version")
        path = directory / name
        if not path.is_file():
            raise PublishedFileCorrupt(f"{path}: missing, but {record} of {label} lists it; rebuild this version")
        expected, size = files[name], path.stat().st_size
        if size != expected.size_bytes:
            raise PublishedFileCorrupt(f"{path}: {size} bytes, but {label} published {expected.size_bytes}; "
                                       "it was edited or cut short after publication; rebuild this version")
        if (actual := sha256_file(path)) != expected.sha256:
            raise PublishedFileCorrupt(f"{path}: sha256 {actual[:12]}... != {expected.sha256[:12]}... published as "
                                       f"{label}; it was edited after publication; rebuild this version")
    if complete:
        _refuse_extra(directory, record, files, label)
    return loaded["version"]


def verify_published(directory: str | Path, *, version: str | None = None) -> str:
    """Verify a directory published by `publish_dir` (its name is its version unless ``version`` says otherwise)."""
    directory = Path(directory)
    return verify_record(directory, version=version or directory.name, complete=True)


def _set_aside(final: Path, reason: str) -> Path:
    """Rename a damaged version folder out of the way (kept for inspection, never read as a version)."""
    damaged = final.parent / f".{final.name}.damaged-{uuid.uuid4().hex}"
    try:
        os.rename(final, damaged)
    except FileNotFoundError:  # a concurrent rebuild set it aside first; this one publishes (or meets its result)
        return damaged
    (damaged / "DAMAGED.txt").write_text(reason + "\n")
    LOGGER.warning("%s failed verification and was moved to %s; publishing it again (%s)", final, damaged, reason)
    return damaged


def _recorded_files(directory: Path) -> dict[str, FileDigest]:
    return _load_record(directory, DIGESTS_FILE, None)["files"]


@contextlib.contextmanager
def publish_dir(final: Path, *, compare: bool = False) -> Iterator[Path | None]:
    """Yield a temporary directory to fill, then record its digests and rename it to ``final``.

    Without ``compare``: yields None when ``final`` already exists and verifies (versions are
    content-addressed, so an intact one is taken to hold the same content and is left untouched).
    An existing folder that fails verification (edited, cut, missing or unrecorded files) is set
    aside as ``.<name>.damaged-<id>`` and this build publishes the version again: a rebuild
    repairs, it never reports success over a damaged folder.

    ``compare=True`` is for callers whose content is deterministic: always yields a directory to
    fill, then compares its digests with the existing folder's record. Equal: the existing folder
    stays. Any difference (a forged folder whose record was rewritten to match its edits verifies,
    but is not what this build publishes) sets the existing folder aside and publishes this one.
    The folder's name is the version it records.
    """
    final = Path(final)
    try:
        ensure_local(final)  # a version another machine published is reused, not rebuilt
    except PublishedFileCorrupt as refused:
        from ops.publish import store_root

        store_root.refused_in_store(final, str(refused))
    if final.exists():
        try:
            verify_published(final)
            intact = True
        except PublishedFileError as error:
            _set_aside(final, str(error))
            intact = False
        if intact and not compare:  # yielded outside the try: the caller's own errors must not look like damage
            _publish_to_store(final)  # published before a store was configured, or its upload failed
            yield None
            return
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        yield staging
        names = [item.name for item in sorted(staging.iterdir())]
        if any(not (staging / name).is_file() for name in names):
            raise ValueError(f"{final}: published folders hold plain files only, got {names}")
        write_record(staging, version=final.name, files=names)
        if final.exists() and _recorded_files(final) == _recorded_files(staging):
            _publish_to_store(final)
            return  # the same content is published already (the finally removes the staging copy)
        if final.exists():
            _set_aside(final, f"its files differ from what this build of version {final.name} publishes: it was "
                              "edited after publication and its digest record rewritten to match")
        fsync_tree(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.exists():
                raise
            # A concurrent writer published the same content-addressed version first; it must verify.
        fsync_path(final.parent)
        verify_published(final)
        _publish_to_store(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
