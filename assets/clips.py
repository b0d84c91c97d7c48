"""Clips group assets: clip_plan -> clip_shards (one partition per shard) -> shard_index, and
data_profile and loader_benchmark, read from the shard index and validated manifest.

``clip_plan`` registers exactly its shards as the dynamic partitions of ``clip_shards``, so a
data engineer backfills any subset of shards from the UI; rerunning a partition on the same
inputs writes a byte-identical shard. ``shard_index`` merges the per-shard indexes once every
shard of the plan exists, and hands the loader, profile and training a ``ShardIndexRef``
(ops/clips/shard_ref.py).

Where the data lies is the ``data_path`` metadata entry: the IO manager writes its own ``path``
(the pickled output) over an asset's ``path`` entry.
"""

import json
import time
from pathlib import Path

import dagster as dg
import pydantic
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from assets import backfill
from assets.inputs import SHARD_INDEX_IN
from assets.metadata import counts_table, lineage_metadata, markdown_table
from ops.clips import plan as clips, profile, shard_cache, shards
from ops.publish import objstore, paths
from ops import progress
from ops.curation import rights
from ops.publish.hashing import digest_json
from ops.lineage import code_version_of
from ops.media.codec import ClipShape
from ops.curation.quarantine import load_validation
from ops.clips.shard_ref import ShardIndexRef
from ops.publish.storage import publish_dir
from resources import LineageResource, StorageResource
from resources.launcher import TorchrunLauncher

# ops.clips.plan and ops.clips.shards with everything they import in the repository (ops.lineage).
SHARD_CODE_VERSION = code_version_of("ops.clips.plan", "ops.clips.shards")
# The named ops modules and everything they import in the repository (ops.lineage).
PROFILE_CODE_VERSION = code_version_of("ops.clips.profile", "ops.clips.shards")
BENCHMARK_CODE_VERSION = code_version_of("ops.clips.throughput")
SHARD_PARTITIONS = dg.DynamicPartitionsDefinition(name="clip_shards")
GROUP = "clips"
_DEFAULTS = clips.ShardConfig()
# Square short and long, landscape and portrait at the default frame rate: every demo source
# (16:9, 9:16, 1:1, 3:4, 4:3; 0.5 to 12 s) finds the bucket of its shape instead of a centre crop.
DEFAULT_BUCKETS = ("8x64x64", "16x64x64", "8x48x80", "8x80x48")


class ShardBuildConfig(dg.Config):
    """Clip shape and shard layout (defaults: ops.clips.plan.ShardConfig)."""

    num_frames: int = _DEFAULTS.shape.num_frames
    fps: float = _DEFAULTS.shape.fps
    width: int = _DEFAULTS.shape.width
    height: int = _DEFAULTS.shape.height
    audio_rate: int = _DEFAULTS.shape.audio_rate
    encoding: str = _DEFAULTS.encoding
    stride_s: float | None = None
    max_clips_per_source: int = _DEFAULTS.max_clips_per_source
    clips_per_shard: int = _DEFAULTS.clips_per_shard
    buckets: list[str] = pydantic.Field(default_factory=lambda: list(DEFAULT_BUCKETS), description=(
        "Clip shapes as 'FRAMESxHEIGHTxWIDTH'; each source is cut to the bucket nearest its aspect ratio, then the "
        "longest that fits, and training batches one bucket per step. Empty: every clip is num_frames x height x "
        "width."))

    def to_ops(self) -> clips.ShardConfig:
        shape = ClipShape(num_frames=self.num_frames, fps=self.fps, width=self.width, height=self.height,
                          audio_rate=self.audio_rate)
        single = sorted({"num_frames", "width", "height"} & self.model_fields_set)
        buckets = self.buckets
        if single and "buckets" in self.model_fields_set and buckets:
            raise ValueError(f"{single} set the one clip shape of unbucketed shards, but buckets {buckets} are set "
                             "too: list every shape in buckets, or set buckets to [] for one shape")
        if single and "buckets" not in self.model_fields_set:
            buckets = []  # asking for a clip shape means one shape, not the default buckets
        return clips.ShardConfig(shape=shape, encoding=self.encoding, stride_s=self.stride_s,
                                 max_clips_per_source=self.max_clips_per_source, clips_per_shard=self.clips_per_shard,
                                 buckets=tuple(clips.parse_bucket(name) for name in buckets))


