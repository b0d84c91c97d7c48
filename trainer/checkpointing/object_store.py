"""Checkpoints straight to an object store, through DCP's fsspec storage writer and reader
(``stage.checkpoint_io=store``).

Layout: the checkpoint mirror's (ops.checkpoints.mirror), so the restore drill, the store's retention and
pins, and every reader of mirrored checkpoints take these versions as they are:

    <root>/<run name>/step_<N>/__<r>_<i>.distcp, .metadata     DCP's objects, written by every rank
    <root>/<run name>/step_<N>/COMMITTED.json                   the signed record (as in a run folder)
    <root>/<run name>/step_<N>/_COMMIT.json                     ops.publish.objstore's record of every object
    <root>/<run name>/latest                                    the newest committed step

Save: rank 0 first removes objects a killed writer left under ``step_<N>/``. A committed version
there that verifies is never overwritten; one that fails verification is set aside under
``<run>/quarantine/`` (kept, as a run folder's quarantine keeps it). Every rank then writes its
DCP files through ``FsspecWriter`` and hashes each one while it streams
(`DigestingStoreFileSystem`, through ops.checkpoints.digesting). The digests are gathered to rank 0, which reads back DCP's small
``.metadata`` to hash it, checks that the listing holds exactly those objects, writes the signed
``COMMITTED.json``, then ``_COMMIT.json``, then ``latest`` (`commit_in_store`). A writer killed
before that leaves objects that no reader accepts, because they have no record; a later save of
that step, or any later commit of the run (`clear_orphans`), removes them. One writer per run at a
time: the stage's pool and the launcher's kill-before-retry see to it, as they do for a run folder.

Load: rank 0 picks the newest version that verifies whole (`check_version`: the store's record,
every object re-hashed, the signature and run id, ``.metadata`` through the allowlist unpickler),
falling back to older ones with a note, as a run folder's resume does. Every rank then reads
through `VerifyingStoreReader`. That is DCP's ``FsspecReader``, except that each object is
streamed whole into a private spool file while it is hashed again, and DCP sees its bytes only
once they equal the signed record's sha256: bytes swapped after the check are refused by name
(the load raises; the run stops rather than train on them). A ranged read straight from the store
would hand DCP bytes that nobody checked. A spool holds one object per reading thread and is
deleted once read. The price is reading every object twice on resume (docs/cluster.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

# DCP's fsspec storage layer: its module is the one place torch 2.13 defines (and lists in __all__)
# FsspecWriter and FsspecReader; the package does not re-export them.
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ops.checkpoints import store as store
from ops.publish import objstore
from ops.checkpoints.dcp_metadata import DCP_METADATA_NAME, MetadataRefused, is_dcp_metadata_name, load_metadata
from ops.checkpoints.digesting import WrittenFiles
from ops.publish.durable import FileDigest

logger = logging.getLogger(__name__)
_CHUNK = 8 << 20


class StoreObjectRefused(ValueError):
    """An object read from the store differs from the signed record; DCP never saw its bytes."""


# ---- writing ----

class DigestingStoreFileSystem(FsspecFileSystem):
    """DCP's fsspec filesystem, each data file hashed as it streams (ops.checkpoints.digesting)."""

    def __init__(self, fs: Any, written: WrittenFiles) -> None:
        super().__init__()
        self.fs, self._written = fs, written

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        name = PurePosixPath(os.fspath(path)).name
        opened = self._opened(path, mode)
        if not (mode == "wb" and name.endswith(DEFAULT_SUFFIX)):
            with opened as raw:
                yield raw  # DCP's small .metadata: read back and hashed at commit
            return
        with self._written.hashing(name, opened) as stream:
            yield stream

    @contextlib.contextmanager
    def _opened(self, path, mode):
        # A full store names itself (StoreFull: the run's store_full), not as the store's generic
        # InternalError; recorded as this rank's write error with that name, as it reaches the commit.
        with objstore.full_store_errors("write", self.fs.unstrip_protocol(os.fspath(path))):
            with super().create_stream(path, mode) as raw:
                yield raw


def writer(url: str, written: WrittenFiles, thread_count: int) -> FsspecWriter:
    """DCP's FsspecWriter to ``url``, hashing what it writes into ``written``. sync_files is off: an
    object is durable once its upload completes (DCP's sync would fsync this machine's disks)."""
    dcp_writer = FsspecWriter(url, thread_count=thread_count, sync_files=False, overwrite=False,
                              **objstore.storage_options(url))
    dcp_writer.fs = DigestingStoreFileSystem(dcp_writer.fs.fs, written)
    return dcp_writer


