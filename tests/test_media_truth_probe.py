"""Issue 9, items 1 and 8: media that looks whole but is not, and probing on a loaded machine.

Every file is generated here with PyAV and then cut the way real transfers cut files: the
header stays, the tail is gone.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import av
import numpy as np
import pytest
from helpers import write_clip

from ops.curation import manifest as manifest_ops
from ops.media import probe

LIMITS = probe.ProbeLimits(timeout_s=20.0)
REPO_ROOT = Path(__file__).resolve().parent.parent


def _cut(path: Path, fraction: float, name: str) -> Path:
    data = path.read_bytes()
    out = path.with_name(name)
    out.write_bytes(data[: int(len(data) * fraction)])
    return out


def _encode(path: Path, *, container: str, codec: str, seed: int, num_frames: int = 50,
            container_options: dict | None = None, codec_options: dict | None = None) -> Path:
    """``num_frames`` random 64x48 frames at 25 fps, encoded with ``codec`` into ``container``."""
    rng = np.random.default_rng(seed)
    with av.open(str(path), "w", format=container, options=container_options or {}) as output:
        video = output.add_stream(codec, rate=25)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        video.options = codec_options or {}
        for index in range(num_frames):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), format="rgb24")
            frame.pts = index
            output.mux(video.encode(frame))
        output.mux(video.encode(None))
    return path


def _faststart_mp4(path: Path, num_frames: int = 50) -> Path:
    """An MP4 with its moov (the full sample table) before mdat, as streaming services serve them."""
    return _encode(path, container="mp4", codec="libx264", seed=1, num_frames=num_frames,
                   container_options={"movflags": "+faststart"},
                   codec_options={"threads": "1", "preset": "ultrafast"})


def _avi(path: Path, codec: str, num_frames: int = 50) -> Path:
    """An AVI: its index (idx1) is written at the end of the file, after every frame."""
    return _encode(path, container="avi", codec=codec, seed=2, num_frames=num_frames)


def _top_level_boxes(data: bytes) -> list[tuple[bytes, int, int]]:
    boxes, offset = [], 0
    while offset + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[offset:offset + 8])
        boxes.append((kind, offset, size))
        if size < 8:
            break
        offset += size
    return boxes


def _cut_mdat(path: Path, name: str, *, mdat_size: str) -> Path:
    """Cut the faststart file halfway through mdat and make the box walk agree with the bytes.

    ``mdat_size="zero"``: size 0, which ISO BMFF defines as "to the end of the file" (streaming
    muxers write it); ``"fit"``: the size rewritten to what remains, as a box-aware copier or a
    naive repair tool leaves it. Either way only moov's sample table still promises the lost half.
    """
    data = bytearray(path.read_bytes())
    kinds = [kind for kind, _, _ in _top_level_boxes(bytes(data))]
    assert kinds.index(b"moov") < kinds.index(b"mdat"), f"not faststart: {kinds}"
    (_, offset, size), = [box for box in _top_level_boxes(bytes(data)) if box[0] == b"mdat"]
    cut = offset + size // 2
    data = data[:cut]
    data[offset:offset + 4] = struct.pack(">I", 0 if mdat_size == "zero" else cut - offset)
    out = path.with_name(name)
    out.write_bytes(bytes(data))
    return out


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("truth")
    mkv = write_clip(root / "whole.mkv", container="matroska", num_frames=50, audio=True)
    webm_source = write_clip(root / "whole_silent.mkv", container="matroska", num_frames=50)
    mp4 = _faststart_mp4(root / "whole_faststart.mp4")
    avi_mpeg4 = _avi(root / "whole_mpeg4.avi", "mpeg4")
    avi_h264 = _avi(root / "whole_h264.avi", "libx264")
    return {
        "whole_avi_mpeg4": avi_mpeg4,
        "cut_avi_mpeg4": _cut(avi_mpeg4, 0.9, "cut_mpeg4.avi"),
        "cut_avi_mpeg4_more": _cut(avi_mpeg4, 0.8, "cut_mpeg4_more.avi"),
        "whole_avi_h264": avi_h264,
        "cut_avi_h264": _cut(avi_h264, 0.8, "cut_h264.avi"),
        "whole_mkv": mkv,
        "cut_mkv": _cut(mkv, 0.5, "cut.mkv"),
        "cut_mkv_silent": _cut(webm_source, 0.6, "cut_silent.mkv"),
        "whole_faststart": mp4,
        "cut_faststart_zero": _cut_mdat(mp4, "cut_faststart_zero.mp4", mdat_size="zero"),
        "cut_faststart_fit": _cut_mdat(mp4, "cut_faststart_fit.mp4", mdat_size="fit"),
        "cut_faststart_plain": _cut(mp4, 0.5, "cut_faststart_plain.mp4"),
    }


@pytest.fixture(scope="module")
def results(media) -> dict[str, probe.ProbeResult]:
    names = sorted(media)
    return dict(zip(names, probe.probe_many([media[name] for name in names], LIMITS)))


@pytest.mark.parametrize("name", ["cut_mkv", "cut_mkv_silent", "cut_faststart_zero", "cut_faststart_fit",
                                  "cut_faststart_plain", "cut_avi_mpeg4", "cut_avi_mpeg4_more", "cut_avi_h264"])
def test_a_file_cut_short_with_its_header_intact_is_truncated_file(results, name: str) -> None:
    result = results[name]
    assert result.error == probe.TRUNCATED_FILE, (result.error, result.error_detail)
    assert result.error_detail


@pytest.mark.parametrize("name", ["cut_mkv", "cut_faststart_zero", "cut_faststart_fit"])
def test_truncation_detail_states_declared_and_measured(results, name: str) -> None:
    result = results[name]
    assert "declares 2.0" in result.error_detail and "cut short" in result.error_detail, result.error_detail
    assert result.duration_s == pytest.approx(2.0, abs=0.05)
    assert 0 < result.measured_duration_s < 1.6


@pytest.mark.parametrize("name", ["cut_avi_mpeg4", "cut_avi_h264"])
def test_a_cut_avi_is_caught_by_its_frame_count(results, name: str) -> None:
    # The cut AVI lost its end-of-file index: FFmpeg re-estimates its duration from the file size,
    # so declared and measured durations agree, and only the header's frame count shows the loss.
    result = results[name]
    assert result.duration_s == pytest.approx(result.measured_duration_s, abs=0.2), "durations alone cannot tell"
    assert result.num_frames == 50 and "video stream declares 50 frames but holds" in result.error_detail, (
        result.error_detail)


@pytest.mark.parametrize("name", ["whole_mkv", "whole_faststart", "whole_avi_mpeg4", "whole_avi_h264"])
def test_whole_files_are_accepted_with_their_measured_duration(results, name: str) -> None:
    result = results[name]
    assert result.error is None, result.error_detail
    assert result.measured_duration_s == pytest.approx(2.0, abs=1e-3)
    assert result.probe_attempts == 1


def test_tolerance_is_a_stated_limit(media) -> None:
    # A tolerance wider than the whole clip accepts the cut file: the refusal comes from the limit.
    generous = probe.ProbeLimits(truncation_tolerance_s=5.0)
    assert probe.probe_in_process(media["cut_mkv"], generous).error is None
    assert probe.probe_in_process(media["cut_mkv"], LIMITS).error == probe.TRUNCATED_FILE


def test_manifest_records_measured_duration_and_refuses_the_cut_file(media, tmp_path: Path) -> None:
    root = tmp_path / "media"
    root.mkdir()
    for name in ("whole_mkv", "cut_mkv", "cut_faststart_fit", "cut_avi_mpeg4"):
        (root / f"{name}{media[name].suffix}").write_bytes(media[name].read_bytes())
    manifest = manifest_ops.build_manifest(root, manifest_ops.ManifestConfig())
    rows = {row["uri"]: row for row in manifest.table.to_pylist()}
    assert rows["whole_mkv.mkv"]["probe_error"] is None
    assert rows["whole_mkv.mkv"]["measured_duration_s"] == pytest.approx(2.0, abs=1e-3)
    assert rows["whole_mkv.mkv"]["probe_attempts"] == 1
    assert rows["cut_mkv.mkv"]["probe_error"] == probe.TRUNCATED_FILE
    assert rows["cut_mkv.mkv"]["measured_duration_s"] < 1.6
    assert rows["cut_faststart_fit.mp4"]["probe_error"] == probe.TRUNCATED_FILE
    assert rows["cut_avi_mpeg4.avi"]["probe_error"] == probe.TRUNCATED_FILE


def test_a_file_that_declares_no_duration_gets_its_measured_one(tmp_path: Path) -> None:
    # Matroska written live (no seeking back) has no Duration element: nothing to compare, so the
    # packets decide the duration rather than leaving the row without one.
    path = tmp_path / "live.mkv"
    with av.open(str(path), "w", format="matroska", options={"live": "1"}) as output:
        video = output.add_stream("libx264", rate=25)
        video.width, video.height, video.pix_fmt = 64, 48, "yuv420p"
        for index in range(50):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), index * 4, np.uint8), format="rgb24")
            frame.pts = index
            output.mux(video.encode(frame))
        output.mux(video.encode(None))
    result = probe.probe_in_process(path, LIMITS)
    assert (result.error, result.duration_s, result.measured_duration_s, result.num_frames) == (None, 2.0, 2.0, 50)


# --- item 8: a busy machine never quarantines a good clip ---------------------------------------------


def test_a_first_timeout_is_retried_with_the_longer_limit(media) -> None:
    # 1 ms cannot fit a probe (a fork alone takes longer): the first attempt always times out,
    # as on a machine loaded enough to stall it; the retry has the time it needs.
    limits = probe.ProbeLimits(timeout_s=0.001, retry_timeout_s=20.0)
    whole, cut = probe.probe_many([media["whole_mkv"], media["cut_mkv"]], limits, num_workers=1)
    assert (whole.error, whole.probe_attempts) == (None, 2), whole.error_detail
    assert whole.measured_duration_s == pytest.approx(2.0, abs=1e-3)
    assert (cut.error, cut.probe_attempts) == (probe.TRUNCATED_FILE, 2), "the retry judges the file, not the load"


def test_probe_processes_import_only_what_probing_needs() -> None:
    modules = probe.probe_worker_modules()
    assert "av" in modules and "ops.media.probe" in modules
    heavy = sorted(name for name in modules if name.split(".")[0] in {"dagster", "torch", "assets", "pipelines",
                                                                     "resources", "pandas", "pyarrow", "mlflow"})
    assert heavy == []


_CALLER = textwrap.dedent("""
    # A caller like a Dagster run worker: its main module imports the whole code location.
    import os, sys
    sys.path.insert(0, {root!r})
    import dagster  # noqa: F401
    import assets.data  # noqa: F401
    with open({marker!r}, "a") as handle:  # every process that runs this module leaves its pid
        handle.write(f"{{os.getpid()}} {{__name__}}\\n")

    if __name__ == "__main__":
        from ops.media import probe
        results = probe.probe_many([{clip!r}, {clip!r}, {clip!r}], probe.ProbeLimits(timeout_s=20.0))
        print([result.error for result in results])