def _bucket_counts(table, config: clips.ShardConfig) -> dict[str, int]:
    """Clips per bucket, every configured bucket listed (an empty one is worth seeing), in config order."""
    names = table.column("bucket").to_pylist()
    return {name: names.count(name) for name in config.bucket_shapes}


def _sync_partitions(instance: dg.DagsterInstance, wanted: list[str]) -> tuple[list[str], list[str]]:
    existing = set(instance.get_dynamic_partitions(SHARD_PARTITIONS.name))
    added = [key for key in wanted if key not in existing]
    removed = sorted(existing - set(wanted))
    if added:
        instance.add_dynamic_partitions(SHARD_PARTITIONS.name, added)
    for key in removed:
        instance.delete_dynamic_partition(SHARD_PARTITIONS.name, key)
    return added, removed


@dg.asset(group_name=GROUP, code_version=SHARD_CODE_VERSION,
          description="Which clips are cut from which validated source into which shard; sets the shard partitions.")
def clip_plan(context: dg.AssetExecutionContext, config: ShardBuildConfig, validated_manifest: dict,
              storage: StorageResource, lineage: LineageResource) -> dg.Output[dict]:
    validation = load_validation(Path(validated_manifest["path"]))
    # An asset revoked after this set was validated is left out here too (ops.curation.rights): the plan, and so
    # the shards and the next training run, never hold it, whether or not validation ran again.
    revoked = rights.revoked(storage.data)
    accepted = validation.accepted
    excluded = sorted(set(accepted.column("asset_id").to_pylist()) & set(revoked))
    if excluded:
        accepted = accepted.filter(pc.invert(pc.is_in(accepted.column("asset_id"), value_set=pa.array(excluded))))
        context.log.warning(f"clip_plan: {len(excluded)} asset(s) of validated set {validation.version} are revoked "
                            f"in the rights ledger and left out: {[asset_id[:12] for asset_id in excluded]}")
    plan = clips.plan_clips(accepted, config.to_ops(), manifest_version=validation.manifest_version,
                            validated_version=validation.version, code_version=SHARD_CODE_VERSION)
    directory = shards.shard_dir(storage.data, plan.version)
    directory.mkdir(parents=True, exist_ok=True)
    clips.write_plan(plan, directory)
    added, removed = _sync_partitions(context.instance, plan.shards)
    record = lineage.collect(manifest_version=plan.manifest_version, config=plan.config.as_dict(),
                             code_version=SHARD_CODE_VERSION)
    per_shard = {shard: count for shard, count in
                 zip(*np.unique(plan.table.column("shard").to_numpy(zero_copy_only=False),
                                                 return_counts=True))}
    return dg.Output(
        {"version": plan.version, "path": str(directory), "media_root": validation.media_root,
         "shards": plan.shards, "validated_version": validation.version},
        data_version=dg.DataVersion(plan.version),
        metadata={"plan_version": plan.version, "data_path": str(directory), "dagster/row_count": plan.table.num_rows,
                  "validated_version": validation.version,
                  "num_revoked_left_out": len(excluded),
                  "revoked_left_out": markdown_table(
                      [{"asset_id": asset_id, "revocation": rights.describe(revoked[asset_id])} for asset_id in excluded],
                      ["asset_id", "revocation"]),
                  "num_shards": len(plan.shards), "encoding": plan.config.encoding,
                  "num_sources_too_short": plan.num_sources_too_short,
                  "partitions_added": len(added), "partitions_removed": len(removed),
                  "clips_per_shard": counts_table({k: int(v) for k, v in per_shard.items()}, "shard"),
                  "clips_per_bucket": counts_table(_bucket_counts(plan.table, plan.config), "bucket"),
                  **lineage_metadata(record)},
    )


