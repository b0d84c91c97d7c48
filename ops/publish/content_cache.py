"""A bounded local cache of object-store bytes, named by content (sha256).

Readers that need local random access to objects in a store (the loader's shard tars, PyAV
probing and cutting media) keep them here. A file is named ``<sha256><suffix>``, so the same
bytes reached through two URLs are one file, and its name is what it was checked against:

- ``fetch(url, sha256, suffix)`` downloads an object whose sha256 is known (a shard from its
  index, a media object from its manifest row), checks it, and renames it into place. A copy
  that hashes to anything else raises ``CachedObjectMismatch`` and is never kept.
- ``ingest(url, suffix)`` downloads an object whose sha256 is not known yet (the media scan),
  hashing it on the way, and files it under what it hashed to.
- ``pin(sha256, suffix, folder)`` hard-links a cached file into the caller's folder. Eviction
  then only removes the cache's name; the caller's link keeps the bytes until it deletes its
  folder, so a child process handed the path (a probe, a decoder) never finds it gone.

The cache holds at most ``max_bytes``; after each download the least recently used files go
until the rest fit (a file just fetched stays, so one object larger than the bound still
works). Processes on a machine share one cache: a lock file per object makes one process
download it while the others wait, and a lock file serializes eviction.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ops.publish import objstore

LOGGER = logging.getLogger(__name__)
_CHUNK = 8 << 20
_STATS: dict[str, dict[str, int]] = {}


class CachedObjectMismatch(ValueError):
    """The store's bytes do not hash to the sha256 they were asked for: the object changed."""

    def __init__(self, url: str, expected: str, actual: str) -> None:
        self.url, self.expected, self.actual = url, expected, actual
        super().__init__(f"{url}: sha256 {actual[:12]}... != expected {expected[:12]}...")


def stats(name: str) -> dict[str, int]:
    """This process's counters of the caches called ``name``: hits, misses (downloads), evictions, bytes_fetched.
    DataLoader workers and probe processes count their own."""
    return dict(_counters(name))


def _counters(name: str) -> dict[str, int]:
    return _STATS.setdefault(name, {"hits": 0, "misses": 0, "evictions": 0, "bytes_fetched": 0})


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive fcntl lock on ``path`` (created when missing) for the block."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _suffix_ok(suffix: str) -> str:
    if suffix and (not suffix.startswith(".") or "/" in suffix or len(suffix) > 16):
        raise ValueError(f"a cache suffix is a short extension like '.mp4', got {suffix!r}")
    return suffix


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


_PINS = ".pins"


