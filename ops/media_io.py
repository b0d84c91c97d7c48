"""Decode and encode clips with PyAV: the one place that touches codecs for shards and loading.

Resizing happens inside FFmpeg (libswscale, through ``VideoFrame.reformat``) on the frames
that are kept, never in Python; the centre crop after a cover-scale is a numpy view. Frame-rate
conversion picks, for each target time, the newest source frame at or before it, so the
result depends only on the source timestamps.

Thread settings: ``thread_count=1`` per decoder. Loader workers are processes, one per core;
``benchmarks/loader.py`` measured FFmpeg's own frame threads on top of that as a loss on small
clips (thread start-up and hand-off cost more than the decode), see docs/data.md.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import av
import numpy as np

# Bit-exact muxing and single-threaded x264 make shard bytes reproducible across machines.
MUXER_OPTIONS = {"fflags": "+bitexact"}
X264_OPTIONS = {"threads": "1", "preset": "veryfast", "crf": "18", "tune": "fastdecode"}
_TIME_EPSILON_S = 1e-6


class ClipDecodeError(ValueError):
    """Clip bytes or a source segment could not be decoded into the expected shape."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ClipShape:
    num_frames: int
    fps: float
    width: int
    height: int
    audio_rate: int
    """Mono PCM sample rate of the clip's audio track."""

    def __post_init__(self) -> None:
        if self.num_frames < 1 or self.fps <= 0 or self.audio_rate < 1:
            raise ValueError(f"clip shape needs num_frames >= 1, fps > 0, audio_rate >= 1: {self}")
        if self.width < 2 or self.height < 2 or self.width % 2 or self.height % 2:
            raise ValueError(f"clip width and height must be even and >= 2 (H.264 4:2:0), got {self.width}x{self.height}")

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps

    @property
    def num_audio_samples(self) -> int:
        return int(round(self.duration_s * self.audio_rate))


def _cover_size(src_w: int, src_h: int, width: int, height: int) -> tuple[int, int]:
    """Smallest size with the source aspect that covers width x height."""
    scale = max(width / src_w, height / src_h)
    return max(width, round(src_w * scale)), max(height, round(src_h * scale))


def _to_rgb(frame: av.VideoFrame, shape: ClipShape) -> np.ndarray:
    cover_w, cover_h = _cover_size(frame.width, frame.height, shape.width, shape.height)
    rgb = frame.reformat(width=cover_w, height=cover_h, format="rgb24", interpolation="AREA").to_ndarray()
    top, left = (cover_h - shape.height) // 2, (cover_w - shape.width) // 2
    return rgb[top:top + shape.height, left:left + shape.width]


def decode_source_video(path: str, starts_s: list[float], shape: ClipShape) -> list[np.ndarray]:
    """Frames [T, H, W, 3] uint8 for each clip start, in one decoding pass over the source."""
    targets = sorted((start + k / shape.fps, clip, k) for clip, start in enumerate(starts_s)
                     for k in range(shape.num_frames))
    clips = [np.empty((shape.num_frames, shape.height, shape.width, 3), np.uint8) for _ in starts_s]
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_count = 1
        container.seek(int(min(starts_s) / stream.time_base), stream=stream, backward=True)
        position, previous = 0, None  # previous: (time, frame, converted or None)
        for frame in container.decode(stream):
            if frame.time is None:
                continue
            while position < len(targets) and frame.time > targets[position][0] + _TIME_EPSILON_S:
                previous = _emit(previous or (frame.time, frame, None), targets[position], clips, shape)
                position += 1
            if position == len(targets):
                break
            previous = (frame.time, frame, None)
        if previous is None:
            raise ClipDecodeError(f"{path}: no video frame decoded after {min(starts_s):.3f} s")
        while position < len(targets):  # the source ended: hold its last frame
            previous = _emit(previous, targets[position], clips, shape)
            position += 1
    return clips


