"""Tests of ops/curation/manifest.py over the demo media: rows, reasons, versions, immutable publication."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import write_clip

from ops.curation import manifest as manifest_ops
from ops.media import scan
from ops.curation import validation
from tools.demo_media import EDGE_CASE_PURPOSES
from ops.media.probe import ProbeLimits
from ops.curation.splits import SplitConfig
from ops.publish.storage import DIGESTS_FILE

REQUIRED_COLUMNS = ("asset_id", "uri", "size_bytes", "sha256", "container", "video_codec", "width", "height", "fps",
                    "num_frames", "duration_s", "audio_codec", "sample_rate", "channels", "caption", "license",
                    "consent", "source_group", "split", "provenance", "probe_error")


@pytest.fixture(scope="module")
def demo_validation(demo_manifest) -> validation.Validation:
    return validation.validate(demo_manifest, validation.ValidationConfig())


@pytest.fixture(scope="module")
def rejected(demo_validation) -> dict[str, str]:
    return dict(zip(demo_validation.rejected["uri"], demo_validation.rejected["reason"]))


def test_one_row_per_object_and_per_orphan_sidecar(demo, demo_manifest) -> None:
    listed = scan.scan_media_root(demo.out_dir)
    objects = {item.uri for item in listed if item.kind in (scan.KIND_MEDIA, scan.KIND_UNSUPPORTED)}
    orphans = {uri for uri in demo.bad if uri.endswith(".json")}  # sidecars without their media
    uris = demo_manifest.table.column("uri").to_pylist()
    assert len(uris) == len(set(uris))
    assert set(uris) == objects | orphans
    assert uris == sorted(uris)
    assert set(demo.good) | set(demo.split_leak) <= objects


def test_required_columns_are_present(demo_manifest) -> None:
    missing = [name for name in REQUIRED_COLUMNS if name not in demo_manifest.table.schema.names]
    assert missing == []
    assert demo_manifest.table.schema.equals(manifest_ops.MANIFEST_SCHEMA)


def test_good_clip_rows_carry_probe_and_sidecar_facts(demo, demo_manifest) -> None:
    rows = {row["uri"]: row for row in demo_manifest.table.to_pylist()}
    for uri in demo.good:
        row, sidecar = rows[uri], json.loads((demo.out_dir / f"{uri}.json").read_text())
        assert row["probe_error"] is None and row["sidecar_error"] is None
        assert row["sha256"] == row["asset_id"] == sidecar["sha256"]
        assert row["size_bytes"] == (demo.out_dir / uri).stat().st_size
        assert (row["caption"], row["license"], row["consent"], row["source_group"], row["split"]) == (
            sidecar["caption"], sidecar["license"], sidecar["consent"], sidecar["source_group"], sidecar["split"])
        assert row["video_codec"] == "h264" and row["width"] > 0 and row["height"] > 0 and row["fps"] > 0
        assert row["duration_s"] > 0 and row["num_frames"] > 0
        provenance = json.loads(row["provenance"])
        assert provenance["sidecar"] == f"{uri}.json" and provenance["prober"].startswith("pyav ")


@pytest.mark.parametrize("reason", sorted(EDGE_CASE_PURPOSES))
def test_each_bad_input_is_quarantined_with_its_reason(demo, rejected, reason: str) -> None:
    if reason == validation.SPLIT_LEAKAGE:
        leaked = {uri: rejected.get(uri) for uri in demo.split_leak}
        assert sorted(leaked.values(), key=str) == [None, validation.SPLIT_LEAKAGE], leaked
        return
    uris = [uri for uri, expected in demo.bad.items() if expected == reason]
    assert uris, f"the demo set has no {reason} case"
    assert {uri: rejected.get(uri) for uri in uris} == dict.fromkeys(uris, reason)


def test_quarantine_is_exactly_the_bad_inputs(demo, rejected) -> None:
    (leaked,) = [uri for uri in demo.split_leak if uri in rejected]
    assert rejected == {**demo.bad, leaked: validation.SPLIT_LEAKAGE}


def test_good_clips_are_all_accepted(demo, demo_validation) -> None:
    accepted = set(demo_validation.accepted.column("uri").to_pylist())
    (kept,) = [uri for uri in demo.split_leak if uri in accepted]
    assert accepted == set(demo.good) | {kept}


def test_unpinned_rows_of_one_group_share_a_split(tmp_path: Path) -> None:
    """Groups spread over splits by hash, and every object of a group lands in its group's split."""
    media = tmp_path / "media"
    media.mkdir()
    num_groups = 12
    for index in range(3 * num_groups):
        # Unsupported objects are never probed, yet get a split like any other row: fast to build.
        (media / f"object_{index:02d}.bin").write_bytes(bytes([index]))
        sidecar = {"license": "CC0-1.0", "consent": "granted", "source_group": f"g{index % num_groups}"}
        (media / f"object_{index:02d}.bin.json").write_text(json.dumps(sidecar))
    built = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig())
    splits_by_group = defaultdict(set)
    for row in built.table.to_pylist():
        assert row["split_source"] == "group_hash"
        splits_by_group[row["source_group"]].add(row["split"])
    assert len(splits_by_group) == num_groups
    assert all(len(splits) == 1 for splits in splits_by_group.values()), dict(splits_by_group)
    assert len(set().union(*splits_by_group.values())) > 1, "12 groups all hashed into one split"


