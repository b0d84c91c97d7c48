"""Probe media files with PyAV under explicit limits, in killable child processes.

A probe reads container and stream headers, refuses anything over the limits *before*
decoding (decode bombs declare absurd sizes or durations), then decodes the first video
frame to prove the stream is readable. Each probe runs in its own child process with a
wall-clock timeout and an address-space cap, because a hostile file can hang or exhaust
FFmpeg in ways no in-process guard can interrupt.

Every failure becomes a reason code (``ProbeResult.error``); nothing raises to the caller.
"""

from __future__ import annotations

import codecs
import multiprocessing
import multiprocessing.connection
import resource
import struct
import time
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

import av

# Reason codes a probe can return (see docs/quarantine.md for the full table).
EMPTY_FILE = "empty_file"
NOT_MEDIA = "not_media"
UNRECOGNIZED_FORMAT = "unrecognized_format"
TRUNCATED_FILE = "truncated_file"
UNREADABLE_MEDIA = "unreadable_media"
EXCEEDS_LIMITS = "exceeds_limits"
NO_VIDEO_STREAM = "no_video_stream"
DECODE_ERROR = "decode_error"
PROBE_TIMEOUT = "probe_timeout"
PROBE_CRASHED = "probe_crashed"


@dataclass(kw_only=True, slots=True, frozen=True)
class ProbeLimits:
    max_pixels: int = 3840 * 2160
    """Largest width*height accepted; checked on the header before any decoding."""
    max_duration_s: float = 3600.0
    """Longest declared duration accepted."""
    max_streams: int = 8
    """Most streams a container may declare."""
    timeout_s: float = 20.0
    """Wall-clock limit for one file's probe; the child is killed past it."""
    max_memory_bytes: int = 4 << 30
    """Address-space cap of the probing child (RLIMIT_AS)."""
    max_packets_to_first_frame: int = 512
    """Packets demuxed at most while looking for the first decodable video frame."""

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_streams", "max_memory_bytes", "max_packets_to_first_frame"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ProbeLimits.{name} must be positive, got {getattr(self, name)}")
        if self.max_duration_s <= 0 or self.timeout_s <= 0:
            raise ValueError("ProbeLimits.max_duration_s and timeout_s must be positive")


@dataclass(kw_only=True, slots=True)
class ProbeResult:
    container: str | None = None
    video_codec: str | None = None
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    num_frames: int | None = None
    duration_s: float | None = None
    audio_codec: str | None = None
    sample_rate: int | None = None
    channels: int | None = None
    num_streams: int | None = None
    error: str | None = None
    """Reason code when the file cannot be used; None when the probe succeeded."""
    error_detail: str | None = None

    def failed(self, code: str, detail: str) -> "ProbeResult":
        self.error, self.error_detail = code, detail
        return self


class _Rejected(Exception):
    """A header check refused the file; carries the reason code and detail."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code, self.detail = code, detail


def sniff_format(head: bytes) -> str:
    """Container family from magic bytes: mp4, matroska, ogg, riff, flac, mp3, text or unknown."""
    if len(head) >= 8 and head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "matroska"
    for magic, family in ((b"OggS", "ogg"), (b"RIFF", "riff"), (b"fLaC", "flac"), (b"ID3", "mp3")):
        if head.startswith(magic):
            return family
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        return "mp3"
    try:
        # Incremental decoding tolerates a multi-byte character cut at the end of ``head``.
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return "unknown"
    printable = sum(ch.isprintable() or ch in "\r\n\t" for ch in text)
    return "text" if text and printable / len(text) > 0.95 else "unknown"


def iso_bmff_truncation(path: Path, size_bytes: int) -> str | None:
    """Describe how an MP4's top-level boxes overrun the file, or None if they fit."""
    offset = 0
    with open(path, "rb") as handle:
        while offset < size_bytes:
            handle.seek(offset)
            header = handle.read(16)
            if len(header) < 8:
                return f"box header cut at byte {offset} of {size_bytes}"
            box_size, box_type = struct.unpack(">I4s", header[:8])
            if box_size == 1:
                if len(header) < 16:
                    return f"64-bit box header cut at byte {offset}"
                box_size = struct.unpack(">Q", header[8:16])[0]
            elif box_size == 0:  # box extends to end of file by definition
                return None
            if box_size < 8:
                return f"box {box_type!r} at byte {offset} declares impossible size {box_size}"
            if offset + box_size > size_bytes:
                name = box_type.decode("latin-1")
                return f"box '{name}' at byte {offset} declares {box_size} bytes but the file ends at {size_bytes}"
            offset += box_size
    return None


def _rate(value: Fraction | None) -> float | None:
    return float(value) if value else None


