"""Asset tests of the clip stage: clip_plan -> clip_shards (dynamic partitions) -> shard_index,
data_profile and loader_benchmark, materialized through Dagster on a temporary instance.

The module fixture runs the graph the way ``make demo`` (pipelines/demo.py) does: everything up
to clip_plan, then one run per shard partition, then the data assets downstream of the shards (the
training stages and drills after them are walked by tests/test_end_to_end.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq
import pytest
from helpers import DEMO_MAX_QUARANTINE_FRACTION, copy_media

from assets import checks
from ops.publish import objstore, paths
from ops.clips.plan import ClipPlan, read_plan
from ops.publish.hashing import sha256_file
from ops.clips.shard_ref import ShardIndexRef
from ops.clips.shards import read_index
from pipelines.definitions import all_assets
from pipelines.demo import SHARDS, _stages
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher

PLAN = dg.AssetKey("clip_plan")
PARTITIONS = "clip_shards"
DATA_ASSETS = tuple(dg.AssetKey(name) for name in ("shard_index", "data_profile", "loader_benchmark"))
# The default buckets cut the demo set into 15 train and 25 test clips: 1 + 2 shards of 16.
CLIPS_PER_SHARD = 16
FIGURES = ("loader_frames_per_s", "decode_ceiling_frames_per_s", "naive_frames_per_s", "ratio_vs_ceiling",
           "ratio_vs_naive")


def _plan_config(**config) -> dict:
    return {"ops": {"validated_manifest_and_quarantine": {"config": {
        "max_quarantine_fraction": DEMO_MAX_QUARANTINE_FRACTION}},
        "clip_plan": {"config": {"clips_per_shard": CLIPS_PER_SHARD, **config}}}}


DOWNSTREAM_CONFIG = {"ops": {"data_profile": {"config": {"max_clips_timed": 8}},
                             "loader_benchmark": {"config": {"batch_size": 4, "num_workers": 0, "epochs": 1,
                                                             "rounds": 1}}}}


def _materializations(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetMaterialization]:
    return {event.asset_key.to_user_string(): event.materialization
            for event in result.get_asset_materialization_events()}


def _data_version(materialization: dg.AssetMaterialization) -> str:
    return materialization.tags["dagster/data_version"]


def _run(job: dg.JobDefinition, instance: dg.DagsterInstance, selection: list[dg.AssetKey],
         **kwargs) -> dg.ExecuteInProcessResult:
    result = job.execute_in_process(instance=instance, asset_selection=selection, raise_on_error=False, **kwargs)
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    return result


@dataclass(kw_only=True)
class Graph:
    instance: dg.DagsterInstance
    job: dg.JobDefinition
    plan: ClipPlan
    partitions_after_plan: list[str]
    upstream: dg.ExecuteInProcessResult
    shard_runs: dict[str, list[dg.ExecuteInProcessResult]]
    """partition -> its runs, in order (the first partition is run twice)."""
    downstream: dg.ExecuteInProcessResult
    definitions: dg.Definitions

    def run(self, selection: list[dg.AssetKey], **kwargs) -> dg.ExecuteInProcessResult:
        return _run(self.job, self.instance, selection, **kwargs)


@pytest.fixture(scope="module")
def graph(demo, tmp_path_factory, request) -> Graph:
    base = tmp_path_factory.mktemp("shard_assets")
    # Validation records the demo's revoked clip in the rights ledger, sealed with the signing key;
    # conftest moves TRAINYARD_HOME (and so the key file) per test: one key for the module, the
    # deployment way (an environment variable), so later tests can read the ledger.
    patch = pytest.MonkeyPatch()
    patch.setenv("TRAINYARD_CHECKPOINT_HMAC_KEY", "shard-assets-module-key")
    request.addfinalizer(patch.undo)
    media_root = copy_media(demo.out_dir, base / "media")
    definitions = dg.Definitions(
        assets=all_assets, asset_checks=checks.all_checks,
        resources={"storage": StorageResource(media_root=str(media_root), data_root=str(base / "data")),
                   "lineage": LineageResource(),
                   # Training assets are in the graph but not selected here; the job still needs the key.
                   "launcher": LocalTorchrunLauncher(mlflow_tracking_uri=f"sqlite:///{base}/mlflow.db")})
    before, after = _stages(definitions)
    assert PLAN in before and SHARDS not in before + after
    job = definitions.resolve_implicit_global_asset_job_def()
    instance = dg.DagsterInstance.ephemeral(tempdir=str(base / "dagster"))
    upstream = _run(job, instance, before, run_config=_plan_config())
    plan = read_plan(Path(_materializations(upstream)["clip_plan"].metadata["data_path"].value))
    partitions = list(instance.get_dynamic_partitions(PARTITIONS))
    first, second, *rest = partitions
    shard_runs: dict[str, list[dg.ExecuteInProcessResult]] = {}
    for partition in (first, second, first, *rest):  # the first partition is materialized twice
        shard_runs.setdefault(partition, []).append(_run(job, instance, [SHARDS], partition_key=partition))
    assert set(DATA_ASSETS) <= set(after)
    downstream = _run(job, instance, list(DATA_ASSETS), run_config=DOWNSTREAM_CONFIG)
    return Graph(instance=instance, job=job, plan=plan, partitions_after_plan=partitions, upstream=upstream,
                 shard_runs=shard_runs, downstream=downstream, definitions=definitions)


def test_clip_plan_registers_exactly_its_shards_as_partitions(graph: Graph) -> None:
    assert graph.partitions_after_plan == graph.plan.shards
    assert len(graph.plan.shards) == 3
    metadata = _materializations(graph.upstream)["clip_plan"].metadata
    assert metadata["num_shards"].value == 3 and metadata["partitions_added"].value == 3
    assert metadata["partitions_removed"].value == 0
    assert metadata["dagster/row_count"].value == graph.plan.table.num_rows == 40
    assert metadata["num_sources_too_short"].value == graph.plan.num_sources_too_short == 1
    buckets = metadata["clips_per_bucket"].value
    for name, count in (("8x64x64", 0), ("16x64x64", 7), ("8x48x80", 14), ("8x80x48", 19)):
        assert f"| {name} | {count} |" in buckets, (name, buckets)


def test_shard_partitions_carry_their_sha256_and_row_count(graph: Graph) -> None:
    for partition, runs in graph.shard_runs.items():
        events = runs[0].get_asset_materialization_events()
        assert [(event.asset_key, event.partition) for event in events] == [(SHARDS, partition)]
        metadata = events[0].materialization.metadata
        path = Path(metadata["data_path"].value)
        assert path.name == f"{partition}.tar" and path.parent == Path(
            _materializations(graph.upstream)["clip_plan"].metadata["data_path"].value)
        assert metadata["sha256"].value == sha256_file(path)
        assert _data_version(events[0].materialization) == metadata["sha256"].value[:20]
        assert metadata["dagster/row_count"].value == len(graph.plan.rows_for(partition)) > 0
        assert metadata["num_failed_clips"].value == 0


def test_rematerializing_a_partition_gives_the_same_data_version(graph: Graph) -> None:
    first = graph.plan.shards[0]
    once, twice = (_materializations(run)["clip_shards"] for run in graph.shard_runs[first])
    assert _data_version(twice) == _data_version(once)
    assert twice.metadata["sha256"].value == once.metadata["sha256"].value


def test_every_partition_is_materialized_and_indexed(graph: Graph) -> None:
    assert graph.instance.get_materialized_partitions(SHARDS) == set(graph.plan.shards)
    metadata = _materializations(graph.downstream)["shard_index"].metadata
    index = read_index(metadata["data_path"].value)
    index.verify()
    assert index.plan_version == graph.plan.version
    assert metadata["dagster/row_count"].value == index.table.num_rows == graph.plan.table.num_rows
    assert metadata["num_shards"].value == len(graph.plan.shards)


def test_shard_index_hands_downstream_a_typed_reference(graph: Graph) -> None:
    # As the profile and the training stages load it: from the IO manager's stored (pickled) output.
    ref = graph.definitions.load_asset_value(dg.AssetKey("shard_index"), instance=graph.instance)
    metadata = _materializations(graph.downstream)["shard_index"].metadata
    index = read_index(metadata["data_path"].value)
    assert ref == ShardIndexRef(path=metadata["data_path"].value, version=index.version,
                                manifest_version=index.manifest_version)
    assert graph.downstream.output_for_node("shard_index") == ref


def test_shard_index_publishes_the_shard_set_to_the_store_where_one_is_configured(graph: Graph, tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """TRAINYARD_SHARD_ROOT (a folder here; the deployment's S3 bucket in tests/test_cluster.py): the set is
    published whole as <root>/<index version>/, another machine fetches it and reads the same index,
    and a writer's leftover temporary file neither enters it nor makes publishing again fail."""
    root = tmp_path / "store"
    monkeypatch.setenv(paths.SHARD_ROOT_VARIABLE, str(root))
    result = graph.run([dg.AssetKey("shard_index")])
    metadata = _materializations(result)["shard_index"].metadata
    index = read_index(metadata["data_path"].value)
    url = metadata["published_to"].value
    assert url == f"{root}/{index.version}"
    assert result.output_for_node("shard_index").path == url  # downstream reads the store's copy
    assert read_index(url).version == index.version  # a folder store is read in place
    record = objstore.verify(url)
    local = sorted(path.name for path in Path(metadata["data_path"].value).iterdir() if not path.name.startswith("."))
    assert sorted(record["files"]) == local and all(f"{shard}.tar" in record["files"] for shard in graph.plan.shards)
    assert metadata["published_objects"].value == len(local) and metadata["published_mb"].value > 0
    fetched = tmp_path / "machine-2" / index.version
    objstore.fetch(url, fetched)
    copy = read_index(fetched)
    copy.verify()  # every shard re-hashed against the index
    assert (copy.version, copy.table) == (index.version, index.table)
    leftover = Path(metadata["data_path"].value) / ".train-00000.tar.tmp-123"
    leftover.write_bytes(b"half a shard")
    try:
        again = _materializations(graph.run([dg.AssetKey("shard_index")]))["shard_index"].metadata
    finally:
        leftover.unlink()
    assert again["published_to"].value == url and again["published_mb"].value == 0  # already there, unchanged
    assert sorted(objstore.verify(url)["files"]) == local


def test_data_profile_publishes_figures_plot_and_parquet(graph: Graph) -> None:
    metadata = _materializations(graph.downstream)["data_profile"].metadata
    validated = _materializations(graph.upstream)["validated_manifest"].metadata["dagster/row_count"].value
    quarantined = _materializations(graph.upstream)["quarantine"].metadata["dagster/row_count"].value
    assert metadata["invalid_file_rate"].value == round(quarantined / (validated + quarantined), 4) > 0
    assert metadata["num_sources"].value == validated and metadata["num_clips"].value == 40
    assert isinstance(metadata["distributions"], dg.MarkdownMetadataValue)
    distributions = metadata["distributions"].value
    for name in ("resolution", "duration", "video_codec", "audio", "clips_per_split", "clips_per_bucket"):
        assert f"**{name}**" in distributions, name
    plot = Path(metadata["plot"].value)
    assert plot.is_file() and plot.read_bytes().startswith(b"\x89PNG")
    directory = Path(metadata["data_path"].value)
    assert plot.parent == directory
    assert pq.read_table(directory / "sources.parquet").num_rows == validated
    decode = pq.read_table(directory / "decode_times.parquet")
    assert decode.num_rows == metadata["num_clips_timed"].value == 8
    assert min(decode.column("decode_s").to_pylist()) > 0
    # Where the shards were written (the plan's backfill reports, assets/backfill.py): one run per
    # partition here, all on this machine.
    import socket

    assert metadata["backfill_runs"].value >= len(graph.plan.shards)
    nodes = metadata["backfill_nodes"].value
    assert socket.gethostname() in nodes and "partitions_written" in nodes


def test_loader_benchmark_reports_five_positive_figures(graph: Graph) -> None:
    metadata = _materializations(graph.downstream)["loader_benchmark"].metadata
    for figure in FIGURES:
        assert metadata[figure].value > 0, figure
    assert metadata["num_clips"].value == 15  # one epoch of the train split


def test_data_profile_files_follow_its_config(graph: Graph) -> None:
    first = _materializations(graph.downstream)["data_profile"].metadata
    rerun = graph.run([dg.AssetKey("data_profile")],
                      run_config={"ops": {"data_profile": {"config": {"max_clips_timed": 4}}}})
    metadata = _materializations(rerun)["data_profile"].metadata
    directory = Path(metadata["data_path"].value)
    assert directory != Path(first["data_path"].value), "another config must not reuse the published profile"
    assert pq.read_table(directory / "decode_times.parquet").num_rows == metadata["num_clips_timed"].value == 4


def test_a_changed_plan_resyncs_the_partitions(graph: Graph) -> None:
    """Runs last: it changes the plan, and so the partitions, of the shared instance."""
    original = set(graph.plan.shards)
    fewer = graph.run([PLAN], run_config=_plan_config(clips_per_shard=32))
    fewer_plan = read_plan(Path(_materializations(fewer)["clip_plan"].metadata["data_path"].value))
    assert sorted(graph.instance.get_dynamic_partitions(PARTITIONS)) == fewer_plan.shards
    assert original - set(fewer_plan.shards) == {"test-00001"}
    metadata = _materializations(fewer)["clip_plan"].metadata
    assert (metadata["partitions_added"].value, metadata["partitions_removed"].value) == (0, 1)

    more = graph.run([PLAN], run_config=_plan_config(clips_per_shard=8))
    more_plan = read_plan(Path(_materializations(more)["clip_plan"].metadata["data_path"].value))
    assert sorted(graph.instance.get_dynamic_partitions(PARTITIONS)) == more_plan.shards
    assert set(more_plan.shards) - set(fewer_plan.shards) == {"train-00001", "test-00001", "test-00002",
                                                              "test-00003"}
    metadata = _materializations(more)["clip_plan"].metadata
    assert (metadata["partitions_added"].value, metadata["partitions_removed"].value) == (4, 0)
    assert more_plan.version != fewer_plan.version != graph.plan.version
