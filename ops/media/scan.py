"""Scan a media root: what is there, what it weighs, and what it hashes to.

The listing is the identity of ``raw_media``: its digest is the data version, so unchanged
media give an unchanged version. Paths never leave the root: a symlink (file or folder)
whose target escapes it is listed with ``escapes_root=True`` and never opened.

Nothing under the root stops a scan: a symlink loop, a file or folder that cannot be read, a
FIFO or device, a file that vanishes between listing and hashing, or a name that is not UTF-8
is listed with a reason code (``scan_error``) that the manifest turns into a quarantine row.
A folder that cannot be listed gets one row of its own, so its files are accounted for.

A ``uri`` is the path itself for every name that is valid UTF-8 without a backslash; any other
name is escaped (``printable_uri``: ``\\\\`` for a backslash, ``\\xNN`` for an undecodable byte),
which is injective, so two objects never share a uri. An escaped uri is not the path, so such an
object is ``invalid_filename`` and never opened; should two listed objects still share a uri,
each is ``invalid_filename`` rather than one silently replacing the other.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat as stat_module
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow as pa

from ops import progress
from ops.publish.hashing import digest_json
from ops.curation.reason_codes import CHECKSUM_MISMATCH, MISSING_OBJECT

MEDIA_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi",
                              ".m4a", ".mp3", ".wav", ".ogg", ".opus", ".flac"})
SIDECAR_EXTENSION = ".json"
# Notes that travel with a dataset (provenance, licences): listed, never treated as media.
DOC_EXTENSIONS = frozenset({".md", ".txt", ".pdf"})
# Metadata tables (ops.media.metadata_table) and dataset cards (ops.curation.dataset_card) that travel with the media:
# listed, never probed, never a manifest row of their own.
TABLE_EXTENSIONS = frozenset({".csv", ".tsv", ".parquet"})
CARD_NAME = "dataset_card.yaml"  # ops.curation.dataset_card.CARD_FILE; spelled here so the scan imports no YAML

KIND_MEDIA, KIND_SIDECAR, KIND_DOC, KIND_UNSUPPORTED = "media", "sidecar", "doc", "unsupported"
KIND_TABLE, KIND_CARD = "table", "card"
_CHUNK_BYTES = 1 << 20  # hashing reads, as ops.publish.hashing does

# Reason codes found while scanning (see docs/quarantine.md).
SYMLINK_LOOP = "symlink_loop"
UNREADABLE_PATH = "unreadable_path"
INVALID_FILENAME = "invalid_filename"
# MISSING_OBJECT (it vanished mid-scan) comes from ops.curation.reason_codes, shared with ops.media.probe and
# ops.curation.manifest.

LISTING_SCHEMA = pa.schema([
    ("uri", pa.string()),
    ("kind", pa.string()),
    ("size_bytes", pa.int64()),
    ("sha256", pa.string()),
    ("escapes_root", pa.bool_()),
    ("link_target", pa.string()),
    ("scan_error", pa.string()),
    ("scan_error_detail", pa.string()),
])


@dataclass(kw_only=True, slots=True, frozen=True)
class ListedFile:
    uri: str
    """Path relative to the media root, POSIX separators."""
    kind: str
    size_bytes: int
    sha256: str
    """Empty when the file was not read (escaping symlink)."""
    escapes_root: bool = False
    link_target: str = ""
    scan_error: str = ""
    """Reason code when the path could not be listed or read (never opened further); "" when fine."""
    scan_error_detail: str = ""
    identity: tuple[int, ...] = ()
    """``file_identity`` of the bytes that were hashed (a folder's files only; () for a store's object):
    a later reader (the probe) checks that it opened this very file, unchanged."""


# ---- opening a file under the root: once, no symlink followed, regular files only ----

_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class NotRegularFile(OSError):
    """The path is (now) a symlink, FIFO, socket, device or folder where a regular file was expected."""


class FileChanged(OSError):
    """The file's size, times or inode changed while it was read, or it is not the file listed."""


class FileTooLarge(ValueError):
    """The file is larger than its reader accepts; found from its size before any byte is read."""

    def __init__(self, what: str, size_bytes: int, max_bytes: int) -> None:
        super().__init__(f"{what} is {size_bytes} bytes or more; at most {max_bytes} are read")
        self.size_bytes, self.max_bytes = size_bytes, max_bytes


