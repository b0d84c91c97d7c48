"""Probe media files with PyAV under explicit limits, in killable child processes.

A probe reads container and stream headers, refuses anything over the limits *before*
decoding (decode bombs declare absurd sizes or durations), decodes the first video frame to
prove the stream is readable, then demuxes every packet to the end (cheap next to decoding):
a file cut short with its header intact (Matroska has no sample table; an MP4 with moov
first keeps its index) declares more than its packets hold, and is refused as
``truncated_file``. A container whose index sits at the end (AVI) loses it when cut, and
FFmpeg then re-estimates the duration from the file size, so the durations agree; its header
still states the frame count, so fewer video packets than declared frames is truncation too.
The measured duration is recorded beside the declared one.

Each probe runs in its own process with a wall-clock timeout and an address-space cap,
because a hostile file can hang or exhaust FFmpeg in ways no in-process guard can interrupt.
The processes fork from a small worker interpreter (``python -c`` + this module + PyAV), never
from the caller: multiprocessing's children re-import the caller's ``__main__`` (inside Dagster,
the whole code location), which measured 79 s against 2 s for 80 files and made good files time
out under load. A timeout is retried once with ``retry_timeout_s`` before it is a verdict.

Every failure becomes a reason code (``ProbeResult.error``); nothing raises to the caller.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import resource
import select
import signal
import stat
import struct
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from fractions import Fraction
from pathlib import Path

from ops.curation.reason_codes import CHECKSUM_MISMATCH, MISSING_OBJECT

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
# MISSING_OBJECT (the file vanished before its probe) comes from ops.curation.reason_codes, shared with ops.media.scan.


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
    retry_timeout_s: float | None = None
    """Limit of the one retry after a timeout: a loaded machine gets a second, longer chance
    before a good file is quarantined as probe_timeout. None (default): max(60 s, 3 x timeout_s),
    so raising only ``timeout_s`` stays a valid config."""
    max_memory_bytes: int = 4 << 30
    """Address-space cap of the probing child (RLIMIT_AS)."""
    max_packets_to_first_frame: int = 512
    """Packets demuxed at most while looking for the first decodable video frame."""
    truncation_tolerance_s: float = 0.1
    """How far the packets may end before the declared duration (plus two frame periods, for
    muxers that round or count the last frame differently) before the file is truncated_file."""

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_streams", "max_memory_bytes", "max_packets_to_first_frame"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ProbeLimits.{name} must be positive, got {getattr(self, name)}")
        if self.max_duration_s <= 0 or self.timeout_s <= 0:
            raise ValueError("ProbeLimits.max_duration_s and timeout_s must be positive")
        if self.retry_timeout_s is None:
            # Frozen dataclass: set the derived default once, so asdict() (the manifest's config and
            # version, the request to a probe process) always carries the number actually used.
            object.__setattr__(self, "retry_timeout_s", default_retry_timeout_s(self.timeout_s))
        if self.retry_timeout_s < self.timeout_s:
            raise ValueError(f"ProbeLimits.retry_timeout_s ({self.retry_timeout_s}) must be at least timeout_s "
                             f"({self.timeout_s}): the retry exists to give a slow machine more time")
        if self.truncation_tolerance_s < 0:
            raise ValueError(f"ProbeLimits.truncation_tolerance_s must be >= 0, got {self.truncation_tolerance_s}")


def default_retry_timeout_s(timeout_s: float) -> float:
    """Retry limit when none is set: three times the first limit, never under the historical 60 s."""
    return max(60.0, 3.0 * timeout_s)


@dataclass(kw_only=True, slots=True)
class ProbeResult:
    container: str | None = None
    video_codec: str | None = None
    width: int | None = None
    height: int | None = None
    fps: float | None = None
    num_frames: int | None = None
    duration_s: float | None = None
    """Duration the headers declare."""
    measured_duration_s: float | None = None
    """End of the last video packet after demuxing the whole file (what the bytes hold)."""
    audio_codec: str | None = None
    sample_rate: int | None = None
    channels: int | None = None
    num_streams: int | None = None
    error: str | None = None
    """Reason code when the file cannot be used; None when the probe succeeded."""
    error_detail: str | None = None
    probe_attempts: int = 1
    """2 when the first attempt timed out (retryable) and the file was probed again."""

    def failed(self, code: str, detail: str) -> ProbeResult:
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
    import av
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
        raise _Rejected(EXCEEDS_LIMITS,
                        f"declared duration {result.duration_s:.0f} s > max_duration_s {limits.max_duration_s:.0f}")
    if video.frames:
        result.num_frames = int(video.frames)
    elif result.duration_s is not None and result.fps:
        result.num_frames = int(round(result.duration_s * result.fps))
    return video


@dataclass(kw_only=True, slots=True)
class _Extent:
    """Earliest start and latest end (seconds) of the packets of one stream or of all streams."""
    start_s: float | None = None
    end_s: float | None = None

    def add(self, start_s: float, end_s: float) -> None:
        self.start_s = start_s if self.start_s is None else min(self.start_s, start_s)
        self.end_s = end_s if self.end_s is None else max(self.end_s, end_s)

    @property
    def length_s(self) -> float:
        return (self.end_s - self.start_s) if self.start_s is not None else 0.0


def _packet_span(packet, fallback_duration_s: float) -> tuple[float, float] | None:
    stamp = packet.pts if packet.pts is not None else packet.dts
    if stamp is None or not packet.time_base:
        return None  # the flush packet at the end of each stream
    start_s = float(stamp * packet.time_base)
    duration_s = float(packet.duration * packet.time_base) if packet.duration else fallback_duration_s
    return start_s, start_s + duration_s


@dataclass(kw_only=True, slots=True)
class _Demuxed:
    """What demuxing the file found: packet extents, video packets counted, and any problem."""
    video: _Extent
    all_streams: _Extent
    num_video_packets: int = 0
    gave_up: bool = False
    """True when no frame decoded within the packet budget: the rest was never demuxed, so the
    extents and the count say nothing about truncation (the file is decode_error)."""
    problem: str | None = None
    """Why the file is unusable (no frame within the budget, demuxer error); a demuxer error is kept
    as text so that a short file still reports truncated_file with its cause."""


def _demux_to_end(container, video, limits: ProbeLimits) -> _Demuxed:
    """Decode the first video frame, then demux the rest, measuring what the packets hold."""
    import av
    frame_s = 1.0 / float(video.average_rate or video.guessed_rate or 25)
    found = _Demuxed(video=_Extent(), all_streams=_Extent())
    decoded = False
    try:
        for packet in container.demux():
            is_video = packet.stream.index == video.index
            if (span := _packet_span(packet, frame_s if is_video else 0.0)) is None:
                continue
            found.all_streams.add(*span)
            if not is_video:
                continue
            found.video.add(*span)
            found.num_video_packets += 1
            if not decoded:
                if found.num_video_packets > limits.max_packets_to_first_frame:
                    found.problem = f"no frame decoded in the first {limits.max_packets_to_first_frame} packets"
                    found.gave_up = True
                    return found
                decoded = any(True for _ in packet.decode())
    except av.error.FFmpegError as error:
        found.problem = f"demuxer failed after {found.video.length_s:.3f} s: {type(error).__name__}: {error}"
        return found
    if not decoded:
        decoded = any(True for _ in video.codec_context.decode(None))  # frames held back by the decoder
    found.problem = None if decoded else "stream ended before any frame decoded"
    return found


def _truncation(container, video, result: ProbeResult, found: _Demuxed, limits: ProbeLimits) -> str | None:
    """Why the header's durations or frame count overrun the packets, or None when they agree within tolerance."""
    import av
    fps = result.fps or 25.0
    tolerance_s = limits.truncation_tolerance_s + 2.0 / fps
    declared = []
    if video.duration is not None and video.time_base:
        declared.append(("video stream", float(video.duration * video.time_base), found.video.length_s))
    if container.duration is not None:
        declared.append(("container", container.duration / av.time_base, found.all_streams.length_s))
    for what, declared_s, measured_s in declared:
        if declared_s - measured_s > tolerance_s:
            return (f"{what} declares {declared_s:.3f} s but its packets end at {measured_s:.3f} s "
                    f"(tolerance {tolerance_s:.3f} s): the file was cut short")
    # A cut AVI loses its end-of-file index, and FFmpeg re-estimates the durations from the file
    # size, so they agree with the packets; the header's frame count still says what was there.
    declared_frames, tolerance_frames = int(video.frames or 0), tolerance_s * fps
    if declared_frames and declared_frames - found.num_video_packets > tolerance_frames:
        return (f"video stream declares {declared_frames} frames but holds {found.num_video_packets} packets "
                f"(tolerance {tolerance_frames:.1f} frames): the file was cut short")
    return None


