"""Training assets: step_profile -> pretrain -> finetune, and restore_drill.

Each stage fills a ``StageLaunch`` from its run config and hands it to ``launch_stage``
(assets/stage_runs.py), which checks it, names its run folder and launches torchrun through the
launcher resource with Dagster Pipes: logs stream back, and the completed run reports its figures,
lineage, committed checkpoint and MLflow run as this asset's metadata. A stage run's folder is
named by its config and data (trainer/launch/run_identity.py), so a retry of the same run resumes
its own checkpoint and is tagged ``retry_of`` in MLflow, while a new config is a new run. Each
stage's blocking checks are assets/checkpoint_checks.py's.

The restore drill (ops/drills/restore_drill.py) restores pretrain's second-newest committed
checkpoint, reads the original run's launch back and replays it on the same data at the saved and
at another world size; this asset launches those continuations and reports the verdict.
"""

from pathlib import Path

import dagster as dg

from assets.checkpoint_checks import CHECKPOINT_CHECKS, checkpoint_checks, verify_checkpoint
from assets.inputs import SHARD_INDEX_IN
from assets.metadata import lineage_metadata
from assets.stage_runs import (
    STAGE_CONFIG_SCHEMA, TRAINING_CODE_VERSION, TRAINING_POOL, StageRunConfig, latest_metadata, launch_stage,
    only_requeues_retry, stage_config, stage_launch, stage_result)
from ops.clips.shard_ref import ShardIndexRef
from ops.drills import restore_drill as drill
from ops.publish.hashing import digest_json
from resources import LineageResource, StorageResource
from resources.launcher import TorchrunLauncher
from trainer.launch.stage_launch import CheckpointRef, StageLaunch

GROUP = "training"


STEP_PROFILE_DEFAULTS = ("train.parallelism=none", "train.profile=true", "stage.checkpoint=false", "stage.mlflow=true",
                         "train.eval_every=0")  # a performance baseline: no evaluation beside it
PRETRAIN_DEFAULTS = ("stage.mlflow=true",)
FINETUNE_DEFAULTS = ("stage.mlflow=true", "optim.lr=3e-4", "optim.warmup_steps=0")


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["loader_benchmark"], kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA, ins={"shard_index": SHARD_INDEX_IN},
          description="Single-device performance baseline: phase times, throughput, bound verdict, profiler trace.")
def step_profile(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict,
                 storage: StorageResource, launcher: TorchrunLauncher) -> dg.MaterializeResult:
    with only_requeues_retry():
        config = stage_config(context)
        run = StageRunConfig(config_path=config.config_path, steps=min(config.steps, 12), nproc=1,
                             overrides=config.overrides, secrets=config.secrets)
        launch = stage_launch("step_profile", run, ShardIndexRef.of(shard_index), launcher,
                              defaults=STEP_PROFILE_DEFAULTS, storage=storage, log=context.log.warning)
        return stage_result(*launch_stage(context, launch, storage=storage, launcher=launcher))


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["step_profile"], kinds={"torch", "mlflow"},
          code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA, ins={"shard_index": SHARD_INDEX_IN},
          check_specs=[dg.AssetCheckSpec(name, asset="pretrain", blocking=True) for name in CHECKPOINT_CHECKS],
          description="Distributed pretraining under torchrun (DDP/FSDP), committed DCP checkpoints, MLflow run.")
def pretrain(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict,
             storage: StorageResource, launcher: TorchrunLauncher):
    with only_requeues_retry():
        launch = stage_launch("pretrain", stage_config(context), ShardIndexRef.of(shard_index), launcher,
                              defaults=PRETRAIN_DEFAULTS, storage=storage, log=context.log.warning)
        result = stage_result(*launch_stage(context, launch, storage=storage, launcher=launcher))
    yield result
    yield from checkpoint_checks("pretrain", result.metadata)


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["pretrain"], kinds={"torch", "mlflow"}, code_version=TRAINING_CODE_VERSION,
          config_schema=STAGE_CONFIG_SCHEMA, ins={"shard_index": SHARD_INDEX_IN},
          check_specs=[dg.AssetCheckSpec(name, asset="finetune", blocking=True) for name in CHECKPOINT_CHECKS],
          description="Next stage: starts from pretrain's verified committed checkpoint (weights), trains further.")
def finetune(context: dg.AssetExecutionContext, shard_index: ShardIndexRef | dict,
             storage: StorageResource, launcher: TorchrunLauncher):
    with only_requeues_retry():
        config = stage_config(context)
        parent = latest_metadata(context, "pretrain")
        if not parent.get("checkpoint"):
            raise dg.Failure("pretrain's latest materialization reports no committed checkpoint to start from")
        report = verify_checkpoint(parent["checkpoint"], expected_run_id=parent["run_id"])
        if not report.ok:  # never start a stage from a checkpoint that fails integrity
            raise dg.Failure(f"pretrain checkpoint {parent['checkpoint']} failed verification: {report.problems}")
        launch = stage_launch("finetune", config, ShardIndexRef.of(shard_index), launcher, defaults=FINETUNE_DEFAULTS,
                              init_from=CheckpointRef(path=parent["checkpoint"], run_id=parent["run_id"]),
                              storage=storage, log=context.log.warning)
        result = stage_result(*launch_stage(context, launch, storage=storage, launcher=launcher))
    yield dg.MaterializeResult(metadata={**result.metadata, "parent_checkpoint": parent["checkpoint"]},
                               data_version=result.data_version)
    yield from checkpoint_checks("finetune", result.metadata)


