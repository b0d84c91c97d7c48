"""``fault_drill`` (training group): every injected fault on a short 2-rank CPU run, proven recovered or
stopped as intended, every night (``fault_drill_job`` on the ``nightly_fault_drill`` schedule,
pipelines/training.py) and in ``make demo``.

Each fault runs as its own stage run (under ``<data>/fault_drills/<dagster run id>/<fault>``)
through the launcher, so the fault policy (trainer/supervisor/elastic.py) that handles it is the one every
training stage runs under; an uninterrupted run on the same data is the reference. The judging
(ops/drills/fault.py) reads the runs' own records. The metadata holds a Markdown table, one row per
fault, and ``faults_total`` / ``faults_passed``; the blocking check ``fault_drill_passed`` passes
only when they are equal.
"""


import concurrent.futures
import json
import threading
import time
from pathlib import Path

import dagster as dg

from assets.inputs import SHARD_INDEX_IN
from assets.metadata import lineage_metadata
from assets.stage_runs import TRAINING_CODE_VERSION, TRAINING_POOL, index_buckets, launch_stage
from ops.publish.hashing import digest_json
from ops.publish.paths import REPO_ROOT
from ops.clips.shard_ref import ShardIndexRef
from resources import LineageResource, StorageResource
from resources.launcher import TorchrunLauncher, raise_if_canceled
from trainer.launch.stage_launch import StageLaunch

GROUP = "training"


class FaultDrillConfig(dg.Config):
    config_path: str = "configs/fault_drill.yaml"
    """Experiment YAML, relative to the repository root (a tiny model on the demo's shards); each
    fault adds its overrides."""
    faults: list[str] = []
    """Names of the faults to run (ops/drills/fault.py FAULTS); empty: all of them."""
    parallel: int = 2
    """Faults run at once. Each is its own run folder and process group; most of a fault's time is
    process start-up and waiting (a watchdog, a grace period), so two at once take about two thirds
    of the time on 2 cores. Recovery times are wall clock and grow with it: 1 to measure them alone."""


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["pretrain"], kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          ins={"shard_index": SHARD_INDEX_IN},
          check_specs=[dg.AssetCheckSpec("fault_drill_passed", asset="fault_drill", blocking=True)],
          description="Each injected fault (rank killed, preempted, NaN, stalled fetch, bad sample, corrupt "
                      "checkpoint, death in a save) on a 2-rank CPU run: class, recovery, steps lost, bit-identity.")
def fault_drill(context: dg.AssetExecutionContext, config: FaultDrillConfig, shard_index: ShardIndexRef | dict,
                storage: StorageResource, launcher: TorchrunLauncher, lineage: LineageResource):
    from ops.drills import fault as drill  # torch (parameter comparison): imported by the run that drills

    known = {fault.name: fault for fault in drill.FAULTS}
    unknown = sorted(set(config.faults) - set(known))
    if unknown:
        raise dg.Failure(f"fault_drill: unknown fault(s) {unknown}; known: {sorted(known)}")
    faults = [known[name] for name in config.faults] if config.faults else list(drill.FAULTS)
    data = ShardIndexRef.of(shard_index)
    buckets = index_buckets(data)
    root = storage.data / "fault_drills" / context.run.run_id
    config_path = str(Path(config.config_path) if Path(config.config_path).is_absolute() else REPO_ROOT / config.config_path)

    if config.parallel < 1:
        raise dg.Failure(f"fault_drill: parallel must be at least 1, not {config.parallel}")
    cancel = threading.Event()  # set when this step is interrupted: the worker threads' launches stop

    def run(name: str, overrides: tuple) -> Path:
        raise_if_canceled(cancel)
        launch = StageLaunch(stage="fault_drill", config_path=config_path, data=data, buckets=buckets, steps=drill.STEPS,
                             world_size=drill.WORLD_SIZE, run_dir=str(root / name),
                             user_overrides=(*drill.COMMON, *overrides))
        try:
            launch_stage(context, launch, storage=storage, launcher=launcher, report=False, cancel=cancel)
        except dg.Failure as failure:  # the fault did its work: its records say what happened
            context.log.info(f"fault drill {name}: the launch failed as a fault may make it: {failure.description}")
        return root / name

    def drill_one(fault) -> dict:
        overrides = fault.overrides + ((f"faults.raise_on_sample={sample}",) if fault.needs_sample else ())
        fault_started = time.monotonic()
        run_dir = run(fault.name, overrides)
        if fault.relaunch:  # what the scheduler (or the stage's retry policy) does after a requeue-able end
            run(fault.name, overrides)
        result = drill.judge(fault, run_dir, reference, sample=sample if fault.needs_sample else None)
        result["wall_s"] = round(time.monotonic() - fault_started, 1)
        context.log.info(f"fault drill {fault.name}: {'PASSED' if result['passed'] else 'FAILED'} "
                         f"({result['class_recorded']}, {result['outcome']}): {result['problems']}")
        return result

    started = time.monotonic()
    reference = run("uninterrupted", ())
    if (json.loads((reference / "final.json").read_text()).get("status") if (reference / "final.json").is_file()
            else None) != "completed":
        raise dg.Failure(f"fault_drill: the uninterrupted reference run did not complete; see {reference}")
    sample = _sample_at(reference, step=3, rank=1)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=config.parallel, thread_name_prefix="fault_drill")
    try:
        futures = [pool.submit(drill_one, fault) for fault in faults]
        # Waited in slices: Dagster's interrupt reaches this (main) thread between them.
        while not all(future.done() for future in futures):
            concurrent.futures.wait(futures, timeout=1.0)
        results = [future.result() for future in futures]  # FAULTS' order, whatever finished first
    except BaseException:  # Dagster's interrupt is a BaseException; always re-raised below
        cancel.set()  # the running launches stop as a cancel would stop them; the queued never start
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    passed = sum(result["passed"] for result in results)
    (root / "results.json").write_text(json.dumps(results, indent=2))
    record = lineage.collect(manifest_version=data.manifest_version, code_version=TRAINING_CODE_VERSION,
                             config={"fault_drill": config.model_dump(), "shard_index": data.version})
    metadata = {"faults_total": len(results), "faults_passed": passed, "drill_dir": str(root),
                "table": dg.MetadataValue.md(drill.markdown(results)), "wall_s": round(time.monotonic() - started, 1),
                **{f"{result['fault']}/{key}": result[key] for result in results
                   for key in ("class_recorded", "outcome", "passed")},
                **lineage_metadata(record)}
    yield dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(digest_json(
        [{k: v for k, v in result.items() if k not in ("wall_s", "time_to_recover_s")} for result in results])[:20]))
    yield dg.AssetCheckResult(check_name="fault_drill_passed", passed=passed == len(results) and bool(results),
                              metadata={"faults_total": len(results), "faults_passed": passed,
                                        "failed": ", ".join(r["fault"] for r in results if not r["passed"]) or "none"})


def _sample_at(run_dir: Path, *, step: int, rank: int) -> str:
    """A sample id the reference run trained at ``step`` on ``rank``: the bad-sample fault's target."""
    steps = dict((s, keys) for s, keys in json.loads((run_dir / "samples" / f"rank_{rank}.json").read_text())["steps"])
    if not steps.get(step):
        raise dg.Failure(f"fault_drill: the reference run trained no sample at step {step} on rank {rank}")
    return steps[step][0]
