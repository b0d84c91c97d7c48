"""Media roots in a folder or in an object store, read the same way.

``open_root(location)`` gives the reader for a media root: a folder path (``LocalMediaRoot``,
ops.media.scan's walk, unchanged) or an object-store URL such as ``s3://bucket/media``
(``ObjectMediaRoot``, through fsspec). Every stage that touches media goes through it: the
scan (``raw_media``, the manifest), probes and sidecars (ops.curation.manifest), the object recheck at
validation, cutting clips (ops.clips.shards), the naive loader of the benchmark, and the media-change
sensor. Both give the same listing rows, so the manifest, its reason codes and everything
downstream are the same code.

In a store, bytes are read through a bounded local cache named by content
(ops.publish.content_cache, ``TRAINYARD_MEDIA_CACHE``, at most ``TRAINYARD_MEDIA_CACHE_GB``):

- The scan streams every object once, hashing it on the way; media and sidecars stay cached
  under their sha256, so the probes that follow read local files (the "local cache" way of
  probing; PyAV's demuxer seeks too often for ranged reads to pay).
- ``local_files`` hands a caller local paths for (uri, sha256) pairs. Each is fetched when the
  cache lacks it and checked against the sha256 the caller knows (the listing's, or the clip
  plan's asset id), then hard-linked into a folder of the caller's, so eviction cannot take it
  while a probe or a decoder reads it. An object that changed since it was listed is
  ``checksum_mismatch`` and one that is gone ``missing_object``: never the new bytes under the
  old checksum (a local folder has that window; a store's copy here does not).

What a key can be differs from a file name, so the listing says how each maps:
- keys under a hidden part (``.partial/``, ``.upload.mp4``) are skipped, as hidden files are;
- folder placeholders (``dir/``, zero bytes) are no objects;
- a key with an empty, ``.`` or ``..`` part, or a backslash, is ``invalid_filename`` and never
  read (it cannot be a relative path under the root).

A store that fails (unreachable, refused credentials, a missing bucket) raises
``objstore.ObjectStoreError`` naming the URL and the variable: a scan never turns an outage
into a quarantine of everything. One object that vanishes or is refused mid-scan is a row with
its reason, as in a folder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as stat_module
import urllib.parse
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from ops.publish import content_cache, objstore, paths
from ops import progress
from ops.media import scan
from ops.publish.hashing import digest_json, sha256_file
from ops.curation.reason_codes import CHECKSUM_MISMATCH, MISSING_OBJECT

LOGGER = logging.getLogger(__name__)
_CACHED_KINDS = (scan.KIND_MEDIA, scan.KIND_SIDECAR)  # read again after the scan (probe, cut, parse)
_SCAN_THREADS = 4
CACHE_NAME = "media"


@dataclass(slots=True)
class LocalFiles:
    """Local paths for the objects a caller asked for, and why the others have none."""
    paths: dict[str, Path] = field(default_factory=dict)
    problems: dict[str, tuple[str, str]] = field(default_factory=dict)
    """uri -> (reason code, detail) for an object that could not be provided."""


class MediaRoot(Protocol):
    location: str
    """What manifests record as ``media_root``: an absolute folder path or a URL without a trailing slash."""

    def scan(self, *, with_checksums: bool = True) -> list[scan.ListedFile]: ...
    def fingerprint(self) -> str | None:
        """A cheap change detector (no reads); None when the root does not exist (a prefix: holds no object)."""

    def exists(self) -> bool: ...
    def local_files(self, wanted: Iterable[tuple[str, str]]) -> contextlib.AbstractContextManager[LocalFiles]: ...
    def check(self, uri: str, size_bytes: int, sha256: str, *, rehash: bool) -> tuple[str, str] | None: ...


def open_root(location: str | os.PathLike) -> LocalMediaRoot | ObjectMediaRoot:
    """The reader for the media root at ``location`` (a folder, or an object-store URL)."""
    if objstore.is_remote(location):
        parts = urllib.parse.urlsplit(str(location))
        if parts.username or parts.password:  # it would be recorded in every manifest, listing and log line
            raise ValueError(f"media root {parts.scheme}://***@{parts.hostname}{parts.path}: credentials do not "
                             "belong in the URL; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
        return ObjectMediaRoot(str(location).rstrip("/"))
    text = str(location)
    return LocalMediaRoot(str(Path(text[len("file://"):] if text.startswith("file://") else text).resolve()))


@dataclass(frozen=True, slots=True)
class LocalMediaRoot:
    """A folder: ops.media.scan's walk, files read where they are."""
    location: str

    @property
    def root(self) -> Path:
        return Path(self.location)

    def scan(self, *, with_checksums: bool = True) -> list[scan.ListedFile]:
        return scan.scan_media_root(self.root, with_checksums=with_checksums)

    def fingerprint(self) -> str | None:
        return scan.quick_fingerprint(self.root) if self.root.is_dir() else None

    def exists(self) -> bool:
        return self.root.is_dir()

    @contextlib.contextmanager
    def local_files(self, wanted: Iterable[tuple[str, str]]) -> Iterator[LocalFiles]:
        # The files themselves: their readers (the probe, the decoder) report what is wrong with them.
        yield LocalFiles(paths={uri: self.root / uri for uri, _ in wanted})

    def check(self, uri: str, size_bytes: int, sha256: str, *, rehash: bool) -> tuple[str, str] | None:
        path = self.root / uri
        if not path.is_file():
            return MISSING_OBJECT, f"{uri} no longer exists under {self.location}"
        if os.path.getsize(path) != size_bytes or (rehash and sha256_file(path) != sha256):
            return CHECKSUM_MISMATCH, f"{uri} changed after manifest was built"
        return None


