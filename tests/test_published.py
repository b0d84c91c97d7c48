"""Published files are bound to their versions (issue 9, item 3).

One tiny published tree (listing, manifest, validated set with its quarantine and report, clip
plan, shards and shard index) is built once from real PyAV clips, one of them with revoked
consent. Each test copies it, edits a row or flips a byte in one published file, and reads it
through one reader path: the ops functions, the assets and checks that read it, the loader, the
CLI and the trainer. Every one must raise a named PublishedFileError (or ShardIntegrityError for
a per-shard index) naming the file and the version, never return the edited content.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_clip, write_shards

from assets import checks, clips as clip_assets, data as data_assets
from cli.main import EXIT_BAD_INPUT, main
from ops.curation import manifest as manifest_ops
from ops.curation import quarantine, validation
from ops.media import scan
from ops.clips import shards
from ops.clips.plan import PLAN_FILE, PLAN_INFO_FILE, PLAN_RECORD_FILE, ShardConfig, read_plan, write_plan
from ops.loading.loader import ClipLoader, LoaderConfig
from ops.loading.sampling import World
from ops.publish.storage import (DIGESTS_FILE, PublishedFileCorrupt, PublishedFileError, PublishedRecordMissing, publish_dir,
                                 verify_published)
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher
from trainer.launch.config import load_config
from trainer.launch.preflight import preflight
from trainer.data import DataConfig, ShardClips

SOURCES = {"a.mp4": "granted", "b.mp4": "granted", "revoked.mp4": "revoked"}
VALIDATION = validation.ValidationConfig(max_quarantine_fraction=0.5)
SHARDING = ShardConfig(encoding="decoded", splits=("train",), clips_per_shard=2, max_clips_per_source=2)


@dataclass(kw_only=True)
class Tree:
    """Where each published version of the tiny set lies, and its version ids."""
    root: Path
    listing: Path
    manifest: Path
    validated: Path
    shards: Path
    manifest_version: str
    index_version: str

    @property
    def media(self) -> Path:
        return self.root / "media"

    @property
    def data(self) -> Path:
        return self.root / "data"

    def moved(self, root: Path) -> Tree:
        return Tree(root=root, manifest_version=self.manifest_version, index_version=self.index_version,
                    **{name: root / getattr(self, name).relative_to(self.root)
                       for name in ("listing", "manifest", "validated", "shards")})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Tree:
    root = tmp_path_factory.mktemp("published")
    for seed, (uri, consent) in enumerate(SOURCES.items()):
        write_clip(root / "media" / uri, num_frames=50, seed=seed)
        (root / "media" / f"{uri}.json").write_text(json.dumps({
            "caption": uri, "license": "CC-BY-4.0", "consent": consent, "source_group": uri, "split": "train"}))
    data = root / "data"
    listed = scan.scan_media_root(root / "media")
    listing = data / "listings" / scan.listing_version(listed)
    with publish_dir(listing) as staging:
        pq.write_table(scan.listing_table(listed), staging / "listing.parquet")
    built = manifest_ops.build_manifest(root / "media", manifest_ops.ManifestConfig(num_probe_workers=1))
    manifest_dir = manifest_ops.write_manifest(built, manifest_ops.manifests_dir(data))
    result = validation.validate(built, VALIDATION)
    assert list(result.rejected["uri"]) == ["revoked.mp4"]
    rows = quarantine.record(result, quarantine.ledger_path(data))
    validated = quarantine.write_validated(result, rows, quarantine.validated_dir(data, result.version),
                                           _report(result))
    write_shards(result, SHARDING, data / "shards" / "set")
    return Tree(root=root, listing=listing, manifest=manifest_dir, validated=validated, shards=data / "shards" / "set",
                manifest_version=built.version, index_version=shards.read_index_info(data / "shards" / "set").version)


def _report(result: validation.Validation) -> dict:
    return {"version": result.version, "manifest_version": result.manifest_version, "media_root": result.media_root,
            "config": asdict(result.config), "num_accepted": result.accepted.num_rows}


@pytest.fixture
def tree(pristine: Tree, tmp_path: Path) -> Tree:
    """A private copy of the published tree that a test may damage."""
    shutil.copytree(pristine.root, tmp_path / "tree")
    return pristine.moved(tmp_path / "tree")


# --- damage --------------------------------------------------------------------------------

def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_parquet(path: Path, change: Callable[[list[dict]], list[dict]]) -> None:
    table = pq.read_table(path)
    pq.write_table(pa.Table.from_pylist(change(table.to_pylist()), schema=table.schema), path)


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:
    body = json.loads(path.read_text())
    change(body)
    path.write_text(json.dumps(body, indent=2, sort_keys=True))


def _grant_revoked(rows: list[dict]) -> list[dict]:
    """The attack of the issue: a revoked-consent clip edited back to granted."""
    return [{**row, "consent": "granted"} if row["uri"] == "revoked.mp4" else row for row in rows]


def _revoked_back_in(tree: Tree) -> Callable[[list[dict]], list[dict]]:
    revoked = [row for row in pq.read_table(tree.manifest / manifest_ops.MANIFEST_FILE).to_pylist()
               if row["uri"] == "revoked.mp4"]
    return lambda rows: rows + _grant_revoked(revoked)


# (file, how it is edited): a meaningful edit that keeps the file well-formed.
EDITS: dict[str, Callable[[Tree, Path], None]] = {
    "listing.parquet": lambda tree, path: _edit_parquet(path, lambda rows: rows[1:]),
    "manifest.parquet": lambda tree, path: _edit_parquet(path, _grant_revoked),
    "manifest.json": lambda tree, path: _edit_json(path, lambda body: body.update(media_root="/elsewhere")),
    "validated.parquet": lambda tree, path: _edit_parquet(path, _revoked_back_in(tree)),
    "quarantine.parquet": lambda tree, path: _edit_parquet(path, lambda rows: []),
    "report.json": lambda tree, path: _edit_json(path, lambda body: body["config"].update(
        max_quarantine_fraction=1.0)),
    "plan.parquet": lambda tree, path: _edit_parquet(path, lambda rows: rows[:-1]),
    "plan.json": lambda tree, path: _edit_json(path, lambda body: body.update(num_sources_too_short=7)),
    "index.parquet": lambda tree, path: _edit_parquet(path, lambda rows: rows[:-1]),
    "index.json": lambda tree, path: _edit_json(path, lambda body: body["config"].update(encoding="compressed")),
}


def _folder(tree: Tree, name: str) -> Path:
    if name == "listing.parquet":
        return tree.listing
    if name.startswith("manifest"):
        return tree.manifest
    if name in (quarantine.VALIDATED_FILE, quarantine.QUARANTINE_FILE, quarantine.REPORT_FILE):
        return tree.validated
    return tree.shards


def _version(tree: Tree, name: str) -> str:
    folder = _folder(tree, name)
    if name.startswith("plan"):
        return json.loads((folder / PLAN_INFO_FILE).read_text())["version"]
    if name.startswith("index"):
        return json.loads((folder / shards.INDEX_INFO_FILE).read_text())["version"]
    return folder.name


def _damage(tree: Tree, name: str, how: str) -> tuple[Path, str]:
    """Damage ``name`` in ``tree``; (its path, the version it was published as)."""
    path, version = _folder(tree, name) / name, _version(tree, name)
    if how == "flip":
        _flip_byte(path)
    else:
        EDITS[name](tree, path)
    return path, version


def _assert_refused(read: Callable[[], object], path: Path, version: str) -> None:
    with pytest.raises(PublishedFileError) as caught:
        read()
    assert isinstance(caught.value, PublishedFileCorrupt)
    message = str(caught.value)
    assert path.name in message and version in message, message


# --- readers -------------------------------------------------------------------------------

@functools.cache
def _instance() -> dg.DagsterInstance:
    return dg.DagsterInstance.ephemeral()


def _context() -> dg.AssetExecutionContext:
    return dg.build_asset_context(instance=_instance())


def _check_context() -> dg.AssetCheckExecutionContext:
    return dg.build_asset_check_context(instance=_instance())


def _storage(tree: Tree) -> StorageResource:
    return StorageResource(media_root=str(tree.media), data_root=str(tree.data))


def _run_asset_validation(tree: Tree) -> None:
    list(data_assets.validated_manifest_and_quarantine(
        _context(), config=data_assets.ValidationRunConfig(max_quarantine_fraction=0.5),
        dataset_manifest={"path": str(tree.manifest)}, storage=_storage(tree), lineage=LineageResource()))


def _cli_validate(tree: Tree) -> None:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["manifest", "validate", str(tree.manifest), "--verify", "off"])
    assert code == EXIT_BAD_INPUT and stdout.getvalue() == ""
    assert stderr.getvalue().count("\n") == 1
    raise PublishedFileCorrupt(stderr.getvalue())  # re-raised so _assert_refused checks what it names


def _index_dict(tree: Tree) -> dict:
    """What the shard_index asset handed downstream before ShardIndexRef (still read: ShardIndexRef.of)."""
    return {"path": str(tree.shards), "version": tree.index_version, "manifest_version": tree.manifest_version}


def _shard_config(tree: Tree) -> DataConfig:
    return DataConfig(source="shards", shard_index=str(tree.shards), batch_size=2, clip_frames=8, height=64, width=64,
                      manifest_version=_index_dict(tree)["manifest_version"], num_workers=0)


def _trainer_preflight(tree: Tree) -> None:
    config = load_config(None, ["preset=tiny_cpu", f"train.run_dir={tree.root / 'run'}", "data.source=shards",
                                f"data.shard_index={tree.shards}",
                                f"data.manifest_version={_index_dict(tree)['manifest_version']}",
                                "data.batch_size=2", "data.clip_frames=8", "data.height=64", "data.width=64",
                                "data.audio_samples=16000"])
    preflight(config, world_size=1)


MANIFEST_READERS: dict[str, Callable[[Tree], object]] = {
    "ops.read_manifest(dir)": lambda tree: manifest_ops.read_manifest(tree.manifest),
    "ops.read_manifest(version)": lambda tree: manifest_ops.read_manifest(tree.manifest.name, tree.data),
    "asset validated_manifest": _run_asset_validation,
    "check manifest_covers_listing": lambda tree: checks.manifest_covers_listing(
        _check_context(), dataset_manifest={"path": str(tree.manifest)}, raw_media={"path": str(tree.listing)}),
    "cli manifest validate": _cli_validate,
}
VALIDATED_READERS: dict[str, Callable[[Tree], object]] = {
    "ops.load_validation": lambda tree: quarantine.load_validation(tree.validated),
    "ops.read_quarantine": lambda tree: quarantine.read_quarantine(tree.validated),
    "asset clip_plan": lambda tree: clip_assets.clip_plan(
        _context(), config=clip_assets.ShardBuildConfig(), validated_manifest={"path": str(tree.validated)},
        storage=_storage(tree), lineage=LineageResource()),
    "check accepted_rows_conform": lambda tree: checks.validated_manifest_checks[0](
        _check_context(), validated_manifest={"path": str(tree.validated)}),
    "asset data_profile": lambda tree: clip_assets.data_profile(
        _context(), config=clip_assets.ProfileConfig(max_clips_timed=1), validated_manifest={"path": str(tree.validated)},
        shard_index=_index_dict(tree), storage=_storage(tree), lineage=LineageResource()),
}
PLAN_READERS: dict[str, Callable[[Tree], object]] = {
    "ops.read_plan": lambda tree: read_plan(tree.shards),
    "asset clip_shards": lambda tree: list(clip_assets.clip_shards(  # a generator: it records each partition
        _context(), clip_plan={"path": str(tree.shards), "media_root": str(tree.media)}, storage=_storage(tree),
        lineage=LineageResource(), launcher=LocalTorchrunLauncher())),
    "asset shard_index": lambda tree: clip_assets.shard_index(
        _context(), clip_plan={"path": str(tree.shards)}, lineage=LineageResource()),
}
INDEX_READERS: dict[str, Callable[[Tree], object]] = {
    "ops.read_index": lambda tree: shards.read_index(tree.shards),
    "trainer ShardClips": lambda tree: ShardClips(_shard_config(tree), world=World(rank=0, world_size=1),
                                                  local_batch_size=2),
    "asset data_profile": lambda tree: clip_assets.data_profile(
        _context(), config=clip_assets.ProfileConfig(max_clips_timed=1), validated_manifest={"path": str(tree.validated)},
        shard_index=_index_dict(tree), storage=_storage(tree), lineage=LineageResource()),
    "asset loader_benchmark": lambda tree: clip_assets.loader_benchmark(
        _context(), config=clip_assets.LoaderBenchmarkConfig(batch_size=2, num_workers=0, epochs=1, rounds=1),
        clip_plan={"path": str(tree.shards), "media_root": str(tree.media)}, shard_index=_index_dict(tree),
        lineage=LineageResource()),
}
# index.json alone is what preflight and the stage's bucket overrides read (the table can be large).
INDEX_INFO_READERS: dict[str, Callable[[Tree], object]] = {
    "ops.read_index_info": lambda tree: shards.read_index_info(tree.shards),
    "trainer preflight": _trainer_preflight,
}

CASES = [
    *[(name, reader) for name in ("manifest.parquet", "manifest.json") for reader in MANIFEST_READERS],
    ("listing.parquet", "check manifest_covers_listing"),
    *[(name, reader) for name in (quarantine.VALIDATED_FILE, quarantine.QUARANTINE_FILE, quarantine.REPORT_FILE)
      for reader in VALIDATED_READERS],
    *[(name, reader) for name in (PLAN_FILE, PLAN_INFO_FILE) for reader in PLAN_READERS],
    *[(name, reader) for name in (shards.INDEX_FILE, shards.INDEX_INFO_FILE) for reader in INDEX_READERS],
    *[(shards.INDEX_INFO_FILE, reader) for reader in INDEX_INFO_READERS],
]
READERS = {**MANIFEST_READERS, **VALIDATED_READERS, **PLAN_READERS, **INDEX_READERS, **INDEX_INFO_READERS}


def test_the_pristine_tree_reads_through_every_reader(pristine: Tree, tmp_path: Path) -> None:
    """The readers below accept an undamaged tree (so a refusal is the damage, not the reader)."""
    tree = pristine.moved(shutil.copytree(pristine.root, tmp_path / "tree"))
    assert manifest_ops.read_manifest(tree.manifest).version == tree.manifest.name
    assert checks.manifest_covers_listing(_check_context(), dataset_manifest={"path": str(tree.manifest)},
                                          raw_media={"path": str(tree.listing)}).passed
    loaded = quarantine.load_validation(tree.validated)
    assert "revoked.mp4" not in loaded.accepted.column("uri").to_pylist()
    assert read_plan(tree.shards).table.num_rows == shards.read_index(tree.shards).table.num_rows == 4
    _trainer_preflight(tree)
    source = ShardClips(_shard_config(tree), world=World(rank=0, world_size=1), local_batch_size=2)
    assert len(source.next_batch()["keys"]) == 2
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert main(["manifest", "validate", str(tree.manifest), "--verify", "off"]) == 0


@pytest.mark.parametrize("how", ["edit", "flip"])
@pytest.mark.parametrize(("name", "reader"), CASES, ids=[f"{name}-{reader}" for name, reader in CASES])
def test_a_damaged_published_file_is_refused_by_every_reader(tree: Tree, name: str, reader: str, how: str) -> None:
    path, version = _damage(tree, name, how)
    _assert_refused(lambda: READERS[reader](tree), path, version)


@pytest.mark.parametrize("how", ["edit", "flip"])
def test_the_loader_serves_the_index_that_was_verified_not_the_file(tree: Tree, how: str) -> None:
    """The loader reads only the table read_index checked (it does not hash the index files again on
    every rank): damage to index.parquet after that read changes nothing it serves, and the next
    read_index refuses the file."""
    index = shards.read_index(tree.shards)
    path, version = _damage(tree, shards.INDEX_FILE, how)
    loader = ClipLoader(index, LoaderConfig(batch_size=2, num_workers=0, shuffle=False))
    keys = [key for _, batch in zip(range(2), loader) for key in batch["keys"]]
    assert sorted(keys) == sorted(index.table.column("sample_key").to_pylist())
    _assert_refused(lambda: shards.read_index(tree.shards), path, version)


@pytest.mark.parametrize("name", [DIGESTS_FILE, "manifest.json"])
def test_a_deleted_file_or_record_is_refused(tree: Tree, name: str) -> None:
    (tree.manifest / name).unlink()
    error = PublishedRecordMissing if name == DIGESTS_FILE else PublishedFileCorrupt
    with pytest.raises(error, match=tree.manifest.name):
        manifest_ops.read_manifest(tree.manifest)


def test_a_version_folder_renamed_to_another_version_is_refused(tree: Tree) -> None:
    other = tree.manifest.parent / ("0" * 20)
    tree.manifest.rename(other)
    with pytest.raises(PublishedFileCorrupt, match="0" * 20):
        manifest_ops.read_manifest(other)


def test_a_file_added_to_a_published_folder_is_refused(tree: Tree) -> None:
    (tree.validated / "extra.parquet").write_bytes(b"not part of the version")
    with pytest.raises(PublishedFileCorrupt, match="extra.parquet"):
        quarantine.load_validation(tree.validated)


@pytest.mark.parametrize("how", ["edit", "flip"])
def test_a_damaged_per_shard_index_is_refused_when_the_index_is_rebuilt(tree: Tree, how: str) -> None:
    """A dropped row in a shard's own index would silently drop samples from the merged index."""
    path = tree.shards / "train-00000.index.parquet"
    if how == "flip":
        _flip_byte(path)
    else:
        _edit_parquet(path, lambda rows: rows[:-1])
    before = (tree.shards / shards.INDEX_FILE).read_bytes()
    with pytest.raises(shards.ShardIntegrityError, match="train-00000"):
        shards.build_index(read_plan(tree.shards), tree.shards)
    assert (tree.shards / shards.INDEX_FILE).read_bytes() == before


