"""Where a run's checkpoints live: its run folder, or an object store. The Checkpointer holds one.

    location = open_location(run_dir, store_url=None, hmac_key=key, keep_last_k=3, keep_every_m=1000,
                             start_over=False, mirror=None)      # RunFolder; with store_url: ObjectStore
    staging = location.stage(step)                               # rank 0, before the ranks write
    writer = location.writer(staging, written, thread_count)     # every rank: DCP's writer, hashing
    record = location.commit(staging, record, digests)           # rank 0: record last, then retention

`CheckpointLocation` is what differs between the two; the Checkpointer does the rest (DCP's
collectives, the record's content, verifying the live model against it) once for both:

- `RunFolder`: ``<run_dir>/checkpoints/`` through ops.checkpoints.store (a tmp dir renamed at
  commit, ``latest``, quarantine), with the optional mirror that publishes each commit to an
  object store (ops.checkpoints.mirror) and restores from it.
- `ObjectStore`: ``<root>/<run name>/step_<N>/`` written and read straight through DCP's fsspec
  writer and reader (trainer.checkpointing.object_store), in the mirror's layout.

Methods marked "rank 0" run on the coordinator only; the Checkpointer broadcasts their result
(or their error), so they return picklable values. `verify_checkpoint` and `checkpoint_reader`
serve any checkpoint, wherever it is (a parent run's, named by a path or a URL).
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from torch.distributed.checkpoint import FileSystemWriter, StorageReader, StorageWriter
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem

from ops.checkpoints import store as store
from ops.checkpoints.dcp_metadata import RecordedMetadataReader
from ops.checkpoints.digesting import WrittenFiles
from ops.checkpoints.mirror import CheckpointMirror
from ops.publish import objstore
from trainer.checkpointing import object_store

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Staging:
    """Where one save writes before it is committed (broadcast from rank 0 to every rank)."""

    step: int
    target: str
    """The run folder's tmp dir, or the version's URL in the store."""
    shown: str
    """How messages name the partial save."""
    supersede: bool = False
    """A committed folder of this step fails verification: the commit moves it to quarantine."""


class Choice(NamedTuple):
    """Rank 0's verdict on where a resume starts, verified before anything is read."""

    chosen: str | None
    record: dict[str, Any] | None
    problems: list[tuple[str, str]]
    notes: list[str]
    none_verified: bool
    """Checkpoints exist and none verifies: resuming refuses rather than start from step 0."""


class CheckpointLocation(Protocol):
    """Where a Checkpointer saves, commits, lists, retains and finds its run's checkpoints."""

    root: str
    """The run's checkpoints: the run folder, or the run's URL in the store (for messages)."""
    mirror: CheckpointMirror | None
    """The mirror that publishes each commit to an object store and restores from it; None: none."""

    def where(self, step: int) -> str:
        """The checkpoint of ``step``: a folder path, or a store URL."""

    def folder(self, step: int) -> Path | None:
        """The checkpoint's folder on this machine (fault drills damage its bytes); None in a store."""

    def stage(self, step: int) -> Staging:
        """Rank 0: clear what a killed save left and place the new one. A committed ``step`` that verifies
        is never overwritten (FileExistsError); one that fails verification is superseded, never deleted."""

    def writer(self, staging: Staging, written: WrittenFiles, thread_count: int) -> StorageWriter:
        """DCP's storage writer into ``staging``, each data file hashed into ``written`` as it is written."""

    def commit(self, staging: Staging, record: dict[str, Any], digests: dict[str, store.FileDigest]) -> dict[str, Any]:
        """Rank 0: sign and write the record last, then name the step the latest; then apply retention
        (keep_last_k, keep_every_m, pinned steps kept). Returns the record as written."""

    def abandon(self, staging: Staging) -> None:
        """Rank 0, after a failed save: remove what it wrote (it has no record, so no reader took it)."""

    def latest_name(self) -> str | None:
        """The newest committed checkpoint's name, for messages."""

    def has_committed(self) -> bool:
        """Rank 0: whether the run has committed a checkpoint of its own."""

    def choose(self, run_id: str | None) -> Choice:
        """Rank 0: the newest committed checkpoint of ``run_id`` that verifies, older ones fallen back to."""

    def start_over_if_none_verifies(self, run_id: str) -> list[str]:
        """Rank 0: with start_over, set the run's checkpoints aside when none verifies (notes on what moved)."""

    def close(self) -> None:
        """Wait for background deletes and uploads."""


