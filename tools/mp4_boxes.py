"""Patch an MP4 in place so its header declares an absurd duration (the demo's decode bomb).

FFmpeg takes the shortest of the header durations (mvhd, mdhd, tkhd), the edit list (elst)
and the sample table (stts), so all of them are stretched; no bytes are added. Box versions 0
(32-bit fields) and 1 (64-bit) are handled. Used only by tools/demo_media.py to make test input.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator


# --- decode bomb: MP4 box patching -------------------------------------------------------

# Body offsets (after the 8-byte box header) of the duration field, by box type and version.
_DURATION_FIELD = {
    "mvhd": {0: (16, ">I"), 1: (24, ">Q")},
    "mdhd": {0: (16, ">I"), 1: (24, ">Q")},
    "tkhd": {0: (20, ">I"), 1: (28, ">Q")},
}
_TIMESCALE_OFFSET = {0: 12, 1: 20}  # mvhd and mdhd


def _children(data: bytes, start: int, end: int) -> Iterator[tuple[str, int, int]]:
    """(type, body start, box end) of each box in data[start:end]."""
    while start + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, start)
        header = 8
        if size == 1:
            size, header = struct.unpack_from(">Q", data, start + 8)[0], 16
        elif size == 0:
            size = end - start
        if size < header or start + size > end:
            raise ValueError(f"corrupt MP4 box {kind!r} at byte {start}")
        yield kind.decode("latin-1"), start + header, start + size
        start += size


def _descend(data: bytes, span: tuple[int, int], *path: str) -> list[tuple[int, int]]:
    """Body spans of every box reached by following `path` from `span`."""
    spans = [span]
    for kind in path:
        spans = [(body, end) for s in spans for k, body, end in _children(data, *s) if k == kind]
    return spans


def _pack(data: bytearray, offset: int, fmt: str, value: int) -> None:
    if not 0 <= value < 1 << (8 * struct.calcsize(fmt)):
        raise ValueError(f"{value} does not fit a {fmt} field; use a smaller duration or timescale")
    struct.pack_into(fmt, data, offset, value)


def _set_header_duration(data: bytearray, kind: str, body: int, duration_s: int, timescale: int) -> None:
    offset, fmt = _DURATION_FIELD[kind][data[body]]
    _pack(data, body + offset, fmt, duration_s * timescale)


def _timescale(data: bytes, body: int) -> int:
    return struct.unpack_from(">I", data, body + _TIMESCALE_OFFSET[data[body]])[0]


def declare_absurd_duration(data: bytearray, duration_s: int) -> None:
    """Rewrite an MP4 in place so it declares `duration_s` seconds, without adding bytes.

    FFmpeg 8 ignores mvhd/tkhd/mdhd when the sample table and edit list disagree
    (it takes the minimum), so the last stts entry, which must hold a single
    sample, and the single edit are stretched too: the last frame lasts ~forever.
    """
    (moov,) = _descend(data, (0, len(data)), "moov")
    (mvhd,) = _descend(data, moov, "mvhd")
    movie_scale = _timescale(data, mvhd[0])
    _set_header_duration(data, "mvhd", mvhd[0], duration_s, movie_scale)
    for trak in _descend(data, moov, "trak"):
        (tkhd,) = _descend(data, trak, "tkhd")
        _set_header_duration(data, "tkhd", tkhd[0], duration_s, movie_scale)
        for elst in _descend(data, trak, "edts", "elst"):
            _stretch_edit(data, elst[0], duration_s * movie_scale)
        (mdhd,) = _descend(data, trak, "mdia", "mdhd")
        media_scale = _timescale(data, mdhd[0])
        _set_header_duration(data, "mdhd", mdhd[0], duration_s, media_scale)
        (stts,) = _descend(data, trak, "mdia", "minf", "stbl", "stts")
        _stretch_last_sample(data, stts[0], duration_s * media_scale)


def _stretch_edit(data: bytearray, body: int, duration: int) -> None:
    version, (count,) = data[body], struct.unpack_from(">I", data, body + 4)
    if count != 1:
        raise ValueError(f"expected one edit list entry, found {count}")
    _pack(data, body + 8, ">Q" if version == 1 else ">I", duration)


def _stretch_last_sample(data: bytearray, body: int, total: int) -> None:
    (count,) = struct.unpack_from(">I", data, body + 4)
    entries = [struct.unpack_from(">II", data, body + 8 + 8 * i) for i in range(count)]
    if not entries or entries[-1][0] != 1:
        raise ValueError("last stts entry must hold one sample; mux with last_frame_periods set")
    before = sum(n * delta for n, delta in entries[:-1])
    _pack(data, body + 8 + 8 * (count - 1) + 4, ">I", total - before)
