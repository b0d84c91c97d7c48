"""Shard sets in an object store, read through a bounded local cache.

A shard set that ``shard_index`` published to the store (``$TRAINYARD_SHARD_ROOT/<index
version>/``, ops.publish.objstore's protocol) is read by a machine that does not share the filesystem
that wrote it, with ``data.shard_index=s3://bucket/shards/<version>``:

- ``open_index(url)`` fetches the set's index and plan, not its tars, into
  ``<cache>/sets/<name>-<url digest>/``, re-hashed against the commit record, and reads them with
  ops.clips.shards.read_index. The index is then checked exactly as a local one (its digest record,
  its version recomputed from the plan and the shard digests, the plan beside it).
- The loader opens each shard through ``ShardCache.open`` when the sample order first reaches
  it. The first use streams the whole tar from the store into the cache, checks its sha256
  against the index, and renames it into place as ``<cache>/tars/<sha256>.tar``. The file is
  named by its content, so the same shard in another set is the same file. After that, samples
  are local random-access reads (seek to the row's offset).
- The cache holds at most ``TRAINYARD_SHARD_CACHE_GB`` of tars (plus, while one downloads, its
  partial file). After each download, the least recently opened tars go until the rest fit. A
  reader that still holds an evicted tar open keeps reading it (POSIX unlink), and its space
  returns when the handle closes. The loader keeps only a few shard handles open per process
  when it reads through a cache.

Why whole shards rather than a ranged read per sample: a sample's bytes can be checked only
against its shard's sha256. A ranged read would hand the decoder bytes nobody checked. A shuffled
order also reads each shard many times per epoch, so one download per shard while it stays
cached costs less I/O. The price is refetching when the cache is smaller than the split's
shards: ``stats()`` counts the misses, and docs/cluster.md says how to size the cache.

Every rank and DataLoader worker on a machine shares one cache. A lock file per shard (fcntl)
makes one process download while the others wait for it, and a lock file serializes eviction.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ops.clips import plan, shards
from ops.publish import content_cache, objstore, paths
from ops.publish.storage import PublishedFileError

LOGGER = logging.getLogger(__name__)
# What read_index reads: the index, and the plan it checks the index against.
INDEX_OBJECTS = (shards.INDEX_FILE, shards.INDEX_INFO_FILE, shards.INDEX_RECORD_FILE,
                 plan.PLAN_FILE, plan.PLAN_INFO_FILE, plan.PLAN_RECORD_FILE)
_OPEN_ATTEMPTS = 3
_HITS = {"hits": 0}
_COUNTERS = "shards"


def stats() -> dict[str, int]:
    """This process's cache counters: hits (opens of a cached tar), misses (downloads), evictions,
    bytes_fetched. DataLoader workers count their own."""
    return {**content_cache.stats(_COUNTERS), **_HITS}


@dataclass(frozen=True, slots=True)
class ShardCache:
    """The tars of the published set at ``url``, cached under ``directory``, at most ``max_bytes``.

    Picklable (URL, folder and bound only), so DataLoader workers take it along; each process
    opens its own store connection. The bytes live in an ops.publish.content_cache.ContentCache
    (``<directory>/tars/<sha256>.tar``).
    """
    url: str
    directory: str
    max_bytes: int

    @property
    def tars(self) -> Path:
        return Path(self.directory) / "tars"

    @property
    def content(self) -> content_cache.ContentCache:
        return content_cache.ContentCache(str(self.tars), self.max_bytes, _COUNTERS)

    def open(self, shard: str, sha256: str) -> BinaryIO:
        """An open handle on ``shard``'s tar, downloaded first when the cache lacks it.

        Raises shards.ShardIntegrityError when the store's copy differs from the index, and
        objstore.ObjectStoreError (naming the URL) when the store fails.
        """
        content = self.content
        final = content.path(sha256, ".tar")
        fetched = False
        for _ in range(_OPEN_ATTEMPTS):
            try:
                handle = open(final, "rb")
            except FileNotFoundError:
                fetched = self._fetch(content, shard, sha256) or fetched
                continue
            _HITS["hits"] += not fetched
            content.touch(final)  # most recently used
            return handle
        raise OSError(f"shard cache {self.directory}: {shard}.tar was evicted as soon as it was fetched, "
                      f"{_OPEN_ATTEMPTS} times: the cache ({self.max_bytes / 1e9:.2f} GB, "
                      f"{paths.SHARD_CACHE_GB_VARIABLE}) is too small for the shards being read")

    def _fetch(self, content: content_cache.ContentCache, shard: str, sha256: str) -> bool:
        """Download ``shard`` into the cache unless another process just did; whether this one did."""
        remote = objstore.join(self.url, f"{shard}.tar")
        try:
            fetched = content.fetch(remote, sha256, ".tar")
        except FileNotFoundError as error:
            raise shards.ShardIntegrityError(f"{remote} is missing from the store") from error
        except PermissionError as error:
            raise objstore.ObjectStoreError(f"fetch {remote}: {type(error).__name__}: {error}") from error
        except content_cache.CachedObjectMismatch as error:
            raise shards.ShardIntegrityError(f"{remote}: sha256 {error.actual[:12]}... != index {sha256[:12]}...: "
                                             "the store's copy is not the shard the index was built from") from error
        if fetched:
            LOGGER.info("shard cache: fetched %s into %s", remote, self.tars)
        return fetched


def open_index(url: str, *, cache_dir: str | Path | None = None, max_bytes: int | None = None) -> shards.ShardIndex:
    """The published shard set at ``url``: its index read from a verified local copy, its tars
    through a ShardCache (TRAINYARD_SHARD_CACHE and TRAINYARD_SHARD_CACHE_GB by default)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else paths.shard_cache_dir()
    max_bytes = max_bytes if max_bytes is not None else paths.shard_cache_max_bytes()
    url = url.rstrip("/")
    # The version's name and the URL's digest: two stores may both hold a version called "v1".
    name = f"{url.rsplit('/', 1)[-1]}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"
    local = cache_dir / "sets" / name
    local.parent.mkdir(parents=True, exist_ok=True)
    with content_cache.locked(local.parent / f".{name}.lock"):  # ranks and workers of one machine fetch it once
        index = None
        if local.is_dir():
            try:
                index = shards.read_index(local)
            except (PublishedFileError, shards.ShardIntegrityError, OSError, ValueError) as error:
                LOGGER.warning("shard cache: the cached index of %s does not verify (%s); fetching it again", url, error)
        if index is None:
            objstore.fetch(url, local, only=INDEX_OBJECTS)
            index = shards.read_index(local)
    return dataclasses.replace(index, cache=ShardCache(url=url, directory=str(cache_dir),
                                                       max_bytes=max_bytes))


def read_any_index(location: str | Path) -> shards.ShardIndex:
    """A shard index from a folder (ops.clips.shards.read_index) or from an object-store URL (open_index)."""
    return open_index(str(location)) if objstore.is_remote(location) else shards.read_index(location)


def read_any_index_info(location: str | Path) -> shards.IndexInfo:
    """index.json's facts from a folder (ops.clips.shards.read_index_info), or from a set in an object store
    (its index and plan fetched into the cache and verified: small files, cached for the run)."""
    return open_index(str(location)) if objstore.is_remote(location) else shards.read_index_info(location)