def open_location(run_dir: str | Path, *, store_url: str | None, hmac_key: bytes | str, keep_last_k: int,
                  keep_every_m: int, start_over: bool = False, mirror: CheckpointMirror | None = None,
                  ) -> CheckpointLocation:
    """The run folder, or with ``store_url`` (``<root>/<run name>``) the object store."""
    if store_url is None:
        return RunFolder(run_dir, hmac_key=hmac_key, keep_last_k=keep_last_k, keep_every_m=keep_every_m,
                         start_over=start_over, mirror=mirror)
    if mirror is not None:
        raise ValueError("a checkpointer that writes to the store has nothing local to mirror: pass one of "
                         "store_url and mirror")
    if start_over:
        raise ValueError("start_over moves a run folder's failed checkpoints aside and starts from step 0; in "
                         "the store a run never discards its progress wholesale (a resume passes a failing "
                         "version over, a new save of its step sets it aside): remove the failed versions "
                         "there, or use a new run")
    return ObjectStore(store_url, run_dir=run_dir, hmac_key=hmac_key, keep_last_k=keep_last_k,
                       keep_every_m=keep_every_m)


def verify_checkpoint(where: str | Path, hmac_key: bytes | str | None, run_id: str | None) -> store.VerifyReport:
    """Any checkpoint, a folder or a store URL, against its signed record."""
    if objstore.is_remote(where):  # every object re-hashed here, and again as it loads
        return object_store.check_version(str(where), hmac_key, run_id, rehash=True)
    return store.verify(where, hmac_key, run_id)


def checkpoint_reader(where: str | Path, record_files: dict[str, Any]) -> StorageReader:
    """DCP's reader of any checkpoint that reads only what the record lists, with the sha256 it lists."""
    if objstore.is_remote(where):
        return object_store.VerifyingStoreReader(str(where), record_files)
    return RecordedMetadataReader(where, record_files)


# --------------------------------------------------------------------------------------------
# The run folder
# --------------------------------------------------------------------------------------------

class _DigestingFileSystem(FileSystem):
    """DCP's local filesystem, each data file hashed as written (ops.checkpoints.digesting)."""

    def __init__(self, written: WrittenFiles) -> None:
        super().__init__()
        self._written = written

    @contextmanager
    def create_stream(self, path, mode):
        name = Path(path).name
        opened = super().create_stream(path, mode)
        if mode != "wb" or not name.endswith(DEFAULT_SUFFIX):
            with opened as raw:
                yield raw  # the small .metadata pickle: hashed at commit
            return
        with self._written.hashing(name, opened) as stream:
            yield stream