QUARANTINE = "quarantine"
"""``<run>/quarantine/<step>-<id>/``: committed versions that failed verification, set aside by a save of their step."""


def prepare(url: str, hmac_key: bytes | str | None) -> None:
    """Before a save (rank 0): remove what a killed writer left at ``url``. A committed version there
    that verifies is never overwritten (FileExistsError); one that fails verification is set aside
    under ``<run>/quarantine/`` (kept, as a run folder's quarantine keeps it) and superseded."""
    if objstore.read_object(objstore.join(url, objstore.COMMIT_NAME)) is not None:
        report = check_version(url, hmac_key, None, rehash=True)
        if report.ok:
            raise FileExistsError(f"{url} is a committed checkpoint that verifies; it is never overwritten")
        run_url, name = url.rsplit("/", 1)
        target = objstore.join(run_url, QUARANTINE, f"{name}-{uuid.uuid4().hex[:8]}")
        why = "; ".join(f"{file}: {problem}" for file, problem in report.problems)
        logger.warning("checkpoint: %s fails verification (%s); set aside to %s and superseded", url, why, target)
        objstore.set_aside(url, target)
    if objstore.clear_uncommitted(url):
        logger.warning("checkpoint: removed the objects of an uncommitted save at %s", url)


def clear_orphans(run_url: str, below_step: int) -> list[str]:
    """Remove uncommitted step prefixes older than ``below_step`` (saves a killed writer left and
    no later save of that step replaced); a run saves one step at a time, so none is in flight."""
    listing = objstore.list_versions(run_url, accept=lambda name: store.checkpoint_step(name) is not None)
    cleared = []
    for name in listing.ignored:
        if store.checkpoint_step(name) < below_step and objstore.clear_uncommitted(objstore.join(run_url, name)):
            cleared.append(name)
    return cleared