@dg.asset(group_name=GROUP, code_version=SHARD_CODE_VERSION, partitions_def=SHARD_PARTITIONS,
          backfill_policy=backfill.backfill_policy(), output_required=False,
          description=("One WebDataset tar shard of the clip plan, published atomically; partition = shard. Where the "
                       "launcher runs data work on SLURM, a backfill's partitions are array tasks (docs/data.md)."))
def clip_shards(context: dg.AssetExecutionContext, clip_plan: dict, storage: StorageResource,
                lineage: LineageResource, launcher: TorchrunLauncher):
    """Each partition of the run written (here, or as array tasks on the cluster), checked against what
    its writer recorded, and materialized on its own (assets/backfill.py); the failed ones named."""
    started = time.time()
    plan = clips.read_plan(Path(clip_plan["path"]))
    partitions = list(context.partition_keys)
    unknown = [key for key in partitions if key not in set(plan.shards)]
    if unknown:
        raise dg.Failure(description=f"clip_shards: partition(s) {unknown[:5]} are not shards of plan {plan.version} "
                                     f"(materialize clip_plan, which sets the partitions)", allow_retries=False)
    out_dir = Path(clip_plan["path"])
    if launcher.runs_data_on_cluster:
        records, attempts = backfill.write_on_cluster(context, launcher, plan_dir=clip_plan["path"],
                                                      media_root=clip_plan["media_root"], partitions=partitions,
                                                      data_root=storage.data)
        where = "slurm"
    else:
        with progress.reporting(log=context.log.info):  # decoding and encoding its clips: a line every 10 s
            records = backfill.write_here(context, plan, media_root=clip_plan["media_root"], out_dir=clip_plan["path"],
                                          partitions=partitions)
        attempts, where = {}, "local"
    for key, record in records.items():
        problem = backfill.verify_published(record, out_dir) if record.get("class") == "ok" else ""
        if problem:
            records[key] = {**record, "class": "corrupt", "reason": problem}
    report = backfill.build_report(context, records, attempts, plan_version=plan.version, where=where,
                                   started=started)
    report_path = backfill.write_report(storage.data, report)
    lineage_md = lineage_metadata(lineage.collect(manifest_version=plan.manifest_version,
                                                  config=plan.config.as_dict(), code_version=SHARD_CODE_VERSION))
    for key in partitions:
        record = records[key]
        if record.get("class") != "ok":
            continue
        if record.get("failures"):
            context.log.warning(f"{key}: {len(record['failures'])} planned clips could not be cut: "
                                f"{record['failures'][:3]}")
        yield backfill.materialize_partition(context, record, plan_version=plan.version, code_version=SHARD_CODE_VERSION,
                                       lineage=lineage_md, report_path=report_path,
                                       queue_wait_s=report["partitions"][key]["queue_wait_s"])
    if len(partitions) > 1 or where != "local":
        context.log.info(f"clip_shards: {report['num_written']}/{len(partitions)} partition(s) written ({where}) in "
                         f"{report['wall_s']:.1f} s; per node: " + "; ".join(
                             f"{node}: {stats['partitions_written']} written, {stats['failures']} failed"
                             for node, stats in report["nodes"].items()) + f"; report {report_path}")
    failed = [key for key in partitions if records[key].get("class") != "ok"]
    if failed:
        raise dg.Failure(
            description=f"clip_shards: {len(failed)} of {len(partitions)} partition(s) failed (the others are "
                        f"materialized):\n- " + "\n- ".join(
                            f"{key}: {records[key]['class']}: {records[key].get('reason', '')}" for key in failed[:20]),
            allow_retries=False,
            metadata={"failed_partitions": ", ".join(failed[:100]), "backfill_report": str(report_path),
                      "per_node": backfill.nodes_table(report)})


