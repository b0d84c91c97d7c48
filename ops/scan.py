"""Scan a media root: what is there, what it weighs, and what it hashes to.

The listing is the identity of ``raw_media``: its digest is the data version, so unchanged
media give an unchanged version. Paths never leave the root: a symlink (file or folder)
whose target escapes it is listed with ``escapes_root=True`` and never opened.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pyarrow as pa

from ops.hashing import digest_json, sha256_file

MEDIA_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi",
                              ".m4a", ".mp3", ".wav", ".ogg", ".opus", ".flac"})
SIDECAR_EXTENSION = ".json"
# Notes that travel with a dataset (provenance, licences): listed, never treated as media.
DOC_EXTENSIONS = frozenset({".md", ".txt", ".pdf"})

KIND_MEDIA, KIND_SIDECAR, KIND_DOC, KIND_UNSUPPORTED = "media", "sidecar", "doc", "unsupported"

LISTING_SCHEMA = pa.schema([
    ("uri", pa.string()),
    ("kind", pa.string()),
    ("size_bytes", pa.int64()),
    ("sha256", pa.string()),
    ("escapes_root", pa.bool_()),
    ("link_target", pa.string()),
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


def classify(uri: str) -> str:
    suffix = PurePosixPath(uri).suffix.lower()
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


def _walk(root: Path):
    """Yield (uri, path) for every file and symlink under root, sorted, hidden names skipped."""
    for directory, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(name for name in dirnames if not name.startswith("."))
        base = Path(directory)
        # Symlinked folders are not descended into (cycles); they are listed like files so
        # an escaping one is quarantined rather than silently skipped.
        linked_dirs = [name for name in dirnames if (base / name).is_symlink()]
        dirnames[:] = [name for name in dirnames if name not in linked_dirs]
        for name in sorted(filenames + linked_dirs):
            if not name.startswith("."):
                path = base / name
                yield path.relative_to(root).as_posix(), path


def scan_media_root(root: str | Path, *, with_checksums: bool = True) -> list[ListedFile]:
    """List every file under ``root`` in path order."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"media root {root} does not exist or is not a directory")
    listed = []
    for uri, path in _walk(root):
        target = resolve_inside(root, uri)
        link_target = os.readlink(path) if path.is_symlink() else ""
        if target is None or not target.is_file():
            # Escaping or dangling links and linked folders are never opened.
            listed.append(ListedFile(uri=uri, kind=classify(uri), size_bytes=0, sha256="",
                                     escapes_root=target is None, link_target=link_target))
            continue
        listed.append(ListedFile(uri=uri, kind=classify(uri), size_bytes=target.stat().st_size,
                                 sha256=sha256_file(target) if with_checksums else "",
                                 link_target=link_target))
    return listed


def listing_table(listed: list[ListedFile]) -> pa.Table:
    return pa.Table.from_pylist([
        {name: getattr(item, name) for name in LISTING_SCHEMA.names} for item in listed
    ], schema=LISTING_SCHEMA)


def listing_version(listed: list[ListedFile]) -> str:
    """Data version of a listing: digest of (uri, size, checksum, link) for every file."""
    return digest_json([[f.uri, f.size_bytes, f.sha256, f.escapes_root, f.link_target] for f in listed])[:24]


def quick_fingerprint(root: str | Path) -> str:
    """Cheap change detector for sensors: (path, size, mtime_ns) of every file, no reads."""
    root = Path(root)
    entries = []
    for uri, path in _walk(root):
        stat = path.lstat()
        entries.append([uri, stat.st_size, stat.st_mtime_ns])
    return digest_json(entries)[:24]
