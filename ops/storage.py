"""Immutable, atomically published directories and files under the data root.

Writers fill a temporary sibling directory and rename it into place, so a reader never sees
a half-written version; an existing version is never overwritten.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's fsync makes renames and new entries in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    for item in sorted(path.rglob("*")):
        if item.is_file():
            with open(item, "rb+") as handle:
                os.fsync(handle.fileno())
    fsync_path(path)


@contextlib.contextmanager
def publish_dir(final: Path) -> Iterator[Path | None]:
    """Yield a temporary directory to fill, then rename it to ``final``.

    Yields None when ``final`` already exists: versions are content-addressed, so an
    existing one holds the same content and is left untouched.
    """
    final = Path(final)
    if final.exists():
        yield None
        return
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        try:
            os.rename(staging, final)
        except OSError:
            if not final.exists():
                raise
            # A concurrent writer published the same content-addressed version first.
        fsync_path(final.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` via temp file, fsync and rename (for mutable ledgers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    with open(staging, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staging, path)
    fsync_path(path.parent)