def media_cache() -> content_cache.ContentCache:
    return content_cache.ContentCache(str(paths.media_cache_dir()), paths.media_cache_max_bytes(), CACHE_NAME)


@dataclass(frozen=True, slots=True)
class ObjectMediaRoot:
    """A prefix in an object store (``s3://bucket/prefix``), read through fsspec and the media cache."""
    location: str

    @property
    def cache(self) -> content_cache.ContentCache:
        return media_cache()

    def _url(self, uri: str) -> str:
        return objstore.join(self.location, uri)

    def _list(self) -> list[tuple[str, dict]]:
        """(relative key, fsspec info) of every object under the root, sorted by key."""
        fs, root = objstore.shared_filesystem(self.location)
        try:
            with objstore.store_errors("list", self.location):
                _require_bucket(fs, self.location)
                found = fs.find(root, detail=True, withdirs=False)
        except objstore.ObjectStoreError as error:
            raise objstore.ObjectStoreError(
                f"{error} (the media root TRAINYARD_MEDIA_ROOT; the store TRAINYARD_S3_ENDPOINT_URL with "
                "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)") from error
        listed = []
        for key, info in found.items():
            relative = key[len(root):].lstrip("/") if key.startswith(root) else key
            if info.get("type") == "directory" or key.endswith("/") or not relative:
                continue  # a folder placeholder, not an object
            listed.append((relative, info))
        return sorted(listed)

    def exists(self) -> bool:
        return bool(self._list())

    def scan(self, *, with_checksums: bool = True) -> list[scan.ListedFile]:
        listed = self._list()
        if not listed:
            raise FileNotFoundError(f"media root {self.location} holds no objects (an empty or misspelled prefix? "
                                    "TRAINYARD_MEDIA_ROOT)")
        visible = [(relative, info) for relative, info in listed if not _hidden(relative)]
        with ThreadPoolExecutor(_SCAN_THREADS) as pool, \
                progress.task("scanning", len(visible), unit="objects") as bar:  # one round trip or more each
            rows = []
            for row in pool.map(lambda item: self._list_one(*item, with_checksums), visible):
                rows.append(row)
                bar.advance()
        return scan.mark_uri_collisions(rows)

    def _list_one(self, relative: str, info: dict, with_checksums: bool) -> scan.ListedFile:
        uri, kind = scan.printable_uri(relative), scan.classify(relative)
        if problem := _key_problem(relative):
            return scan.ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", scan_error=scan.INVALID_FILENAME,
                                   scan_error_detail=problem)
        if not with_checksums:
            return scan.ListedFile(uri=uri, kind=kind, size_bytes=int(info.get("size") or 0), sha256="")
        try:
            sha256, size = self.cache.ingest(self._url(relative), _suffix(relative), keep=kind in _CACHED_KINDS)
        except FileNotFoundError as error:
            return scan.ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", scan_error=MISSING_OBJECT,
                                   scan_error_detail=f"vanished during the scan: {error}")
        except PermissionError as error:
            return scan.ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", scan_error=scan.UNREADABLE_PATH,
                                   scan_error_detail=f"the store refuses to read it: {type(error).__name__}: {error}")
        return scan.ListedFile(uri=uri, kind=kind, size_bytes=size, sha256=sha256)

    def fingerprint(self) -> str | None:
        """(key, size, ETag or modification time) of every visible object, from one listing and no reads;
        None when the prefix holds no object."""
        listed = self._list()
        if not listed:
            return None
        return digest_json([[relative, info.get("size"), info.get("ETag") or str(info.get("LastModified", ""))]
                            for relative, info in listed if not _hidden(relative)])[:24]

    @contextlib.contextmanager
    def local_files(self, wanted: Iterable[tuple[str, str]]) -> Iterator[LocalFiles]:
        """Local, pinned copies of (uri, sha256) objects for the block; each checked against its sha256."""
        cache = self.cache
        with cache.pins() as folder:
            result = LocalFiles()
            for uri, sha256 in wanted:
                try:
                    result.paths[uri] = self._pinned(cache, uri, sha256, folder)
                except (FileNotFoundError, PermissionError, content_cache.CachedObjectMismatch) as error:
                    result.problems[uri] = self._problem(uri, error)
            yield result

    def _pinned(self, cache: content_cache.ContentCache, uri: str, sha256: str, folder: Path) -> Path:
        suffix = _suffix(uri)
        for _ in range(3):
            fetched = cache.fetch(self._url(uri), sha256, suffix)
            try:  # evicted by another process between fetch and link: fetch again
                link = cache.pin(sha256, suffix, folder)
            except FileNotFoundError:
                continue
            # A copy cached earlier is read again before use: a file named by its content may still have been
            # edited or damaged on disk since it was checked. Dropped and fetched again when it was.
            if fetched or sha256_file(link) == sha256:
                return link
            LOGGER.warning("media cache: %s no longer hashes to its name; fetching %s again", link.name, uri)
            link.unlink()
            cache.path(sha256, suffix).unlink(missing_ok=True)
        raise PermissionError(f"the media cache {cache.directory} evicted {uri} three times before it could be used: "
                              f"it is too small ({paths.MEDIA_CACHE_GB_VARIABLE})")

    def _problem(self, uri: str, error: Exception) -> tuple[str, str]:
        if isinstance(error, FileNotFoundError):
            return MISSING_OBJECT, f"{uri} no longer exists under {self.location}"
        if isinstance(error, content_cache.CachedObjectMismatch):
            return CHECKSUM_MISMATCH, (f"{uri} changed after it was listed: the store's bytes hash to "
                                       f"{error.actual[:12]}..., not {error.expected[:12]}...")
        return scan.UNREADABLE_PATH, f"{uri} cannot be read from the store: {type(error).__name__}: {error}"

    def check(self, uri: str, size_bytes: int, sha256: str, *, rehash: bool) -> tuple[str, str] | None:
        fs, path = objstore.shared_filesystem(self._url(uri))
        try:
            with objstore.store_errors("stat", self._url(uri)):
                size = fs.info(path)["size"]
        except FileNotFoundError:
            return MISSING_OBJECT, f"{uri} no longer exists under {self.location}"
        if size != size_bytes:
            return CHECKSUM_MISMATCH, f"{uri} changed after manifest was built"
        if rehash:  # the store's bytes now, read again: a cached copy says only what they were
            try:
                actual, _ = self.cache.ingest(self._url(uri), keep=False)
            except FileNotFoundError:
                return MISSING_OBJECT, f"{uri} no longer exists under {self.location}"
            except PermissionError as error:
                return self._problem(uri, error)
            if actual != sha256:
                return CHECKSUM_MISMATCH, f"{uri} changed after manifest was built"
        return None


