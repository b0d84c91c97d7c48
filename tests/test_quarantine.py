"""Tests of ops/curation/quarantine.py: the ledger across reruns and manifest versions, and published sets."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pandas as pd
import pytest
from helpers import manifest_row

from ops.curation import ledger_anchor, quarantine, validation
from ops.curation import manifest as manifest_ops
from ops.publish.storage import DIGESTS_FILE

CONFIG = validation.ValidationConfig()
MISSING_LICENSE_URI = "edge_cases/missing_license.mp4"
STILL_BAD_URI = "edge_cases/empty.mp4"


def _ledger(data_root: Path) -> dict[tuple[str, str], dict]:
    """The ledger folded into one entry per (uri, reason)."""
    entries = quarantine.ledger_entries(quarantine.read_ledger(quarantine.ledger_path(data_root))).values()
    return {(entry["uri"], entry["reason"]): entry for entry in entries}


def _entries(ledger_file: Path) -> list[dict]:
    return list(quarantine.ledger_entries(quarantine.read_ledger(ledger_file)).values())


def test_rerun_on_the_same_manifest_gives_an_identical_quarantine(demo_manifest, tmp_path: Path) -> None:
    ledger_file = quarantine.ledger_path(tmp_path)
    first = quarantine.record(validation.validate(demo_manifest, CONFIG), ledger_file)
    ledger_after_first = quarantine.read_ledger(ledger_file)
    second = quarantine.record(validation.validate(demo_manifest, CONFIG), ledger_file)
    pd.testing.assert_frame_equal(first, second)
    assert quarantine.read_ledger(ledger_file) == ledger_after_first
    assert list(first.columns) == quarantine.QUARANTINE_SCHEMA.names
    assert set(first["first_seen_version"]) == set(first["manifest_version"]) == {demo_manifest.version}
    assert list(first["uri"]) == sorted(first["uri"])
    assert len(ledger_after_first) == len(first) + 1  # one VALIDATED marker for the manifest version
    assert [event["event"] for event in ledger_after_first] == [quarantine.VALIDATED] + [quarantine.QUARANTINED] * len(first)
    assert all(entry["resolved_in_version"] is None for entry in _entries(ledger_file))


def test_fixed_file_leaves_quarantine_and_keeps_its_history(media_copy: Path, tmp_path: Path) -> None:
    data_root = tmp_path / "data"
    ledger_file = quarantine.ledger_path(data_root)
    old = manifest_ops.build_manifest(media_copy, manifest_ops.ManifestConfig())
    old_quarantine = quarantine.record(validation.validate(old, CONFIG), ledger_file)
    assert MISSING_LICENSE_URI in set(old_quarantine["uri"])

    sidecar_path = media_copy / f"{MISSING_LICENSE_URI}.json"
    sidecar = json.loads(sidecar_path.read_text())
    assert "license" not in sidecar
    sidecar_path.write_text(json.dumps({**sidecar, "license": "CC0-1.0"}))
    new = manifest_ops.build_manifest(media_copy, manifest_ops.ManifestConfig())
    assert new.version != old.version
    new_quarantine = quarantine.record(validation.validate(new, CONFIG), ledger_file)

    assert MISSING_LICENSE_URI not in set(new_quarantine["uri"])
    assert set(new_quarantine["uri"]) == set(old_quarantine["uri"]) - {MISSING_LICENSE_URI}
    ledger = _ledger(data_root)
    fixed = ledger[(MISSING_LICENSE_URI, validation.MISSING_LICENSE)]
    assert (fixed["first_seen_version"], fixed["last_seen_version"], fixed["resolved_in_version"]) == (
        old.version, old.version, new.version)

    still_bad = new_quarantine.set_index("uri").loc[STILL_BAD_URI]
    assert (still_bad["first_seen_version"], still_bad["manifest_version"]) == (old.version, new.version)
    entry = ledger[(STILL_BAD_URI, "empty_file")]
    assert (entry["first_seen_version"], entry["last_seen_version"], entry["resolved_in_version"]) == (
        old.version, new.version, None)
    assert set(new_quarantine["first_seen_version"]) == {old.version}


def test_file_that_breaks_again_reopens_its_entry(demo_manifest, tmp_path: Path) -> None:
    ledger_file = quarantine.ledger_path(tmp_path)
    bad = validation.validate(demo_manifest, CONFIG)
    quarantine.record(bad, ledger_file)
    clean = validation.Validation(accepted=bad.accepted, rejected=bad.rejected.iloc[0:0], version="v2",
                                  manifest_version="later", config=CONFIG, media_root=bad.media_root)
    quarantine.record(clean, ledger_file)
    assert {entry["resolved_in_version"] for entry in _entries(ledger_file)} == {"later"}
    broken_again = validation.Validation(accepted=bad.accepted, rejected=bad.rejected, version="v3",
                                         manifest_version="third", config=CONFIG, media_root=bad.media_root)
    again = quarantine.record(broken_again, ledger_file)
    assert set(again["first_seen_version"]) == {demo_manifest.version}
    assert {(entry["last_seen_version"], entry["resolved_in_version"]) for entry in _entries(ledger_file)} == {
        ("third", None)}


def test_published_validation_round_trips(demo_manifest, tmp_path: Path) -> None:
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(tmp_path))  # load_validation checks against it
    result = validation.validate(demo_manifest, CONFIG, code_version="test")
    rows = quarantine.record(result, quarantine.ledger_path(tmp_path))
    directory = quarantine.validated_dir(tmp_path, result.version)
    report = {"version": result.version, "manifest_version": result.manifest_version,
              "media_root": result.media_root, "config": asdict(CONFIG)}
    quarantine.write_validated(result, rows, directory, report)
    assert {path.name for path in directory.iterdir()} == {
        quarantine.VALIDATED_FILE, quarantine.QUARANTINE_FILE, quarantine.REPORT_FILE, DIGESTS_FILE}
    pd.testing.assert_frame_equal(quarantine.read_quarantine(directory), rows)

    loaded = quarantine.load_validation(directory)
    assert loaded.accepted.equals(result.accepted)
    pd.testing.assert_frame_equal(loaded.rejected, result.rejected)
    assert (loaded.version, loaded.manifest_version, loaded.config, loaded.media_root, loaded.code_version) == (
        result.version, result.manifest_version, CONFIG, result.media_root, "test")
    assert [gate.passed for gate in validation.gates(loaded)] == [gate.passed for gate in validation.gates(result)]


def test_published_validation_is_never_overwritten_in_place(demo_manifest, tmp_path: Path) -> None:
    """Same content again: the folder is left as it is. Other content under the same version (only a
    forged folder or a bug gives that): the old folder is set aside, never edited in place."""
    result = validation.validate(demo_manifest, CONFIG)
    rows = quarantine.record(result, quarantine.ledger_path(tmp_path))
    directory = quarantine.validated_dir(tmp_path, result.version)
    quarantine.write_validated(result, rows, directory, {"marker": 1})
    inode = directory.stat().st_ino
    quarantine.write_validated(result, rows, directory, {"marker": 1})
    assert directory.stat().st_ino == inode and not [p for p in directory.parent.iterdir() if p.name.startswith(".")]
    quarantine.write_validated(result, rows.iloc[0:0], directory, {"marker": 2})
    assert json.loads((directory / quarantine.REPORT_FILE).read_text())["marker"] == 2
    (aside,) = [p for p in directory.parent.iterdir() if p.name.startswith(".")]
    assert json.loads((aside / quarantine.REPORT_FILE).read_text())["marker"] == 1
    assert "differ" in (aside / "DAMAGED.txt").read_text()


def test_an_edited_validation_is_never_published_under_its_version(demo_manifest, tmp_path: Path) -> None:
    result = validation.validate(demo_manifest, CONFIG)
    rows = quarantine.record(result, quarantine.ledger_path(tmp_path))
    edited = validation.Validation(accepted=result.accepted, rejected=result.rejected.iloc[1:], version=result.version,
                                   manifest_version=result.manifest_version, config=CONFIG,
                                   media_root=result.media_root)
    with pytest.raises(ValueError, match="hash to"):
        quarantine.write_validated(edited, rows, quarantine.validated_dir(tmp_path, result.version), {})
    assert not quarantine.validated_dir(tmp_path, result.version).exists()


def _validated(*rows: dict) -> validation.Validation:
    manifest = manifest_ops.manifest_from_rows(list(rows), config={}, media_root="/nowhere")
    return validation.validate(manifest, validation.ValidationConfig(verify_objects="off", max_quarantine_fraction=1.0))


@pytest.mark.parametrize("attack", ["older_copy", "deleted", "another_history"])
def test_a_rolled_back_quarantine_ledger_is_refused_by_name(tmp_path: Path, attack: str) -> None:
    """The quarantine ledger's newest state is anchored outside the data root (ops/curation/ledger_anchor.py): an older
    copy restored, the ledger deleted, or another history put in its place never rewrites quarantine history."""
    ledger_file = quarantine.ledger_path(tmp_path / "data")
    broken = _validated(manifest_row("a.mp4"), manifest_row("b.mp4", license=""))
    quarantine.record(broken, ledger_file)
    older = ledger_file.read_bytes()
    fixed = _validated(manifest_row("a.mp4"), manifest_row("b.mp4"))
    quarantine.record(fixed, ledger_file)  # b.mp4 resolved
    if attack == "older_copy":
        ledger_file.write_bytes(older)
    elif attack == "deleted":
        ledger_file.unlink()
    else:  # as many events, in another data root's ledger
        other = quarantine.ledger_path(tmp_path / "other")
        quarantine.record(_validated(manifest_row("x.mp4", license="")), other)
        quarantine.record(_validated(manifest_row("x.mp4")), other)
        ledger_file.write_bytes(other.read_bytes())
    with pytest.raises(quarantine.QuarantineLedgerRolledBack, match="anchor") as refused:
        quarantine.record(fixed, ledger_file)
    assert str(ledger_file) in str(refused.value)


def test_a_quarantine_ledger_ahead_of_its_anchor_is_accepted_and_anchors_it(tmp_path: Path) -> None:
    ledger_file = quarantine.ledger_path(tmp_path)
    anchor = ledger_anchor.anchor_file(ledger_file)
    quarantine.record(_validated(manifest_row("a.mp4"), manifest_row("b.mp4", license="")), ledger_file)
    first = anchor.read_bytes()
    events = quarantine.read_ledger(ledger_file)
    fixed = _validated(manifest_row("a.mp4"), manifest_row("b.mp4"))
    quarantine.record(fixed, ledger_file)
    anchor.write_bytes(first)  # the anchor write after the second append was lost
    quarantine.record(fixed, ledger_file)
    assert ledger_anchor.load(ledger_file).count == len(quarantine.read_ledger(ledger_file)) > len(events)