def _probe_container(container, result: ProbeResult, limits: ProbeLimits) -> ProbeResult:
    video = _read_headers(container, result, limits)
    found = _demux_to_end(container, video, limits)
    result.measured_duration_s = round(found.video.length_s, 6)
    if result.duration_s is None and found.video.start_s is not None:
        # Nothing declared (a live recording's Matroska): what the packets hold is the duration.
        result.duration_s = result.measured_duration_s
        if result.num_frames is None and result.fps:
            result.num_frames = int(round(result.duration_s * result.fps))
    if not found.gave_up and (overrun := _truncation(container, video, result, found, limits)) is not None:
        return result.failed(TRUNCATED_FILE, overrun + (f"; {found.problem}" if found.problem else ""))
    if found.problem is not None:
        return result.failed(DECODE_ERROR, found.problem)
    return result


_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _identity(info: os.stat_result) -> list[int]:
    """ops.media.scan.file_identity, spelled here: the probe worker imports only this module and PyAV."""
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def probe_in_process(path: str | Path, limits: ProbeLimits, identity: list[int] | None = None) -> ProbeResult:
    """Probe one file in this process (no timeout): the body that the probe process runs.

    The file is opened once, never through a symlink and without blocking (a FIFO is refused, never
    waited on), and every read of the probe goes through that descriptor. With ``identity`` (the
    scan's ops.media.scan.file_identity of the bytes it hashed), a file that is not that very file, or that
    changes while it is probed, is ``checksum_mismatch``: the probe never describes other bytes than
    the manifest's sha256.
    """
    result = ProbeResult()
    try:
        descriptor = os.open(path, _OPEN_FLAGS)  # FileNotFoundError: classified by the caller
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        return result.failed(CHECKSUM_MISMATCH if identity is not None else UNREADABLE_MEDIA,
                             "is a symlink (never followed)" + ("; it was a file when listed" if identity else ""))
    try:
        opened = os.fstat(descriptor)
        if not stat.S_ISREG(opened.st_mode):
            return result.failed(UNREADABLE_MEDIA, "not a regular file (a FIFO, socket or device); never read")
        # A None part is not compared: a cluster node leaves out the device number, which differs
        # between the clients of one network filesystem (ops/array_tasks.py).
        if identity is not None and (len(identity) != len(_identity(opened)) or any(
                want is not None and want != got for want, got in zip(identity, _identity(opened)))):
            return result.failed(CHECKSUM_MISMATCH, "changed after it was listed: not the file the scan hashed "
                                 "(replaced, edited or renamed over); scan again")
        # /proc/self/fd names this descriptor's file, so PyAV reads the inode checked above, whatever the path holds now.
        proc_path = f"/proc/self/fd/{descriptor}"
        verified = proc_path if os.path.exists(proc_path) else str(path)
        try:
            _probe_file(Path(verified), opened.st_size, limits, result)
        except MemoryError as error:
            raise MemoryError(str(error).replace(proc_path, str(path))) from error
        if result.error_detail:  # FFmpeg names the file it opened: name the one the caller asked for
            result.error_detail = result.error_detail.replace(proc_path, str(path))
        if _identity(os.fstat(descriptor)) != _identity(opened):
            return result.failed(CHECKSUM_MISMATCH, "changed while it was probed; scan again")
        return result
    finally:
        os.close(descriptor)


