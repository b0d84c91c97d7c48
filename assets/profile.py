"""Data profile and loader benchmark assets, read from the shard index and validated manifest."""

import json
from pathlib import Path

import dagster as dg
import pyarrow.parquet as pq

from assets.metadata import counts_table, lineage_metadata
from assets.inputs import SHARD_INDEX_IN
from ops.clips import plan as clips, profile, shard_cache
from ops.publish.hashing import digest_json
from ops.lineage import code_version_of
from ops.curation.quarantine import load_validation
from ops.clips.shard_ref import ShardIndexRef
from ops.publish.storage import publish_dir
from resources import LineageResource, StorageResource

# The named ops modules and everything they import in the repository (ops.lineage).
PROFILE_CODE_VERSION = code_version_of("ops.clips.profile", "ops.clips.shards")
BENCHMARK_CODE_VERSION = code_version_of("ops.clips.throughput")
GROUP = "clips"


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
    histograms = "\n\n".join(f"**{name}**\n{_text_histogram(counts)}" for name, counts in result.distributions.items())
    return dg.Output(
        {"version": version, "path": str(directory)},
        # Decode timings vary run to run; the data version is the data profiled, not the timings.
        data_version=dg.DataVersion(version),
        metadata={**{key: value for key, value in result.summary.items() if isinstance(value, (int, float, str))},
                  "data_path": str(directory), "plot": dg.MetadataValue.path(str(directory / "profile.png")),
                  "distributions": dg.MetadataValue.md(histograms),
                  "resolutions": counts_table(result.distributions["resolution"], "resolution"),
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
