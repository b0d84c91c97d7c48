"""Health of the training stages as asset checks: `health_checks`, four per stage (pretrain, finetune).

Each check reads the stage's latest materialization (its `run_dir`, `run_id`, `checkpoint`
metadata) from the instance and calls one plain function of ops/drills/health.py on the run folder:

    no_stall                    warn   the longest step of the run's last attempt (or, for a run
                                       that has not ended, the time since its stalest rank's last
                                       step) against TRAINYARD_HEALTH_MAX_STEP_GAP_S; an attempt
                                       that ran no step (a completed run materialized again)
                                       passes: it judges the attempt it describes
    restarts_within_budget      warn   restarts and requeues in attempts.jsonl against
                                       TRAINYARD_HEALTH_MAX_RESTARTS
    checkpoint_not_corrupted    block  every committed checkpoint the run keeps re-hashes to its
                                       signed record; checkpoint_integrity (assets/checkpoint_checks.py)
                                       verifies only the reported one, and the older ones are
                                       what a resume falls back to
    throughput_vs_step_profile  warn   steady samples/s against step_profile's latest
                                       materialization, only when both ran alike

Blocking where the next stage would consume bad state (a corrupted checkpoint); a warning where
the run's results stand and a person should look (slow steps, flaky restarts, a slower run).
Register with `Definitions(asset_checks=health_checks)`; no resource is needed.
"""

from collections.abc import Callable
from pathlib import Path

import dagster as dg

from ops.checkpoints import store
from ops.drills import health
from ops.publish import objstore
from resources.launcher import read_attempts

STAGES = ("pretrain", "finetune")
BASELINE_ASSET = "step_profile"


def _latest_metadata(instance: dg.DagsterInstance, asset: str) -> dict | None:
    event = instance.get_latest_materialization_event(dg.AssetKey(asset))
    if event is None:
        return None
    return {key: getattr(value, "value", value) for key, value in event.asset_materialization.metadata.items()}


def _result(outcome: health.Health, severity: dg.AssetCheckSeverity) -> dg.AssetCheckResult:
    return dg.AssetCheckResult(passed=outcome.passed, description=outcome.description, severity=severity,
                               metadata={**outcome.metadata, "skipped": outcome.skipped})


def _stage_run(context: dg.AssetCheckExecutionContext, stage: str) -> tuple[dict, Path] | health.Health:
    metadata = _latest_metadata(context.instance, stage)
    if metadata is None or not metadata.get("run_dir"):
        return health.Health(False, f"{stage} has no materialization that names its run folder", {"run_dir": "none"})
    return metadata, Path(metadata["run_dir"])


def _check(stage: str, name: str, *, blocking: bool, description: str,
           measure: Callable[[dg.AssetCheckExecutionContext, dict, Path], health.Health]) -> dg.AssetChecksDefinition:
    severity = dg.AssetCheckSeverity.ERROR if blocking else dg.AssetCheckSeverity.WARN

    @dg.asset_check(asset=stage, name=name, blocking=blocking, description=description)
    def _health(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        found = _stage_run(context, stage)
        if isinstance(found, health.Health):
            return _result(found, severity)
        metadata, run_dir = found
        try:
            outcome = measure(context, metadata, run_dir)
        except (health.RunRecordUnreadable, store.CheckpointRecordCorrupt) as error:
            # A damaged record is a finding about the run, named, not an error of the check.
            outcome = health.Health(False, f"damaged run record: {error}", {"run_dir": str(run_dir)})
        return _result(outcome, severity)

    return _health


def _no_stall(context, metadata: dict, run_dir: Path) -> health.Health:
    return health.no_stall(run_dir, max_step_gap_s=health.Thresholds.from_env().max_step_gap_s)


def _restarts(context, metadata: dict, run_dir: Path) -> health.Health:
    return health.restarts_within_budget(read_attempts(run_dir), max_restarts=health.Thresholds.from_env().max_restarts)


def _checkpoints(context, metadata: dict, run_dir: Path) -> health.Health:
    if objstore.is_remote(str(metadata.get("checkpoint") or "")):
        return health.Health(True, "checkpoints in the object store (stage.checkpoint_io=store): the reported one "
                             "is verified by checkpoint_integrity; older versions are not listed here",
                             {"checkpoint": metadata["checkpoint"]}, skipped=True)
    return health.checkpoints_not_corrupted(run_dir, hmac_key=store.configured_key(),
                                            expected_run_id=metadata.get("run_id"))


def _throughput(context, metadata: dict, run_dir: Path) -> health.Health:
    final = health.read_final(run_dir)
    if final is None:
        return health.Health(False, f"{run_dir.name}: no final.json, no throughput to compare", {"run_dir": str(run_dir)})
    baseline_metadata = _latest_metadata(context.instance, BASELINE_ASSET) or {}
    baseline_final = health.read_final(baseline_metadata["run_dir"]) if baseline_metadata.get("run_dir") else None
    return health.throughput_vs_baseline(
        health.throughput_profile(final), health.throughput_profile(baseline_final) if baseline_final else None,
        max_regression=health.Thresholds.from_env().max_throughput_regression)


def stage_health_checks(stage: str) -> list[dg.AssetChecksDefinition]:
    return [
        _check(stage, "no_stall", blocking=False, measure=_no_stall,
               description="No step of the run's last attempt took longer than TRAINYARD_HEALTH_MAX_STEP_GAP_S "
                           "(final.json step_log: data wait through checkpoint save; an attempt that ran no step, "
                           "such as a completed run materialized again, is no stall); for a run that has not "
                           "ended, no rank has gone that long since its last step (metrics/rank-<r>.prom)."),
        _check(stage, "restarts_within_budget", blocking=False, measure=_restarts,
               description="Restarts and requeues recorded in attempts.jsonl are at most "
                           "TRAINYARD_HEALTH_MAX_RESTARTS."),
        _check(stage, "checkpoint_not_corrupted", blocking=True, measure=_checkpoints,
               description="Every committed checkpoint the run keeps re-hashes to its signed COMMITTED.json "
                           "(checkpoint_integrity checks the reported one only)."),
        _check(stage, "throughput_vs_step_profile", blocking=False, measure=_throughput,
               description="Steady samples/s at least (1 - TRAINYARD_HEALTH_MAX_THROUGHPUT_REGRESSION) x "
                           "step_profile's, compared only at the same device, world size, precision, batch and "
                           "clip shapes; otherwise passed and marked skipped."),
    ]


health_checks = [check for stage in STAGES for check in stage_health_checks(stage)]
