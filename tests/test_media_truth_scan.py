"""Issue 9, item 2: nothing in the media root crashes a build.

Each case is real where the test machine allows it (symlink loops, a FIFO, a name that is not
UTF-8, a file deleted while the scan reads the root). Tests run as root, and root reads a
chmod-000 file or folder anyway, so "permission denied" is injected at the exact OS boundary the
scan calls (``os.scandir`` for a folder, ``scan.open_regular`` for a file), with the real scan code
around it; the other paths through the scan stay untouched.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from helpers import write_clip

from ops.curation import manifest as manifest_ops
from ops.media import scan
from ops.media import sidecar as sidecar_ops
from ops.curation import validation as validation_ops
from ops.publish.hashing import digest_json

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
    real_open = scan.open_regular

    def open_regular(base, relative):  # the one place the scan opens a file
        if relative == "sub/also_good.mp4":
            raise PermissionError(13, "Permission denied", str(Path(base) / relative))
        return real_open(base, relative)

    monkeypatch.setattr(scan, "open_regular", open_regular)
    rows = _build(root, tmp_path)
    assert rows["sub/also_good.mp4"]["reason"] == scan.UNREADABLE_PATH
    assert "PermissionError" in rows["sub/also_good.mp4"]["probe_error_detail"]


def test_a_file_that_vanishes_mid_scan_is_missing_object(root: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = scan.open_regular
    doomed = root / "sub" / "also_good.mp4"

    def open_regular(base, relative):
        if relative == "sub/also_good.mp4":
            doomed.unlink()  # another process deletes it after the scan listed it
        return real_open(base, relative)

    monkeypatch.setattr(scan, "open_regular", open_regular)
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


# ---- Issue 32, item 4: what is parsed and probed is what the scan hashed ----
# The swap is real: a wrapper around the scan changes the root after the listing was hashed and
# before the manifest reads anything, as another process could.

REVOKED = b'{"caption": "c", "license": "CC0-1.0", "consent": "revoked"}'
GRANTED = REVOKED.replace(b"revoked", b"granted")  # same size: only the hash tells them apart


def _after_scan(monkeypatch: pytest.MonkeyPatch, swap) -> None:
    real_scan = scan.scan_media_root

    def scan_then_swap(root, **kwargs):
        listed = real_scan(root, **kwargs)
        swap()
        return listed

    monkeypatch.setattr(scan, "scan_media_root", scan_then_swap)


def _consents(manifest: manifest_ops.Manifest) -> dict[str, tuple]:
    return {row["uri"]: (row["consent"], row["sidecar_error"]) for row in manifest.table.to_pylist()}


def test_a_sidecar_flipped_after_the_scan_is_refused_not_read_as_granted(root: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    sidecar = root / "good.mp4.json"
    sidecar.write_bytes(REVOKED)
    _after_scan(monkeypatch, lambda: sidecar.write_bytes(GRANTED))
    rows = _consents(manifest_ops.build_manifest(root, CONFIG))
    assert rows["good.mp4.json"] == (None, manifest_ops.CHECKSUM_MISMATCH)
    assert rows["good.mp4"] == (None, manifest_ops.MISSING_SIDECAR)  # never "granted" under the revoked hash


def _outside_copy(tmp_path: Path, name: str, data: bytes) -> Path:
    outside = tmp_path / "outside" / name
    outside.parent.mkdir(exist_ok=True)
    outside.write_bytes(data)
    return outside


def test_a_sidecar_swapped_for_a_symlink_after_the_scan_is_never_followed(root: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The link's target holds the very bytes that were hashed: only refusing to follow the link catches it.
    sidecar = root / "good.mp4.json"
    sidecar.write_bytes(GRANTED)
    outside = _outside_copy(tmp_path, "good.mp4.json", GRANTED)

    def swap() -> None:
        sidecar.unlink()
        sidecar.symlink_to(outside)

    _after_scan(monkeypatch, swap)
    rows = _consents(manifest_ops.build_manifest(root, CONFIG))
    assert rows["good.mp4.json"] == (None, manifest_ops.CHECKSUM_MISMATCH)
    assert rows["good.mp4"][0] is None


def test_a_folder_swapped_for_a_symlink_after_the_scan_is_never_followed(root: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (root / "sub" / "also_good.mp4.json").write_bytes(GRANTED)
    outside = _outside_copy(tmp_path, "also_good.mp4.json", GRANTED).parent
    (outside / "also_good.mp4").write_bytes((root / "sub" / "also_good.mp4").read_bytes())

    def swap() -> None:
        (root / "sub").rename(root / ".sub_before")
        (root / "sub").symlink_to(outside, target_is_directory=True)

    _after_scan(monkeypatch, swap)
    manifest = manifest_ops.build_manifest(root, CONFIG)
    rows = _consents(manifest)
    assert rows["sub/also_good.mp4.json"] == (None, manifest_ops.CHECKSUM_MISMATCH)
    probed = {row["uri"]: row["probe_error"] for row in manifest.table.to_pylist()}
    assert probed["sub/also_good.mp4"] == manifest_ops.CHECKSUM_MISMATCH  # same bytes, but not the file hashed
    assert probed["good.mp4"] is None


def test_a_sidecar_swapped_for_a_fifo_after_the_scan_does_not_hang_the_build(root: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    sidecar = root / "good.mp4.json"
    sidecar.write_bytes(GRANTED)

    def swap() -> None:
        sidecar.unlink()
        os.mkfifo(sidecar)

    _after_scan(monkeypatch, swap)
    built: list[manifest_ops.Manifest] = []
    worker = threading.Thread(target=lambda: built.append(manifest_ops.build_manifest(root, CONFIG)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    if worker.is_alive():  # blocked opening the FIFO: a writer that connects and closes releases it
        os.close(os.open(sidecar, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(timeout=10)
        pytest.fail("the build blocked on a FIFO that replaced a sidecar after the scan")
    assert _consents(built[0])["good.mp4.json"] == (None, manifest_ops.CHECKSUM_MISMATCH)


@pytest.mark.parametrize("swap_kind", ["rewritten", "symlink"])
def test_media_changed_after_the_scan_is_not_probed_as_the_hashed_file(root: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       swap_kind: str) -> None:
    clip = root / "good.mp4"
    other = write_clip(tmp_path / "other.mp4", width=96, height=64, seed=3)  # a valid clip of another size

    def swap() -> None:
        if swap_kind == "rewritten":
            clip.write_bytes(other.read_bytes())
        else:
            clip.unlink()
            clip.symlink_to(other)

    _after_scan(monkeypatch, swap)
    rows = {row["uri"]: row for row in manifest_ops.build_manifest(root, CONFIG).table.to_pylist()}
    assert rows["good.mp4"]["probe_error"] == manifest_ops.CHECKSUM_MISMATCH
    assert rows["good.mp4"]["width"] is None  # the other clip's 96 px never describe the hashed bytes
    assert rows["sub/also_good.mp4"]["probe_error"] is None


# ---- Issue 32, item 5: one sidecar never stops the build ----

def test_hostile_sidecars_each_become_a_reason_and_the_build_goes_on(root: Path) -> None:
    clip = (root / "good.mp4").read_bytes()
    sidecars = {
        "deep": b"[" * 200_000 + b"]" * 200_000,  # json recurses once per level
        "deep_object": b'{"a":' * 200_000 + b"1" + b"}" * 200_000,
        "doubled": b'{"license": "CC0-1.0", "consent": "revoked", "consent": "granted"}',
        "long_caption": json.dumps({"caption": "x" * (sidecar_ops.MAX_CAPTION_BYTES + 1), "license": "CC0-1.0",
                                    "consent": "granted"}).encode(),
        # over the 1 MiB sidecar bound (as a 64 MB caption is): refused from its size, before it is read
        "huge": b'{"caption": "' + b"x" * (2 << 20) + b'", "license": "CC0-1.0", "consent": "granted"}',
    }
    for name, data in sidecars.items():
        (root / f"{name}.mp4").write_bytes(clip)
        (root / f"{name}.mp4.json").write_bytes(data)
    (root / "good.mp4.json").write_bytes(GRANTED)
    rows = {row["uri"]: row for row in manifest_ops.build_manifest(root, CONFIG).table.to_pylist()}
    for name in sidecars:
        assert rows[f"{name}.mp4"]["sidecar_error"] == sidecar_ops.MALFORMED_SIDECAR, name
        assert rows[f"{name}.mp4"]["consent"] is None and rows[f"{name}.mp4"]["caption"] is None, name
    assert "stated twice" in rows["doubled.mp4"]["sidecar_error_detail"]
    assert "caption is" in rows["long_caption.mp4"]["sidecar_error_detail"]
    assert "at most" in rows["huge.mp4"]["sidecar_error_detail"]
    assert "nested" in rows["deep.mp4"]["sidecar_error_detail"]
    assert (rows["good.mp4"]["consent"], rows["good.mp4"]["sidecar_error"]) == ("granted", None)


def test_a_listed_file_is_never_read_past_its_limit(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = root / "dataset_card.yaml"
    with open(big, "wb") as handle:  # 300 MB, sparse: cheap to make
        handle.truncate(300 << 20)
    read_bytes = []
    real_read = os.read

    def counting_read(descriptor, size):
        data = real_read(descriptor, size)
        read_bytes.append(len(data))
        return data

    monkeypatch.setattr(os, "read", counting_read)
    with pytest.raises(scan.FileTooLarge, match="at most 65536"):
        scan.read_regular(root, "dataset_card.yaml", max_bytes=64 * 1024, what="dataset card")
    assert sum(read_bytes) == 0  # refused from fstat's size, before any byte
