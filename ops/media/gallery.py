"""Galleries of generated samples: the contact sheet (a row of frames per sample), and reading a
sample MP4's frames back (an erasure regenerates a sheet without the samples it deleted:
ops/curation/erasure.py). The trainer writes both (trainer/heldout.py)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np

CONTACT_FRAMES = 8
"""Columns of the contact sheet."""


def contact_sheet(rows: Sequence[np.ndarray], *, columns: int = CONTACT_FRAMES, gap: int = 2) -> bytes:
    """PNG bytes: one row per sample, up to `columns` frames evenly spaced over its time."""
    from PIL import Image

    height = max(frames.shape[1] for frames in rows)
    width = max(frames.shape[2] for frames in rows)
    shown = min(columns, max(frames.shape[0] for frames in rows))
    canvas = np.full((len(rows) * (height + gap) + gap, shown * (width + gap) + gap, 3), 255, dtype=np.uint8)
    for row, frames in enumerate(rows):
        picks = np.linspace(0, frames.shape[0] - 1, num=min(shown, frames.shape[0])).round().astype(int)
        for column, index in enumerate(picks):
            top, left = gap + row * (height + gap), gap + column * (width + gap)
            canvas[top:top + frames.shape[1], left:left + frames.shape[2]] = frames[index]
    buffer = io.BytesIO()
    Image.fromarray(canvas).save(buffer, format="PNG")
    return buffer.getvalue()


def mp4_frames(path: str | Path) -> np.ndarray:
    """Every video frame of an MP4 as uint8 [T, H, W, 3] (PyAV)."""
    import av

    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    if not frames:
        raise ValueError(f"{path}: no video frame")
    return np.stack(frames)
