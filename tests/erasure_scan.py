"""A byte scan for an erased asset's content (issue 37): every file under the given roots, tar members
included, decoded where it is media, compared with the hashes of frames only that asset's clips hold.

A clip's frames decode to the same bytes from every copy of the clip (a tar in the data root, its hard
link in a successor, the shard cache's copy, the store's object), so sha256 of each decoded frame finds
a copy whatever its name; frames that another asset's clips also hold are left out of the targets.
Files whose sha256 is the asset id (the source media, a media-cache copy) are hits too."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import av
import numpy as np

MEDIA = (".mkv", ".mp4", ".webm", ".mov")


def _frames(data: bytes) -> list[bytes]:
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                return []
            return [frame.to_ndarray(format="rgb24").tobytes() for frame in container.decode(video=0)]
    except (av.error.FFmpegError, ValueError):
        return []


def _npy_frames(data: bytes) -> list[bytes]:
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError:
        return []
    return [frame.tobytes() for frame in array] if array.ndim == 4 else []


def member_frames(name: str, data: bytes) -> list[bytes]:
    if name.endswith(".video.npy"):
        return _npy_frames(data)
    if name.endswith(MEDIA):
        return _frames(data)
    return []


def clip_frame_hashes(tar_path: Path) -> dict[str, set[str]]:
    """sample key prefix (asset id[:16]) -> sha256 of every decoded frame of that asset's clips in a shard."""
    found: dict[str, set[str]] = {}
    with tarfile.open(tar_path) as archive:
        for member in archive:
            if member.isfile():
                frames = member_frames(member.name, archive.extractfile(member).read())
                found.setdefault(member.name[:16], set()).update(hashlib.sha256(frame).hexdigest() for frame in frames)
    return found


def scan(roots: list[Path], frame_hashes: set[str], asset_id: str) -> list[str]:
    """Where under ``roots`` the content is: 'path' or 'path!member' for each hit."""
    hits = []
    for root in roots:
        for path in sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink()):
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == asset_id:
                hits.append(str(path))
                continue
            if data[257:262] == b"ustar":
                with tarfile.open(fileobj=io.BytesIO(data)) as archive:
                    for member in archive:
                        if member.isfile() and _hit(member_frames(member.name, archive.extractfile(member).read()),
                                                    frame_hashes):
                            hits.append(f"{path}!{member.name}")
            elif path.suffix in MEDIA and _hit(_frames(data), frame_hashes):
                hits.append(str(path))
    return hits


def _hit(frames: list[bytes], hashes: set[str]) -> bool:
    return any(hashlib.sha256(frame).hexdigest() in hashes for frame in frames)