def _hidden(relative: str) -> bool:
    return any(part.startswith(".") and part not in (".", "..") for part in relative.split("/"))


def _key_problem(relative: str) -> str:
    """Why the key cannot be a uri under the root ("" when it can): the detail of its invalid_filename."""
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return (f"key {relative!r} has an empty, '.' or '..' part: it is no relative path under the media root; "
                "rename it (never read)")
    return next((problem for problem in map(scan.name_problem, parts) if problem), "")


def _suffix(uri: str) -> str:
    suffix = PurePosixPath(uri).suffix.lower()
    return suffix if 1 < len(suffix) <= 16 and suffix[1:].isalnum() else ""


def _require_bucket(fs, url: str) -> None:
    try:
        objstore.require_bucket(fs, url)
    except objstore.ObjectStoreError as error:
        raise objstore.ObjectStoreError(f"{error} (the media root: TRAINYARD_MEDIA_ROOT)") from None


def upload_folder(local_dir: str | Path, url: str) -> tuple[int, list[str]]:
    """Copy the regular files under ``local_dir`` to the media root ``url`` (the demo media, a test's tree):
    (number uploaded, relative paths left out because an object store cannot hold them: links, FIFOs,
    names that are not UTF-8)."""
    local_dir = Path(local_dir)
    fs, root = objstore.filesystem(url)
    uploaded, left_out = 0, []
    with objstore.store_errors("upload to", url):
        _require_bucket(fs, url)
        # os.walk: never into a linked folder (a loop), and an unreadable folder is reported, not raised.
        for folder, subfolders, files in os.walk(local_dir, onerror=lambda error: left_out.append(str(error))):
            subfolders.sort()
            for name in sorted(files):
                path = Path(folder) / name
                relative = path.relative_to(local_dir).as_posix()
                if not stat_module.S_ISREG(path.lstat().st_mode) or scan.name_problem(relative):
                    left_out.append(scan.printable_uri(relative))
                    continue
                fs.put_file(str(path), f"{root}/{relative}")
                uploaded += 1
    return uploaded, left_out