@dataclass(frozen=True, slots=True)
class ContentCache:
    """Files named by sha256 under ``directory``, at most ``max_bytes`` of them (picklable: a folder and a bound)."""
    directory: str
    max_bytes: int
    name: str = "objects"
    """Whose counters (``stats(name)``) this cache's hits, downloads and evictions go to."""

    @property
    def root(self) -> Path:
        return Path(self.directory)

    def path(self, sha256: str, suffix: str = "") -> Path:
        return self.root / f"{sha256}{_suffix_ok(suffix)}"

    def touch(self, path: Path) -> None:
        """Mark ``path`` most recently used (eviction goes oldest first)."""
        with contextlib.suppress(OSError):
            os.utime(path)

    def fetch(self, url: str, sha256: str, suffix: str = "") -> bool:
        """Make sure the object at ``url``, which must hash to ``sha256``, is cached; whether this call downloaded it.

        Raises CachedObjectMismatch when the store's bytes differ, FileNotFoundError when the object is gone,
        PermissionError when the store refuses it, objstore.ObjectStoreError (naming the URL) when the store fails.
        """
        final = self.path(sha256, suffix)
        self.root.mkdir(parents=True, exist_ok=True)
        with locked(self.root / f".{sha256}.lock"):
            if final.exists():  # cached, or another process fetched it while this one waited
                _counters(self.name)["hits"] += 1
                self.touch(final)
                return False
            partial = self._partial(final)
            try:
                actual, size = self._download(url, partial)
                if actual != sha256:
                    raise CachedObjectMismatch(url, sha256, actual)
                # Not durable.write_file_atomic (bytes held in memory): the download streams into ``partial`` while
                # it is hashed, and this rename only keeps other processes from reading half a download.
                os.replace(partial, final)
            finally:
                partial.unlink(missing_ok=True)
        self._fetched(url, final, size)
        return True

    def ingest(self, url: str, suffix: str = "", *, keep: bool = True) -> tuple[str, int]:
        """Download the object at ``url`` and hash it on the way: (sha256, size). With ``keep`` it is then
        cached under that sha256 (a scan that probes next reads it from here); without, only hashed."""
        self.root.mkdir(parents=True, exist_ok=True)
        partial = self._partial(self.root / "ingest")
        try:
            sha256, size = self._download(url, partial)
            if keep:
                final = self.path(sha256, suffix)
                with locked(self.root / f".{sha256}.lock"):
                    if final.exists():
                        self.touch(final)
                    else:
                        os.replace(partial, final)
                self._fetched(url, final, size)
        finally:
            partial.unlink(missing_ok=True)
        return sha256, size

    @contextlib.contextmanager
    def pins(self) -> Iterator[Path]:
        """A folder of this process's for ``pin`` links, removed (and the links' bytes let go) after the block.
        A process killed inside the block leaves it behind; ``evict`` removes it once the process is gone."""
        folder = self.root / _PINS
        folder.mkdir(parents=True, exist_ok=True)
        mine = Path(tempfile.mkdtemp(prefix=f"{os.getpid()}-", dir=folder))
        try:
            yield mine
        finally:
            shutil.rmtree(mine, ignore_errors=True)

    def pin(self, sha256: str, suffix: str, folder: Path) -> Path:
        """A hard link to the cached ``sha256`` in ``folder`` (it must exist): eviction cannot take it from the
        caller. FileNotFoundError when the cache no longer holds it (fetch it again)."""
        link = Path(folder) / f"{sha256}{_suffix_ok(suffix)}"
        if not link.exists():
            os.link(self.path(sha256, suffix), link)
        return link

    def _partial(self, final: Path) -> Path:
        return final.with_name(f".{final.name}.{os.getpid()}.{os.urandom(4).hex()}.partial")

    @staticmethod
    def _download(url: str, partial: Path) -> tuple[str, int]:
        """Stream ``url`` into ``partial``: (sha256, size) of what was written."""
        fs, path = objstore.shared_filesystem(url)
        digest, size = hashlib.sha256(), 0
        try:
            with fs.open(path, "rb", block_size=_CHUNK) as source, open(partial, "wb") as out:
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
        except (FileNotFoundError, PermissionError):
            raise  # this object's problem: the caller records it
        except Exception as error:  # s3fs and botocore errors: the store failed, name it
            raise objstore.ObjectStoreError(f"fetch {url}: {type(error).__name__}: {error}") from error
        return digest.hexdigest(), size

    def _fetched(self, url: str, final: Path, size: int) -> None:
        counters = _counters(self.name)
        counters["misses"] += 1
        counters["bytes_fetched"] += size
        LOGGER.debug("content cache: fetched %s (%.1f MB) into %s", url, size / 1e6, self.root)
        self.evict(keep=final)

    def evict(self, *, keep: Path | None = None) -> int:
        """Remove the least recently used files until the rest fit ``max_bytes``; how many went."""
        removed = 0
        with locked(self.root / ".evict.lock"):
            self._remove_orphans()
            entries = []
            for path in self.root.iterdir():
                if path.name.startswith("."):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    status = path.stat()
                    entries.append((status.st_mtime_ns, path, status.st_size))
            total = sum(size for _, _, size in entries)
            for _, path, size in sorted(entries):
                if total <= self.max_bytes:
                    break
                if path == keep:
                    continue
                path.unlink(missing_ok=True)
                total -= size
                removed += 1
                _counters(self.name)["evictions"] += 1
                LOGGER.info("content cache: evicted %s (the cache holds at most %.2f GB)", path.name,
                            self.max_bytes / 1e9)
        return removed

    def _remove_orphans(self) -> None:
        """Partial downloads and pin folders of processes that no longer run (killed mid-fetch or mid-read):
        nothing else would ever remove them, and they hold bytes outside the bound."""
        candidates = [(path, path.name.split(".")[-3]) for path in self.root.glob(".*.partial")]
        if (self.root / _PINS).is_dir():
            candidates += [(path, path.name.split("-")[0]) for path in (self.root / _PINS).iterdir()]
        for path, pid in candidates:
            if pid.isdigit() and not _alive(int(pid)):
                LOGGER.info("content cache: removing %s, left by process %s, which is gone", path.name, pid)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    def num_bytes(self) -> int:
        """Bytes of cached files now (not counting in-flight partial files)."""
        total = 0
        for path in self.root.glob("[!.]*"):
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total