def test_a_damaged_shard_is_refused_when_the_index_is_rebuilt(tree: Tree) -> None:
    _flip_byte(tree.shards / "train-00001.tar")
    with pytest.raises(shards.ShardIntegrityError, match="train-00001.tar"):
        shards.build_index(read_plan(tree.shards), tree.shards)


# --- rebuild over damage: repaired or refused, never success --------------------------------

def _damaged_manifest(tree: Tree, how: str) -> None:
    if how == "delete_file":
        (tree.manifest / manifest_ops.INFO_FILE).unlink()
    elif how == "no_record":  # a folder published before digests were recorded
        (tree.manifest / DIGESTS_FILE).unlink()
    else:
        _damage(tree, manifest_ops.MANIFEST_FILE, how)


@pytest.mark.parametrize("how", ["edit", "flip", "delete_file", "no_record"])
def test_rebuilding_over_a_damaged_manifest_repairs_it(tree: Tree, how: str) -> None:
    built = manifest_ops.read_manifest(tree.manifest)
    _damaged_manifest(tree, how)
    with pytest.raises(PublishedFileError):
        manifest_ops.read_manifest(tree.manifest)
    assert manifest_ops.write_manifest(built, tree.manifest.parent) == tree.manifest
    repaired = manifest_ops.read_manifest(tree.manifest)
    assert repaired.table.equals(built.table) and repaired.version == built.version
    (set_aside,) = [path for path in tree.manifest.parent.iterdir() if path.name.startswith(".")]
    assert set_aside.name.startswith(f".{built.version}.damaged-")
    assert (set_aside / "DAMAGED.txt").read_text().strip()