def _declared_duration_s(container, stream) -> float | None:
    if stream.duration is not None and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _read_headers(container, result: ProbeResult, limits: ProbeLimits):
    """Fill header fields and return the video stream; raise _Rejected past a limit."""
    result.num_streams = len(container.streams)
    if result.num_streams > limits.max_streams:
        raise _Rejected(EXCEEDS_LIMITS, f"{result.num_streams} streams > max_streams {limits.max_streams}")
    if container.streams.audio:
        audio = container.streams.audio[0]
        result.audio_codec = audio.codec_context.name
        result.sample_rate = audio.codec_context.sample_rate or None
        result.channels = audio.codec_context.channels or None
    if not container.streams.video:
        raise _Rejected(NO_VIDEO_STREAM, f"{container.format.name} has no video stream")
    video = container.streams.video[0]
    result.video_codec = video.codec_context.name
    result.width, result.height = video.codec_context.width, video.codec_context.height
    result.fps = _rate(video.average_rate) or _rate(video.guessed_rate)
    result.duration_s = _declared_duration_s(container, video)
    pixels = (result.width or 0) * (result.height or 0)
    if pixels > limits.max_pixels:
        raise _Rejected(EXCEEDS_LIMITS, f"{result.width}x{result.height} = {pixels} pixels > max_pixels {limits.max_pixels}")
    if result.duration_s is not None and result.duration_s > limits.max_duration_s:
        raise _Rejected(EXCEEDS_LIMITS, f"declared duration {result.duration_s:.0f} s > max_duration_s {limits.max_duration_s:.0f}")
    if video.frames:
        result.num_frames = int(video.frames)
    elif result.duration_s is not None and result.fps:
        result.num_frames = int(round(result.duration_s * result.fps))
    return video


def _decode_first_frame(container, video, limits: ProbeLimits) -> str | None:
    """Error text if no frame decodes within the packet budget, else None."""
    for index, packet in enumerate(container.demux(video)):
        if index >= limits.max_packets_to_first_frame:
            return f"no frame decoded in the first {limits.max_packets_to_first_frame} packets"
        for _frame in packet.decode():
            return None
    return "stream ended before any frame decoded"


def probe_in_process(path: str | Path, limits: ProbeLimits) -> ProbeResult:
    """Probe one file in this process (no timeout): the body that the child runs."""
    path = Path(path)
    result = ProbeResult()
    size_bytes = path.stat().st_size
    if size_bytes == 0:
        return result.failed(EMPTY_FILE, "file has 0 bytes")
    with open(path, "rb") as handle:
        family = sniff_format(handle.read(64))
    if family == "text":
        return result.failed(NOT_MEDIA, "content is plain text, not a media container")
    if family == "unknown":
        return result.failed(UNRECOGNIZED_FORMAT, "no known container signature in the first bytes")
    if family == "mp4" and (overrun := iso_bmff_truncation(path, size_bytes)):
        return result.failed(TRUNCATED_FILE, overrun)
    result.container = family
    try:
        with av.open(str(path), metadata_errors="ignore") as container:
            video = _read_headers(container, result, limits)
            if (problem := _decode_first_frame(container, video, limits)) is not None:
                return result.failed(DECODE_ERROR, problem)
    except _Rejected as rejected:
        return result.failed(rejected.code, rejected.detail)
    except av.error.FFmpegError as error:
        # Errors from FFmpeg are the file's fault by construction: classify, keep the text.
        code = DECODE_ERROR if result.video_codec else UNREADABLE_MEDIA
        return result.failed(code, f"{type(error).__name__}: {error}")
    return result


def _child(path: str, limits: ProbeLimits, conn) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (limits.max_memory_bytes, limits.max_memory_bytes))
    try:
        result = probe_in_process(path, limits)
    except MemoryError:
        result = ProbeResult().failed(EXCEEDS_LIMITS, f"probe exceeded {limits.max_memory_bytes} bytes of memory")
    except OSError as error:
        result = ProbeResult().failed(UNREADABLE_MEDIA, f"{type(error).__name__}: {error}")
    conn.send(asdict(result))
    conn.close()


def _context():
    # forkserver: children fork from a small clean server, not from a threaded Dagster process.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ops.probe"])
    return context


def probe_many(paths: list[Path], limits: ProbeLimits, *, num_workers: int = 2) -> list[ProbeResult]:
    """Probe ``paths`` with at most ``num_workers`` children at a time; results in input order."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    context = _context()
    results: list[ProbeResult | None] = [None] * len(paths)
    pending = list(enumerate(paths))
    running: dict = {}  # receiving connection -> (index, process, deadline)
    while pending or running:
        while pending and len(running) < num_workers:
            index, path = pending.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(str(path), limits, sender), daemon=True)
            process.start()
            sender.close()
            running[receiver] = (index, process, time.monotonic() + limits.timeout_s)
        timeout = max(0.0, min(deadline for _, _, deadline in running.values()) - time.monotonic())
        for receiver in multiprocessing.connection.wait(list(running), timeout=timeout):
            index, process, _ = running.pop(receiver)
            results[index] = _receive(receiver, process)
        now = time.monotonic()
        for receiver, (index, process, deadline) in list(running.items()):
            if now >= deadline:
                process.kill()
                process.join()
                receiver.close()
                del running[receiver]
                results[index] = ProbeResult().failed(PROBE_TIMEOUT, f"probe exceeded {limits.timeout_s} s wall clock")
    return results  # type: ignore[return-value]


def _receive(receiver, process) -> ProbeResult:
    try:
        payload = receiver.recv()
    except EOFError:
        process.join()
        return ProbeResult().failed(PROBE_CRASHED, f"probe process died with exit code {process.exitcode}")
    finally:
        receiver.close()
    process.join()
    return ProbeResult(**payload)