def file_identity(info: os.stat_result) -> tuple[int, ...]:
    """(device, inode, size, mtime_ns, ctime_ns): any write, replacement or rename-over changes it
    (ctime cannot be set back by the file's owner, unlike mtime)."""
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def open_regular(root: str | Path, relative: str) -> int:
    """A read-only descriptor of the regular file ``relative`` under ``root``, opened once.

    Every part of ``relative`` is opened from its folder's own descriptor with O_NOFOLLOW, so a file
    or folder swapped for a symlink after the listing is refused (NotRegularFile), never followed out
    of the root; O_NONBLOCK makes a FIFO open at once, and fstat refuses it and anything else that is
    not a regular file. The caller closes the descriptor.
    """
    parts = PurePosixPath(relative).parts
    if not parts or PurePosixPath(relative).is_absolute() or any(part in (".", "..") for part in parts):
        raise NotRegularFile(errno.EINVAL, f"{relative!r} is not a relative path under the root")
    folder = os.open(root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        for part in parts[:-1]:
            try:
                inner = os.open(part, _FOLDER_FLAGS, dir_fd=folder)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise NotRegularFile(error.errno, f"{part!r} in {relative!r} is not a folder now "
                                         "(a symlink is never followed)") from error
                raise
            os.close(folder)
            folder = inner
        try:
            descriptor = os.open(parts[-1], _FILE_FLAGS, dir_fd=folder)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise NotRegularFile(error.errno, f"{relative!r} is a symlink now (never followed)") from error
            raise
    finally:
        os.close(folder)
    mode = os.fstat(descriptor).st_mode
    if not stat_module.S_ISREG(mode):
        os.close(descriptor)
        raise NotRegularFile(errno.EINVAL, f"{relative!r} is not a regular file (a FIFO, socket, device or folder); "
                             "opened without blocking and never read")
    return descriptor


def hash_descriptor(descriptor: int) -> tuple[str, tuple[int, ...]]:
    """(sha256, identity) of an open file's bytes; FileChanged when it changed while being read."""
    before = file_identity(os.fstat(descriptor))
    digest = hashlib.sha256()
    os.lseek(descriptor, 0, os.SEEK_SET)
    while chunk := os.read(descriptor, _CHUNK_BYTES):
        digest.update(chunk)
    if file_identity(os.fstat(descriptor)) != before:
        raise FileChanged(errno.EAGAIN, "changed while it was hashed")
    return digest.hexdigest(), before


def read_regular(root: str | Path, relative: str, *, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of ``relative`` under ``root`` (opened as ``open_regular`` does), at most ``max_bytes``.

    The size is checked on the open descriptor before reading, and at most ``max_bytes + 1`` bytes are
    read (a file growing meanwhile is caught too): FileTooLarge names the limit.
    """
    descriptor = open_regular(root, relative)
    try:
        size_bytes = os.fstat(descriptor).st_size
        if size_bytes > max_bytes:
            raise FileTooLarge(what, size_bytes, max_bytes)
        chunks, total = [], 0
        while total <= max_bytes and (chunk := os.read(descriptor, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise FileTooLarge(what, total, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(descriptor)


def classify(uri: str) -> str:
    path = PurePosixPath(uri)
    suffix = path.suffix.lower()
    if path.name == CARD_NAME:
        return KIND_CARD
    if suffix in TABLE_EXTENSIONS:
        return KIND_TABLE
    if suffix in MEDIA_EXTENSIONS:
        return KIND_MEDIA
    if suffix == SIDECAR_EXTENSION:
        return KIND_SIDECAR
    if suffix in DOC_EXTENSIONS:
        return KIND_DOC
    return KIND_UNSUPPORTED


def resolve_inside(root: Path, uri: str) -> Path | None:
    """Absolute path of ``uri`` under ``root`` after resolving symlinks and '..', or None if it escapes."""
    root = root.resolve()
    candidate = (root / uri).resolve()
    return candidate if candidate.is_relative_to(root) else None


def printable_uri(uri: str) -> str:
    """``uri`` as valid UTF-8, escaped injectively: a backslash becomes ``\\\\`` and a byte that is
    not UTF-8 (surrogate-escaped by os) ``\\xNN``. Escaping the backslash too is what keeps a real
    0xFF byte and a name literally spelled ``\\xff`` apart; names without either are unchanged."""
    escaped = uri.replace("\\", "\\\\")
    return escaped.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def name_problem(name: str) -> str:
    """Why ``name`` cannot be a uri as it stands ("" when it can): the detail of its invalid_filename."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return (f"name {printable_uri(name)!r} is not valid UTF-8; rename it "
                "(nothing under a folder with such a name is read)")
    if "\\" in name:
        # The uri escapes the backslash, so it is not the path every later stage opens; and a
        # backslash is a separator on Windows and in many object-store tools.
        return (f"name {printable_uri(name)!r} contains a backslash, escaped as \\\\ in its uri; rename it "
                "(nothing under a folder with such a name is read)")
    return ""


@dataclass(kw_only=True, slots=True, frozen=True)
class _Found:
    uri: str
    path: Path
    error: str = ""
    detail: str = ""


def _problem(root: Path, path: Path, code: str, detail: str) -> _Found:
    return _Found(uri=printable_uri(path.relative_to(root).as_posix()), path=path, error=code, detail=detail)


def _os_error_code(error: OSError) -> str:
    if error.errno == errno.ELOOP:
        return SYMLINK_LOOP
    return MISSING_OBJECT if isinstance(error, FileNotFoundError) else UNREADABLE_PATH


def _list_dir(root: Path, directory: Path) -> tuple[list[os.DirEntry], _Found | None]:
    try:
        with os.scandir(directory) as entries:
            return sorted(entries, key=lambda entry: entry.name), None
    except OSError as error:
        if directory == root:
            raise
        detail = f"folder cannot be listed, so nothing under it is read: {type(error).__name__}: {error}"
        return [], _problem(root, directory, _os_error_code(error), detail)


def _walk(root: Path) -> Iterator[_Found]:
    """Every file and symlink under root: a folder's own files first, then its subfolders, sorted.

    Hidden names are skipped. Symlinked folders are not descended into (cycles); they are listed
    like files so an escaping one is quarantined rather than silently skipped.
    """
    entries, _ = _list_dir(root, root)  # an unlistable root raises: there is nothing to build from
    yield from _walk_entries(root, entries)


def _walk_entries(root: Path, entries: list[os.DirEntry]) -> Iterator[_Found]:
    subdirs = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        path = Path(entry.path)
        if problem := name_problem(entry.name):
            yield _problem(root, path, INVALID_FILENAME, problem)
            continue
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError as error:
            yield _problem(root, path, _os_error_code(error), f"cannot stat: {type(error).__name__}: {error}")
            continue
        if is_dir:
            subdirs.append(path)
        else:
            yield _Found(uri=path.relative_to(root).as_posix(), path=path)
    for directory in subdirs:
        entries, problem = _list_dir(root, directory)
        if problem is not None:
            yield problem
        yield from _walk_entries(root, entries)


def _resolve(root: Path, uri: str) -> tuple[Path | None, str, str]:
    """(target inside root or None, error code, detail) for ``uri``, loops and unreadable links included."""
    try:
        return resolve_inside(root, uri), "", ""
    except RuntimeError as error:  # Python < 3.13 reports a symlink loop this way
        return None, SYMLINK_LOOP, f"{error}; never opened"
    except OSError as error:
        return None, _os_error_code(error), f"cannot resolve: {type(error).__name__}: {error}"


def _list_one(root: Path, found: _Found, with_checksums: bool) -> ListedFile:
    uri, path = found.uri, found.path
    kind = classify(uri)
    if found.error:
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", scan_error=found.error,
                          scan_error_detail=found.detail)
    try:
        link_target = os.readlink(path) if path.is_symlink() else ""
    except OSError as error:  # vanished or replaced between listing and now
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", scan_error=_os_error_code(error),
                          scan_error_detail=f"vanished during the scan: {error}")
    target, code, detail = _resolve(root, uri)
    if code:
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", link_target=link_target,
                          scan_error=code, scan_error_detail=detail)
    if target is None or (link_target and not target.is_file()):
        # Escaping or dangling links and linked folders are never opened.
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", escapes_root=target is None,
                          link_target=link_target)
    real_root = root.resolve()
    try:
        # Opened once (no link followed, regular files only) and hashed from that descriptor: the
        # identity recorded here is what the probe checks it opened (ops.media.probe).
        descriptor = open_regular(real_root, target.relative_to(real_root).as_posix())
    except NotRegularFile as error:
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", link_target=link_target,
                          scan_error=UNREADABLE_PATH, scan_error_detail=f"{error.strerror}")
    except OSError as error:
        what = "vanished during the scan" if isinstance(error, FileNotFoundError) else "cannot be read"
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", link_target=link_target,
                          scan_error=_os_error_code(error), scan_error_detail=f"{what}: {type(error).__name__}: {error}")
    try:
        if with_checksums:
            sha256, identity = hash_descriptor(descriptor)
        else:
            sha256, identity = "", file_identity(os.fstat(descriptor))
    except FileChanged as error:
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", link_target=link_target,
                          scan_error=CHECKSUM_MISMATCH, scan_error_detail=f"{error.strerror}; scan again")
    except OSError as error:
        return ListedFile(uri=uri, kind=kind, size_bytes=0, sha256="", link_target=link_target,
                          scan_error=_os_error_code(error), scan_error_detail=f"cannot be read: {type(error).__name__}: {error}")
    finally:
        os.close(descriptor)
    return ListedFile(uri=uri, kind=kind, size_bytes=identity[2], sha256=sha256, link_target=link_target,
                      identity=identity)