@dg.asset(group_name=GROUP, code_version=SHARD_CODE_VERSION, deps=[clip_shards],
          description="Random-access index over every shard of the plan (sample key, shard, offsets, shard sha256).")
def shard_index(context: dg.AssetExecutionContext, clip_plan: dict,
                lineage: LineageResource) -> dg.Output[ShardIndexRef]:
    directory = Path(clip_plan["path"])
    plan = clips.read_plan(directory)
    index = shards.build_index(plan, directory)  # re-hashes every shard against its own index first
    published = _publish_shard_set(context, directory, index)
    record = lineage.collect(manifest_version=plan.manifest_version, config=plan.config.as_dict(),
                             code_version=SHARD_CODE_VERSION)
    splits = dict(zip(*np.unique(index.table.column("split").to_numpy(zero_copy_only=False),
                                                   return_counts=True)))
    # Downstream reads the set where the deployment keeps it: the bucket's copy when one was published.
    location = published.get("published_to", str(directory))
    return dg.Output(
        ShardIndexRef(path=location, version=index.version, manifest_version=plan.manifest_version),
        data_version=dg.DataVersion(index.version),
        metadata={"shard_index_version": index.version, "data_path": str(directory),
                  "dagster/row_count": index.table.num_rows, "num_shards": len(plan.shards),
                  "encoding": plan.config.encoding,
                  "clips_per_split": counts_table({str(k): int(v) for k, v in splits.items()}, "split"),
                  "clips_per_bucket": counts_table(_bucket_counts(index.table, plan.config), "bucket"),
                  **published, **lineage_metadata(record)},
    )


def _publish_shard_set(context: dg.AssetExecutionContext, directory: Path, index: shards.ShardIndex) -> dict:
    """Where the deployment keeps shard sets in an object store (TRAINYARD_SHARD_ROOT), publish this one
    there as ``<root>/<index version>/``: its tars, per-shard indexes, plan and index, then the commit
    record (ops.publish.objstore). A version is immutable: publishing the same index again finds it done.
    The asset's reference then names that URL, so the profile, the loader benchmark and every
    training stage read the set from the store (ops.clips.shard_cache), not from this machine's disk."""
    root = paths.shard_store_root()
    if root is None:
        return {}
    url = objstore.join(root, index.version)
    try:
        result = objstore.publish_tree(directory, url, skip_hidden=True,  # a killed writer's temporary files
                                       metadata={"shard_index_version": index.version,
                                                 "plan_version": index.plan_version})
    except (objstore.ObjectStoreError, OSError) as error:  # asked for and not done: the asset says so
        raise dg.Failure(f"shard_index: publishing {directory} to {url} ({paths.SHARD_ROOT_VARIABLE}) failed: "
                         f"{error}") from error
    context.log.info(f"shard set published to {url}: {len(result.record['files'])} objects, "
                     f"{result.bytes / 1e6:.1f} MB in {result.seconds:.2f} s")
    return {"published_to": url, "published_objects": len(result.record["files"]),
            "published_mb": round(result.bytes / 1e6, 3), "published_s": round(result.seconds, 3)}



def _text_histogram(counts: dict[str, int], width: int = 30) -> str:
    top = max(counts.values(), default=0) or 1
    lines = [f"{name:>18} | {'█' * round(width * count / top):<{width}} {count}" for name, count in counts.items()]
    return "```\n" + "\n".join(lines) + "\n```"


class ProfileConfig(dg.Config):
    max_clips_timed: int = 64
    """Clips sampled (seeded) for the decode-time and read-throughput figures."""


@dg.asset(group_name=GROUP, code_version=PROFILE_CODE_VERSION, ins={"shard_index": SHARD_INDEX_IN},
          description="Distributions of the validated media and measured clip decode time / read throughput.")