class RunFolder:
    """Checkpoints under ``<run_dir>/checkpoints/``, published by ops.checkpoints.store."""

    def __init__(self, run_dir: str | Path, *, hmac_key: bytes | str, keep_last_k: int, keep_every_m: int,
                 start_over: bool = False, mirror: CheckpointMirror | None = None) -> None:
        store.plan_retention([], keep_last_k, keep_every_m)  # validates the retention numbers
        self.run_dir, self._hmac_key = Path(run_dir), hmac_key
        self.root = str(self.run_dir)
        self.keep_last_k, self.keep_every_m, self.start_over = keep_last_k, keep_every_m, start_over
        """start_over: when checkpoint folders exist but none verifies, quarantine them and start from step 0
        (True), or refuse with NoVerifiedCheckpoint (False). Never discards one that verifies."""
        self.mirror = mirror
        # Retention deletes old checkpoints here: rmtree of 500 MB costs ~0.1 s of a save's pause.
        self._deleter = ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")
        self._survey: tuple[str, store.ResumeSurvey] | None = None
        """(run id, verdict) of start_over on rank 0, for the next choose() only."""

    def where(self, step: int) -> str:
        return str(self._final(step))

    def folder(self, step: int) -> Path | None:
        return self._final(step)

    def _final(self, step: int) -> Path:
        return store.checkpoints_dir(self.run_dir) / store.step_dir_name(step)

    def stage(self, step: int) -> Staging:
        self._survey = None  # a save changes the folder: no earlier verdict holds
        final = self._final(step)
        supersede = False
        if final.exists():
            report = store.verify(final, self._hmac_key)
            if report.ok:
                raise FileExistsError(f"step {step} is already committed at {final}")
            logger.warning("checkpoint: %s fails verification and will be superseded: %s", final, report.summary())
            supersede = True
        tmp_dir = store.new_tmp_dir(self.run_dir, step)
        return Staging(step=step, target=str(tmp_dir), shown=tmp_dir.name, supersede=supersede)

    def writer(self, staging: Staging, written: WrittenFiles, thread_count: int) -> StorageWriter:
        writer = FileSystemWriter(staging.target, thread_count=thread_count, sync_files=True, overwrite=False)
        writer.fs = _DigestingFileSystem(written)
        return writer

    def commit(self, staging: Staging, record: dict[str, Any], digests: dict[str, store.FileDigest]) -> dict[str, Any]:
        tmp_dir = Path(staging.target)
        try:
            full = store.commit(tmp_dir, self._final(staging.step), record, self._hmac_key,
                                known_digests=digests, supersede_existing=staging.supersede)
        except Exception:  # always re-raised, after the staging folder is cleared (CheckpointSaveError on every rank)
            if tmp_dir.exists():  # not renamed: never became a checkpoint
                store.remove_incomplete(tmp_dir)
            raise
        self._apply_retention(staging.step)
        if self.mirror is not None:
            self.mirror.submit(self.run_dir)
        return full

    def _apply_retention(self, step: int) -> None:
        try:
            plan = store.apply_retention(self.run_dir, self.keep_last_k, self.keep_every_m,
                                         remove=self._delete_in_background)
        except OSError as error:  # a full or read-only disk must not fail a committed save
            logger.error("checkpoint: retention after step %d failed: %s", step, error)
        else:
            if plan.delete:
                logger.info("checkpoint: retention let go of %s", [info.name for info in plan.delete])

    def _delete_in_background(self, path: Path) -> None:
        """store.discard on the deleter thread: verify, then delete, or quarantine if it fails."""
        def report(done: Future) -> None:
            if done.exception() is not None:  # left as a hidden dir; the next retention retries
                logger.error("checkpoint: could not delete %s: %s", path, done.exception())
            elif done.result() is not None:
                logger.error("checkpoint: %s failed verification; kept in %s", path.name, done.result())

        self._deleter.submit(store.discard, path, self._hmac_key).add_done_callback(report)

    def abandon(self, staging: Staging) -> None:
        store.remove_incomplete(staging.target)

    def latest_name(self) -> str | None:
        return store.read_latest(self.run_dir)

    def has_committed(self) -> bool:
        return (store.checkpoints_dir(self.run_dir) / store.LATEST_NAME).exists()

    def choose(self, run_id: str | None) -> Choice:
        survey = self._take_survey(run_id)
        if survey.chosen is not None:
            return Choice(str(survey.chosen), survey.record, [], survey.notes, False)
        if survey.failed and not self.start_over:  # a run's progress is never thrown away silently
            return Choice(None, None, [(info.name, why) for info, why in survey.failed], survey.notes, True)
        return Choice(None, None, [], survey.notes + self._quarantine_failed(survey.failed), False)

    def _take_survey(self, run_id: str | None) -> store.ResumeSurvey:
        """The survey start_over just made for this run id (once), else a new one."""
        cached, self._survey = self._survey, None
        if cached is not None and cached[0] == run_id:
            return cached[1]
        return store.survey_resume(self.run_dir, self._hmac_key, run_id)

    def start_over_if_none_verifies(self, run_id: str) -> list[str]:
        if not self.start_over:
            return []
        survey = store.survey_resume(self.run_dir, self._hmac_key, run_id)
        if survey.chosen is not None:
            # The choose() that follows takes this verdict instead of re-hashing every file again;
            # the reader still re-checks .metadata's sha256 when DCP reads it.
            self._survey = (run_id, survey)
            return []
        return self._quarantine_failed(survey.failed)

    @staticmethod
    def _quarantine_failed(failed: list[tuple[store.CheckpointInfo, str]]) -> list[str]:
        notes = []
        for info, why in failed:
            target = store.quarantine_checkpoint(info.path, reason=f"start_over: no checkpoint verified: {why}",
                                                 by="start_over")
            notes.append(f"start_over: no checkpoint verified; moved {info.name} to {target} ({why})")
        return notes

    def close(self) -> None:
        try:
            self._deleter.shutdown(wait=True)
        finally:
            if self.mirror is not None:
                self.mirror.close()


