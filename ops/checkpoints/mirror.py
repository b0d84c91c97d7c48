"""Checkpoints that outlive the machine: every committed checkpoint published to an object store.

A run's checkpoints are committed in its run folder first (ops.checkpoints.store: record last,
rename, `latest`), and the coordinator then publishes each one under the mirror URL with
ops.publish.objstore's protocol for stores without rename (objects, commit record, `latest` object):

    s3://bucket/checkpoints/<run id>/step_000040/...      the checkpoint's files, its own signed record among them
    s3://bucket/checkpoints/<run id>/step_000040/_COMMIT.json
    s3://bucket/checkpoints/<run id>/latest

The upload runs on a thread of its own, so training does not wait on the store; each upload
catches up every committed checkpoint the store lacks, so one that failed (a store that went
away) is retried at the next save. `close()` waits for the last one. Retention applies the
stage's rule (keep_last_k, keep_every_m) to the store's versions as well.

A run whose folder has no checkpoint (a new machine, a lost disk) restores from the mirror:
`restore_into` fetches the newest committed version into the run folder, re-hashed against its
commit record, and the checkpointer then verifies it as any checkpoint (its signed record, its
lineage), so a checkpoint from the bucket is trusted exactly as much as a local one.

The mirror is a deployment setting, not an experiment's: ``TRAINYARD_CHECKPOINT_ROOT``
(``s3://bucket/prefix`` or a folder), outside the run's identity.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ops.checkpoints import store as store
from ops.publish import paths
from ops.publish import objstore
from ops.publish.durable import FileDigest

# Under "trainer": the trainer logs through that logger's handler, so a run's log shows what its mirror did.
log = logging.getLogger("trainer.mirror")
ROOT_VARIABLE = paths.CHECKPOINT_ROOT_VARIABLE


def configured_root() -> str | None:
    return paths.checkpoint_store_root()


class CheckpointMirror:
    def __init__(self, url: str, *, keep_last_k: int, keep_every_m: int) -> None:
        self.url, self.keep_last_k, self.keep_every_m = url.rstrip("/"), keep_last_k, keep_every_m
        self._uploader = ThreadPoolExecutor(1, thread_name_prefix="ckpt-mirror")
        self._lock = threading.Lock()
        self._last: Future | None = None
        self.published: list[dict[str, Any]] = []
        """One entry per version this process published: name, seconds, bytes."""
        self.failures: list[str] = []

    @classmethod
    def for_run(cls, run_id: str, *, keep_last_k: int, keep_every_m: int) -> CheckpointMirror | None:
        root = configured_root()
        return None if root is None else cls(objstore.join(root, run_id), keep_last_k=keep_last_k,
                                             keep_every_m=keep_every_m)

    def __repr__(self) -> str:
        return f"CheckpointMirror({self.url!r})"

    # ---- publishing ----

    def submit(self, run_dir: str | Path) -> Future:
        """Publish, in the background, every committed checkpoint of ``run_dir`` the store lacks."""
        with self._lock:
            self._last = self._uploader.submit(self._catch_up, Path(run_dir))
            return self._last

    def _catch_up(self, run_dir: Path) -> None:
        try:
            self.catch_up(run_dir)
        except Exception as error:  # the local checkpoint stands; the next save retries
            message = f"{type(error).__name__}: {error}"
            self.failures.append(message)
            log.error("checkpoint mirror: publishing to %s failed (the local checkpoints stand; the next save "
                      "retries): %s", self.url, message)

    def catch_up(self, run_dir: str | Path) -> list[str]:
        """Publish the committed checkpoints missing from the store, oldest first; then apply retention there."""
        local = [info for info in store.list_checkpoints(run_dir) if info.status == store.STATUS_COMMITTED]
        listing = self._listing()
        done = []
        for info in sorted(local, key=lambda info: info.step):
            if info.name in listing.committed:
                continue
            try:
                # The signed record's digests: a file changed on disk since the commit is refused here,
                # never published for a reader to refuse later.
                record = store.read_record(info.path)
                expected = {name: FileDigest(**digest) for name, digest in record["files"].items()}
                result = objstore.publish_tree(info.path, objstore.join(self.url, info.name),
                                               metadata={"step": info.step}, expected=expected)
            except (objstore.ObjectStoreError, store.CheckpointStoreError, OSError) as error:
                # one bad version must not stop the newer ones
                message = f"{info.name}: {type(error).__name__}: {error}"
                self.failures.append(message)
                log.error("checkpoint mirror: publishing %s to %s failed: %s", info.name, self.url, message)
                continue
            self.published.append({"name": info.name, "seconds": round(result.seconds, 3), "bytes": result.bytes})
            log.info("checkpoint mirror: %s published to %s (%.1f MB in %.2f s)", info.name, self.url,
                     result.bytes / 1e6, result.seconds)
            done.append(info.name)
        self.apply_retention(run_dir)
        return done

    def apply_retention(self, run_dir: Path) -> None:
        """The stage's rule on the store's versions; a step a restore drill proved (pinned here or in the
        run folder) is never let go."""
        listing = self._listing()
        local_pin = store.read_known_good(run_dir)
        pinned = {int(pin["step"]) for pin in (local_pin, self.read_known_good()) if pin is not None}
        for info in store.plan_retention(self._infos(listing), self.keep_last_k, self.keep_every_m, pinned=pinned).delete:
            objstore.delete_version(objstore.join(self.url, info.name))
            log.info("checkpoint mirror: retention let go of %s", info.name)

    def wait(self) -> None:
        with self._lock:
            last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        self.wait()
        self._uploader.shutdown(wait=True)

    def _listing(self) -> objstore.Listing:
        return objstore.list_versions(self.url, accept=lambda name: store.checkpoint_step(name) is not None)

    # ---- the store as a drill's source ----

    def committed(self) -> list[store.CheckpointInfo]:
        """The store's committed checkpoints, oldest step first (paths are version names, not local)."""
        listing = self._listing()
        for note in listing.notes:
            log.warning("checkpoint mirror: %s: %s", self.url, note)
        return sorted(self._infos(listing), key=lambda info: info.step)

    @staticmethod
    def _infos(listing: objstore.Listing) -> list[store.CheckpointInfo]:
        return [store.CheckpointInfo(path=Path(name), step=store.checkpoint_step(name), status=store.STATUS_COMMITTED,
                                     is_latest=name == listing.latest) for name in listing.committed]

    def fetch(self, name: str, into: str | Path) -> store.CheckpointInfo:
        """Copy the committed version ``name`` to ``into/name``, re-hashed against its commit record
        (objstore.VersionRefused when it is not intact); its signed record is the caller's to verify."""
        local = Path(into) / name
        objstore.fetch(objstore.join(self.url, name), local)
        return store.CheckpointInfo(path=local, step=store.checkpoint_step(name), status=store.STATUS_COMMITTED)

    def source_of(self, name: str) -> str:
        return objstore.join(self.url, name)

    def pin_known_good(self, step: int, evidence: dict[str, Any]) -> str:
        """Record in the store that ``step`` restored correctly: retention there keeps it from now on.

        The pin names the commit record's sha256, as the run folder's pin names its record's.
        """
        name = store.step_dir_name(step)
        version = objstore.join(self.url, name)
        objstore.read_record(version)  # raises unless committed
        pin = {"step": step, "checkpoint": name, "evidence": evidence,
               "commit_sha256": hashlib.sha256(objstore.read_object(objstore.join(version, objstore.COMMIT_NAME))
                                               or b"").hexdigest()}
        url = objstore.join(self.url, store.KNOWN_GOOD_NAME)
        objstore.write_object(url, json.dumps(pin, indent=1, sort_keys=True, default=str).encode())
        return url

    def read_known_good(self) -> dict[str, Any] | None:
        """The store's pin, or None; an unreadable one is reported and pins nothing."""
        url = objstore.join(self.url, store.KNOWN_GOOD_NAME)
        data = objstore.read_object(url)
        if data is None:
            return None
        try:
            pin = json.loads(data)
            int(pin["step"])
        except (ValueError, KeyError, TypeError) as error:
            log.error("checkpoint mirror: %s is unreadable and pins nothing: %s", url, error)
            return None
        return pin

    # ---- restoring ----

    def restore_into(self, run_dir: str | Path) -> str | None:
        """Fetch the store's newest committed checkpoint into ``run_dir`` when it has none; its name, or None.

        Falls back to older committed versions when the newest cannot be fetched intact (each
        refusal logged). Only the coordinator calls this, before the run decides where it starts.
        """
        checkpoints = store.checkpoints_dir(run_dir)
        if store.read_latest(run_dir) is not None or any(
                info.status == store.STATUS_COMMITTED for info in store.list_checkpoints(run_dir)):
            return None  # the run folder has its own checkpoints: they come first
        listing = objstore.list_versions(self.url, accept=lambda name: store.checkpoint_step(name) is not None)
        for note in listing.notes:
            log.warning("checkpoint mirror: %s: %s", self.url, note)
        for name, reason in listing.ignored.items():
            log.warning("checkpoint mirror: ignored %s/%s: %s", self.url, name, reason)
        # Newest step first: a writer that died between a record and `latest` left the newest
        # committed version unnamed by the pointer, and it is still the one to resume.
        candidates = sorted(listing.committed, key=lambda name: -store.checkpoint_step(name))
        for name in candidates:
            try:
                objstore.fetch(objstore.join(self.url, name), checkpoints / name)
            except objstore.VersionRefused as refused:
                log.error("checkpoint mirror: %s refused, trying an older one: %s", name, refused)
                continue
            store.point_latest(checkpoints, name)
            log.info("checkpoint mirror: restored %s from %s into %s", name, self.url, checkpoints)
            return name
        return None
