"""The ``reproduction`` asset: proves the training stages' lineage by replaying it (ops/drills/replay.py).

Weekly (pipelines/training.py ``weekly_reproduction``), and not part of ``make demo`` (its time budget;
tests/test_end_to_end.py materializes it on the demo's data). It reproduces a sample of pinned
checkpoints: by default the newest known-good checkpoint of each stage (the restore drill's pin), else
that stage's newest committed one, parents before children, until the time budget is spent. Each
result marks its checkpoint (``trainyard checkpoint list``) and its stage's page (an observation of
the stage asset with ``reproduction`` metadata), and the blocking check ``reproduced`` fails when
any sampled checkpoint does not reproduce or was refused.
"""

import time
from pathlib import Path

import dagster as dg
import pydantic

from assets.metadata import lineage_metadata, markdown_table
from assets.stage_runs import TRAINING_CODE_VERSION, TRAINING_POOL
from ops.checkpoints import store
from ops.publish import paths
from ops.publish.hashing import digest_json
from resources import LineageResource, StorageResource

GROUP = "training"
STAGES = ("pretrain", "finetune")  # parents first: a child whose parent is gone starts from its reproduction


class ReproductionConfig(dg.Config):
    stages: list[str] = pydantic.Field(default_factory=lambda: list(STAGES),
                                       description="Stages whose newest known-good checkpoint is reproduced, in order.")
    budget_s: float = pydantic.Field(default=3600.0, description=(
        "No new reproduction starts after this many seconds; those left are reported as skipped."))
    world_size: int | None = pydantic.Field(default=None, description="Ranks of each re-run; default: as recorded.")


def _sample(context: dg.AssetExecutionContext, stage: str) -> tuple[Path | None, str]:
    """The checkpoint of ``stage`` to reproduce and why that one (or None and why none)."""
    event = context.instance.get_latest_materialization_event(dg.AssetKey(stage))
    run_dir = None
    if event is not None and event.asset_materialization is not None:
        entry = event.asset_materialization.metadata.get("run_dir")
        run_dir = Path(str(entry.value)) if entry is not None else None
    if run_dir is None or not run_dir.is_dir():
        return None, f"{stage} has no materialized run folder on this machine"
    try:
        pin = store.read_known_good(run_dir)
    except store.CheckpointRecordCorrupt as error:
        return None, f"its known-good pin is damaged: {error}"
    if pin is not None and (store.checkpoints_dir(run_dir) / store.step_dir_name(pin["step"])).is_dir():
        return store.checkpoints_dir(run_dir) / store.step_dir_name(pin["step"]), "known-good (restore drill pin)"
    committed = [info for info in store.list_checkpoints(run_dir) if info.status == store.STATUS_COMMITTED]
    if not committed:
        return None, f"{run_dir} has no committed checkpoint"
    return committed[-1].path, "newest committed (no known-good pin)"


@dg.asset(group_name=GROUP, pool=TRAINING_POOL, deps=list(STAGES), kinds={"torch"}, code_version=TRAINING_CODE_VERSION,
          check_specs=[dg.AssetCheckSpec("reproduced", asset="reproduction", blocking=True)],
          description="Rebuilds the stages' pinned checkpoints from their signed records alone (recorded commit, "
                      "environment, data by version) and compares bit for bit on CPU.")
def reproduction(context: dg.AssetExecutionContext, config: ReproductionConfig, storage: StorageResource,
                 lineage: LineageResource):
    from ops.drills.replay import Options, reproduce

    started, rows, failed = time.monotonic(), [], []
    options = Options(repo=paths.REPO_ROOT, data_root=storage.data, home=paths.trainyard_home(),
                      world_size=config.world_size, log=context.log.info)
    for stage in config.stages:
        checkpoint, why = _sample(context, stage)
        if checkpoint is None:
            rows.append({"stage": stage, "status": "none", "step": "", "reason": why, "wall_s": 0})
            continue
        if time.monotonic() - started > config.budget_s:
            rows.append({"stage": stage, "status": "skipped", "step": "", "reason": f"time budget {config.budget_s} s spent",
                         "wall_s": 0})
            continue
        report = reproduce(checkpoint, options)
        status = report["status"]
        rows.append({"stage": stage, "status": status, "step": report.get("step", ""), "reason": report["reason"],
                     "wall_s": report["wall_s"], "checkpoint": str(checkpoint), "sampled": why,
                     "report": f"{report['reproduction_dir']}/reproduction.json"})
        if status != "reproduced":
            failed.append(f"{stage} step {report.get('step')}: {status}: {report['reason']}")
        context.log_event(dg.AssetObservation(asset_key=stage, metadata={
            "reproduction": status, "reproduction_step": report.get("step", -1),
            "reproduction_reason": str(report["reason"])[:1000], "reproduction_report": f"{report['reproduction_dir']}"
            "/reproduction.json", "dagster/reproduction_run": context.run.run_id}))
        context.log.info(f"reproduction of {stage} ({why}): {status.upper()}: {report['reason']}")
    reproduced = sum(row["status"] == "reproduced" for row in rows)
    record = lineage.collect(manifest_version="none", code_version=TRAINING_CODE_VERSION,
                             config={"reproduction": config.model_dump()})
    summary = {row["stage"]: f"{row['status']} step {row['step']}" for row in rows}
    yield dg.MaterializeResult(
        metadata={"reproduced": reproduced, "failed": len(failed),
                  "results": markdown_table(rows, ["stage", "status", "step", "sampled", "wall_s", "reason", "report"]),
                  **lineage_metadata(record)},
        data_version=dg.DataVersion(digest_json(summary)[:20]))
    yield dg.AssetCheckResult(check_name="reproduced", passed=not failed and reproduced > 0,
                              metadata={"failures": "; ".join(failed)[:2000] or "none",
                                        "reproduced": reproduced})