# --------------------------------------------------------------------------------------------
# The object store
# --------------------------------------------------------------------------------------------

class ObjectStore:
    """Checkpoints under ``<root>/<run name>/`` in an object store (trainer.checkpointing.object_store)."""

    mirror = None  # the store is where checkpoints already are

    def __init__(self, url: str, *, run_dir: str | Path, hmac_key: bytes | str, keep_last_k: int,
                 keep_every_m: int) -> None:
        store.plan_retention([], keep_last_k, keep_every_m)  # validates the retention numbers
        self.url, self.run_dir, self._hmac_key = url.rstrip("/"), Path(run_dir), hmac_key
        self.root = self.url
        self.keep_last_k, self.keep_every_m = keep_last_k, keep_every_m
        self._retention: CheckpointMirror | None = None

    def where(self, step: int) -> str:
        return objstore.join(self.url, store.step_dir_name(step))

    def folder(self, step: int) -> Path | None:
        return None

    def stage(self, step: int) -> Staging:
        url = self.where(step)
        object_store.prepare(url, self._hmac_key)  # a committed step that verifies is never overwritten
        return Staging(step=step, target=url, shown=url)

    def writer(self, staging: Staging, written: WrittenFiles, thread_count: int) -> StorageWriter:
        return object_store.writer(staging.target, written, thread_count)

    def commit(self, staging: Staging, record: dict[str, Any], digests: dict[str, store.FileDigest]) -> dict[str, Any]:
        try:
            full = object_store.commit_in_store(staging.target, record, digests, self._hmac_key)
        except Exception:  # always re-raised (the caller turns it into CheckpointSaveError on every rank)
            object_store.abandon(staging.target)  # uncommitted: clear its objects (a committed one is kept, logged)
            raise
        self._apply_retention(staging.step)
        return full

    def _apply_retention(self, step: int) -> None:
        """The stage's rule on the store's versions, pinned steps kept (the mirror's retention)."""
        if self._retention is None:
            self._retention = CheckpointMirror(self.url, keep_last_k=self.keep_last_k, keep_every_m=self.keep_every_m)
        try:
            self._retention.apply_retention(self.run_dir)
            if cleared := object_store.clear_orphans(self.url, step):
                logger.info("checkpoint: removed uncommitted saves %s from %s", cleared, self.url)
        except objstore.ObjectStoreError as error:  # must not fail a committed save; the next one retries
            logger.error("checkpoint: retention in %s after step %d failed: %s", self.url, step, error)

    def abandon(self, staging: Staging) -> None:
        object_store.abandon(staging.target)  # uncommitted: no reader took them meanwhile

    def latest_name(self) -> str | None:
        try:
            names = object_store.committed_versions(self.url)
        except objstore.ObjectStoreError:
            return "unknown (the store did not answer)"
        return names[0] if names else None

    def has_committed(self) -> bool:
        return bool(object_store.committed_versions(self.url))

    def choose(self, run_id: str | None) -> Choice:
        """Every object of a version re-hashed, as the run folder's survey does, so a damaged newest one
        falls back to an older one with a note; none verifying refuses the resume. The reader hashes each
        object again as DCP loads it: bytes changed after this check are refused, never loaded unchecked."""
        notes: list[str] = []
        failed: list[tuple[str, str]] = []
        for name in object_store.committed_versions(self.url):
            report = object_store.check_version(objstore.join(self.url, name), self._hmac_key, run_id, rehash=True)
            if report.ok:
                return Choice(str(report.checkpoint_dir), report.record, [], notes, False)
            why = "; ".join(f"{file}: {problem}" for file, problem in report.problems)
            failed.append((name, why))
            notes.append(f"{name} in {self.url} failed verification and was passed over: {why}")
        return Choice(None, None, failed, notes, bool(failed))

    def start_over_if_none_verifies(self, run_id: str) -> list[str]:
        return []  # a run in the store never discards its progress wholesale (open_location refuses start_over)

    def close(self) -> None:
        pass
