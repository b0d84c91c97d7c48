"""Tests of ops/curation/validation.py on small hand-built manifests: row rules, set rules, priority, gates."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa
import pytest
from helpers import manifest_row

from ops.curation import manifest as manifest_ops
from ops.curation import validation
from ops.curation.manifest import MANIFEST_SCHEMA
from ops.curation.splits import SplitConfig, assign_split

OFF = validation.ValidationConfig(verify_objects="off")
NO_MEDIA = "/nonexistent-media-root"


def _manifest(rows: list[dict], *, media_root: str = NO_MEDIA, config: dict | None = None) -> manifest_ops.Manifest:
    return manifest_ops.manifest_from_rows(rows, config=config or {}, media_root=media_root)


def _reasons(result: validation.Validation) -> dict[str, str]:
    return dict(zip(result.rejected["uri"], result.rejected["reason"]))


def _details(result: validation.Validation) -> dict[str, str]:
    return dict(zip(result.rejected["uri"], result.rejected["detail"]))


def _three_splits() -> list[dict]:
    return [manifest_row("a.mp4", split="train"), manifest_row("b.mp4", split="val"),
            manifest_row("c.mp4", split="test")]


def test_good_rows_are_all_accepted() -> None:
    result = validation.validate(_manifest(_three_splits()), OFF)
    assert result.rejected.empty
    assert result.accepted.column("uri").to_pylist() == ["a.mp4", "b.mp4", "c.mp4"]
    assert result.split_counts() == {"test": 1, "train": 1, "val": 1}


# --- row rules ---------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "reason"), [
    ({"duration_s": 0.1}, validation.INVALID_DURATION),
    ({"duration_s": 601.0}, validation.INVALID_DURATION),
    ({"width": 16}, validation.UNEXPECTED_DIMENSIONS),
    ({"height": 5000}, validation.UNEXPECTED_DIMENSIONS),
    ({"width": 1000, "height": 200}, validation.UNEXPECTED_DIMENSIONS),  # aspect 5 > 4
    ({"width": 100, "height": 401}, validation.UNEXPECTED_DIMENSIONS),  # portrait, aspect just over 4
    ({"fps": 0.5}, validation.INVALID_FRAME_RATE),
    ({"fps": 500.0}, validation.INVALID_FRAME_RATE),
    ({"video_codec": "prores"}, validation.UNSUPPORTED_CODEC),
    ({"expected_sha256": "0" * 64}, validation.CHECKSUM_MISMATCH),
    ({"consent": "revoked"}, validation.CONSENT_REVOKED),
    ({"consent": None}, validation.MISSING_CONSENT),
    ({"consent": "pending"}, validation.MISSING_CONSENT),
    ({"license": None}, validation.MISSING_LICENSE),
    ({"license": "   "}, validation.MISSING_LICENSE),
])
def test_row_rule_rejects_with_its_reason(fields: dict, reason: str) -> None:
    rows = [*_three_splits(), manifest_row("bad.mp4", **fields)]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"bad.mp4": reason}
    assert _details(result)["bad.mp4"].startswith(f"{reason}: ")


@pytest.mark.parametrize("fields", [
    {"duration_s": 0.5}, {"duration_s": 600.0}, {"width": 32, "height": 32}, {"width": 400, "height": 100},
    {"fps": 240.0}, {"video_codec": "av1"}, {"expected_sha256": None}, {"audio_codec": None, "sample_rate": None},
])
def test_values_at_the_limits_are_accepted(fields: dict) -> None:
    result = validation.validate(_manifest([*_three_splits(), manifest_row("edge.mp4", **fields)]), OFF)
    assert result.rejected.empty, _details(result)


def test_matching_expected_checksum_is_accepted() -> None:
    row = manifest_row("a.mp4")
    result = validation.validate(_manifest([{**row, "expected_sha256": row["sha256"]}]), OFF)
    assert result.rejected.empty


def test_config_moves_the_row_rules() -> None:
    rows = [manifest_row("a.mp4", duration_s=2.0, video_codec="prores")]
    config = validation.ValidationConfig(verify_objects="off", min_duration_s=3.0,
                                         allowed_video_codecs=("prores",))
    assert _reasons(validation.validate(_manifest(rows), config)) == {"a.mp4": validation.INVALID_DURATION}


def test_primary_reason_follows_priority_and_detail_lists_all() -> None:
    rows = [manifest_row("a.mp4", consent="revoked", license=None, duration_s=0.1)]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"a.mp4": validation.CONSENT_REVOKED}
    codes = [part.split(":")[0] for part in _details(result)["a.mp4"].split("; ")]
    assert codes == [validation.CONSENT_REVOKED, validation.MISSING_LICENSE, validation.INVALID_DURATION]


def test_ingest_errors_become_reasons_in_priority_order() -> None:
    rows = [manifest_row("a.mp4", probe_error="decode_error", probe_error_detail="no frame",
                         sidecar_error="missing_sidecar", sidecar_error_detail="no sidecar", duration_s=0.1),
            manifest_row("b.mp4", sidecar_error="malformed_sidecar", sidecar_error_detail="not JSON")]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"a.mp4": "decode_error", "b.mp4": "malformed_sidecar"}
    # Row rules are not applied to rows that failed at ingest: their probed fields mean nothing.
    assert _details(result)["a.mp4"] == "decode_error: no frame; missing_sidecar: no sidecar"


def test_ingest_error_without_detail_falls_back_to_its_code() -> None:
    result = validation.validate(_manifest([manifest_row("b.mp4", sidecar_error="malformed_sidecar")]), OFF)
    assert _details(result)["b.mp4"] == "malformed_sidecar: malformed_sidecar"


# --- set rules ---------------------------------------------------------------------------

def test_duplicate_content_keeps_the_first_uri() -> None:
    digest = "d" * 64
    rows = [manifest_row("z_copy.mp4", sha256=digest), manifest_row("a_original.mp4", sha256=digest),
            manifest_row("m_other.mp4")]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"z_copy.mp4": validation.DUPLICATE_CONTENT}
    assert "same content as a_original.mp4" in _details(result)["z_copy.mp4"]
    assert "across splits" not in _details(result)["z_copy.mp4"]


@pytest.mark.parametrize("refusal", [{"consent": "revoked"}, {"license": None}, {"probe_error": "decode_error"}])
def test_refused_content_does_not_come_back_under_another_name(refusal: dict) -> None:
    """Duplicates are judged over every row: a copy of refused content (say, revoked consent),
    renamed and with a clean sidecar, is still a duplicate of the refused original."""
    digest = "f" * 64
    rows = [manifest_row("a_original.mp4", sha256=digest, **refusal), manifest_row("z_renamed_copy.mp4", sha256=digest),
            manifest_row("m_other.mp4")]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result)["z_renamed_copy.mp4"] == validation.DUPLICATE_CONTENT
    assert "same content as a_original.mp4" in _details(result)["z_renamed_copy.mp4"]
    assert result.accepted.column("uri").to_pylist() == ["m_other.mp4"]


def test_same_content_in_two_splits_is_a_duplicate_across_splits() -> None:
    digest = "e" * 64
    rows = [manifest_row("a.mp4", sha256=digest, split="train"), manifest_row("b.mp4", sha256=digest, split="test")]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"b.mp4": validation.DUPLICATE_CONTENT}
    assert "across splits train/test" in _details(result)["b.mp4"]
    assert validation.no_split_leakage(result).passed


def test_source_group_in_two_splits_keeps_its_most_common_split() -> None:
    rows = [manifest_row("a.mp4", source_group="g", split="train"),
            manifest_row("b.mp4", source_group="g", split="train"),
            manifest_row("c.mp4", source_group="g", split="test", split_source="sidecar")]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"c.mp4": validation.SPLIT_LEAKAGE}
    assert "'train'" in _details(result)["c.mp4"]


def test_split_tie_goes_to_the_hash_assigned_split() -> None:
    # Alphabetical order would pick "test"; the unpinned row's hash split is "train".
    rows = [manifest_row("a.mp4", source_group="g", split="test", split_source="sidecar"),
            manifest_row("b.mp4", source_group="g", split="train", split_source="group_hash")]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"a.mp4": validation.SPLIT_LEAKAGE}


def test_split_tie_between_pinned_rows_goes_to_the_hash_split() -> None:
    splits = SplitConfig(seed=1)
    assert assign_split("leaky_group", splits) == "train"
    rows = [manifest_row("a.mp4", source_group="leaky_group", split="train", split_source="sidecar"),
            manifest_row("b.mp4", source_group="leaky_group", split="test", split_source="sidecar")]
    config = manifest_ops.ManifestConfig(splits=splits).transform_config()
    result = validation.validate(_manifest(rows, config=config), OFF)
    assert _reasons(result) == {"b.mp4": validation.SPLIT_LEAKAGE}


def test_rows_rejected_for_other_reasons_do_not_vote_on_a_groups_split() -> None:
    rows = [manifest_row("a.mp4", source_group="g", split="test", license=None),
            manifest_row("b.mp4", source_group="g", split="test", license=None),
            manifest_row("c.mp4", source_group="g", split="train")]
    result = validation.validate(_manifest(rows), OFF)
    assert _reasons(result) == {"a.mp4": validation.MISSING_LICENSE, "b.mp4": validation.MISSING_LICENSE}


# --- objects checked at validation time ---------------------------------------------------

@pytest.fixture
def media(tmp_path: Path) -> tuple[Path, list[dict]]:
    """Three files on disk and manifest rows that describe them (train, val, test)."""
    root = tmp_path / "objects"
    root.mkdir()
    rows = []
    for name, split in (("a.mp4", "train"), ("b.mp4", "val"), ("c.mp4", "test")):
        (root / name).write_bytes(name.encode() * 100)
        rows.append(manifest_row(name, split=split, size_bytes=(root / name).stat().st_size))
    return root, rows


def test_object_deleted_after_the_manifest_is_missing(media) -> None:
    root, rows = media
    (root / "b.mp4").unlink()
    built = _manifest(rows, media_root=str(root))
    assert _reasons(validation.validate(built, validation.ValidationConfig(verify_objects="stat"))) == {
        "b.mp4": manifest_ops.MISSING_OBJECT}
    assert validation.validate(built, OFF).rejected.empty


def test_object_that_changed_size_is_a_checksum_mismatch(media) -> None:
    root, rows = media
    with open(root / "a.mp4", "ab") as handle:
        handle.write(b"more")
    result = validation.validate(_manifest(rows, media_root=str(root)), validation.ValidationConfig())
    assert _reasons(result) == {"a.mp4": validation.CHECKSUM_MISMATCH}
    assert "changed after manifest" in _details(result)["a.mp4"]


def test_same_size_change_needs_hash_verification(media) -> None:
    root, rows = media
    from ops.publish.hashing import sha256_file

    rows = [{**row, "sha256": sha256_file(root / row["uri"]), "asset_id": sha256_file(root / row["uri"])}
            for row in rows]
    (root / "c.mp4").write_bytes(b"X" * (root / "c.mp4").stat().st_size)
    built = _manifest(rows, media_root=str(root))
    assert validation.validate(built, validation.ValidationConfig(verify_objects="stat")).rejected.empty
    assert _reasons(validation.validate(built, validation.ValidationConfig(verify_objects="hash"))) == {
        "c.mp4": validation.CHECKSUM_MISMATCH}


# --- gates -------------------------------------------------------------------------------

def _validation(accepted: list[dict], *, rejected: list[dict] = (), config=OFF,
                media_root: str = NO_MEDIA) -> validation.Validation:
    """A Validation as validate() would never produce it, to prove each gate can fail."""
    return validation.Validation(
        accepted=pa.Table.from_pylist(accepted, schema=MANIFEST_SCHEMA),
        rejected=pd.DataFrame(list(rejected), columns=["asset_id", "uri", "reason", "detail"]),
        version="v", manifest_version="m", config=config, media_root=media_root)


def test_every_gate_passes_on_a_good_set(media) -> None:
    root, rows = media
    result = validation.validate(_manifest(rows, media_root=str(root)), validation.ValidationConfig())
    gates = {gate.name: gate for gate in validation.gates(result)}
    assert set(gates) == {"accepted_rows_conform", "no_duplicate_assets", "no_split_leakage", "quarantine_rate",
                          "train_split_nonempty", "objects_unchanged"}
    assert {name: gate.passed for name, gate in gates.items()} == dict.fromkeys(gates, True)
    assert gates["objects_unchanged"].metadata["num_checked"] == 3


def test_object_recheck_gate_only_when_objects_are_verified() -> None:
    result = validation.validate(_manifest(_three_splits()), OFF)
    assert "objects_unchanged" not in {gate.name for gate in validation.gates(result)}


def test_accepted_rows_conform_fails_on_a_bad_accepted_row() -> None:
    gate = validation.accepted_rows_conform(_validation([*_three_splits(), manifest_row("d.mp4", duration_s=0.1)]))
    assert not gate.passed and gate.metadata["num_failing_rows"] == 1


def test_no_duplicate_assets_fails_on_repeated_content() -> None:
    rows = [manifest_row("a.mp4", sha256="f" * 64), manifest_row("b.mp4", sha256="f" * 64)]
    gate = validation.no_duplicate_assets(_validation(rows))
    assert not gate.passed and gate.metadata["num_duplicates"] == 1
    assert validation.no_duplicate_assets(_validation(_three_splits())).passed


@pytest.mark.parametrize(("rows", "leaky_key"), [
    ([manifest_row("a.mp4", source_group="g", split="train"), manifest_row("b.mp4", source_group="g", split="val")],
     "num_groups_in_two_splits"),
    ([manifest_row("a.mp4", sha256="9" * 64, split="train"), manifest_row("b.mp4", sha256="9" * 64, split="val")],
     "num_assets_in_two_splits"),
])
def test_no_split_leakage_fails_on_a_group_or_asset_in_two_splits(rows: list[dict], leaky_key: str) -> None:
    gate = validation.no_split_leakage(_validation(rows))
    assert not gate.passed and gate.metadata[leaky_key] == 1
    assert validation.no_split_leakage(_validation(_three_splits())).passed


def test_quarantine_rate_fails_over_the_limit() -> None:
    rows = [*_three_splits(), *(manifest_row(f"bad{i}.mp4", license=None) for i in range(4))]
    result = validation.validate(_manifest(rows), OFF)
    gate = validation.quarantine_rate(result)
    assert not gate.passed
    assert gate.metadata["quarantine_fraction"] == pytest.approx(4 / 7, abs=1e-6)
    assert gate.metadata["reason_missing_license"] == 4
    relaxed = validation.validate(_manifest(rows), validation.ValidationConfig(verify_objects="off",
                                                                               max_quarantine_fraction=0.6))
    assert validation.quarantine_rate(relaxed).passed


def test_quarantine_rate_zero_tolerance_and_empty_set() -> None:
    rows = [*_three_splits(), manifest_row("bad.mp4", license=None)]
    strict = validation.ValidationConfig(verify_objects="off", max_quarantine_fraction=0.0)
    assert not validation.quarantine_rate(validation.validate(_manifest(rows), strict)).passed
    assert validation.quarantine_rate(validation.validate(_manifest(_three_splits()), strict)).passed
    assert not validation.quarantine_rate(_validation([])).passed, "an empty set must not pass as clean"


def test_train_split_nonempty_fails_without_train_rows() -> None:
    gate = validation.train_split_nonempty(_validation([manifest_row("a.mp4", split="val")]))
    assert not gate.passed and gate.metadata == {"num_val": 1}
    assert not validation.train_split_nonempty(_validation([])).passed
    assert validation.train_split_nonempty(_validation(_three_splits())).passed


def test_objects_unchanged_fails_when_accepted_objects_vanish_or_change(media) -> None:
    root, rows = media
    result = validation.validate(_manifest(rows, media_root=str(root)), validation.ValidationConfig())
    assert validation.objects_unchanged(result).passed
    (root / "a.mp4").unlink()
    (root / "b.mp4").write_bytes(b"shorter")
    gate = validation.objects_unchanged(result)
    assert not gate.passed
    assert (gate.metadata["num_missing"], gate.metadata["num_changed"]) == (1, 1)
    assert gate.metadata["examples"] == "a.mp4, b.mp4"


# --- config and versions -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"min_duration_s": 0}, {"min_duration_s": 5.0, "max_duration_s": 5.0}, {"min_duration_s": -1},
    {"min_side": 0}, {"min_side": 64, "max_side": 32}, {"verify_objects": "sometimes"},
    {"max_quarantine_fraction": -0.1}, {"max_quarantine_fraction": 1.5},
])
def test_validation_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        validation.ValidationConfig(**kwargs)


def test_validation_version_follows_manifest_config_and_code() -> None:
    built = _manifest(_three_splits())
    first = validation.validate(built, OFF, code_version="c1")
    assert validation.validate(built, OFF, code_version="c1").version == first.version
    assert validation.validate(built, OFF, code_version="c2").version != first.version
    other = validation.ValidationConfig(verify_objects="off", min_side=16)
    assert validation.validate(built, other, code_version="c1").version != first.version
    changed = _manifest([*_three_splits(), manifest_row("d.mp4")])
    assert validation.validate(changed, OFF, code_version="c1").version != first.version


def test_validation_version_follows_the_decisions(media) -> None:
    """Same manifest, rules and code, but a file vanished: other decisions are another version."""
    root, rows = media
    built = _manifest(rows, media_root=str(root))
    stat = validation.ValidationConfig(verify_objects="stat")
    before = validation.validate(built, stat, code_version="c1")
    assert before.rejected.empty
    (root / "b.mp4").unlink()
    after = validation.validate(built, stat, code_version="c1")
    assert _reasons(after) == {"b.mp4": manifest_ops.MISSING_OBJECT}
    assert after.version != before.version