def test_rebuilding_through_the_asset_repairs_a_damaged_manifest(tree: Tree) -> None:
    def build() -> Path:
        output = data_assets.dataset_manifest(_context(), config=data_assets.ManifestBuildConfig(num_probe_workers=1),
                                        raw_media={"media_root": str(tree.media), "version": "listing"},
                                        storage=_storage(tree), lineage=LineageResource(),
                                        launcher=LocalTorchrunLauncher())
        return Path(output.value["path"])

    path = build()  # this copy's media root is part of the version: a version of its own
    _edit_parquet(path / manifest_ops.MANIFEST_FILE, _grant_revoked)
    assert build() == path
    assert "revoked" in manifest_ops.read_manifest(path).table.column("consent").to_pylist()


@pytest.mark.parametrize("name", [quarantine.VALIDATED_FILE, quarantine.QUARANTINE_FILE, quarantine.REPORT_FILE])
def test_rebuilding_over_a_damaged_validated_set_repairs_it(tree: Tree, name: str) -> None:
    loaded = quarantine.load_validation(tree.validated)
    rows = quarantine.read_quarantine(tree.validated)
    _damage(tree, name, "edit")
    quarantine.write_validated(loaded, rows, tree.validated, _report(loaded))
    again = quarantine.load_validation(tree.validated)
    assert again.accepted.equals(loaded.accepted) and again.rejected.equals(loaded.rejected)


