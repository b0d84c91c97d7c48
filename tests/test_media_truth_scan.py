"""Issue 9, item 2: nothing in the media root crashes a build.

Each case is real where the test machine allows it (symlink loops, a FIFO, a name that is not
UTF-8, a file deleted while the scan reads the root). Tests run as root, and root reads a
chmod-000 file or folder anyway, so "permission denied" is injected at the exact OS boundary the
scan calls (``os.scandir`` for a folder, the hashing read for a file), with the real scan code
around it; the other paths through the scan stay untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import write_clip

from ops import manifest as manifest_ops
from ops import scan
from ops import validation as validation_ops
from ops.hashing import digest_json

CONFIG = manifest_ops.ManifestConfig()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    media = tmp_path / "media"
    write_clip(media / "good.mp4")
    write_clip(media / "sub" / "also_good.mp4", seed=1)
    return media


def _build(root: Path, tmp_path: Path) -> dict[str, dict]:
    """Build, publish and validate the manifest; rows by uri with their quarantine reason."""
    manifest = manifest_ops.build_manifest(root, CONFIG)
    written = manifest_ops.write_manifest(manifest, tmp_path / "manifests")
    assert pq.read_table(written / manifest_ops.MANIFEST_FILE).num_rows == manifest.table.num_rows
    result = validation_ops.validate(manifest, validation_ops.ValidationConfig(verify_objects="off"))
    reasons = dict(zip(result.rejected["uri"], result.rejected["reason"]))
    rows = {row["uri"]: {**row, "reason": reasons.get(row["uri"])} for row in manifest.table.to_pylist()}
    # The good clips still make it through, whatever else is in the root.
    assert rows["good.mp4"]["probe_error"] is None
    return rows


def test_symlink_loops_are_quarantined(root: Path, tmp_path: Path) -> None:
    os.symlink("b.mp4", root / "a.mp4")
    os.symlink("a.mp4", root / "b.mp4")
    os.symlink("self.json", root / "self.json")  # a sidecar that is its own loop
    rows = _build(root, tmp_path)
    for uri in ("a.mp4", "b.mp4", "self.json"):
        assert rows[uri]["probe_error" if uri.endswith(".mp4") else "sidecar_error"] == scan.SYMLINK_LOOP
    assert rows["a.mp4"]["reason"] == scan.SYMLINK_LOOP
    assert "loop" in rows["a.mp4"]["probe_error_detail"].lower()


def test_a_fifo_is_never_opened_and_is_quarantined(root: Path, tmp_path: Path) -> None:
    # Opening a FIFO for reading blocks until a writer comes: a real unreadable file, even for root.
    os.mkfifo(root / "pipe.mp4")
    rows = _build(root, tmp_path)
    assert rows["pipe.mp4"]["reason"] == scan.UNREADABLE_PATH
    assert "not a regular file" in rows["pipe.mp4"]["probe_error_detail"]


def test_an_unreadable_folder_is_a_row_not_a_silent_gap(root: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    real_scandir = os.scandir
    locked = root / "sub"

    def scandir(path=".", *args):
        if Path(os.fsdecode(path)) == locked:
            raise PermissionError(13, "Permission denied", str(locked))
        return real_scandir(path, *args)

    monkeypatch.setattr(os, "scandir", scandir)
    rows = _build(root, tmp_path)
    assert rows["sub"]["reason"] == scan.UNREADABLE_PATH
    assert "nothing under it is read" in rows["sub"]["probe_error_detail"]
    assert "sub/also_good.mp4" not in rows


def test_an_unreadable_file_is_quarantined(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_sha256 = scan.sha256_file
    unreadable = root / "sub" / "also_good.mp4"

    def sha256_file(path):
        if Path(path) == unreadable:
            raise PermissionError(13, "Permission denied", str(path))
        return real_sha256(path)

    monkeypatch.setattr(scan, "sha256_file", sha256_file)
    rows = _build(root, tmp_path)
    assert rows["sub/also_good.mp4"]["reason"] == scan.UNREADABLE_PATH
    assert "PermissionError" in rows["sub/also_good.mp4"]["probe_error_detail"]


def test_a_file_that_vanishes_mid_scan_is_missing_object(root: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real_sha256 = scan.sha256_file
    doomed = root / "sub" / "also_good.mp4"

    def sha256_file(path):
        if Path(path) == doomed:
            doomed.unlink()  # another process deletes it after the scan listed and stat'ed it
        return real_sha256(path)

    monkeypatch.setattr(scan, "sha256_file", sha256_file)
    rows = _build(root, tmp_path)
    assert rows["sub/also_good.mp4"]["reason"] == manifest_ops.MISSING_OBJECT
    assert "vanished during the scan" in rows["sub/also_good.mp4"]["probe_error_detail"]


def test_names_that_are_not_utf8_are_quarantined(root: Path, tmp_path: Path) -> None:
    raw_root = os.fsencode(root)
    with open(os.path.join(raw_root, b"caf\xe9.mp4"), "wb") as handle:  # Latin-1, as old cameras write
        handle.write((root / "good.mp4").read_bytes())
    os.mkdir(os.path.join(raw_root, b"d\xff"))
    with open(os.path.join(raw_root, b"d\xff", b"inside.mp4"), "wb") as handle:
        handle.write(b"bytes")
    rows = _build(root, tmp_path)
    assert rows["caf\\xe9.mp4"]["reason"] == scan.INVALID_FILENAME
    assert rows["d\\xff"]["reason"] == scan.INVALID_FILENAME
    assert "not valid UTF-8" in rows["caf\\xe9.mp4"]["probe_error_detail"]


def test_listing_of_a_hostile_root_is_stable_and_tabular(root: Path) -> None:
    os.symlink("loop.mp4", root / "loop.mp4")
    os.mkfifo(root / "pipe.mkv")
    with open(os.path.join(os.fsencode(root), b"x\x80.mp4"), "wb"):
        pass
    first, second = scan.scan_media_root(root), scan.scan_media_root(root)
    assert scan.listing_version(first) == scan.listing_version(second)
    table = scan.listing_table(first)
    errors = dict(zip(table.column("uri").to_pylist(), table.column("scan_error").to_pylist()))
    assert errors == {"good.mp4": "", "loop.mp4": scan.SYMLINK_LOOP, "pipe.mkv": scan.UNREADABLE_PATH,
                      "x\\x80.mp4": scan.INVALID_FILENAME, "sub/also_good.mp4": ""}
    assert scan.quick_fingerprint(root)


def test_clean_listing_keeps_its_version_shape(root: Path) -> None:
    # Error-free entries hash exactly as before the scan learned about errors: no spurious new version.
    listed = scan.scan_media_root(root)
    expected = digest_json([[f.uri, f.size_bytes, f.sha256, f.escapes_root, f.link_target] for f in listed])[:24]
    assert scan.listing_version(listed) == expected


# --- review #9: two objects, one uri --------------------------------------------------------------


def _write_colliding_names(root: Path) -> None:
    """A name with a real 0xFF byte, and a name literally spelled with a backslash, 'x', 'f', 'f'."""
    with open(os.path.join(os.fsencode(root), b"bad\xff.mp4"), "wb") as handle:
        handle.write((root / "good.mp4").read_bytes())
    write_clip(root / "bad\\xff.mp4", seed=2)


def test_a_real_0xff_byte_and_a_literal_backslash_name_get_two_uris(root: Path, tmp_path: Path) -> None:
    _write_colliding_names(root)
    listed = {item.uri: item for item in scan.scan_media_root(root)}
    assert set(listed) == {"good.mp4", "sub/also_good.mp4", "bad\\xff.mp4", "bad\\\\xff.mp4"}
    rows = _build(root, tmp_path)
    assert rows["bad\\xff.mp4"]["reason"] == scan.INVALID_FILENAME
    assert "not valid UTF-8" in rows["bad\\xff.mp4"]["probe_error_detail"]
    # Its uri is escaped, so it is not the path any later stage would open: refused, never dropped.
    assert rows["bad\\\\xff.mp4"]["reason"] == scan.INVALID_FILENAME
    assert "backslash" in rows["bad\\\\xff.mp4"]["probe_error_detail"]


def test_every_listed_object_has_exactly_one_row(root: Path) -> None:
    # What the blocking check manifest_covers_listing asserts, on the build that used to lose a row.
    _write_colliding_names(root)
    listed = [item.uri for item in scan.scan_media_root(root) if item.kind == scan.KIND_MEDIA]
    uris = manifest_ops.build_manifest(root, CONFIG).table.column("uri").to_pylist()
    assert sorted(uris) == sorted(listed) and len(set(uris)) == len(uris) == 4


def test_the_escape_is_injective_and_leaves_clean_names_alone() -> None:
    names = ["caf\udce9.mp4", "caf\\xe9.mp4", "caf\\\\xe9.mp4", "caf\\\udce9.mp4", "50% off café.mp4", "a b.mp4"]
    escaped = [scan.printable_uri(name) for name in names]
    assert len(set(escaped)) == len(names), escaped
    assert escaped[-2:] == names[-2:], "valid UTF-8 without a backslash keeps its uri, and so its listing version"


def test_clean_unusual_names_keep_their_uri_and_are_probed(root: Path, tmp_path: Path) -> None:
    write_clip(root / "50% off café.mp4", seed=3)
    rows = _build(root, tmp_path)
    assert rows["50% off café.mp4"]["probe_error"] is None


def test_a_residual_uri_collision_quarantines_both(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The old, non-injective escape (no backslash escaping) stands in for any future way two
    # objects could map to one uri: both get a row and a reason, none silently replaces the other.
    _write_colliding_names(root)
    monkeypatch.setattr(scan, "printable_uri",
                        lambda uri: uri.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace"))
    manifest = manifest_ops.build_manifest(root, CONFIG)
    colliding = [row for row in manifest.table.to_pylist() if row["uri"] == "bad\\xff.mp4"]
    assert len(colliding) == 2
    assert {row["probe_error"] for row in colliding} == {scan.INVALID_FILENAME}
    assert all("2 objects share the uri" in row["probe_error_detail"] for row in colliding)
    rejected = validation_ops.validate(manifest, validation_ops.ValidationConfig(verify_objects="off")).rejected
    assert list(rejected["uri"]).count("bad\\xff.mp4") == 2
