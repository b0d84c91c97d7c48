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

import functools
import io
import os
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import av
    from av.video.reformatter import Interpolation, VideoReformatter

# PyAV is imported inside the functions that decode or encode: ClipShape reaches the Dagster
# Definitions (through the clip plan), which must load without codecs.

# Bit-exact muxing and single-threaded x264 "ultrafast" make shard bytes reproducible: the
# "veryfast" preset (with or without tune=fastdecode) encoded the same frames to different
# bits from run to run on some real clips, which would break byte-identical shards.
# ultrafast also decodes fastest (no CABAC, no deblocking); crf 18 keeps quality high.
MUXER_OPTIONS = {"fflags": "+bitexact"}
X264_OPTIONS = {"threads": "1", "preset": "ultrafast", "crf": "18"}
_TIME_EPSILON_S = 1e-6
# One reformatter per process keeps libswscale's context cached between frames of the same
# size; ``VideoFrame.to_ndarray(format=...)`` builds a new one per frame, which measured 25x
# slower (1 ms vs 0.04 ms per 64x64 frame) and dominated clip decoding. Scaling runs on one
# thread: loader workers are already one process per core, and a context that owns threads
# deadlocks a child forked from its process (the threads do not exist there).
_SCALER_THREADS = 1
_reformatter_of: tuple[int, VideoReformatter] | None = None


def _reformatter() -> VideoReformatter:
    """This process's reformatter (never one inherited through fork)."""
    global _reformatter_of
    if _reformatter_of is None or _reformatter_of[0] != os.getpid():
        from av.video.reformatter import VideoReformatter
        _reformatter_of = (os.getpid(), VideoReformatter())
    return _reformatter_of[1]


@functools.cache
def _write_interpolation() -> Interpolation:
    """Shards are written with bit-exact, accurately rounded scaling so their bytes do not depend on
    which SIMD path this CPU takes."""
    from av.video.reformatter import Interpolation
    return Interpolation.AREA | Interpolation.ACCURATE_RND | Interpolation.BITEXACT


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
    rgb = _reformatter().reformat(frame, width=cover_w, height=cover_h, format="rgb24",
                                  interpolation=_write_interpolation(), threads=_SCALER_THREADS).to_ndarray()
    top, left = (cover_h - shape.height) // 2, (cover_w - shape.width) // 2
    return rgb[top:top + shape.height, left:left + shape.width]


@dataclass(kw_only=True, slots=True)
class SourceClips:
    """Frames [T, H, W, 3] uint8 per clip start; a clip the source cannot fill is None, with its reason."""
    frames: list[np.ndarray | None]
    short: dict[int, str]
    """Clip index -> why it is not cut (the source ends before the clip does)."""


def decode_source_clips(path: str, starts_s: list[float], shape: ClipShape) -> SourceClips:
    """Every clip of ``starts_s`` in one decoding pass; clips past the source's real end are refused.

    A target time is covered by the newest frame at or before it, up to that frame's end. When the
    source runs out first (a truncated file, or a header that promised more), holding its last
    frame would make a frozen clip that trains as real motion, so the clip is reported short.
    """
    import av
    targets = sorted((start + k / shape.fps, clip, k) for clip, start in enumerate(starts_s)
                     for k in range(shape.num_frames))
    clips = [np.empty((shape.num_frames, shape.height, shape.width, 3), np.uint8) for _ in starts_s]
    with av.open(path) as container:
        stream = container.streams.video[0]
        stream.thread_count = 1
        period_s = 1.0 / float(stream.average_rate or stream.guessed_rate or shape.fps)
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
        end_s = previous[0] + _frame_duration_s(previous[1], period_s)
        short: dict[int, str] = {}
        for time_s, clip, index in targets[position:]:
            if time_s + _TIME_EPSILON_S < end_s:  # still inside the last frame's own duration
                previous = _emit(previous, (time_s, clip, index), clips, shape)
            elif clip not in short:
                short[clip] = (f"source ends at {end_s:.3f} s, but clip frame {index} of {shape.num_frames} "
                               f"is planned at {time_s:.3f} s: the clip would repeat the last frame")
    return SourceClips(frames=[None if clip in short else frames for clip, frames in enumerate(clips)], short=short)


def _frame_duration_s(frame: av.VideoFrame, period_s: float) -> float:
    duration = getattr(frame, "duration", None)
    return float(duration * frame.time_base) if duration and frame.time_base else period_s