""")


def test_probing_never_re_imports_the_callers_main_module(media, tmp_path: Path) -> None:
    marker = tmp_path / "imported_by.txt"
    script = tmp_path / "caller.py"
    script.write_text(_CALLER.format(root=str(REPO_ROOT), marker=str(marker), clip=str(media["whole_mkv"])))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[None, None, None]"
    importers = marker.read_text().splitlines()
    assert [line.split()[1] for line in importers] == ["__main__"], (
        f"probe processes re-ran the caller's main module (and imported dagster and assets): {importers}")


def test_a_probe_process_that_dies_is_probe_crashed_not_a_hang(media) -> None:
    # A child that dies without replying (here: a request it cannot parse) must be reported by the
    # worker at once, so the file is neither hung until the timeout nor judged on stale output.
    worker = probe._Worker(boot_timeout_s=30)
    try:
        worker.send({"path": str(media["whole_mkv"]), "limits": {"not_a_limit": 1}})
        assert worker.wait_readable(10), "no reply: the worker waited on a dead child"
        reply = worker.receive()
        # Issue 32: the cause is recorded, not only an exit code.
        assert reply["error"] == probe.PROBE_CRASHED
        assert "TypeError" in reply["error_detail"] and "not_a_limit" in reply["error_detail"]
        worker.send({"path": str(media["whole_mkv"]), "limits": dataclasses.asdict(LIMITS)})
        assert worker.wait_readable(20)
        assert worker.receive()["error"] is None, "the worker keeps serving after a crashed probe"
    finally:
        worker.kill()