def _probe_file(path: Path, size_bytes: int, limits: ProbeLimits, result: ProbeResult) -> ProbeResult:
    import av  # here, not at the top: ops.curation.manifest (and so the Dagster Definitions) import this module
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
            return _probe_container(container, result, limits)
    except _Rejected as rejected:
        return result.failed(rejected.code, rejected.detail)
    except av.error.FFmpegError as error:
        if getattr(error, "errno", None) == errno.ENOMEM:  # the address-space cap, not the file: _probe_child says so
            raise MemoryError(f"FFmpeg: {error}") from error
        # Other errors from FFmpeg are the file's fault by construction: classify, keep the text.
        code = DECODE_ERROR if result.video_codec else UNREADABLE_MEDIA
        return result.failed(code, f"{type(error).__name__}: {error}")


class ProbeWorkerError(RuntimeError):
    """The probe worker interpreter could not start; no file was judged (nothing is quarantined)."""


# The worker is a fresh interpreter that imports this module (stdlib + PyAV) and nothing else.
_WORKER_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from ops.media.probe import _serve; _serve()"
_REPLY_LIMIT_CHARS = 2000


def _cap_address_space(max_memory_bytes: int) -> tuple[int, str]:
    """Cap this probe process's address space (RLIMIT_AS); (the cap in force, a note for details).

    A limit inherited from the build's own process (ulimit -v, a batch system) that is lower than
    ``max_memory_bytes`` cannot be raised: the probe runs under it, and says so wherever memory is the cause.
    """
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and hard < max_memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        return hard, (f"; the address-space limit inherited from the build process ({hard} bytes) is below "
                      f"max_memory_bytes ({max_memory_bytes}) and was kept")
    # The soft limit only: once the probe has failed for memory, `_lift_cap` gives the reply room to be written
    # (under a cap far below what the process already maps, even formatting the reply can fail otherwise).
    resource.setrlimit(resource.RLIMIT_AS, (max_memory_bytes, hard))
    return max_memory_bytes, ""


