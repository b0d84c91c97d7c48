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
    """Names of the faults to run (ops/drills/fault.py FAULTS and NODE_FAULTS); empty: all of FAULTS, and
    the node faults too when the launcher places the drill's ranks on several nodes with a spare one."""
    node_fault_command: str = ""
    """How the node faults lose a node: a command line, split like a shell's but run without one, in
    which ``{node}`` is the node's SLURM name. Empty: the local lab cluster's
    ``deploy/slurm/lose-node.sh kill {node}``, which refuses any node but the lab's own. On a real
    cluster, yours: e.g. ``ssh {node} sudo systemctl kill --signal=KILL slurmd`` (docs/slurm.md)."""
    node_restore_command: str = ""
    """Brings the lost node back after its case (``{node}`` as above). Empty: ``lose-node.sh restore {node}``."""
    parallel: int = 2
    """Faults run at once. Each is its own run folder and process group; most of a fault's time is
    process start-up and waiting (a watchdog, a grace period), so two at once take about two thirds
    of the time on 2 cores. Recovery times are wall clock and grow with it: 1 to measure them alone."""


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["pretrain"], kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          ins={"shard_index": SHARD_INDEX_IN},
          check_specs=[dg.AssetCheckSpec("fault_drill_passed", asset="fault_drill", blocking=True)],
          description="Each injected fault (rank killed, preempted, NaN, stalled fetch, bad sample, corrupt "
                      "checkpoint, death in a save; a lost node under a multi-node SLURM launcher) on a 2-rank "
                      "CPU run: class, recovery, steps lost, bit-identity.")
def fault_drill(context: dg.AssetExecutionContext, config: FaultDrillConfig, shard_index: ShardIndexRef | dict,
                storage: StorageResource, launcher: TorchrunLauncher, lineage: LineageResource):
    from ops.drills import fault as drill  # torch (parameter comparison): imported by the run that drills

    known = {fault.name: fault for fault in drill.ALL_FAULTS}
    unknown = sorted(set(config.faults) - set(known))
    if unknown:
        raise dg.Failure(f"fault_drill: unknown fault(s) {unknown}; known: {sorted(known)}")
    node_faults_why_not = _node_faults_why_not(launcher, config)
    if config.faults:
        faults = [known[name] for name in config.faults]
        if node_faults_why_not and any(fault.node_loss for fault in faults):
            raise dg.Failure(f"fault_drill: {', '.join(f.name for f in faults if f.node_loss)} cannot run: "
                             f"{node_faults_why_not}")
    else:
        faults = list(drill.FAULTS) + ([] if node_faults_why_not else list(drill.NODE_FAULTS))
        if node_faults_why_not:
            context.log.info(f"fault_drill: no node faults ({', '.join(f.name for f in drill.NODE_FAULTS)}): "
                             f"{node_faults_why_not}")
    data = ShardIndexRef.of(shard_index)
    buckets = index_buckets(data)
    root = storage.data / "fault_drills" / context.run.run_id
    config_path = str(Path(config.config_path) if Path(config.config_path).is_absolute() else REPO_ROOT / config.config_path)

    if config.parallel < 1:
        raise dg.Failure(f"fault_drill: parallel must be at least 1, not {config.parallel}")
    cancel = threading.Event()  # set when this step is interrupted: the worker threads' launches stop

    def run(name: str, overrides: tuple, *, node_fault: bool = False) -> Path:
        raise_if_canceled(cancel)
        launch = StageLaunch(stage="fault_drill", config_path=config_path, data=data, buckets=buckets, steps=drill.STEPS,
                             world_size=drill.WORLD_SIZE, run_dir=str(root / name),
                             user_overrides=(*drill.COMMON, *overrides))
        try:
            # A node fault resumes at the same world size on a spare node (min_nodes=0), so that the
            # continued run can be held to the uninterrupted one bit for bit.
            launch_stage(context, launch, storage=storage, report=False, cancel=cancel,
                         launcher=launcher.model_copy(update={"min_nodes": 0}) if node_fault else launcher)
        except dg.Failure as failure:  # the fault did its work: its records say what happened
            context.log.info(f"fault drill {name}: the launch failed as a fault may make it: {failure.description}")
        return root / name

    def drill_one(fault) -> dict:
        overrides = fault.overrides + ((f"faults.raise_on_sample={sample}",) if fault.needs_sample else ())
        fault_started = time.monotonic()
        loss = drill.NodeLoss(root / fault.name, how=fault.node_loss, fault_command=config.node_fault_command,
                              restore_command=config.node_restore_command, stop=cancel).start() \
            if fault.node_loss else None
        try:
            run_dir = run(fault.name, overrides, node_fault=bool(fault.node_loss))
            if fault.relaunch:  # what the scheduler (or the stage's retry policy) does after a requeue-able end
                run(fault.name, overrides)
        finally:
            if loss is not None:
                loss.finish()  # the node back whatever happened: its link up, slurmd running
        result = drill.judge(fault, run_dir, reference, sample=sample if fault.needs_sample else None,
                             lost_node=loss.node if loss is not None else None)
        if loss is not None:
            result["lost_node"], result["lost_at"] = loss.node, loss.lost_at
            if loss.problems:  # the node was never lost, or not brought back: the case did not happen as stated
                result["problems"] = "; ".join(p for p in (result["problems"], *loss.problems) if p != "none")
                result["passed"] = False
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
        results = []
        # The node faults last and one at a time: a lost node takes every job on it down, and no
        # other fault's run may be among them.
        for batch in ([fault for fault in faults if not fault.node_loss],
                      *([fault] for fault in faults if fault.node_loss)):
            futures = [pool.submit(drill_one, fault) for fault in batch]
            # Waited in slices: Dagster's interrupt reaches this (main) thread between them.
            while not all(future.done() for future in futures):
                concurrent.futures.wait(futures, timeout=1.0)
            results += [future.result() for future in futures]  # FAULTS' order, whatever finished first
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
        [{k: v for k, v in result.items() if k not in ("wall_s", "time_to_recover_s", "lost_at")} for result in results])[:20]))
    yield dg.AssetCheckResult(check_name="fault_drill_passed", passed=passed == len(results) and bool(results),
                              metadata={"faults_total": len(results), "faults_passed": passed,
                                        "failed": ", ".join(r["fault"] for r in results if not r["passed"]) or "none"})


