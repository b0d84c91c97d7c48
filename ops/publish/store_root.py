"""The data root in an object store: ``TRAINYARD_DATA_ROOT=s3://bucket/prefix``.

Every step writes where it always has, in a folder (`ops.publish.paths.data_root`): here, this
machine's working copy of the data root. What other machines rely on is published to the store
with ops.publish.objstore's protocol (data objects, then the commit record, then ``latest``):

- each version ops.publish.storage.publish_dir makes (listings, manifests, validated sets, profiles):
  ``<kind>/<version>/`` in the working copy, ``<url>/<kind>/<version>/`` in the store;
- the quarantine ledger (ops.curation.quarantine): ``quarantine/ledger.parquet``, and one committed
  snapshot per change, ``<url>/quarantine/ledger/<events>-<chain head>/``;
- a stage run's records (launch.json, final.json, sample order, rank reports; not its
  checkpoints): ``runs/<name>/``, and one version per launch, ``<url>/runs/<name>/records/<time>-<id>/``;
- shard sets and checkpoints, unless their own variables say otherwise: ``<url>/shard_sets/``
  and ``<url>/checkpoints/`` (ops.publish.paths.shard_store_root, checkpoint_store_root).

Reading: a version the working copy lacks (another machine made it, or this machine's disk was
replaced) is fetched from the store, re-hashed against its commit record, and then read as any
local version, its own digest record checked too. A prefix without a commit record (a writer
killed mid-publication) is never fetched: for a reader, that version does not exist. A committed
copy whose objects differ from its record is refused, naming the URL.

Writing: a version is in the store before the step that made it reports success. A step whose
store write fails fails, naming the URL, and its rerun publishes again. Publishing an identical
version again is a no-op; different files under a published name are refused (versions are
immutable). The working copy is not a cache with a bound: run folders and shards being written
live there. Any published part of it may be deleted; readers fetch it back.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from ops.publish import objstore, paths
from ops.publish.errors import PublishedFileCorrupt

LOGGER = logging.getLogger(__name__)
RECORDS = "records"
"""A run's records under ``<url>/runs/<name>/``: one committed version per stage launch."""
RUN_RECORDS_LEFT_OUT = ("checkpoints",)
"""Checkpoints are mirrored to the checkpoint root (ops.checkpoints.mirror), not copied with the records."""


def url_for(local: str | os.PathLike) -> str | None:
    """The store URL of a path in the working copy, or None (no data root URL, or a path outside it)."""
    url = paths.data_store_url()
    if url is None:
        return None
    try:
        relative = Path(local).resolve().relative_to(paths.data_root().resolve())
    except ValueError:
        return None
    return objstore.join(url, relative.as_posix()) if relative.parts else url


def publish_version(directory: Path) -> str | None:
    """Publish a verified version folder of the working copy to the store; its URL, or None where
    the data root is a folder. ObjectStoreError (naming the URL) when the store refuses it."""
    url = url_for(directory)
    if url is None:
        return None
    result = objstore.publish_tree(directory, url)
    if result.bytes:
        LOGGER.info("data store: %s published to %s (%d objects)", directory.name, url, len(result.record["files"]))
    return url


def fetch_version(directory: Path) -> bool:
    """Fetch the committed version at ``directory``'s URL into the working copy when it is missing
    there. False when there is nothing to fetch (a folder data root, the folder exists, or the store
    has no committed version there). PublishedFileCorrupt when the store's copy is refused."""
    directory = Path(directory)
    url = url_for(directory)
    if url is None or directory.exists():
        return False
    if objstore.read_object(objstore.join(url, objstore.COMMIT_NAME)) is None:
        return False  # never committed (or never published): not a version
    directory.parent.mkdir(parents=True, exist_ok=True)
    fetched = directory.parent / f".{directory.name}.fetched-{uuid.uuid4().hex}"
    try:
        objstore.fetch(url, fetched)
        try:
            # Not objstore.fetch straight into place: it replaces an existing folder, which another
            # process fetching the same version at once may be reading by now. The first rename wins.
            os.rename(fetched, directory)
        except OSError:
            if not directory.exists():
                raise
    except objstore.VersionRefused as refused:
        raise PublishedFileCorrupt(f"{url}: the store's copy of version {directory.name} was refused "
                                   f"({'; '.join(refused.problems)}); rebuild this version") from refused
    finally:
        shutil.rmtree(fetched, ignore_errors=True)
    LOGGER.info("data store: fetched %s from %s", directory.name, url)
    return True


