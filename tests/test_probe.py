"""Tests of ops/media/probe.py: reason codes for bad inputs, probed fields of good clips, limits, timeout."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import write_clip

from ops.media import probe
from ops.publish.paths import REPO_ROOT

PROBE_LEVEL_REASONS = ("empty_file", "truncated_file", "unrecognized_format", "not_media", "exceeds_limits",
                       "no_video_stream")
FAST = probe.ProbeLimits(timeout_s=20.0)

# A Matroska EBML header for doc type "matroska", then a Segment of unknown size. Followed by
# a terabyte of sparse zeros, FFmpeg's Matroska resync reads it byte by byte (about 6 s per GB
# here): to the prober it is a file that never finishes, without using any disk.
_EBML_BODY = (bytes.fromhex("4286 81 01 42f7 81 01 42f2 81 04 42f3 81 08 4282 88") + b"matroska"
              + bytes.fromhex("4287 81 04 4285 81 02"))
_STALLING_MKV_HEAD = (bytes.fromhex("1a45dfa3") + bytes([0x80 | len(_EBML_BODY)]) + _EBML_BODY
                      + bytes.fromhex("18538067 01ffffffffffffff"))


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clips")
    return {
        "mp4_aac": write_clip(root / "a.mp4", width=64, height=48, fps=25, num_frames=25, audio=True),
        "mkv_silent": write_clip(root / "b.mkv", width=96, height=64, fps=30, num_frames=15, container="matroska"),
    }


@pytest.fixture(scope="module")
def edge_results(demo) -> dict[str, probe.ProbeResult]:
    """Every probe-level edge case of the demo set, probed once."""
    uris = sorted(uri for uri, reason in demo.bad.items() if reason in PROBE_LEVEL_REASONS)
    results = probe.probe_many([demo.out_dir / uri for uri in uris], FAST)
    return dict(zip(uris, results))


@pytest.mark.parametrize("reason", PROBE_LEVEL_REASONS)
def test_each_bad_input_gets_its_reason_code(demo, edge_results, reason: str) -> None:
    uris = [uri for uri, expected in demo.bad.items() if expected == reason]
    assert uris, f"the demo set has no {reason} case"
    for uri in uris:
        result = edge_results[uri]
        assert (result.error, uri) == (reason, uri), result.error_detail
        assert result.error_detail


def test_demo_good_clips_probe_cleanly(demo) -> None:
    results = probe.probe_many([demo.out_dir / uri for uri in demo.good], FAST)
    assert [(uri, r.error) for uri, r in zip(demo.good, results)] == [(uri, None) for uri in demo.good]
    assert {r.video_codec for r in results} == {"h264"}
    assert {r.container for r in results} == {"mp4", "matroska"}


@pytest.mark.parametrize(("name", "expected"), [
    ("mp4_aac", dict(container="mp4", video_codec="h264", width=64, height=48, fps=25.0, num_frames=25,
                     audio_codec="aac", sample_rate=48_000, channels=1, num_streams=2)),
    ("mkv_silent", dict(container="matroska", video_codec="h264", width=96, height=64, fps=30.0, num_frames=15,
                        audio_codec=None, sample_rate=None, channels=None, num_streams=1)),
])
def test_good_clip_probes_with_its_properties(clips, name: str, expected: dict) -> None:
    (result,) = probe.probe_many([clips[name]], FAST)
    assert result.error is None, result.error_detail
    assert {key: getattr(result, key) for key in expected} == expected
    assert result.duration_s == pytest.approx(expected["num_frames"] / expected["fps"], abs=0.05)


@pytest.mark.parametrize(("limits", "detail_word"), [
    (probe.ProbeLimits(max_pixels=64 * 48 - 1), "max_pixels"),
    (probe.ProbeLimits(max_duration_s=0.5), "max_duration_s"),
    (probe.ProbeLimits(max_streams=1), "max_streams"),
])
def test_limits_reject_before_decoding(clips, limits: probe.ProbeLimits, detail_word: str) -> None:
    (result,) = probe.probe_many([clips["mp4_aac"]], limits)
    assert result.error == probe.EXCEEDS_LIMITS
    assert detail_word in result.error_detail


def test_limits_at_the_boundary_accept(clips) -> None:
    (result,) = probe.probe_many([clips["mp4_aac"]], probe.ProbeLimits(max_pixels=64 * 48, max_streams=2))
    assert result.error is None, result.error_detail


def _processes_holding(path: Path) -> list[int]:
    holders = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # process gone, or not ours to inspect
            continue
        for fd in descriptors:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    holders.append(int(pid))
            except OSError:
                continue
    return holders


def test_timeout_kills_a_probe_that_never_finishes(tmp_path: Path) -> None:
    stalling = tmp_path / "stalls.mkv"
    with open(stalling, "wb") as handle:
        handle.write(_STALLING_MKV_HEAD)
        handle.truncate(1 << 40)  # sparse: no blocks allocated
    good = write_clip(tmp_path / "good.mp4")
    try:
        started = time.monotonic()
        stalled, fine = probe.probe_many([stalling, good], probe.ProbeLimits(timeout_s=1.0, retry_timeout_s=2.0))
        elapsed_s = time.monotonic() - started
        assert stalled.error == probe.PROBE_TIMEOUT
        assert stalled.probe_attempts == 2, "a timeout is retried once before it is a verdict"
        assert "retry" in stalled.error_detail
        assert fine.error is None, "a timeout on one file must not affect the others"
        assert elapsed_s < 10, f"probe_many returned after {elapsed_s:.1f} s with timeout_s=1"
        assert _processes_holding(stalling) == [], "the timed-out probe process is still reading the file"
    finally:
        stalling.unlink()  # a terabyte-long file (even sparse) should not outlive the test


def test_probe_many_keeps_input_order(demo, clips) -> None:
    # A slow decode first and instant rejections after it: completion order differs from input order.
    paths = [clips["mp4_aac"], demo.out_dir / "edge_cases/empty.mp4", demo.out_dir / "edge_cases/text.mkv",
             clips["mkv_silent"], demo.out_dir / "edge_cases/truncated.mp4"]
    results = probe.probe_many(paths, FAST, num_workers=2)
    assert [(r.error, r.width) for r in results] == [
        (None, 64), (probe.EMPTY_FILE, None), (probe.NOT_MEDIA, None), (None, 96), (probe.TRUNCATED_FILE, None)]


def test_probe_many_rejects_zero_workers(clips) -> None:
    with pytest.raises(ValueError, match="num_workers"):
        probe.probe_many([clips["mp4_aac"]], FAST, num_workers=0)


@pytest.mark.parametrize("name", ["max_pixels", "max_duration_s", "max_streams", "timeout_s", "max_memory_bytes",
                                  "max_packets_to_first_frame", "retry_timeout_s"])
@pytest.mark.parametrize("value", [0, -1])
def test_probe_limits_reject_non_positive_values(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=name):
        probe.ProbeLimits(**{name: value})


@pytest.mark.parametrize(("head", "family"), [
    (b"\x00\x00\x00\x18ftypisom", "mp4"),
    (b"\x1a\x45\xdf\xa3\x9f", "matroska"),
    (b"OggS\x00\x02", "ogg"),
    (b"RIFF\x24\x00\x00\x00WAVE", "riff"),
    (b"fLaC\x00\x00", "flac"),
    (b"ID3\x04\x00", "mp3"),
    (b"\xff\xfb\x90\x00", "mp3"),
    ("plain text, ünïcödé\n".encode(), "text"),
    (bytes(range(128, 192)), "unknown"),
    (b"", "unknown"),
])
def test_sniff_format_recognizes_container_signatures(head: bytes, family: str) -> None:
    assert probe.sniff_format(head) == family


def test_iso_bmff_truncation_finds_a_box_that_overruns_the_file(tmp_path: Path) -> None:
    whole = b"\x00\x00\x00\x10ftypisom\x00\x00\x00\x00" + b"\x00\x00\x00\x10free" + bytes(8)
    path = tmp_path / "boxes.mp4"
    path.write_bytes(whole)
    assert probe.iso_bmff_truncation(path, len(whole)) is None
    path.write_bytes(whole[:-4])
    assert "'free'" in probe.iso_bmff_truncation(path, len(whole) - 4)


def test_raising_only_the_timeout_is_a_valid_config() -> None:
    # Review #12: the retry limit defaulted to a fixed 60 s, so timeout_s=90 alone was refused.
    limits = probe.ProbeLimits(timeout_s=90.0)
    assert limits.retry_timeout_s == 270.0
    assert probe.ProbeLimits().retry_timeout_s == 60.0, "the default limits (and so manifest versions) are unchanged"
    assert probe.ProbeLimits(timeout_s=90.0, retry_timeout_s=100.0).retry_timeout_s == 100.0


def test_an_explicit_retry_shorter_than_the_timeout_is_still_refused() -> None:
    with pytest.raises(ValueError, match="retry_timeout_s .* must be at least timeout_s"):
        probe.ProbeLimits(timeout_s=90.0, retry_timeout_s=60.0)


def test_dagster_manifest_config_accepts_only_the_timeout_raised() -> None:
    from assets.data import ManifestBuildConfig

    limits = ManifestBuildConfig(probe_timeout_s=90.0).to_ops().limits
    assert (limits.timeout_s, limits.retry_timeout_s) == (90.0, 270.0)
    assert ManifestBuildConfig().to_ops().limits == probe.ProbeLimits()


def test_a_stop_that_lands_after_the_probe_was_reaped_exits_cleanly() -> None:
    """SIGTERM between the worker's waitpid and its bookkeeping: _stop meets a probe that is gone."""
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from ops.media.probe import _stop\n"
            "pid = os.fork()\n"
            "if pid == 0: os._exit(0)\n"
            "os.waitpid(pid, 0)\n"
            "_stop([pid])\n")
    done = subprocess.run([sys.executable, "-c", code, str(REPO_ROOT)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


# ---- Issue 32: the probe reads the file the scan hashed, and a memory limit keeps its cause ----

def test_the_probe_refuses_another_file_a_symlink_or_a_fifo(clips, tmp_path: Path) -> None:
    clip = clips["mp4_aac"]
    info = os.stat(clip)
    identity = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    assert probe.probe_in_process(clip, FAST, identity).error is None
    other = clips["mkv_silent"]  # a valid clip, but not the one that was hashed
    assert probe.probe_in_process(other, FAST, identity).error == probe.CHECKSUM_MISMATCH
    link = tmp_path / "link.mp4"
    link.symlink_to(clip)
    assert probe.probe_in_process(link, FAST, identity).error == probe.CHECKSUM_MISMATCH
    assert "never followed" in probe.probe_in_process(link, FAST).error_detail
    fifo = tmp_path / "pipe.mp4"
    os.mkfifo(fifo)  # opened without blocking, refused by fstat: no writer is ever waited for
    assert probe.probe_in_process(fifo, FAST).error == probe.UNREADABLE_MEDIA


_UNDER_A_LIMIT = """
import json, resource, sys
sys.path.insert(0, sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # a build run under ulimit -v, below the 4 GiB cap
from ops.media import probe
default, tiny = probe.probe_many([sys.argv[2], sys.argv[2]], probe.ProbeLimits(timeout_s=30.0), num_workers=1)
(tiny,) = probe.probe_many([sys.argv[2]], probe.ProbeLimits(timeout_s=30.0, max_memory_bytes=1 << 20))
print(json.dumps([default.error, default.error_detail, tiny.error, tiny.error_detail]))
"""


def test_an_address_space_limit_below_the_cap_probes_and_a_memory_failure_names_its_cause(clips) -> None:
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    if hard != resource.RLIM_INFINITY and hard < 3 << 30:
        pytest.skip("this machine's own address-space limit is below 3 GiB")
    done = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT, str(REPO_ROOT), str(clips["mp4_aac"])],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    default_error, default_detail, tiny_error, tiny_detail = json.loads(done.stdout.strip().splitlines()[-1])
    assert (default_error, default_detail) == (None, None)  # was probe_crashed, "exit code 1", cause lost
    assert tiny_error == probe.EXCEEDS_LIMITS
    assert "1048576 bytes of address space (MemoryError" in tiny_detail, tiny_detail