def _lift_cap() -> None:
    """Raise the probe's soft address-space cap back to its hard limit: the probe is over, the reply is not."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _crash_detail(status: int) -> str:
    """Why a probe process died without a reply: its exit code or signal, and the memory limit in force
    (an allocation refused under RLIMIT_AS often ends in abort() or a segfault inside a codec)."""
    code = os.waitstatus_to_exitcode(status)
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = "no inherited address-space limit" if hard == resource.RLIM_INFINITY else \
        f"inherited address-space limit {hard} bytes"
    return f"probe process died with {how} ({limit})"


def _probe_child(request: dict, out) -> None:
    """Body of one forked probe process: cap memory, probe, write one reply line."""
    limits = ProbeLimits(**request["limits"])
    cap_bytes, cap_note = _cap_address_space(limits.max_memory_bytes)
    try:
        if request.get("op") == "modules":  # diagnostics: what a probe process has imported
            reply = {"modules": sorted(sys.modules)}
        else:
            reply = asdict(probe_in_process(request["path"], limits, request.get("identity")))
    except MemoryError as error:
        _lift_cap()
        reply = asdict(ProbeResult().failed(EXCEEDS_LIMITS, f"probe exceeded {cap_bytes} bytes of address space "
                                            f"(MemoryError{': ' + str(error) if str(error) else ''}){cap_note}"))
    except FileNotFoundError as error:
        reply = asdict(ProbeResult().failed(MISSING_OBJECT, f"vanished before probing: {error}"))
    except OSError as error:
        reply = asdict(ProbeResult().failed(UNREADABLE_MEDIA, f"{type(error).__name__}: {error}"))
    if reply.get("error_detail"):
        reply["error_detail"] = reply["error_detail"][:_REPLY_LIMIT_CHARS]
    out.write(json.dumps(reply).encode() + b"\n")
    out.flush()


def _serve() -> None:
    """Worker loop: one JSON request per stdin line, each probed in a process forked from here.

    Forking is safe here (one thread, no decoder ever opened in this process) and cheap (PyAV is
    imported once), and a crash or memory blow-up of one file takes down only its own process.
    """
    import av  # noqa: F401 - once, before the first fork: each probe process inherits it, and no timeout pays it
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a library prints must not corrupt the reply stream
    running: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: _stop(running))
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            code = 1  # no reply written: the worker reports probe_crashed instead of a silent hang
            try:
                _probe_child(request, out)
                code = 0
            except BaseException as error:  # noqa: BLE001 - classified as probe_crashed, with its cause
                _lift_cap()
                traceback.print_exc()
                code = _reply_crash(out, f"probe process failed: {type(error).__name__}: {error}")
            finally:
                os._exit(code)
        running.append(pid)
        _, status = os.waitpid(pid, 0)
        running.clear()
        if os.waitstatus_to_exitcode(status) != 0:
            _reply_crash(out, _crash_detail(status))


def _reply_crash(out, detail: str) -> int:
    """Write a probe_crashed reply naming ``detail``; 0 when written, 1 when even that failed."""
    try:
        reply = asdict(ProbeResult().failed(PROBE_CRASHED, detail[:_REPLY_LIMIT_CHARS]))
        out.write(json.dumps(reply).encode() + b"\n")
        out.flush()
    except (OSError, MemoryError):  # the worker then reports the exit code itself
        traceback.print_exc()
        return 1
    return 0


def _stop(running: list[int]) -> None:
    """SIGTERM in the worker: kill the probe in flight and reap it, so its file is closed on return.

    The signal can land after the serving loop reaped the probe but before it cleared ``running``:
    that probe is already gone, which is what this wanted (ProcessLookupError / ChildProcessError).
    """
    for pid in running:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # already exited and reaped by _serve: nothing left to stop
    os._exit(0)


class _Worker:
    """One worker interpreter in its own session, so a timeout kills it and its probe together."""

    def __init__(self, boot_timeout_s: float) -> None:
        root = str(Path(__file__).resolve().parents[2])
        self.process = subprocess.Popen([sys.executable, "-c", _WORKER_BOOT, root], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, start_new_session=True)
        if not self.wait_readable(boot_timeout_s) or json.loads(self.process.stdout.readline() or b"{}") != {"ready": True}:
            try:  # its stdout closed early, or it said something else: it is exiting, or wedged
                exited = self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                exited = None
            self.kill()
            if exited is not None:  # e.g. an address-space limit (ulimit -v) too small to import PyAV
                _, hard = resource.getrlimit(resource.RLIMIT_AS)
                limit = "none" if hard == resource.RLIM_INFINITY else f"{hard} bytes"
                raise ProbeWorkerError(f"the probe worker ({sys.executable}) exited with code {exited} before it was "
                                       f"ready (inherited address-space limit: {limit}); its error is on stderr above")
            raise ProbeWorkerError(f"the probe worker ({sys.executable}) did not start within {boot_timeout_s:.0f} s; "
                                   "check that ops.media.probe and PyAV import in a fresh interpreter")

    def wait_readable(self, timeout_s: float) -> bool:
        return bool(select.select([self.process.stdout], [], [], max(0.0, timeout_s))[0])

    def send(self, request: dict) -> None:
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()

    def receive(self) -> dict | None:
        """The reply line, or None when the worker itself died."""
        line = self.process.stdout.readline()
        return json.loads(line) if line.endswith(b"\n") else None

    def kill(self) -> None:
        """Stop the worker and its probe; on return neither holds the file any more."""
        if self.process.poll() is None:
            self.process.terminate()  # the worker kills and reaps its probe first (_stop)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:  # wedged: _stop never ran
                pass
        try:  # anything left in the worker's session (a probe forked as the signal came) goes too
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.close()

    def close(self) -> None:
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except BrokenPipeError:  # the worker is already gone; nothing left to flush
                pass
        self.process.wait()


@dataclass(kw_only=True, slots=True)
class _Job:
    index: int
    path: str
    attempt: int = 1
    deadline: float = 0.0
    identity: list[int] | None = None


def probe_worker_modules(limits: ProbeLimits | None = None) -> list[str]:
    """Modules loaded in a probe process (what a probe pays to start); for checks and tests."""
    limits = limits or ProbeLimits()
    worker = _Worker(limits.retry_timeout_s)
    try:
        worker.send({"op": "modules", "limits": asdict(limits)})
        if not worker.wait_readable(limits.retry_timeout_s) or (reply := worker.receive()) is None:
            raise ProbeWorkerError("the probe worker did not answer")
        return reply["modules"]
    finally:
        worker.close()


def probe_many(paths: list[Path], limits: ProbeLimits, *, num_workers: int = 2,
               identities: list[list[int] | None] | None = None,
               on_progress: Callable[[int], None] | None = None) -> list[ProbeResult]:
    """Probe ``paths`` with at most ``num_workers`` probes at a time; results in input order.
    ``identities``: per path, the ops.media.scan.file_identity of the bytes the scan hashed (None: unchecked).
    ``on_progress`` is told how many are done whenever that changes (ops.progress)."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    identities = identities if identities is not None else [None] * len(paths)
    if len(identities) != len(paths):
        raise ValueError(f"{len(identities)} identities for {len(paths)} paths")
    results: list[ProbeResult | None] = [None] * len(paths)
    pending = deque(_Job(index=index, path=str(path), identity=identity)
                    for index, (path, identity) in enumerate(zip(paths, identities)))
    idle: list[_Worker] = []
    busy: dict[_Worker, _Job] = {}
    try:
        while pending or busy:
            while pending and len(busy) < num_workers:
                job = pending.popleft()
                worker = idle.pop() if idle else _Worker(limits.retry_timeout_s)
                job.deadline = time.monotonic() + (limits.timeout_s if job.attempt == 1 else limits.retry_timeout_s)
                worker.send({"path": job.path, "limits": asdict(limits), "identity": job.identity})
                busy[worker] = job
            _collect(busy, idle, results, timeout_s=min(job.deadline for job in busy.values()) - time.monotonic())
            _expire(busy, pending, results, limits)
            if on_progress is not None:  # a count kept as results land: no scan of a million entries per probe
                done = len(results) - len(pending) - len(busy)
                on_progress(done)
    finally:
        for worker in [*idle, *busy]:
            worker.kill()
    return results  # type: ignore[return-value]