def test_rewriting_a_damaged_plan_repairs_it(tree: Tree) -> None:
    plan = read_plan(tree.shards)
    _damage(tree, PLAN_FILE, "edit")
    with pytest.raises(PublishedFileCorrupt):
        read_plan(tree.shards)
    write_plan(plan, tree.shards)
    assert read_plan(tree.shards).table.equals(plan.table)


@pytest.mark.parametrize("name", [shards.INDEX_FILE, shards.INDEX_INFO_FILE, shards.INDEX_RECORD_FILE])
def test_rebuilding_a_damaged_shard_index_repairs_it(tree: Tree, name: str) -> None:
    index = shards.read_index(tree.shards)
    (tree.shards / name).unlink()
    with pytest.raises((PublishedFileError, FileNotFoundError)):
        shards.read_index(tree.shards)
    rebuilt = shards.build_index(read_plan(tree.shards), tree.shards)
    assert rebuilt.version == index.version
    assert shards.read_index(tree.shards).table.equals(index.table)


def test_a_concurrent_publisher_that_left_a_damaged_version_is_not_reported_as_success(tmp_path: Path) -> None:
    """publish_dir checks what it publishes after the rename: a damaged winner raises, never passes."""
    final = tmp_path / "v1"
    with pytest.raises(PublishedFileError):
        with publish_dir(final) as staging:
            (staging / "a.txt").write_text("mine")
            final.mkdir()  # another writer got there first, and left a folder without a record
            (final / "a.txt").write_text("theirs")


def test_publish_dir_records_every_file_and_verifies(tmp_path: Path) -> None:
    final = tmp_path / "v1"
    with publish_dir(final) as staging:
        (staging / "a.txt").write_text("a")
        (staging / "b.bin").write_bytes(b"\0" * 10)
    record = json.loads((final / DIGESTS_FILE).read_text())
    assert record["version"] == "v1" and set(record["files"]) == {"a.txt", "b.bin"}
    assert record["files"]["b.bin"]["size_bytes"] == 10
    assert verify_published(final) == "v1"
    with publish_dir(final) as staging:  # intact: left untouched
        assert staging is None


# --- a damaged record itself ---------------------------------------------------------------

@pytest.mark.parametrize("record", [PLAN_RECORD_FILE, shards.INDEX_RECORD_FILE])
def test_a_damaged_digest_record_is_refused(tree: Tree, record: str) -> None:
    (tree.shards / record).write_text((tree.shards / record).read_text()[:-5])
    reader = read_plan if record == PLAN_RECORD_FILE else shards.read_index
    with pytest.raises(PublishedFileCorrupt, match=record):
        reader(tree.shards)


def test_the_validated_report_must_name_its_own_version(tree: Tree) -> None:
    """A report of another version, copied in with its record rewritten, is still refused."""
    from ops.publish.storage import write_record

    _edit_json(tree.validated / quarantine.REPORT_FILE, lambda body: body.update(version="0" * 20))
    names = [path.name for path in tree.validated.iterdir() if path.name != DIGESTS_FILE]
    write_record(tree.validated, version=tree.validated.name, files=names)
    with pytest.raises(PublishedFileCorrupt, match="0" * 20):
        quarantine.load_validation(tree.validated)


def test_manifest_rows_must_hash_to_their_version(tree: Tree) -> None:
    """Rows edited and the record rewritten to match: the version id itself still refuses them."""
    from ops.publish.storage import write_record

    _damage(tree, manifest_ops.MANIFEST_FILE, "edit")
    write_record(tree.manifest, version=tree.manifest.name, files=[manifest_ops.MANIFEST_FILE, manifest_ops.INFO_FILE])
    with pytest.raises(PublishedFileCorrupt, match="hash to"):
        manifest_ops.read_manifest(tree.manifest)


# --- the ledger: history is appended, never rewritten ----------------------------------------

def test_revalidating_an_older_manifest_appends_to_the_ledger(tree: Tree) -> None:
    ledger = quarantine.ledger_path(tree.data)
    old = manifest_ops.read_manifest(tree.manifest)
    fixed = manifest_ops.manifest_from_table(
        old.table.set_column(old.table.schema.get_field_index("consent"), "consent",
                             pa.array(["granted"] * old.table.num_rows)),
        config=old.config, media_root=old.media_root)
    quarantine.record(validation.validate(fixed, VALIDATION), ledger)
    after_fix = quarantine.read_ledger(ledger)
    quarantine.record(validation.validate(old, VALIDATION), ledger)
    history = quarantine.read_ledger(ledger)

    assert history[:len(after_fix)] == after_fix, "recorded events were rewritten"
    events = [(e["uri"], e["event"], e["manifest_version"]) for e in history]
    assert events == [("", quarantine.VALIDATED, old.version),
                      ("revoked.mp4", quarantine.QUARANTINED, old.version),
                      ("", quarantine.VALIDATED, fixed.version),
                      ("revoked.mp4", quarantine.RESOLVED, fixed.version)], "re-validating v1 repeats no fact"
    assert [e["sequence"] for e in history] == [0, 1, 2, 3]
    (entry,) = quarantine.ledger_entries(history).values()
    # The older manifest judged again does not reopen an entry that a newer version resolved.
    assert (entry["first_seen_version"], entry["last_seen_version"], entry["resolved_in_version"]) == (
        old.version, old.version, fixed.version)


