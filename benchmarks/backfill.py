"""A clip_shards backfill on one node against two nodes of the SLURM cluster, with the local path
as a third column, side by side in one run.

    python -m benchmarks.backfill [--preset realistic] [--num-good 32] [--partitions 8]
                                  [--clips-per-shard 16] [--shards-per-task 1] [--partition nodes]

Needs a SLURM partition of at least two nodes that mount this machine's filesystem (``make
slurm-up NODES=3``: each node a namespace pinned to its own CPU). Media are generated (tools/
demo_media.py), planned, and the same partitions are written through the real asset (Dagster,
``clip_shards``) three ways, each round in a seeded random order, the shards deleted before each:

- ``local``: the step writes them itself (LocalTorchrunLauncher): one core of this machine;
- ``one_node``: array tasks on the partition's first node only (the others excluded);
- ``two_nodes``: array tasks on its first two nodes.

Every side must write the same bytes (``byte_identical``). Throughput is frames written per
second of the backfill's wall time (queue waits, task start-up and Dagster included), and per core
(the cores the side had: 1 locally, one per node with ``array_cpus_per_task=1``); ``*_work_per_core``
is the same frames over the partitions' own writing time (in their task or step: no queue, no
start-up), the shard writer's throughput on a core. The ceiling is
PyAV alone on the same clips in this process: decode, resize and encode each planned clip
(ops.media.codec), with no hashing, tar, index, task or Dagster: frames/s on one core.

The last line is one JSON object: seconds and frames/s per side, ``speedup_two_over_one`` (goal
1.7), and each side's frames/s per core over the ceiling, by wall time and by writing time (goal 0.8).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import harness

# --smoke: seconds, tiny inputs, figures meaningless (benchmarks/harness.py)
SMOKE_ARGS = ["--preset", "demo", "--num-good", "4", "--partitions", "2", "--clips-per-shard", "2", "--rounds", "1"]
SIDES = ("local", "one_node", "two_nodes")
GOAL_SPEEDUP = 1.7
GOAL_PER_CORE = 0.8


def _plan(base: Path, preset: str, num_good: int | None, clips_per_shard: int):
    from assets import clips as clip_assets
    from ops.clips import plan as plan_ops
    from ops.curation import manifest as manifest_ops, validation as validation_ops
    from tools.demo_media import generate_demo_media

    media = base / "media"
    generate_demo_media(media, seed=0, num_good=num_good, preset=preset)
    manifest = manifest_ops.build_manifest(media, manifest_ops.ManifestConfig())
    validation = validation_ops.validate(manifest, validation_ops.ValidationConfig(max_quarantine_fraction=0.9))
    plan = plan_ops.plan_clips(validation.accepted,
                               clip_assets.ShardBuildConfig(clips_per_shard=clips_per_shard).to_ops(),
                               manifest_version=manifest.version, validated_version=validation.version,
                               code_version=clip_assets.SHARD_CODE_VERSION)
    plan_dir = base / "data" / "shards" / plan.version
    plan_ops.write_plan(plan, plan_dir)
    return media, plan, plan_dir


def _ceiling(plan, partitions: list[str], media: Path) -> tuple[float, int]:
    """PyAV alone on the partitions' clips, one core: (seconds, frames)."""
    import numpy as np

    from ops.media import codec

    seconds, frames = 0.0, 0
    for partition in partitions:
        rows = plan.rows_for(partition)
        for uri in dict.fromkeys(row["uri"] for row in rows):
            source = [row for row in rows if row["uri"] == uri]
            shape = plan.config.bucket_shapes[source[0]["bucket"]]
            started = time.perf_counter()
            clips = codec.decode_source_clips(str(media / uri), [row["start_s"] for row in source], shape)
            audio = codec.decode_source_audio(str(media / uri), [row["start_s"] for row in source], shape)
            for index in range(len(source)):
                if index in clips.short:
                    continue
                pcm = audio[index] if audio is not None else np.zeros(shape.num_audio_samples, np.float32)
                codec.encode_clip(clips.frames[index], pcm, shape)
                frames += shape.num_frames
            seconds += time.perf_counter() - started
    return seconds, frames


def _job(media: Path, data: Path, plan, plan_dir: Path, launcher):
    import dagster as dg

    from assets import clips as clip_assets
    from resources import LineageResource, StorageResource

    @dg.asset(name="clip_plan")
    def fixed_plan() -> dict:
        return {"version": plan.version, "path": str(plan_dir), "media_root": str(media), "shards": plan.shards}

    resources = {"storage": StorageResource(media_root=str(media), data_root=str(data)),
                 "lineage": LineageResource(), "launcher": launcher}
    return dg.Definitions(assets=[fixed_plan, clip_assets.clip_shards],
                          resources=resources).resolve_implicit_global_asset_job_def()


def _side(instance, job, partitions: list[str], plan_dir: Path) -> dict:
    import dagster as dg

    from assets import backfill

    for partition in partitions:
        for suffix in (".tar", ".index.parquet", ".failures.json"):
            (plan_dir / f"{partition}{suffix}").unlink(missing_ok=True)
    started = time.perf_counter()
    result = job.execute_in_process(
        instance=instance, raise_on_error=False, asset_selection=[dg.AssetKey("clip_shards")],
        run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
        tags={"dagster/asset_partition_range_start": partitions[0], "dagster/asset_partition_range_end": partitions[-1]})
    seconds = time.perf_counter() - started
    if not result.success:
        failures = [event.message for event in result.all_events if event.is_failure]
        raise RuntimeError(f"the backfill failed: {failures[:3]}")
    report_path = next(iter(backfill.backfills_dir(plan_dir.parents[1]).glob(f"{result.run_id}/report.json")))
    import json

    report = json.loads(report_path.read_text())
    sha = {event.materialization.partition: event.materialization.metadata["sha256"].value
           for event in result.get_asset_materialization_events()}
    return {"seconds": seconds, "frames": sum(stats["frames"] for stats in report["nodes"].values()),
            "work_s": report["work_s"],
            "nodes": sorted(report["nodes"]), "queue_wait_s": report["queue_wait_s"]["max"], "sha256": sha}