def _collect(busy: dict, idle: list, results: list, *, timeout_s: float) -> None:
    """Take every reply that is ready within ``timeout_s``."""
    streams = {worker.process.stdout: worker for worker in busy}
    for stream in select.select(list(streams), [], [], max(0.0, timeout_s))[0]:
        worker = streams[stream]
        job = busy.pop(worker)
        reply = worker.receive()
        if reply is None:
            worker.kill()
            result = ProbeResult().failed(PROBE_CRASHED, f"probe worker died with exit code {worker.process.returncode}")
        else:
            idle.append(worker)
            result = ProbeResult(**reply)
        result.probe_attempts = job.attempt
        results[job.index] = result


def _expire(busy: dict, pending: deque, results: list, limits: ProbeLimits) -> None:
    """Kill probes past their deadline; a first timeout is retryable and goes back to the queue's head."""
    now = time.monotonic()
    for worker, job in list(busy.items()):
        if now < job.deadline:
            continue
        worker.kill()
        del busy[worker]
        if job.attempt == 1:
            pending.appendleft(_Job(index=job.index, path=job.path, attempt=2, identity=job.identity))
            continue
        result = ProbeResult().failed(PROBE_TIMEOUT, f"probe exceeded {limits.timeout_s} s wall clock, and "
                                      f"{limits.retry_timeout_s} s on its retry; retryable: probe again on a "
                                      "less loaded machine or raise timeout_s")
        result.probe_attempts = job.attempt
        results[job.index] = result
