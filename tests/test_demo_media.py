"""Tests for tools.demo_media: the synthetic demo media folder and its edge cases.

The 40-clip folder is generated once per module; smaller folders are used where
a test needs its own (determinism, overwrite).
"""

from __future__ import annotations

import json
import os
import struct
from collections import Counter, defaultdict
from pathlib import Path

import av
import pytest

from tools.demo_media import DemoMediaReport, generate_demo_media
from tools.mp4_boxes import declare_absurd_duration
from ops.publish.hashing import sha256_file

SPDX_LICENSES = {"CC-BY-4.0", "CC0-1.0", "CC-BY-SA-4.0"}
EXPECTED_BAD = {
    "edge_cases/empty.mp4": "empty_file",
    "edge_cases/truncated.mp4": "truncated_file",
    "edge_cases/truncated.mkv": "truncated_file",
    "edge_cases/random_bytes.mp4": "unrecognized_format",
    "edge_cases/text.mkv": "not_media",
    "edge_cases/decode_bomb.mp4": "exceeds_limits",
    "edge_cases/audio_only.m4a": "no_video_stream",
    "edge_cases/bad_checksum.mp4": "checksum_mismatch",
    "edge_cases/consent_revoked.mp4": "consent_revoked",
    "edge_cases/missing_license.mp4": "missing_license",
    "edge_cases/malformed_sidecar.mp4": "malformed_sidecar",
    "edge_cases/escape_link.mp4": "path_escape",
    "edge_cases/escape_uri.json": "path_escape",
    "edge_cases/missing_object.json": "missing_object",
    "edge_cases/too_short.mp4": "invalid_duration",
    "edge_cases/tiny.mp4": "unexpected_dimensions",
    "edge_cases/no_sidecar.mp4": "missing_sidecar",
}
# Edge-case media that decode fine; their problem is elsewhere (sidecar, size, duration).
DECODABLE_EDGE_CLIPS = (
    "bad_checksum.mp4", "consent_revoked.mp4", "missing_license.mp4", "malformed_sidecar.mp4",
    "split_leak_a.mp4", "split_leak_b.mp4", "too_short.mp4", "tiny.mp4", "no_sidecar.mp4",
)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoMediaReport:
    return generate_demo_media(tmp_path_factory.mktemp("demo") / "media", seed=0, num_good=40)


def _sidecar(root: Path, rel: str) -> dict:
    return json.loads((root / f"{rel}.json").read_text())


def _duplicate_path(report: DemoMediaReport) -> str:
    (path,) = [p for p, reason in report.bad.items() if reason == "duplicate_content"]
    return path