def test_an_older_manifest_validated_again_never_rewrites_resolution(tmp_path: Path) -> None:
    """Review finding 3: v1 rejects X, v2 rejects Y (X fixed), v1 again rejects X."""
    ledger = tmp_path / "ledger.parquet"

    def see(version: str, rejected: list[str]) -> None:
        frame = pd.DataFrame({"asset_id": rejected, "uri": rejected, "reason": ["bad"] * len(rejected),
                              "detail": ["d"] * len(rejected)}, columns=["asset_id", "uri", "reason", "detail"])
        quarantine.record(validation.Validation(accepted=pa.table({}), rejected=frame, version=f"val-{version}",
                                                manifest_version=version, config=VALIDATION, media_root="/m"), ledger)

    see("v1", ["X"])
    see("v2", ["Y"])
    see("v1", ["X"])
    see("v1", [])  # v1 judged again with X accepted: X resolved in v1, still nothing about Y
    entries = {key[0]: entry for key, entry in quarantine.ledger_entries(quarantine.read_ledger(ledger)).items()}
    fields = ("first_seen_version", "last_seen_version", "resolved_in_version")
    assert tuple(entries["X"][f] for f in fields) == ("v1", "v1", "v2")
    assert tuple(entries["Y"][f] for f in fields) == ("v2", "v2", None)
    assert not [e for e in quarantine.read_ledger(ledger) if e["uri"] == "Y" and e["manifest_version"] == "v1"]


def test_a_ledger_event_edited_in_place_is_refused(tree: Tree) -> None:
    ledger = quarantine.ledger_path(tree.data)
    events = quarantine.read_ledger(ledger)
    (index,) = [i for i, e in enumerate(events) if e["event"] == quarantine.QUARANTINED]
    events[index] = {**events[index], "manifest_version": "another"}  # same sequence, same count: edited in place
    pq.write_table(pa.Table.from_pylist(events, schema=quarantine.LEDGER_SCHEMA), ledger)
    with pytest.raises(quarantine.LedgerRewriteError, match="edited in place"):
        quarantine.read_ledger(ledger)
    with pytest.raises(quarantine.LedgerRewriteError, match="edited in place"):
        quarantine.record(validation.validate(manifest_ops.read_manifest(tree.manifest), VALIDATION), ledger)