def _emit(previous, target, clips, shape):
    """Write ``previous`` frame into its target slot, converting it once however often it repeats."""
    time_s, frame, rgb = previous
    if rgb is None:
        rgb = _to_rgb(frame, shape)
    _, clip, index = target
    clips[clip][index] = rgb
    return time_s, frame, rgb


def decode_source_audio(path: str, starts_s: list[float], shape: ClipShape) -> list[np.ndarray] | None:
    """Mono float32 PCM [num_audio_samples] per clip start, or None when the source has no audio."""
    with av.open(path) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=shape.audio_rate)
        end_s = max(starts_s) + shape.duration_s
        container.seek(int(min(starts_s) / stream.time_base), stream=stream, backward=True)
        chunks, first_time = [], None
        for frame in container.decode(stream):
            if frame.time is None:
                continue
            first_time = frame.time if first_time is None else first_time
            chunks.extend(out.to_ndarray()[0] for out in resampler.resample(frame))
            if frame.time > end_s:
                break
        chunks.extend(out.to_ndarray()[0] for out in resampler.resample(None))
    pcm = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    first_time = first_time or 0.0
    clips = []
    for start in starts_s:
        offset = int(round((start - first_time) * shape.audio_rate))
        segment = pcm[max(offset, 0):max(offset, 0) + shape.num_audio_samples]
        clips.append(np.pad(segment, (0, shape.num_audio_samples - len(segment))).astype(np.float32))
    return clips


def encode_video(frames: np.ndarray, fps: float) -> bytes:
    """H.264 MP4 bytes of uint8 frames [T, H, W, 3] (yuv420p), reproducible byte for byte."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4", options=dict(MUXER_OPTIONS)) as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        stream.options = dict(X264_OPTIONS)
        for array in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def encode_audio(pcm: np.ndarray, rate: int) -> bytes:
    """Lossless FLAC bytes of mono float PCM (stored as 16-bit)."""
    buffer = io.BytesIO()
    samples = np.clip(np.round(pcm * 32767), -32768, 32767).astype(np.int16)
    with av.open(buffer, "w", format="flac", options=dict(MUXER_OPTIONS)) as container:
        stream = container.add_stream("flac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate = rate
        container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def decode_video_bytes(data: bytes, shape: ClipShape, *, thread_count: int = 1) -> np.ndarray:
    """Frames [T, H, W, 3] uint8 from H.264 clip bytes; raises ClipDecodeError on any mismatch."""
    out = np.empty((shape.num_frames, shape.height, shape.width, 3), np.uint8)
    count = 0
    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            stream.thread_count = thread_count
            for frame in container.decode(stream):
                if count == shape.num_frames or (frame.width, frame.height) != (shape.width, shape.height):
                    raise ClipDecodeError(f"clip holds more frames or another size than {shape}")
                out[count] = frame.to_ndarray(format="rgb24")
                count += 1
    except (av.error.FFmpegError, IndexError) as error:
        raise ClipDecodeError(f"undecodable clip: {type(error).__name__}: {error}") from error
    if count != shape.num_frames:
        raise ClipDecodeError(f"clip decoded {count} frames, expected {shape.num_frames}")
    return out


def decode_audio_bytes(data: bytes, shape: ClipShape) -> np.ndarray:
    """Mono float32 PCM from FLAC bytes, exactly num_audio_samples long."""
    chunks = []
    try:
        with av.open(io.BytesIO(data)) as container:
            for frame in container.decode(audio=0):
                chunks.append(frame.to_ndarray().reshape(-1))
    except (av.error.FFmpegError, IndexError) as error:
        raise ClipDecodeError(f"undecodable audio: {type(error).__name__}: {error}") from error
    pcm = np.concatenate(chunks).astype(np.float32) / 32768.0 if chunks else np.zeros(0, np.float32)
    if len(pcm) != shape.num_audio_samples:
        raise ClipDecodeError(f"audio holds {len(pcm)} samples, expected {shape.num_audio_samples}")
    return pcm