def decode_source_video(path: str, starts_s: list[float], shape: ClipShape) -> list[np.ndarray]:
    """Frames [T, H, W, 3] uint8 for each clip start, in one decoding pass over the source.

    Raises ClipDecodeError when any clip runs past the source's end (see ``decode_source_clips``).
    """
    decoded = decode_source_clips(path, starts_s, shape)
    if decoded.short:
        raise ClipDecodeError(f"{path}: " + "; ".join(decoded.short.values()))
    return decoded.frames  # type: ignore[return-value]


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
    import av
    with av.open(path) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=shape.audio_rate)
        end_s = max(starts_s) + shape.duration_s
        # Decode from the start of the stream, never after a seek: Matroska can land an audio seek
        # after the target and rounds its timestamps to 1 ms, so a clip's samples would shift (by up
        # to an AAC frame) with whichever other clips share its decoding pass, i.e. with the shard
        # layout. Clips start in the first max_clips_per_source strides, so the extra decode is short.
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
        lead = min(max(-offset, 0), shape.num_audio_samples)  # audio begins after the clip: silence first
        segment = pcm[max(offset, 0):max(offset, 0) + shape.num_audio_samples - lead]
        clips.append(np.pad(segment, (lead, shape.num_audio_samples - lead - len(segment))).astype(np.float32))
    return clips


def encode_clip(frames: np.ndarray, pcm: np.ndarray, shape: ClipShape) -> bytes:
    """Matroska bytes with H.264 video (yuv420p) and lossless FLAC audio (16-bit), reproducible.

    One container for both streams: opening a container is the largest fixed cost of
    decoding a small clip, so the loader pays it once per clip, not twice.
    """
    import av
    buffer = io.BytesIO()
    samples = np.clip(np.round(pcm * 32767), -32768, 32767).astype(np.int16)
    with av.open(buffer, "w", format="matroska", options=dict(MUXER_OPTIONS)) as container:
        # An exact rational rate: a rounded one (12 for 12.5 fps) would time the frames off the audio.
        video = container.add_stream("libx264", rate=Fraction(shape.fps).limit_denominator(1001))
        video.width, video.height, video.pix_fmt = shape.width, shape.height, "yuv420p"
        video.options = dict(X264_OPTIONS)
        video.codec_context.thread_count = 1  # PyAV otherwise picks automatic threading
        audio = container.add_stream("flac", rate=shape.audio_rate, layout="mono")
        packets = [packet for array in frames for packet in video.encode(
            _reformatter().reformat(av.VideoFrame.from_ndarray(array, format="rgb24"), format="yuv420p",
                                    interpolation=_write_interpolation(), threads=_SCALER_THREADS))]
        packets += video.encode(None)
        frame = av.AudioFrame.from_ndarray(samples[None, :], format="s16", layout="mono")
        frame.sample_rate, frame.pts = shape.audio_rate, 0
        # The flush returns an empty packet carrying updated FLAC stream info; Matroska has it already.
        packets += [packet for packet in audio.encode(frame) + audio.encode(None) if packet.size]
        for packet in sorted(packets, key=lambda packet: (float(packet.dts * packet.time_base), packet.stream.index)):
            container.mux(packet)
    return buffer.getvalue()


def decode_clip(data: bytes, shape: ClipShape, *, thread_count: int = 1,
                out: np.ndarray | None = None, hwaccel: object | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(frames [T, H, W, 3] uint8, mono float32 PCM) from ``encode_clip`` bytes; ClipDecodeError on any mismatch.

    ``out``: where to write the frames (e.g. a slot of a shared-memory batch), saving a copy.
    ``hwaccel``: an ``av.codec.hwaccel.HWAccel`` to decode the video on (benchmarks compare it).
    """
    import av
    video = np.empty((shape.num_frames, shape.height, shape.width, 3), np.uint8) if out is None else out
    chunks, count = [], 0
    try:
        with av.open(io.BytesIO(data), hwaccel=hwaccel) as container:
            container.streams.video[0].thread_count = thread_count
            for frame in container.decode(*container.streams):
                if isinstance(frame, av.AudioFrame):
                    chunks.append(frame.to_ndarray().reshape(-1))
                    continue
                if count == shape.num_frames or (frame.width, frame.height) != (shape.width, shape.height):
                    raise ClipDecodeError(f"clip holds more frames or another size than {shape}")
                video[count] = _reformatter().reformat(frame, format="rgb24", threads=_SCALER_THREADS).to_ndarray()
                count += 1
    except (av.error.FFmpegError, IndexError) as error:
        raise ClipDecodeError(f"undecodable clip: {type(error).__name__}: {error}") from error
    if count != shape.num_frames:
        raise ClipDecodeError(f"clip decoded {count} frames, expected {shape.num_frames}")
    pcm = np.concatenate(chunks).astype(np.float32) / 32768.0 if chunks else np.zeros(0, np.float32)
    if len(pcm) != shape.num_audio_samples:
        raise ClipDecodeError(f"clip audio holds {len(pcm)} samples, expected {shape.num_audio_samples}")
    return video, pcm