def measure(args: argparse.Namespace, base: Path) -> dict:
    import dagster as dg

    from ops.publish import paths
    from resources.launcher import LocalTorchrunLauncher
    from resources.slurm import SlurmLauncher

    probe = SlurmLauncher(partition=args.partition, array_cpus_per_task=1)
    nodes = probe.usable_nodes_for(1)
    if len(nodes) < 2:
        raise SystemExit(f"benchmarks.backfill: partition {args.partition!r} has {len(nodes)} usable node(s) "
                         f"({', '.join(nodes) or 'none'}); it needs two (sudo make slurm-up NODES=3)")
    media, plan, plan_dir = _plan(base, args.preset, args.num_good, args.clips_per_shard)
    if len(plan.shards) < args.partitions:
        raise SystemExit(f"the plan has {len(plan.shards)} shards, fewer than --partitions {args.partitions}: "
                         f"lower --clips-per-shard")
    partitions = plan.shards[:args.partitions]
    cluster = {"partition": args.partition, "array_cpus_per_task": 1, "array_parallel": 0, "poll_s": 0.25,
               "shards_per_task": args.shards_per_task, "shared_paths": [str(base), str(paths.REPO_ROOT)]}
    launchers = {"local": LocalTorchrunLauncher(),
                 "one_node": SlurmLauncher(**cluster, exclude=[node for node in nodes if node != nodes[0]]),
                 "two_nodes": SlurmLauncher(**cluster, exclude=nodes[2:])}
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    rng = random.Random(0)
    (base / "dagster").mkdir()
    with dg.DagsterInstance.local_temp(tempdir=str(base / "dagster")) as instance:
        instance.add_dynamic_partitions("clip_shards", plan.shards)
        jobs = {side: _job(media, base / "data", plan, plan_dir, launcher) for side, launcher in launchers.items()}
        jobs["local"].execute_in_process(instance=instance, asset_selection=[dg.AssetKey("clip_plan")])
        for _ in range(args.rounds):
            order = list(SIDES)
            rng.shuffle(order)
            for side in order:
                runs[side].append(_side(instance, jobs[side], partitions, plan_dir))
    ceiling_s, ceiling_frames = _ceiling(plan, partitions, media)
    ceiling = ceiling_frames / ceiling_s
    cores = {"local": 1, "one_node": 1, "two_nodes": 2}
    seconds = {side: statistics.median(run["seconds"] for run in runs[side]) for side in SIDES}
    frames = runs["local"][0]["frames"]
    per_s = {side: frames / seconds[side] for side in SIDES}
    identical = all(run["sha256"] == runs["local"][0]["sha256"] for side in SIDES for run in runs[side])
    return {
        "benchmark": "backfill", "partitions": len(partitions), "clips": sum(len(plan.rows_for(p)) for p in partitions),
        "frames": frames, "rounds": args.rounds, "shards_per_task": args.shards_per_task, "preset": args.preset,
        "slurm_partition": args.partition,
        "nodes_one": runs["one_node"][0]["nodes"], "nodes_two": runs["two_nodes"][0]["nodes"],
        **{f"{side}_s": round(seconds[side], 3) for side in SIDES},
        **{f"{side}_frames_per_s": round(per_s[side], 2) for side in SIDES},
        **{f"{side}_queue_wait_max_s": round(max(run["queue_wait_s"] for run in runs[side]), 3) for side in SIDES},
        "speedup_two_over_one": round(per_s["two_nodes"] / per_s["one_node"], 3), "goal_speedup": GOAL_SPEEDUP,
        "ceiling_frames_per_s_per_core": round(ceiling, 2),
        **{f"{side}_per_core_over_ceiling": round(per_s[side] / cores[side] / ceiling, 3) for side in SIDES},
        # While writing (each partition's own time in its task or step: no queue, no task start-up).
        **{f"{side}_work_per_core_over_ceiling": round(
            frames / statistics.median(run["work_s"] for run in runs[side]) / ceiling, 3) for side in SIDES},
        "goal_per_core": GOAL_PER_CORE, "byte_identical": identical,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="realistic", help="tools/demo_media.py preset of the generated media")
    parser.add_argument("--num-good", type=int, default=32, help="sources to generate")
    parser.add_argument("--partitions", type=int, default=8, help="clip_shards partitions each side writes")
    parser.add_argument("--clips-per-shard", type=int, default=16)
    parser.add_argument("--partition", default="nodes", help="the SLURM partition whose first two nodes are used")
    parser.add_argument("--shards-per-task", type=int, default=1, help="partitions one array task writes")
    parser.add_argument("--rounds", type=int, default=1)
    args = harness.parse(parser, argv, SMOKE_ARGS)
    # Under /tmp, which every lab node mounts (the shared filesystem of deploy/slurm/nodes.sh).
    base = Path(tempfile.mkdtemp(prefix="trainyard-backfill-bench-", dir="/tmp"))
    try:
        summary = measure(args, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    harness.emit(summary, args)


if __name__ == "__main__":
    main()