def data_profile(context: dg.AssetExecutionContext, config: ProfileConfig, validated_manifest: dict,
                 shard_index: ShardIndexRef | dict, storage: StorageResource,
                 lineage: LineageResource) -> dg.Output[dict]:
    validation = load_validation(Path(validated_manifest["path"]))
    index = shard_cache.read_any_index(ShardIndexRef.of(shard_index).path)  # a folder, or the bucket
    result = profile.build_profile(validation.accepted, index, num_quarantined=len(validation.rejected),
                                   max_clips=config.max_clips_timed)
    # The config picks which clips are timed: a profile published under another config is not this one.
    version = digest_json({"validated": validation.version, "index": index.version, "config": config.model_dump(),
                           "code": PROFILE_CODE_VERSION})[:20]
    directory = storage.data / "profiles" / version
    with publish_dir(directory) as staging:
        if staging is not None:
            pq.write_table(validation.accepted, staging / "sources.parquet")
            pq.write_table(result.decode, staging / "decode_times.parquet")
            (staging / "profile.json").write_text(json.dumps(
                {"summary": result.summary, "distributions": result.distributions}, indent=2, sort_keys=True))
            (staging / "profile.png").write_bytes(profile.plot_profile(result, validation.accepted))
    record = lineage.collect(manifest_version=index.manifest_version, config=config.model_dump(),
                             code_version=PROFILE_CODE_VERSION)
    # Where the shards were written, per node (the backfill reports of this plan, assets/backfill.py).
    cluster = backfill.plan_backfills(storage.data, index.plan_version)
    histograms = "\n\n".join(f"**{name}**\n{_text_histogram(counts)}" for name, counts in result.distributions.items())
    return dg.Output(
        {"version": version, "path": str(directory)},
        # Decode timings vary run to run; the data version is the data profiled, not the timings.
        data_version=dg.DataVersion(version),
        metadata={**{key: value for key, value in result.summary.items() if isinstance(value, (int, float, str))},
                  "data_path": str(directory), "plot": dg.MetadataValue.path(str(directory / "profile.png")),
                  "distributions": dg.MetadataValue.md(histograms),
                  "resolutions": counts_table(result.distributions["resolution"], "resolution"),
                  "backfill_runs": cluster["runs"], "backfill_queue_wait_max_s": cluster["queue_wait_max_s"],
                  "backfill_work_s": cluster["work_s"], "backfill_nodes": backfill.nodes_table(cluster),
                  **lineage_metadata(record)},
    )


class LoaderBenchmarkConfig(dg.Config):
    # As benchmarks/loader.py: with batches of 8 tiny demo clips, fixed per-batch costs on 2 cores
    # are what gets measured, not the decode path (docs/status.md).
    batch_size: int = 32
    num_workers: int = 2
    epochs: int = 2
    rounds: int = 2


@dg.asset(group_name=GROUP, code_version=BENCHMARK_CODE_VERSION, ins={"shard_index": SHARD_INDEX_IN},
          description="Loader frames/s vs the plain-PyAV decode ceiling and a naive per-file loader (side by side).")
def loader_benchmark(context: dg.AssetExecutionContext, config: LoaderBenchmarkConfig, clip_plan: dict,
                     shard_index: ShardIndexRef | dict, lineage: LineageResource) -> dg.Output[dict]:
    from ops.clips import throughput  # torch's DataLoader: imported by the run that measures, not by the Definitions
    index = shard_cache.read_any_index(ShardIndexRef.of(shard_index).path)  # a folder, or the bucket
    plan = clips.read_plan(Path(clip_plan["path"]))
    figures = throughput.compare(index, plan, clip_plan["media_root"], batch_size=config.batch_size,
                                 num_workers=config.num_workers, epochs=config.epochs, rounds=config.rounds)
    context.log.info(json.dumps(figures))
    record = lineage.collect(manifest_version=index.manifest_version, config=config.model_dump(),
                             code_version=BENCHMARK_CODE_VERSION)
    return dg.Output(figures, metadata={**figures, **lineage_metadata(record)})