def test_building_twice_gives_the_same_version_and_quarantine(demo, demo_manifest, demo_validation) -> None:
    again = manifest_ops.build_manifest(demo.out_dir, manifest_ops.ManifestConfig(num_probe_workers=1))
    assert again.version == demo_manifest.version
    assert again.table.equals(demo_manifest.table)
    revalidated = validation.validate(again, validation.ValidationConfig())
    assert revalidated.rejected.equals(demo_validation.rejected)
    assert revalidated.version == demo_validation.version


@pytest.mark.parametrize("config", [
    manifest_ops.ManifestConfig(splits=SplitConfig(seed=1)),
    manifest_ops.ManifestConfig(splits=SplitConfig(ratios={"train": 0.5, "val": 0.25, "test": 0.25})),
    manifest_ops.ManifestConfig(limits=ProbeLimits(max_duration_s=3000.0)),
    manifest_ops.ManifestConfig(limits=ProbeLimits(max_pixels=1920 * 1080)),
])
def test_transform_config_changes_the_version(demo, demo_manifest, config) -> None:
    assert manifest_ops.build_manifest(demo.out_dir, config).version != demo_manifest.version


def test_version_depends_on_rows_not_listing_order(demo_manifest) -> None:
    rows = demo_manifest.table.to_pylist()
    kwargs = {"config": demo_manifest.config, "media_root": demo_manifest.media_root}
    assert manifest_ops.manifest_from_rows(rows[::-1], **kwargs).version == demo_manifest.version
    rows[0] = {**rows[0], "caption": "edited"}
    assert manifest_ops.manifest_from_rows(rows, **kwargs).version != demo_manifest.version


def test_media_root_changes_the_version(demo_manifest) -> None:
    """Same rows under another media root are other files: validation and sharding read them from there."""
    rows, config = demo_manifest.table.to_pylist(), demo_manifest.config
    here = manifest_ops.manifest_from_rows(rows, config=config, media_root=demo_manifest.media_root)
    elsewhere = manifest_ops.manifest_from_rows(rows, config=config, media_root="/mnt/other-copy")
    assert here.version == demo_manifest.version
    assert elsewhere.version != demo_manifest.version


def _tree(directory: Path) -> dict[str, tuple[int, int]]:
    return {path.name: (path.stat().st_mtime_ns, path.stat().st_size) for path in directory.iterdir()}