def commit_in_store(url: str, record: Mapping[str, Any], digests: Mapping[str, FileDigest],
                    hmac_key: bytes | str) -> dict[str, Any]:
    """Rank 0, after every rank wrote: hash .metadata, write the signed COMMITTED.json, then the
    store's commit record and ``latest``. Returns the signed record."""
    fs, root = objstore.filesystem(url)
    name = root.rsplit("/", 1)[-1]
    files = dict(digests)
    with objstore.store_errors("commit", url):
        listed = [path.rsplit("/", 1)[-1] for path in fs.find(root)]
        for member in listed:
            if member not in files and is_dcp_metadata_name(member):
                data = fs.cat_file(f"{root}/{member}")
                files[member] = FileDigest(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
        if unhashed := sorted(set(listed) - set(files)):
            raise objstore.ObjectStoreError(f"{url}: objects nobody hashed while writing: {unhashed}; not committed")
        full = store.signed_record(record, files, hmac_key, name=name)
        body = json.dumps(full, indent=1, sort_keys=True).encode()
        fs.pipe_file(f"{root}/{store.RECORD_NAME}", body)
    files[store.RECORD_NAME] = FileDigest(sha256=hashlib.sha256(body).hexdigest(), size_bytes=len(body))
    objstore.commit_objects(url, files, metadata={"step": full["step"]})
    return full


def abandon(url: str) -> None:
    """Rank 0, after a failed save: remove its objects (it has no record, so no reader took them)."""
    try:
        objstore.clear_uncommitted(url)
    except objstore.ObjectStoreError as error:  # the next save of this step removes them
        logger.error("checkpoint: could not remove the failed save's objects at %s: %s", url, error)


# ---- checking ----

def check_version(url: str, hmac_key: bytes | str | None, expected_run_id: str | None, *,
                  rehash: bool) -> store.VerifyReport:
    """The store's version at ``url`` against both records: the store's (listing, sizes; every
    object re-hashed with ``rehash``), the signed COMMITTED.json (signature, run id, step, and the
    same digests as the store's record), and .metadata loaded through the allowlist."""
    report = store.VerifyReport(url, None)
    try:
        commit = objstore.verify(url, rehash=rehash)
        fs, root = objstore.filesystem(url)
        with objstore.store_errors("read", url):
            body = fs.cat_file(f"{root}/{store.RECORD_NAME}")
            expected = commit["files"].get(store.RECORD_NAME)
            if expected is None or hashlib.sha256(body).hexdigest() != expected["sha256"]:
                report.problems.append((store.RECORD_NAME, "differs from the store's commit record"))
                return report
            record = json.loads(body)
            if problems := store.record_problems(record):
                report.problems.append((store.RECORD_NAME, f"malformed record: {'; '.join(problems)}"))
                return report
            report.record = record
            key = store.configured_key() if hmac_key is None else hmac_key
            name = root.rsplit("/", 1)[-1]
            report.problems += store.record_identity_problems(Path(name), record, key, expected_run_id)
            report.signature_checked = key is not None and "signature" in record
            stored = {member: entry for member, entry in commit["files"].items() if member != store.RECORD_NAME}
            if stored != record["files"]:
                report.problems.append((store.RECORD_NAME, "lists other files or digests than the store's record"))
            for member, entry in record["files"].items():
                if is_dcp_metadata_name(member):
                    try:
                        load_metadata(fs.cat_file(f"{root}/{member}"), expected_sha256=entry["sha256"])
                    except MetadataRefused as refused:
                        report.problems.append((member, f"refused: {refused}"))
    except objstore.VersionRefused as refused:
        report.problems += [("", problem) for problem in refused.problems]
    except FileNotFoundError as error:  # deleted meanwhile (retention, a person): not this version any more
        report.problems.append(("", f"vanished while it was checked: {error}"))
    except json.JSONDecodeError as error:
        report.problems.append((store.RECORD_NAME, f"not JSON ({error})"))
    return report


def committed_versions(run_url: str) -> list[str]:
    """The run's committed step versions in the store, newest step first."""
    listing = objstore.list_versions(run_url, accept=lambda name: store.checkpoint_step(name) is not None)
    return sorted(listing.committed, key=store.checkpoint_step, reverse=True)


# ---- reading ----

class _VerifyingFileSystem(FsspecFileSystem):
    def __init__(self, fs: Any, record_files: Mapping[str, Any], refusals: list[Exception]) -> None:
        super().__init__()
        self.fs, self._files, self._refusals = fs, dict(record_files), refusals

    @contextlib.contextmanager
    def create_stream(self, path, mode) -> Iterator[Any]:
        if mode != "rb":
            raise StoreObjectRefused(f"{path}: a checkpoint is read only")
        name = PurePosixPath(os.fspath(path)).name
        entry = self._files.get(name)
        if not isinstance(entry, Mapping):
            self._refuse(f"{name} is not listed in the checkpoint's record")
        with tempfile.TemporaryFile(prefix="trainyard-ckpt-") as spool:
            digest, size = hashlib.sha256(), 0
            with self.fs.open(os.fspath(path), "rb", block_size=_CHUNK) as source:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    spool.write(chunk)
                    size += len(chunk)
            if size != entry["size_bytes"] or digest.hexdigest() != entry["sha256"]:
                self._refuse(f"{name}: the store's bytes ({size} bytes, sha256 {digest.hexdigest()[:12]}...) differ "
                             f"from the signed record ({entry['size_bytes']} bytes, {entry['sha256'][:12]}...)")
            spool.seek(0)
            yield spool

    def _refuse(self, why: str):
        refusal = StoreObjectRefused(why)
        self._refusals.append(refusal)
        raise refusal


class VerifyingStoreReader(FsspecReader):
    """DCP's FsspecReader over a checkpoint in the store: every object hashed whole against the
    signed record before DCP reads a byte of it; .metadata only as the record lists it, through
    the allowlist unpickler (as ops.checkpoints.dcp_metadata.RecordedMetadataReader does for a folder)."""

    def __init__(self, url: str, record_files: Mapping[str, Any]) -> None:
        super().__init__(url, **objstore.storage_options(url))
        self._record_files = dict(record_files)
        self.refusals: list[Exception] = []
        self.fs = _VerifyingFileSystem(self.fs.fs, self._record_files, self.refusals)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA_NAME if rank is None else f"__{rank}{DCP_METADATA_NAME}"
        entry = self._record_files.get(name)
        try:
            if not isinstance(entry, Mapping):
                raise MetadataRefused(f"{name} is not listed in the commit record")
            with objstore.store_errors("read", str(self.path)):
                data = self.fs.fs.cat_file(f"{str(self.path).rstrip('/')}/{name}")
            metadata = load_metadata(data, expected_sha256=entry["sha256"])
        except MetadataRefused as refused:
            self.refusals.append(refused)
            raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