class DrillConfig(dg.Config):
    other_world_size: int = 1
    """World size of the resharded continuation (the other one runs at the saved world size)."""
    overrides: list[str] = []
    """Extra "a.b=c" trainer overrides for both continuations, e.g. an injected fault in tests
    (faults.drop_optimizer_state_on_restore=true must make the drill fail)."""


# The drill's overrides reach run storage like a stage's: the same literal-secret refusal applies.
DRILL_CONFIG_SCHEMA = {**DrillConfig.to_fields_dict(), "overrides": STAGE_CONFIG_SCHEMA["overrides"]}


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=["pretrain"], kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          config_schema=DRILL_CONFIG_SCHEMA,
          check_specs=[dg.AssetCheckSpec("drill_passed", asset="restore_drill", blocking=True)],
          description="Restores pretrain's second-newest committed checkpoint, trains to its newest one at the "
                      "saved and at another world size, and compares with what pretrain itself recorded there.")
def restore_drill(context: dg.AssetExecutionContext,
                  storage: StorageResource, launcher: TorchrunLauncher, lineage: LineageResource):
    config = DrillConfig(**context.op_execution_context.op_config)
    parent = latest_metadata(context, "pretrain")
    run_dir = Path(parent["run_dir"])
    try:
        start = drill.start_drill(run_dir, parent["run_id"], drills_root=storage.data / "drills",
                                  drill_name=context.run.run_id[:8])
        outcome = dict(start.outcome)
        if start.problems:
            outcome |= {"passed": False, "reason": "checkpoint failed verification: " + start.problems}
        else:
            outcome |= _drill(context, config, parent, start, storage, launcher)
    except drill.DrillRefused as refused:
        raise dg.Failure(str(refused)) from refused
    if outcome["passed"]:  # the restored checkpoint is the one proven to bring the run back
        pinned = drill.pin_known_good(run_dir, start.mirror, start.restored.step,
                                      {**outcome, "dagster_run_id": context.run.run_id})
        if pinned is not None:
            context.log.info(f"known good: pinned {pinned}")
    context.log.info(f"restore drill {'PASSED' if outcome['passed'] else 'FAILED'}: {outcome.get('reason')}")
    record = lineage.collect(manifest_version=str(parent.get("manifest_version") or "none"), code_version=TRAINING_CODE_VERSION,
                             config={"drill": config.model_dump(), "pretrain_run_id": parent["run_id"]})
    yield dg.MaterializeResult(metadata={**outcome, **lineage_metadata(record)},
                               data_version=dg.DataVersion(digest_json(outcome)[:20]))
    yield dg.AssetCheckResult(check_name="drill_passed", passed=bool(outcome["passed"]),
                              metadata={"reason": outcome.get("reason", "none")})


# No evaluation in the continuations: it never changes training (trainer/heldout.py), so it proves nothing here.
DRILL_DEFAULTS = ("stage.checkpoint=true", "stage.mlflow=false", "stage.mirror=false", "train.dump_final_params=true",
                  "train.eval_every=0")


def _drill(context: dg.AssetExecutionContext, config: DrillConfig, parent: dict, start: drill.DrillStart,
           storage: StorageResource, launcher: TorchrunLauncher) -> dict:
    """The drill's continuations, each a fresh stage run of ``start.restored`` to ``start.target``'s step
    on the original's data (its shard index and buckets, whatever shard_index has become since) and config."""
    original_dir = drill.original_records(Path(parent["run_dir"]), parent.get("run_store_url"), start.drill_root)
    original = StageLaunch.read(original_dir / "launch.json")

    def continue_run(world: int, run_dir: Path) -> Path:
        launch = StageLaunch(
            stage="restore_drill", config_path=original.config_path, data=original.data, buckets=original.buckets,
            steps=start.target.step, world_size=world, run_dir=str(run_dir),
            defaults=DRILL_DEFAULTS + (("train.parallelism=none",) if world == 1 else ()),
            resume_from=CheckpointRef(path=str(start.restored.path), run_id=parent["run_id"]),
            user_overrides=(*original.replay_overrides(), *config.overrides))
        launch_stage(context, launch, storage=storage, launcher=launcher, report=False)
        return run_dir

    return drill.run_drill(start, run_id=parent["run_id"], original_dir=original_dir, original_config=original.config,
                           other_world_size=config.other_world_size, continue_run=continue_run)