def scan_media_root(root: str | Path, *, with_checksums: bool = True) -> list[ListedFile]:
    """List every file under ``root`` in path order; problems become ``scan_error`` entries, never exceptions."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"media root {root} does not exist or is not a directory")
    found = list(_walk(root))
    with progress.task("scanning", len(found), unit="files") as bar:
        listed = []
        for item in found:
            listed.append(_list_one(root, item, with_checksums))
            bar.advance()
    return mark_uri_collisions(listed)


def mark_uri_collisions(listed: list[ListedFile]) -> list[ListedFile]:
    """``listed`` with every entry whose uri another entry shares turned into invalid_filename.

    The escape makes this impossible for names read from one folder tree; it stays as the guard that
    turns any residual collision into one recorded row per object instead of a dict keeping one.
    """
    counts: dict[str, int] = {}
    for item in listed:
        counts[item.uri] = counts.get(item.uri, 0) + 1
    return [item if counts[item.uri] == 1 else
            ListedFile(uri=item.uri, kind=item.kind, size_bytes=0, sha256="", link_target=item.link_target,
                       scan_error=INVALID_FILENAME,
                       scan_error_detail=f"{counts[item.uri]} objects share the uri {item.uri!r}; rename them "
                                         "(none is opened, so none hides another)")
            for item in listed]


def listing_table(listed: list[ListedFile]) -> pa.Table:
    return pa.Table.from_pylist([
        {name: getattr(item, name) for name in LISTING_SCHEMA.names} for item in listed
    ], schema=LISTING_SCHEMA)


def listing_version(listed: list[ListedFile]) -> str:
    """Data version of a listing: digest of (uri, size, checksum, link) for every file, and scan errors."""
    # Error-free entries hash as before, so a clean media root keeps its version.
    return digest_json([[f.uri, f.size_bytes, f.sha256, f.escapes_root, f.link_target]
                        + ([f.scan_error] if f.scan_error else []) for f in listed])[:24]


def quick_fingerprint(root: str | Path) -> str:
    """Cheap change detector for sensors: (path, size, mtime_ns) of every file, no reads."""
    root = Path(root)
    entries = []
    for found in _walk(root):
        try:
            info = found.path.lstat()
            entries.append([found.uri, info.st_size, info.st_mtime_ns] + ([found.error] if found.error else []))
        except OSError as error:  # gone since listing: a change the next scan records
            entries.append([found.uri, type(error).__name__])
    return digest_json(entries)[:24]