def _tree_fingerprint(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of the bytes, or the link target for symlinks."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = sha256_file(path)
    return out


# --- determinism -------------------------------------------------------------------------


def test_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    first = generate_demo_media(tmp_path / "a", seed=3, num_good=6)
    second = generate_demo_media(tmp_path / "b", seed=3, num_good=6)
    assert _tree_fingerprint(tmp_path / "a") == _tree_fingerprint(tmp_path / "b")
    assert (first.good, first.bad, first.split_leak) == (second.good, second.bad, second.split_leak)
    assert len(_tree_fingerprint(tmp_path / "a")) > 40


def test_different_seed_gives_different_clips(tmp_path: Path) -> None:
    generate_demo_media(tmp_path / "a", seed=3, num_good=6)
    report = generate_demo_media(tmp_path / "b", seed=4, num_good=6)
    for rel in report.good:
        assert sha256_file(tmp_path / "a" / rel) != sha256_file(tmp_path / "b" / rel), rel


# --- good clips ----------------------------------------------------------------------------


def test_good_clips_cover_formats_sizes_rates_and_audio(demo: DemoMediaReport) -> None:
    assert len(demo.good) == 40
    sizes, rates, audio, suffixes, durations = set(), set(), Counter(), set(), []
    for rel in demo.good:
        with av.open(str(demo.out_dir / rel)) as container:
            (video,) = container.streams.video
            assert video.codec_context.name == "h264", rel
            assert next(container.decode(video=0)).width == video.width
            durations.append(container.duration / av.time_base)
            sizes.add((video.width, video.height))
            rates.add(video.average_rate)
            audio[tuple(s.codec_context.name for s in container.streams.audio)] += 1
        suffixes.add(Path(rel).suffix)
    assert all(0.5 <= d <= 12.5 for d in durations), durations
    assert min(durations) == pytest.approx(0.5, abs=1e-3)
    assert max(durations) >= 11.9
    assert any(h > w for w, h in sizes), sizes
    assert len(sizes) >= 5
    assert rates == {24, 25, 30}
    assert set(audio) == {("aac",), ("opus",), ()}
    assert suffixes == {".mp4", ".mkv"}


def test_good_sidecars_match_their_media(demo: DemoMediaReport) -> None:
    groups: dict[str, set[str]] = defaultdict(set)
    group_sizes: Counter = Counter()
    for rel in demo.good:
        record = _sidecar(demo.out_dir, rel)
        assert record["uri"] == rel
        assert record["sha256"] == sha256_file(demo.out_dir / rel)
        assert record["license"] in SPDX_LICENSES
        assert record["consent"] == "granted"
        assert record["caption"].startswith("a ") and "square" in record["caption"]
        groups[record["source_group"]].add(record["split"])
        group_sizes[record["source_group"]] += 1
    assert len(groups) == 12
    assert min(group_sizes.values()) >= 2
    assert all(len(splits) == 1 for splits in groups.values()), groups
    assert {s for (s,) in groups.values()} == {"train", "val", "test"}
    licenses = {_sidecar(demo.out_dir, rel)["license"] for rel in demo.good}
    assert licenses == SPDX_LICENSES


def test_captions_follow_the_content(demo: DemoMediaReport) -> None:
    for rel in demo.good:
        with av.open(str(demo.out_dir / rel)) as container:
            has_audio = bool(container.streams.audio)
        assert ("tone" in _sidecar(demo.out_dir, rel)["caption"]) == has_audio, rel


# --- edge cases ----------------------------------------------------------------------------


def test_report_lists_every_edge_case(demo: DemoMediaReport) -> None:
    bad = dict(demo.bad)
    duplicate = _duplicate_path(demo)
    del bad[duplicate]
    assert bad == EXPECTED_BAD
    assert demo.split_leak == ["edge_cases/split_leak_a.mp4", "edge_cases/split_leak_b.mp4"]
    for rel in [*demo.bad, *demo.split_leak]:
        assert os.path.lexists(demo.out_dir / rel), rel


def test_unreadable_files_do_not_open(demo: DemoMediaReport) -> None:
    root = demo.out_dir
    assert (root / "edge_cases/empty.mp4").stat().st_size == 0
    truncated = (root / "edge_cases/truncated.mp4").read_bytes()
    assert truncated[4:8] == b"ftyp" and b"moov" not in truncated
    assert (root / "edge_cases/random_bytes.mp4").stat().st_size == 50_000
    (root / "edge_cases/text.mkv").read_bytes().decode("utf-8")
    for name in ("empty.mp4", "truncated.mp4", "random_bytes.mp4", "text.mkv"):
        with pytest.raises(av.FFmpegError):
            av.open(str(root / "edge_cases" / name))


def test_truncated_matroska_opens_and_declares_more_than_it_holds(demo: DemoMediaReport) -> None:
    # The header survives the cut: FFmpeg opens it and trusts the 2 s duration; only the packets tell.
    with av.open(str(demo.out_dir / "edge_cases/truncated.mkv")) as container:
        declared_s = container.duration / av.time_base
        (video,) = container.streams.video
        last_s = max(float(packet.pts * packet.time_base) for packet in container.demux(video) if packet.pts is not None)
    assert declared_s == pytest.approx(2.0, abs=0.05)
    assert last_s < 0.7 * declared_s


def test_decode_bomb_declares_huge_duration_but_is_small(demo: DemoMediaReport) -> None:
    path = demo.out_dir / "edge_cases/decode_bomb.mp4"
    assert path.stat().st_size < 20_000
    with av.open(str(path)) as container:
        (video,) = container.streams.video
        assert container.duration / av.time_base > 1e5
        assert float(video.duration * video.time_base) > 1e5
        assert sum(1 for _ in container.decode(video=0)) == 25


def test_audio_only_has_no_video(demo: DemoMediaReport) -> None:
    with av.open(str(demo.out_dir / "edge_cases/audio_only.m4a")) as container:
        assert not container.streams.video
        assert [s.codec_context.name for s in container.streams.audio] == ["aac"]


def test_sidecar_cases(demo: DemoMediaReport) -> None:
    root = demo.out_dir
    record = _sidecar(root, "edge_cases/bad_checksum.mp4")
    assert len(record["sha256"]) == 64
    assert record["sha256"] != sha256_file(root / "edge_cases/bad_checksum.mp4")
    assert _sidecar(root, "edge_cases/consent_revoked.mp4")["consent"] == "revoked"
    assert "license" not in _sidecar(root, "edge_cases/missing_license.mp4")
    with pytest.raises(json.JSONDecodeError):
        _sidecar(root, "edge_cases/malformed_sidecar.mp4")
    assert not (root / "edge_cases/no_sidecar.mp4.json").exists()
    for rel in EXPECTED_BAD:
        if rel.endswith(".json") or rel.endswith(("malformed_sidecar.mp4", "no_sidecar.mp4")):
            continue
        assert _sidecar(root, rel)["uri"] == rel


def test_duplicate_copies_clip_003_and_its_group(demo: DemoMediaReport) -> None:
    duplicate = _duplicate_path(demo)
    (original,) = [rel for rel in demo.good if Path(rel).stem == "clip_003"]
    assert duplicate == "edge_cases/duplicate" + Path(original).suffix
    assert (demo.out_dir / duplicate).read_bytes() == (demo.out_dir / original).read_bytes()
    dup_record, orig_record = _sidecar(demo.out_dir, duplicate), _sidecar(demo.out_dir, original)
    assert dup_record["source_group"] == orig_record["source_group"]
    assert dup_record["split"] == orig_record["split"]


def test_split_leak_pair_shares_a_group_with_two_splits(demo: DemoMediaReport) -> None:
    records = [_sidecar(demo.out_dir, rel) for rel in demo.split_leak]
    assert {r["source_group"] for r in records} == {"leaky_group"}
    assert [r["split"] for r in records] == ["train", "test"]
    assert not set(demo.split_leak) & set(demo.bad)


def test_path_escapes_leave_the_root(demo: DemoMediaReport) -> None:
    root = demo.out_dir.resolve()
    link = root / "edge_cases/escape_link.mp4"
    assert link.is_symlink()
    assert not Path(os.path.realpath(link)).is_relative_to(root)
    uri = json.loads((root / "edge_cases/escape_uri.json").read_text())["uri"]
    assert not (root / uri).resolve().is_relative_to(root)
    missing = json.loads((root / "edge_cases/missing_object.json").read_text())["uri"]
    assert missing == "edge_cases/missing_object.mp4"
    assert not os.path.lexists(root / missing)


def test_short_and_tiny_clips(demo: DemoMediaReport) -> None:
    with av.open(str(demo.out_dir / "edge_cases/too_short.mp4")) as container:
        assert container.duration / av.time_base == pytest.approx(0.1, abs=0.01)
    with av.open(str(demo.out_dir / "edge_cases/tiny.mp4")) as container:
        assert (container.streams.video[0].width, container.streams.video[0].height) == (16, 16)


def test_valid_edge_clips_decode_and_all_content_is_distinct(demo: DemoMediaReport) -> None:
    root = demo.out_dir
    for name in DECODABLE_EDGE_CLIPS:
        with av.open(str(root / "edge_cases" / name)) as container:
            assert container.streams.video[0].codec_context.name == "h264"
            assert sum(1 for _ in container.decode(video=0)) >= 3, name
    media = [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.suffix != ".json"]
    digests = Counter(sha256_file(p) for p in media if p.suffix != ".md")
    assert [n for n in digests.values() if n > 1] == [2]  # clip_003 and its duplicate only


def test_no_partial_or_hidden_files_remain(demo: DemoMediaReport) -> None:
    assert not [p for p in demo.out_dir.rglob("*") if p.name.startswith(".")]


def test_provenance_names_versions_seed_and_every_reason(demo: DemoMediaReport) -> None:
    text = (demo.out_dir / "PROVENANCE.md").read_text()
    assert av.__version__ in text and "seed: 0" in text
    assert "No third-party media" in text
    for reason in {*demo.bad.values(), "split_leakage"}:
        assert f"`{reason}`" in text, reason


# --- contract with the validator -----------------------------------------------------------


@pytest.mark.slow
def test_validator_quarantines_exactly_the_reported_cases(tmp_path: Path) -> None:
    """report.bad is the promise the demo makes; the manifest + validation path must keep it."""
    from ops.curation import manifest, validation

    report = generate_demo_media(tmp_path / "media", seed=0, num_good=4)
    built = manifest.build_manifest(tmp_path / "media", manifest.ManifestConfig())
    result = validation.validate(built, validation.ValidationConfig())
    rejected = dict(zip(result.rejected["uri"], result.rejected["reason"]))
    leaked = {uri: rejected.pop(uri) for uri in report.split_leak if uri in rejected}
    assert rejected == report.bad
    assert list(leaked.values()) == ["split_leakage"]
    accepted = set(result.accepted.column("uri").to_pylist())
    assert accepted == set(report.good) | (set(report.split_leak) - set(leaked))


# --- folder handling -----------------------------------------------------------------------


def test_refuses_non_empty_dir_unless_overwrite(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        generate_demo_media(tmp_path, num_good=4)
    generate_demo_media(tmp_path, num_good=4, overwrite=True)
    (tmp_path / "clips/stale.mp4").write_bytes(b"old")
    report = generate_demo_media(tmp_path, num_good=4, overwrite=True)
    assert not (tmp_path / "clips/stale.mp4").exists()
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert len(report.good) == 4


@pytest.mark.parametrize("kwargs", [{"num_good": 3}, {"seed": -1}, {"preset": "4k"}])
def test_rejects_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        generate_demo_media(tmp_path / "out", **kwargs)


# --- decode-bomb patching of version-1 (64-bit) boxes --------------------------------------


def _box(kind: str, body: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(body), kind.encode()) + body


def test_declare_absurd_duration_handles_version_1_boxes() -> None:
    times = b"\0" * 16  # creation and modification, 64-bit each
    mvhd = _box("mvhd", b"\x01\0\0\0" + times + struct.pack(">IQ", 600, 600) + b"\0" * 80)
    tkhd = _box("tkhd", b"\x01\0\0\0" + times + struct.pack(">IIQ", 1, 0, 600) + b"\0" * 60)
    elst = _box("elst", b"\x01\0\0\0" + struct.pack(">IQqI", 1, 600, 0, 1 << 16))
    mdhd = _box("mdhd", b"\x01\0\0\0" + times + struct.pack(">IQ", 90_000, 90_000) + b"\0" * 4)
    stts = _box("stts", b"\0\0\0\0" + struct.pack(">IIIII", 2, 9, 9_000, 1, 9_000))
    stbl = _box("stbl", stts)
    mdia = _box("mdia", mdhd + _box("minf", stbl))
    moov = _box("moov", mvhd + _box("trak", tkhd + _box("edts", elst) + mdia))
    data = bytearray(_box("ftyp", b"isom") + moov)
    declare_absurd_duration(data, 10_000)

    def read(kind: str, offset: int, fmt: str) -> int:
        return struct.unpack_from(fmt, data, data.find(kind.encode()) + 4 + offset)[0]

    assert read("mvhd", 24, ">Q") == 10_000 * 600
    assert read("tkhd", 28, ">Q") == 10_000 * 600
    assert read("elst", 8, ">Q") == 10_000 * 600
    assert read("mdhd", 24, ">Q") == 10_000 * 90_000
    # Nine frames keep their 9000-tick spacing; the tenth takes up the rest.
    assert read("stts", 20, ">I") == 10_000 * 90_000 - 9 * 9_000
    assert len(data) == len(_box("ftyp", b"isom") + moov)


# --- the realistic preset (benchmarks/loader.py --preset realistic) -----------------------


def test_realistic_preset_is_720p_and_480p_both_orientations_seconds_long_with_stereo_audio(tmp_path: Path) -> None:
    """Four sources (the minimum) cover every size; each is validated, not only written."""
    from ops.curation import manifest, validation

    report = generate_demo_media(tmp_path / "media", seed=0, num_good=4, preset="realistic")
    sizes, seen_bytes = set(), 0
    for rel in report.good:
        with av.open(str(tmp_path / "media" / rel)) as container:
            video, (audio,) = container.streams.video[0], container.streams.audio
            sizes.add((video.width, video.height))
            assert 4.0 <= container.duration / 1e6 <= 8.1 and audio.codec_context.channels == 2
        seen_bytes += (tmp_path / "media" / rel).stat().st_size
        assert "textured field" in _sidecar(tmp_path / "media", rel)["caption"]
    assert sizes == {(1280, 720), (720, 1280), (854, 480), (480, 854)}
    # Texture and grain cost real bits: a flat 720p gradient of this length is a few tens of kB.
    assert seen_bytes > 4 * 500_000
    built = manifest.build_manifest(tmp_path / "media", manifest.ManifestConfig())
    accepted = validation.validate(built, validation.ValidationConfig()).accepted
    assert set(report.good) <= set(accepted.column("uri").to_pylist())
    assert "Preset realistic" in (tmp_path / "media/PROVENANCE.md").read_text()


def test_textured_frames_are_reproducible_and_move() -> None:
    from tools.demo_media import ClipSpec, _bounce, _render_frames

    spec = ClipSpec(width=64, height=48, fps=24, num_frames=6, container="mp4", audio_codec=None, square="red",
                    background="blue", direction="right", speed="quickly", tone="low", texture_seed=11)
    first, second = list(_render_frames(spec)), list(_render_frames(spec))
    assert all((a == b).all() for a, b in zip(first, second, strict=True))
    assert not (first[0] == first[1]).all() and first[0].std() > 10  # grain and texture, not a flat field
    assert [_bounce(d, 4) for d in (0, 3, 4, 5, 8, 9, -2)] == [0, 3, 4, 3, 0, 1, 2]