def _node_faults_why_not(launcher: TorchrunLauncher, config: FaultDrillConfig) -> str:
    """Why the node faults cannot run here ("" when they can): they need the drill's ranks on two or
    more nodes, a spare node to resume on at the same world size, and a way to lose a node."""
    from ops.drills import fault as drill
    from resources.slurm import SlurmLauncher

    if not isinstance(launcher, SlurmLauncher):
        return "the launcher runs every rank on this machine (node faults need a multi-node SlurmLauncher)"
    try:
        nodes = launcher.placement(drill.WORLD_SIZE)[0]
    except ValueError as error:
        return str(error)
    if nodes < 2:
        return (f"SlurmLauncher places the drill's {drill.WORLD_SIZE} ranks on one node (nodes={launcher.nodes}, "
                f"nproc_per_node={launcher.nproc_per_node})")
    if bool(config.node_fault_command) != bool(config.node_restore_command):
        return ("set node_fault_command and node_restore_command together: a node the drill loses with your "
                "command must come back with yours")
    for name in ("node_fault_command", "node_restore_command"):
        template = getattr(config, name)
        if template:
            try:
                drill.node_command(template, "node1")  # the template's shape, before a node is lost with it
            except ValueError as error:
                return f"{name}: {error}"
    if not config.node_fault_command and not drill.lab_cluster_present():
        return ("no node_fault_command set, and this machine runs no lab cluster (deploy/slurm/lose-node.sh): "
                "set FaultDrillConfig.node_fault_command and node_restore_command")
    from resources.slurm_commands import SlurmError

    try:
        usable = launcher.usable_nodes()
    except SlurmError as error:
        return f"the partition's nodes cannot be read: {error}"
    if len(usable) <= nodes:
        return (f"the partition has {len(usable)} usable node(s) ({', '.join(usable) or 'none'}): a node loss "
                f"resumes at the same world size on a spare, so it needs {nodes + 1}")
    return ""


def _sample_at(run_dir: Path, *, step: int, rank: int) -> str:
    """A sample id the reference run trained at ``step`` on ``rank``: the bad-sample fault's target."""
    steps = dict((s, keys) for s, keys in json.loads((run_dir / "samples" / f"rank_{rank}.json").read_text())["steps"])
    if not steps.get(step):
        raise dg.Failure(f"fault_drill: the reference run trained no sample at step {step} on rank {rank}")
    return steps[step][0]