def test_write_manifest_is_immutable_and_round_trips(demo_manifest, tmp_path: Path) -> None:
    out = tmp_path / "manifests"
    path = manifest_ops.write_manifest(demo_manifest, out)
    assert path == out / demo_manifest.version
    before = _tree(path)
    assert set(before) == {manifest_ops.MANIFEST_FILE, manifest_ops.INFO_FILE, DIGESTS_FILE}

    tampered = manifest_ops.Manifest(table=demo_manifest.table.slice(0, 1), version=demo_manifest.version,
                                     media_root=demo_manifest.media_root, config=demo_manifest.config)
    with pytest.raises(ValueError, match="hash to"):  # rows that are not its version are never published
        manifest_ops.write_manifest(tampered, out)
    assert manifest_ops.write_manifest(demo_manifest, out) == path
    assert _tree(path) == before
    assert os.listdir(out) == [demo_manifest.version], "a staging directory was left behind"

    loaded = manifest_ops.read_manifest(path)
    assert loaded.table.equals(demo_manifest.table)
    assert (loaded.version, loaded.media_root, loaded.config) == (
        demo_manifest.version, demo_manifest.media_root, demo_manifest.config)
    info = json.loads((path / manifest_ops.INFO_FILE).read_text())
    assert info["num_rows"] == demo_manifest.table.num_rows
    assert info["reason_counts"] == demo_manifest.reason_counts()


def test_read_manifest_by_version_from_the_data_root(demo_manifest, tmp_path: Path) -> None:
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(tmp_path))
    assert manifest_ops.read_manifest(demo_manifest.version, tmp_path).table.equals(demo_manifest.table)


def test_read_manifest_of_unknown_version_raises(tmp_path: Path) -> None:
    with pytest.raises(manifest_ops.ManifestNotFound):
        manifest_ops.read_manifest("0123456789abcdef0123", tmp_path)
    with pytest.raises(manifest_ops.ManifestNotFound):
        manifest_ops.read_manifest(tmp_path / "nowhere")


def test_unusual_sidecars_get_rows_instead_of_breaking_the_build(tmp_path: Path) -> None:
    media = tmp_path / "media"
    clip = write_clip(media / "clip.mp4")
    Path(f"{clip}.json").write_text(json.dumps({"caption": "c", "license": "CC0-1.0", "consent": "granted"}))
    (media / "NOTES.md").write_text("notes")
    (media / "dangling.json").symlink_to("nowhere.json")
    (media / "escaping.json").symlink_to("../../outside.json")
    (media / "names_a_doc.json").write_text(json.dumps({"uri": "NOTES.md"}))
    (media / "data.bin").write_bytes(b"\x00\x01")
    built = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig())
    errors = {row["uri"]: (row["probe_error"], row["sidecar_error"]) for row in built.table.to_pylist()}
    assert errors == {
        "clip.mp4": (None, None),
        "dangling.json": (None, manifest_ops.MISSING_OBJECT),
        "escaping.json": (None, manifest_ops.PATH_ESCAPE),
        "names_a_doc.json": (None, manifest_ops.MISSING_OBJECT),
        "data.bin": (manifest_ops.UNSUPPORTED_EXTENSION, manifest_ops.MISSING_SIDECAR),
    }


def test_conflicting_and_pinned_sidecars(tmp_path: Path) -> None:
    media = tmp_path / "media"
    first, second = write_clip(media / "a.mp4", seed=1), write_clip(media / "b.mp4", seed=2)
    Path(f"{first}.json").write_text(json.dumps({"license": "x", "consent": "granted", "split": "holdout"}))
    Path(f"{second}.json").write_text(json.dumps({"license": "x", "consent": "granted", "split": "val"}))
    (media / "also_b.json").write_text(json.dumps({"uri": "b.mp4", "license": "y"}))
    built = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig())
    rows = {row["uri"]: row for row in built.table.to_pylist()}
    assert rows["a.mp4"]["sidecar_error"] == "malformed_sidecar" and "holdout" in rows["a.mp4"]["sidecar_error_detail"]
    assert rows["a.mp4"]["split_source"] == "group_hash"
    assert rows["b.mp4"]["sidecar_error"] == manifest_ops.SIDECAR_CONFLICT
    assert "also_b.json" not in rows


def test_manifest_config_rejects_zero_workers() -> None:
    with pytest.raises(ValueError, match="num_probe_workers"):
        manifest_ops.ManifestConfig(num_probe_workers=0)