def refused_in_store(directory: Path, reason: str) -> None:
    """Take back a committed version the store holds that was refused (record first, then objects),
    so a rebuild can publish it again: a rebuild repairs, as a damaged local folder is set aside."""
    url = url_for(directory)
    if url is not None:
        LOGGER.warning("data store: deleting the refused version at %s before rebuilding it (%s)", url, reason)
        objstore.delete_version(url)


# ---- snapshots of a mutable file (the quarantine ledger) ----

def publish_snapshot(local_file: Path, name: str) -> str | None:
    """Publish ``local_file`` as the committed version ``<url of its folder>/<stem>/<name>/``; None locally."""
    parent = url_for(local_file.parent)
    if parent is None:
        return None
    with tempfile.TemporaryDirectory(dir=local_file.parent, prefix=f".{local_file.stem}-publish-") as staging:
        os.link(local_file, Path(staging) / local_file.name)
        url = objstore.join(parent, local_file.stem, name)
        objstore.publish_tree(staging, url)
    return url


def snapshots(local_file: Path) -> objstore.Listing | None:
    """The committed snapshots of ``local_file`` in the store, or None where the data root is a folder."""
    parent = url_for(local_file.parent)
    return None if parent is None else objstore.list_versions(objstore.join(parent, local_file.stem))


def fetch_snapshot(local_file: Path, name: str, into: Path) -> Path:
    """Fetch snapshot ``name`` of ``local_file`` into the folder ``into``; the fetched file's path."""
    url = objstore.join(url_for(local_file.parent), local_file.stem, name)
    try:
        objstore.fetch(url, into)
    except objstore.VersionRefused as refused:
        raise PublishedFileCorrupt(f"{url}: refused ({'; '.join(refused.problems)})") from refused
    return into / local_file.name


# ---- a stage run's records ----

def publish_run_records(run_dir: str | os.PathLike) -> str | None:
    """Publish a run folder's records (everything but its checkpoints and hidden files) as a new
    committed version under ``<url of the run>/records/``; None where the data root is a folder or
    the run folder lies outside it. Each launch of the run adds a version; ``latest`` names the newest."""
    run_dir = Path(run_dir)
    url = url_for(run_dir)
    if url is None or not run_dir.is_dir():
        return None
    with tempfile.TemporaryDirectory(dir=run_dir.parent, prefix=f".{run_dir.name}-records-") as staging:
        for path in sorted(run_dir.rglob("*")):
            relative = path.relative_to(run_dir)
            if (not path.is_file() or relative.parts[0] in RUN_RECORDS_LEFT_OUT
                    or any(part.startswith(".") for part in relative.parts)):
                continue
            target = Path(staging) / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)  # a copy: a late writer (a straggling rank) cannot change what is hashed
        if not any(Path(staging).iterdir()):
            return None
        name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{uuid.uuid4().hex[:8]}"
        version = objstore.join(url, RECORDS, name)
        objstore.publish_tree(staging, version)
    return version


def fetch_run_records(run_url: str, into: Path) -> Path | None:
    """The newest committed records of the run at ``run_url`` (`url_for` of its folder, as the stage's
    materialization states it) fetched into ``into`` and re-hashed, or None when the store has none."""
    listing = objstore.list_versions(objstore.join(run_url, RECORDS))
    if listing.latest is None:
        return None
    objstore.fetch(objstore.join(run_url, RECORDS, listing.latest), into)
    return into