def test_a_history_ledger_written_before_the_chain_is_read_and_chained(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.parquet"
    unchained = [{"sequence": 0, "uri": "x.mp4", "asset_id": "x", "reason": "r", "event": quarantine.QUARANTINED,
                  "manifest_version": "v1", "detail": "d"}]
    pq.write_table(pa.Table.from_pylist(unchained), ledger)
    (event,) = quarantine.read_ledger(ledger)
    assert event["chain"] and {k: event[k] for k in unchained[0]} == unchained[0]


def test_a_ledger_with_removed_events_is_refused(tree: Tree) -> None:
    ledger = quarantine.ledger_path(tree.data)
    old = manifest_ops.read_manifest(tree.manifest)
    quarantine.record(validation.validate(replace(old, version="other"), VALIDATION), ledger)
    events = quarantine.read_ledger(ledger)
    assert len(events) == 4  # a marker and an event for each of the two versions
    pq.write_table(pa.Table.from_pylist(events[1:], schema=quarantine.LEDGER_SCHEMA), ledger)
    with pytest.raises(quarantine.LedgerRewriteError, match="removed or reordered"):
        quarantine.record(validation.validate(old, VALIDATION), ledger)


def test_a_ledger_written_before_it_was_a_history_reads_as_events(tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.parquet"
    legacy = pa.schema([(name, pa.string()) for name in quarantine.ENTRY_FIELDS])
    pq.write_table(pa.Table.from_pylist([
        {"uri": "x.mp4", "asset_id": "x", "reason": "consent_revoked", "detail": "d", "first_seen_version": "v1",
         "last_seen_version": "v2", "resolved_in_version": "v3"}], schema=legacy), ledger)
    events = quarantine.read_ledger(ledger)
    assert [(e["event"], e["manifest_version"]) for e in events] == [
        ("quarantined", "v1"), ("quarantined", "v2"), ("resolved", "v3")]
    (entry,) = quarantine.ledger_entries(events).values()
    assert (entry["first_seen_version"], entry["last_seen_version"], entry["resolved_in_version"]) == ("v1", "v2", "v3")



# --- forged: files rewritten together with their digest record (review finding 2) ----------

def _rewrite_record(folder: Path) -> None:
    from ops.publish.storage import write_record

    write_record(folder, version=folder.name, files=[p.name for p in folder.iterdir() if p.name != DIGESTS_FILE])


def _forge_revoked_back_in(tree: Tree) -> None:
    """The attack: revoked row appended to the accepted rows, quarantine emptied, record rewritten."""
    _edit_parquet(tree.validated / quarantine.VALIDATED_FILE, _revoked_back_in(tree))
    _edit_parquet(tree.validated / quarantine.QUARANTINE_FILE, lambda rows: [])


FORGERIES: dict[str, Callable[[Tree], None]] = {
    "revoked_in_quarantine_emptied": _forge_revoked_back_in,
    "revoked_appended_only": lambda tree: _edit_parquet(tree.validated / quarantine.VALIDATED_FILE,
                                                       _revoked_back_in(tree)),
    "quarantine_emptied_only": lambda tree: _edit_parquet(tree.validated / quarantine.QUARANTINE_FILE,
                                                         lambda rows: []),
    "accepted_row_edited": lambda tree: _edit_parquet(tree.validated / quarantine.VALIDATED_FILE, lambda rows: [
        {**row, "caption": "forged"} for row in rows]),
    "report_config": lambda tree: _edit_json(tree.validated / quarantine.REPORT_FILE, lambda body: body["config"].update(
        max_quarantine_fraction=1.0)),
    "report_media_root": lambda tree: _edit_json(tree.validated / quarantine.REPORT_FILE,
                                                 lambda body: body.update(media_root="/elsewhere")),
}


@pytest.mark.parametrize("forgery", FORGERIES)
def test_a_forged_validated_set_is_refused_on_read(tree: Tree, forgery: str) -> None:
    FORGERIES[forgery](tree)
    _rewrite_record(tree.validated)
    with pytest.raises(PublishedFileCorrupt, match=tree.validated.name):
        quarantine.load_validation(tree.validated)


def test_a_validated_set_without_its_manifest_is_refused(tree: Tree) -> None:
    shutil.rmtree(tree.manifest)
    with pytest.raises(manifest_ops.ManifestNotFound):
        quarantine.load_validation(tree.validated)


def test_a_forged_validated_set_does_not_survive_a_rebuild(tree: Tree) -> None:
    _forge_revoked_back_in(tree)
    _rewrite_record(tree.validated)
    result = validation.validate(manifest_ops.read_manifest(tree.manifest), VALIDATION)
    assert result.version == tree.validated.name
    quarantine.write_validated(result, quarantine.record(result, quarantine.ledger_path(tree.data)),
                               tree.validated, _report(result))
    assert quarantine.load_validation(tree.validated).accepted.column("uri").to_pylist() == ["a.mp4", "b.mp4"]
    (aside,) = [p for p in tree.validated.parent.iterdir() if p.name.startswith(f".{tree.validated.name}.damaged")]
    assert "revoked.mp4" in pq.read_table(aside / quarantine.VALIDATED_FILE).column("uri").to_pylist()


def test_a_forged_manifest_does_not_survive_a_rebuild(tree: Tree) -> None:
    built = manifest_ops.read_manifest(tree.manifest)
    _damage(tree, manifest_ops.MANIFEST_FILE, "edit")
    _rewrite_record(tree.manifest)
    manifest_ops.write_manifest(built, tree.manifest.parent)
    assert manifest_ops.read_manifest(tree.manifest).table.equals(built.table)
    assert [p for p in tree.manifest.parent.iterdir() if p.name.startswith(f".{built.version}.damaged-")]


def test_publish_dir_with_compare_keeps_equal_content_and_replaces_other(tmp_path: Path) -> None:
    final = tmp_path / "v1"
    for text in ("a", "a", "b"):
        with publish_dir(final, compare=True) as staging:
            (staging / "a.txt").write_text(text)
    assert (final / "a.txt").read_text() == "b" and verify_published(final) == "v1"
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert (aside / "a.txt").read_text() == "a"


def _forge_with_record(tree: Tree, name: str, change: Callable[[list[dict]], list[dict]], record: str,
                       files: list[str]) -> None:
    from ops.publish.storage import write_record

    version = _version(tree, name)
    _edit_parquet(tree.shards / name, change)
    write_record(tree.shards, version=version, files=files, record=record)


PLAN_FORGERIES: dict[str, Callable[[list[dict]], list[dict]]] = {
    "clip_dropped": lambda rows: rows[:-1],
    "source_swapped": lambda rows: [{**row, "uri": "revoked.mp4"} if i == 0 else row for i, row in enumerate(rows)],
    "span_moved": lambda rows: [{**row, "start_s": row["start_s"] + 0.5} if i == 0 else row
                                for i, row in enumerate(rows)],
}


@pytest.mark.parametrize("forgery", PLAN_FORGERIES)
def test_a_forged_plan_is_refused_on_read_and_replaced_by_a_rebuild(tree: Tree, forgery: str) -> None:
    plan = read_plan(tree.shards)
    _forge_with_record(tree, PLAN_FILE, PLAN_FORGERIES[forgery], PLAN_RECORD_FILE, [PLAN_FILE, PLAN_INFO_FILE])
    with pytest.raises(PublishedFileCorrupt, match=plan.version):
        read_plan(tree.shards)
    write_plan(plan, tree.shards)  # what the clip_plan asset does on every run
    assert read_plan(tree.shards).table.equals(plan.table)


def test_a_forged_plan_json_is_refused(tree: Tree) -> None:
    from ops.publish.storage import write_record

    _edit_json(tree.shards / PLAN_INFO_FILE, lambda body: body.update(validated_version="0" * 20))
    write_record(tree.shards, version=_version(tree, PLAN_INFO_FILE), files=[PLAN_FILE, PLAN_INFO_FILE],
                 record=PLAN_RECORD_FILE)
    with pytest.raises(PublishedFileCorrupt, match="hash to"):
        read_plan(tree.shards)


INDEX_FILES = [shards.INDEX_FILE, shards.INDEX_INFO_FILE]


def test_a_forged_index_digest_is_refused_on_read(tree: Tree) -> None:
    _forge_with_record(tree, shards.INDEX_FILE, lambda rows: [{**row, "shard_sha256": "0" * 64} for row in rows],
                       shards.INDEX_RECORD_FILE, INDEX_FILES)
    with pytest.raises(PublishedFileCorrupt, match="hash to"):
        shards.read_index(tree.shards)


def _reversion_index(tree: Tree) -> None:
    """A forger holding the signing key: index.json's version recomputed from the edited files, then signed."""
    from ops.publish.storage import write_record

    info, table = json.loads((tree.shards / shards.INDEX_INFO_FILE).read_text()), pq.read_table(tree.shards / shards.INDEX_FILE)
    info["num_samples"] = table.num_rows
    info["version"] = shards._index_version(info, table)
    (tree.shards / shards.INDEX_INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    write_record(tree.shards, version=info["version"], files=INDEX_FILES, record=shards.INDEX_RECORD_FILE)


def test_a_forged_index_json_is_refused_against_the_plan_beside_it(tree: Tree) -> None:
    from ops.publish.storage import write_record

    _edit_json(tree.shards / shards.INDEX_INFO_FILE, lambda body: body["config"].update(encoding="compressed"))
    write_record(tree.shards, version=_version(tree, shards.INDEX_INFO_FILE), files=INDEX_FILES,
                 record=shards.INDEX_RECORD_FILE)
    with pytest.raises(PublishedFileCorrupt, match="hash to"):  # the config is in the index version
        shards.read_index(tree.shards)
    _reversion_index(tree)  # and with the version recomputed, the plan beside it still refuses it
    with pytest.raises(PublishedFileCorrupt, match="differ from plan"):
        shards.read_index(tree.shards)


INDEX_ROW_FORGERIES: dict[str, Callable[[list[dict]], list[dict]]] = {
    "sample_dropped": lambda rows: rows[:-1],
    "offset_moved": lambda rows: [{**row, "offset": row["offset"] + 512} if i == 0 else row
                                  for i, row in enumerate(rows)],
    "key_swapped": lambda rows: [{**row, "sample_key": rows[-1]["sample_key"]} if i == 0 else
                                 {**row, "sample_key": rows[0]["sample_key"]} if i == len(rows) - 1 else row
                                 for i, row in enumerate(rows)],
}


@pytest.mark.parametrize("forgery", INDEX_ROW_FORGERIES)
def test_forged_index_rows_are_refused_against_the_tars_and_replaced_by_a_rebuild(tree: Tree, forgery: str) -> None:
    """Every column is in the index version, so read_index refuses edited rows; and rows whose version
    was recomputed (a forger with the key) are refused by the tars' own members."""
    index = shards.read_index(tree.shards)
    _forge_with_record(tree, shards.INDEX_FILE, INDEX_ROW_FORGERIES[forgery], shards.INDEX_RECORD_FILE, INDEX_FILES)
    with pytest.raises(PublishedFileCorrupt, match="hash to"):
        shards.read_index(tree.shards)
    _reversion_index(tree)
    forged = shards.read_index(tree.shards)
    with pytest.raises(shards.ShardIntegrityError, match="index rows"):
        ClipLoader(forged, LoaderConfig(batch_size=2, num_workers=0))
    with pytest.raises(shards.ShardIntegrityError, match="index rows"):
        forged.verify()
    shards.build_index(read_plan(tree.shards), tree.shards)  # what the shard_index asset does on every run
    assert shards.read_index(tree.shards).table.equals(index.table)


# --- every field a reader relies on is in the recomputed version (issue 32, item 2) ---------
#
# For each published table, every column (read from the published file itself, so a column added
# later is enumerated too) and every key of its JSON companion is changed in turn, the record
# re-signed with the signing key (a writer holding the key: the strongest forger), and the folder
# read back. A field the version leaves out reads as the version it no longer is: the test lists it.

def _changed(value: object) -> object:
    """Another well-formed value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.25
    if isinstance(value, str):
        return value + "~"
    if isinstance(value, dict):  # a value inside changed: still a config the reader can build
        scalars = [key for key in sorted(value) if isinstance(value[key], (bool, int, float, str))]
        keys = scalars or [key for key in sorted(value) if isinstance(value[key], dict)]
        return {**value, keys[0]: _changed(value[keys[0]])} if keys else {**value, "forged": 1}
    if isinstance(value, list):
        return [*value, "forged"]
    return "forged"  # None: a value where there was none


def _typed_change(field: pa.Field, value: object) -> object:
    if value is not None:
        return _changed(value)
    return {pa.types.is_boolean: True, pa.types.is_integer: 1, pa.types.is_floating: 1.0}.get(
        next((test for test in (pa.types.is_boolean, pa.types.is_integer, pa.types.is_floating)
              if test(field.type)), None), "forged")


def _resign(tree: Tree, name: str) -> None:
    """The folder's record written again over its current files, signed with the key."""
    from ops.publish.storage import write_record

    folder = _folder(tree, name)
    if name.startswith("plan"):
        write_record(folder, version=_version(tree, name), files=[PLAN_FILE, PLAN_INFO_FILE], record=PLAN_RECORD_FILE)
    elif name.startswith("index"):
        write_record(folder, version=_version(tree, name), files=INDEX_FILES, record=shards.INDEX_RECORD_FILE)
    else:
        _rewrite_record(folder)


TABLE_READERS: dict[str, Callable[[Tree], object]] = {
    manifest_ops.MANIFEST_FILE: lambda tree: manifest_ops.read_manifest(tree.manifest),
    manifest_ops.INFO_FILE: lambda tree: manifest_ops.read_manifest(tree.manifest),
    quarantine.VALIDATED_FILE: lambda tree: quarantine.load_validation(tree.validated),
    quarantine.QUARANTINE_FILE: lambda tree: quarantine.load_validation(tree.validated),
    quarantine.REPORT_FILE: lambda tree: quarantine.load_validation(tree.validated),
    PLAN_FILE: lambda tree: read_plan(tree.shards),
    PLAN_INFO_FILE: lambda tree: read_plan(tree.shards),
    shards.INDEX_FILE: lambda tree: shards.read_index(tree.shards),
    shards.INDEX_INFO_FILE: lambda tree: shards.read_index(tree.shards),
}
# Fields no version can cover, each with why. Anything else a test finds uncovered fails it.
OUTSIDE_THE_VERSION = {
    # History from the quarantine ledger (ops/curation/quarantine.py), not a function of the manifest and the
    # rules: bound by the signed record only. Shown to people (the quarantine asset's table); no
    # check or stage decides anything from them.
    (quarantine.QUARANTINE_FILE, "first_seen_version"),
    (quarantine.QUARANTINE_FILE, "manifest_version"),
    # A count the report states for people; the decisions it counts are in the version.
    (quarantine.REPORT_FILE, "num_accepted"),
}


def _fields_outside_the_version(pristine: Tree, tmp_path: Path, name: str) -> set[tuple[str, str]]:
    """(name, field) for each field of ``name`` that can change, re-signed, and still be read."""
    path = _folder(pristine, name) / name
    if name.endswith(".parquet"):
        schema = pq.read_schema(path)
        fields = {field.name: field for field in schema}
    else:
        fields = {key: None for key in json.loads(path.read_text()) if key != "version"}
    uncovered = set()
    for number, field_name in enumerate(sorted(fields)):
        tree = pristine.moved(shutil.copytree(pristine.root, tmp_path / f"{number}"))
        target = _folder(tree, name) / name
        if name.endswith(".parquet"):
            field = fields[field_name]
            _edit_parquet(target, lambda rows, f=field: [
                {**row, f.name: _typed_change(f, row[f.name])} if i == 0 else row for i, row in enumerate(rows)])
        else:
            _edit_json(target, lambda body, key=field_name: body.update({key: _changed(body[key])}))
        _resign(tree, name)
        try:
            TABLE_READERS[name](tree)
        except (PublishedFileCorrupt, manifest_ops.ManifestNotFound):  # (a validated set naming another manifest)
            continue
        uncovered.add((name, field_name))
        shutil.rmtree(tree.root)
    return uncovered


@pytest.mark.parametrize("name", TABLE_READERS)
def test_every_field_of_every_published_table_is_in_its_version(pristine: Tree, tmp_path: Path, name: str) -> None:
    """The attack of issue 32: a plan's asset_id (which `rights where` and the revocation checks read)
    rewritten with its record. No field of any published table may change under its version."""
    assert _fields_outside_the_version(pristine, tmp_path, name) == {
        item for item in OUTSIDE_THE_VERSION if item[0] == name}


def test_the_plan_version_covers_every_column_by_construction() -> None:
    """Unit form of the above for the plan: each column changed alone changes the version."""
    from ops.clips.plan import PLAN_SCHEMA, plan_version

    row = {"sample_key": "k-000000000", "shard": "train-00000", "split": "train", "asset_id": "a" * 64,
           "uri": "a.mp4", "start_s": 0.0, "end_s": 1.0, "caption": "c", "has_audio": True, "bucket": "8x64x64"}

    def version(values: dict) -> str:
        return plan_version("v", SHARDING, "code", pa.Table.from_pylist([values], schema=PLAN_SCHEMA),
                            manifest_version="m", num_sources_too_short=0)
    assert set(row) == set(PLAN_SCHEMA.names)
    same = [name for name in PLAN_SCHEMA.names
            if version({**row, name: _typed_change(PLAN_SCHEMA.field(name), row[name])}) == version(row)]
    assert same == []


# --- digest records are signed (issue 32, item 2) --------------------------------------------

def _unsigned_record(folder: Path, record: str) -> None:
    """The record as a forger without the key writes it: the digests of the edited files, no signature
    (the format of records before they were signed)."""
    body = json.loads((folder / record).read_text())
    names = list(body["files"])
    body = {"format": 1, "version": body["version"], "files": {
        name: {"sha256": __import__("hashlib").sha256((folder / name).read_bytes()).hexdigest(),
               "size_bytes": (folder / name).stat().st_size} for name in names}}
    (folder / record).write_text(json.dumps(body, indent=1, sort_keys=True))


def _record_of(name: str) -> str:
    return PLAN_RECORD_FILE if name.startswith("plan") else shards.INDEX_RECORD_FILE if name.startswith("index") \
        else DIGESTS_FILE


def _forge_record(tree: Tree, name: str, how: str) -> Path:
    """``name`` edited (EDITS) and its record rewritten ``how``; the record's path."""
    from ops.publish.storage import write_record

    folder, record = _folder(tree, name), _record_of(name)
    version = _version(tree, name)
    EDITS[name](tree, folder / name)
    if how == "unsigned":
        _unsigned_record(folder, record)
    else:
        files = list(json.loads((folder / record).read_text())["files"])
        write_record(folder, version=version, files=files, record=record, hmac_key=b"another deployment's key")
    return folder / record


# One edited file per record kind, read through every reader of it.
SIGNED_CASES = [
    *[("manifest.parquet", reader) for reader in MANIFEST_READERS],
    ("listing.parquet", "check manifest_covers_listing"),
    *[(quarantine.VALIDATED_FILE, reader) for reader in VALIDATED_READERS],
    *[(PLAN_FILE, reader) for reader in PLAN_READERS],
    *[(shards.INDEX_FILE, reader) for reader in INDEX_READERS],
    *[(shards.INDEX_INFO_FILE, reader) for reader in INDEX_INFO_READERS],
]


@pytest.mark.parametrize("how", ["unsigned", "other_key"])
@pytest.mark.parametrize(("name", "reader"), SIGNED_CASES, ids=[f"{name}-{reader}" for name, reader in SIGNED_CASES])
def test_a_file_rewritten_with_its_record_is_refused_by_name_on_every_reader(tree: Tree, name: str, reader: str,
                                                                            how: str) -> None:
    """The gap docs/status.md admitted: a file and its digest record rewritten together by someone
    who can write the data root but does not hold the signing key."""
    from ops.publish.storage import PublishedRecordUnsigned, PublishedSignatureInvalid

    record = _forge_record(tree, name, how)
    with pytest.raises(PublishedFileError) as caught:
        READERS[reader](tree)
    message = str(caught.value)
    assert record.name in message, message
    if reader == "cli manifest validate":  # one line on stderr, re-raised by _cli_validate
        assert ("unsigned" if how == "unsigned" else "bad signature") in message, message
    else:
        assert type(caught.value) is (PublishedRecordUnsigned if how == "unsigned" else PublishedSignatureInvalid)


def test_a_signed_record_read_without_a_key_is_refused_naming_the_setting(tree: Tree, monkeypatch) -> None:
    from ops.checkpoints.keys import HMAC_KEY_ENV
    from ops.publish.storage import PublishedSignatureInvalid

    monkeypatch.delenv(HMAC_KEY_ENV)
    with pytest.raises(PublishedSignatureInvalid, match=HMAC_KEY_ENV):
        read_plan(tree.shards)


def test_a_record_copied_from_another_record_is_refused(tree: Tree) -> None:
    """Each record signs its own name: the plan's signed record laid over the index's proves nothing."""
    from ops.publish.storage import PublishedSignatureInvalid, write_record

    write_record(tree.shards, version=_version(tree, shards.INDEX_INFO_FILE), files=INDEX_FILES, record=PLAN_RECORD_FILE)
    shutil.move(tree.shards / PLAN_RECORD_FILE, tree.shards / shards.INDEX_RECORD_FILE)
    with pytest.raises(PublishedSignatureInvalid, match=shards.INDEX_RECORD_FILE):
        shards.read_index(tree.shards)


def test_folders_published_before_signing_are_refused_then_repaired_by_a_rebuild(tree: Tree) -> None:
    """An unsigned record (as every folder published before this change has) is refused with a message
    to rebuild; rerunning the step that publishes it (here: the manifest and the plan) repairs it."""
    from ops.publish.storage import PublishedRecordUnsigned

    plan, built = read_plan(tree.shards), manifest_ops.read_manifest(tree.manifest)
    _unsigned_record(tree.shards, PLAN_RECORD_FILE)
    _unsigned_record(tree.manifest, DIGESTS_FILE)
    with pytest.raises(PublishedRecordUnsigned, match="Rebuild this version"):
        read_plan(tree.shards)
    with pytest.raises(PublishedRecordUnsigned, match="Rebuild this version"):
        manifest_ops.read_manifest(tree.manifest)
    write_plan(plan, tree.shards)
    manifest_ops.write_manifest(built, tree.manifest.parent)
    assert read_plan(tree.shards).version == plan.version
    assert manifest_ops.read_manifest(tree.manifest).version == built.version


def test_a_plan_asset_id_rewritten_with_its_record_never_hides_a_revoked_clip(tree: Tree) -> None:
    """The attack of issue 32 item 2 end to end: the revocation walk and the stages' asset list read
    the plan's asset_id; forged (unsigned, or re-signed without recomputing the version) they refuse
    to answer instead of answering "not here"."""
    from ops.curation import rights
    from ops.publish.storage import PublishedRecordUnsigned

    target = read_plan(tree.shards).table.column("asset_id")[0].as_py()
    assert target in rights.index_asset_ids(tree.shards)
    assert rights.where(tree.data, [target]).reach[target].plans
    _edit_parquet(tree.shards / PLAN_FILE, lambda rows: [{**row, "asset_id": "f" * 64} if row["asset_id"] == target
                                                         else row for row in rows])
    _unsigned_record(tree.shards, PLAN_RECORD_FILE)
    with pytest.raises(PublishedRecordUnsigned):
        rights.index_asset_ids(tree.shards)
    found = rights.where(tree.data, [target])
    assert not found.reach[target].plans and any("unsigned" in problem for problem in found.problems)
    _resign(tree, PLAN_FILE)  # with the key, but the version still says what the plan held
    with pytest.raises(PublishedFileCorrupt, match="hash to"):
        rights.index_asset_ids(tree.shards)


def test_rights_resolves_a_uri_only_through_verified_manifests(tree: Tree) -> None:
    """`trainyard rights where revoked.mp4` resolved the uri from manifest.parquet read raw: a uri
    pointed at another asset id made the revoked content read as held nowhere."""
    from cli import rights as rights_cli

    asset_id, _ = rights_cli.resolve(tree.data, "a.mp4")
    _edit_parquet(tree.manifest / manifest_ops.MANIFEST_FILE, lambda rows: [
        {**row, "asset_id": "f" * 64} if row["uri"] == "a.mp4" else row for row in rows])
    with pytest.raises(ValueError, match="could not be verified") as caught:
        rights_cli.resolve(tree.data, "a.mp4")
    assert manifest_ops.MANIFEST_FILE in str(caught.value) and "f" * 64 not in str(caught.value)
