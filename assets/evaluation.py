"""Evaluation assets: ``evaluation/pretrain`` and ``evaluation/finetune``, one downstream of each stage.

Each takes its stage's latest committed checkpoint, verifies it (every file re-hashed against the
signed record, lineage naming the stage's run: a checkpoint that fails is refused, never evaluated),
and runs ``python -m trainer.evaluate`` (torchrun with ``nproc`` > 1) on the stage's own config,
read back from the run's launch.json, on the held-out split (``test`` by default). It records:

- the split's loss (mean, per fixed time, per clip shape) and how many samples it covers;
- generated samples (H.264 MP4 with the conditioning audio) and a contact sheet, shown inline;
- the checkpoint, its step, and its lineage (the signed record's) beside this run's own;
- the change against the previous evaluation of the same stage.

The samples and the figures also go to the stage's MLflow run (artifacts under evaluation/step_N,
metrics ``<split>/loss...`` at the checkpoint's step). A non-blocking check, ``no_regression``,
flags a loss more than ``regression_tolerance`` (a fraction) above the previous evaluation's.
"""

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg

from assets.checkpoint_checks import verify_checkpoint
from assets.stage_runs import STAGE_CONFIG_SCHEMA, TRAINING_CODE_VERSION, TRAINING_POOL, latest_metadata
from ops import process_tree
from ops.drills.restore_drill import DrillRefused, original_records
from ops.publish.paths import REPO_ROOT
from resources import StorageResource
from resources.launcher import LocalTorchrunLauncher, TorchrunLauncher, write_overrides_file
from trainer.launch.config_sections import EvalConfig as EvalSettings
from trainer.launch.stage_launch import LaunchRecordError, StageLaunch

GROUP = "evaluation"
EVALUATED_STAGES = ("pretrain", "finetune")
REGRESSION_CHECK = "no_regression"
MAX_INLINE_SHEET_BYTES = 512 * 1024


class EvaluationConfig(dg.Config):
    split: str = "test"
    """Held-out split of the stage's shard index to measure."""
    nproc: int = 1
    """Ranks of the evaluation (torchrun when > 1): the figures are the same on any number."""
    regression_tolerance: float = 0.05
    """The no_regression check fails when the loss exceeds the previous evaluation's by more than this fraction."""
    overrides: list[str] = []
    """Extra "a.b=c" overrides of the evaluation, e.g. eval.samples=4 or eval.solver=euler."""


# The overrides reach run storage like a stage's: the same literal-secret refusal applies.
EVALUATION_CONFIG_SCHEMA = {**EvaluationConfig.to_fields_dict(), "overrides": STAGE_CONFIG_SCHEMA["overrides"]}


def evaluation_asset(stage: str) -> dg.AssetsDefinition:
    key = dg.AssetKey(["evaluation", stage])

    @dg.asset(key=key, group_name=GROUP, pool=TRAINING_POOL, deps=[stage], kinds={"torch", "mlflow"},
              code_version=TRAINING_CODE_VERSION, config_schema=EVALUATION_CONFIG_SCHEMA,
              check_specs=[dg.AssetCheckSpec(REGRESSION_CHECK, asset=key, blocking=False,
                                             description="held-out loss not worse than the previous evaluation's "
                                                         "by more than regression_tolerance")],
              description=f"Held-out loss, generated samples and contact sheet of {stage}'s latest verified "
                          "checkpoint, against the previous evaluation.")
    def _evaluation(context: dg.AssetExecutionContext, storage: StorageResource, launcher: TorchrunLauncher):
        config = EvaluationConfig(**context.op_execution_context.op_config)
        result = evaluate_stage(context, stage, config, storage=storage, launcher=launcher)
        yield result
        yield regression_check(key, result.metadata, tolerance=config.regression_tolerance)

    return _evaluation


evaluation_assets = [evaluation_asset(stage) for stage in EVALUATED_STAGES]


def evaluate_stage(context: dg.AssetExecutionContext, stage: str, config: EvaluationConfig, *,
                   storage: StorageResource, launcher: TorchrunLauncher) -> dg.MaterializeResult:
    if config.nproc < 1 or config.regression_tolerance < 0:
        raise dg.Failure(f"nproc must be >= 1 and regression_tolerance >= 0, got {config.nproc}, "
                         f"{config.regression_tolerance}")
    try:  # the trainer's own rule for a split name (it names metrics), before anything starts
        EvalSettings(split=config.split)
    except ValueError as error:
        raise dg.Failure(f"evaluation: split {config.split!r} refused: {error}") from error
    if not isinstance(launcher, LocalTorchrunLauncher):
        context.log.warning(f"evaluation runs trainer.evaluate on this Dagster host, not through the "
                            f"{type(launcher).__name__}: the stage's model must fit here")
    parent = latest_metadata(context, stage)
    checkpoint, run_id = parent.get("checkpoint"), parent.get("run_id")
    if not checkpoint:
        raise dg.Failure(f"{stage}'s latest materialization reports no committed checkpoint to evaluate")
    report = verify_checkpoint(checkpoint, expected_run_id=run_id)
    if not report.ok:  # never evaluate (and so never vouch for) a checkpoint that fails integrity
        raise dg.Failure(f"evaluation refused: {stage} checkpoint {checkpoint} failed verification: "
                         + "; ".join(f"{file}: {problem}" for file, problem in report.problems))
    out = storage.data / "evaluations" / stage / f"{run_id}-{Path(str(checkpoint).rstrip('/')).name}-{context.run.run_id[:8]}"
    try:
        records = original_records(Path(parent["run_dir"]), parent.get("run_store_url"), out)
    except DrillRefused as refused:
        raise dg.Failure(str(refused)) from refused
    try:
        original = StageLaunch.read(records / "launch.json")
    except LaunchRecordError as error:
        raise dg.Failure(f"evaluation: {stage}'s launch record cannot be read: {error}") from error
    record = _run_evaluation(context, original, checkpoint=str(checkpoint), run_id=run_id, out=out, config=config)
    previous = _previous(context, dg.AssetKey(["evaluation", stage]))
    metadata = _metadata(stage, record, report.record or {}, previous, out)
    _log_to_mlflow(context, launcher.tracking_uri, parent.get("mlflow_run_id"), record, out)
    step = record.get("checkpoint_step")
    return dg.MaterializeResult(metadata=metadata, data_version=dg.DataVersion(f"{run_id}-step{step}-{config.split}"))


def _run_evaluation(context: dg.AssetExecutionContext, original: StageLaunch, *, checkpoint: str, run_id: str,
                    out: Path, config: EvaluationConfig) -> dict:
    """trainer.evaluate on the stage's config (its launch overrides less the run-control ones)."""
    from trainer.launch.config import check_no_literal_secrets

    check_no_literal_secrets(config.overrides, where="evaluation overrides")
    overrides = [override for override in original.overrides() if not override.startswith("stage.")]
    overrides += [f"stage.stage={original.stage}", "stage.mlflow=false", f"train.run_dir={out}"]
    if config.nproc > 1 and (original.config or {}).get("train", {}).get("parallelism") == "none":
        overrides.append("train.parallelism=ddp")  # the figures do not depend on it; several ranks need a group
    overrides += config.overrides
    out.mkdir(parents=True, exist_ok=True)
    overrides_file = write_overrides_file(out / "overrides.json", overrides)
    program = ["-m", "trainer.evaluate", "--config", original.config_path, "--overrides-file", str(overrides_file),
               "--checkpoint", checkpoint, "--run-id", run_id, "--out", str(out), f"--split={config.split}"]
    command = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={config.nproc}",
                *program] if config.nproc > 1 else [sys.executable, *program])
    context.log.info(f"evaluating {checkpoint} on split {config.split!r}: {' '.join(command)}")
    # Streamed line by line: a long evaluation shows progress, never a silent stretch.
    process = subprocess.Popen(command, cwd=str(REPO_ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    tail: list[str] = []
    try:
        for line in process.stdout:
            line = line.rstrip()
            if line:
                context.log.info(line)
                tail = [*tail[-19:], line]
        returncode = process.wait()
    except BaseException:  # a cancel: the ranks go with it (each leads its own session under torchrun)
        process_tree.kill_tree(process)
        raise
    if returncode != 0:
        raise dg.Failure(f"evaluation of {checkpoint} failed (exit {returncode})",
                         metadata={"log_tail": dg.MetadataValue.text("\n".join(tail))})
    return json.loads((out / "evaluation.json").read_text())


def _previous(context: dg.AssetExecutionContext, key: dg.AssetKey) -> dict | None:
    event = context.instance.get_latest_materialization_event(key)
    if event is None:
        return None
    return {name: getattr(value, "value", value) for name, value in event.asset_materialization.metadata.items()}


def _metadata(stage: str, record: dict, checkpoint_record: dict, previous: dict | None, out: Path) -> dict:
    loss, samples = record["loss"], record["samples"]
    split = record["split"]
    metadata: dict = {
        "stage": stage, "split": split, "status": loss.get("status"), "reason": loss.get("reason") or "none",
        "checkpoint": record["checkpoint"], "checkpoint_step": record["checkpoint_step"], "run_id": record["run_id"],
        "evaluation_dir": dg.MetadataValue.path(str(out)), "world_size": record["world_size"],
        "precision": record["precision"],
        # What the figure measured: only evaluations of the same settings compare (no_regression).
        "settings": _settings(record),
        # This evaluation's own lineage, under the contract names every asset carries (docs/lineage.md) ...
        **{name: value for name, value in (record.get("lineage") or {}).items() if name not in ("run_id", "stage")},
        # ... and the evaluated checkpoint's, from its signed record.
        **{f"checkpoint_lineage/{name}": str(value)
           for name, value in (checkpoint_record.get("lineage") or {}).items()},
    }
    if loss.get("status") == "ok":
        metadata |= {f"{split}/loss": loss["loss"], "loss": loss["loss"], "num_samples": loss["num_samples"],
                     "num_failed": loss["num_failed"],
                     **{f"{split}/loss_t{time}": value for time, value in loss["loss_t"].items()},
                     **{f"{split}/loss_bucket_{name}": value for name, value in loss["loss_bucket"].items()}}
        before = (previous or {}).get("loss")
        if isinstance(before, (int, float)) and (previous or {}).get("settings") != metadata["settings"]:
            metadata["previous_loss"] = (f"none (the previous evaluation measured other settings: "
                                         f"{(previous or {}).get('settings')})")
        elif isinstance(before, (int, float)):
            metadata |= {"previous_loss": before, "previous_checkpoint": str((previous or {}).get("checkpoint")),
                         "loss_change": loss["loss"] - before,
                         "loss_change_fraction": (loss["loss"] - before) / before if before else 0.0}
        else:
            metadata["previous_loss"] = "none (first evaluation of this split)"
    metadata["samples/status"] = samples.get("status")
    if samples.get("reason"):
        metadata["samples/reason"] = samples["reason"]
    for index, sample in enumerate(samples.get("samples") or []):
        where = str(Path(samples["dir"]) / sample["path"]) if sample.get("path") else sample["status"]
        metadata[f"samples/{index}"] = dg.MetadataValue.path(where) if sample.get("path") else where
    if samples.get("contact_sheet"):
        sheet = Path(samples["dir"]) / samples["contact_sheet"]
        caption = (f"Frames over time (columns) of each generated sample (rows), {samples.get('solver')} "
                   f"{samples.get('steps')} steps")
        png = sheet.read_bytes()
        # Inline in the event log up to a bound (a sheet of large frames stays a path, not megabytes per event).
        metadata["contact_sheet"] = dg.MetadataValue.md(
            f"{caption}:\n\n![contact sheet](data:image/png;base64,{base64.b64encode(png).decode()})"
            if len(png) <= MAX_INLINE_SHEET_BYTES else f"{caption}: {len(png)} bytes, too large to inline; see {sheet}")
        metadata["contact_sheet_path"] = dg.MetadataValue.path(str(sheet))
    return metadata


def _settings(record: dict) -> str:
    """The split and the evaluation's fixed choices (times, noise seed, sample cap), as one string."""
    loss = record["loss"]
    return json.dumps({"split": record["split"], "timesteps": loss.get("timesteps"), "seed": loss.get("seed"),
                       "max_samples": (record.get("eval") or {}).get("max_samples")}, sort_keys=True)


def regression_check(key: dg.AssetKey, metadata: dict, *, tolerance: float) -> dg.AssetCheckResult:
    """Non-blocking: the loss against the previous evaluation's, within ``tolerance`` (a fraction)."""
    values = {name: getattr(value, "value", value) for name, value in metadata.items()}
    change = values.get("loss_change_fraction")
    if values.get("status") != "ok":
        return dg.AssetCheckResult(asset_key=key, check_name=REGRESSION_CHECK, passed=False,
                                   severity=dg.AssetCheckSeverity.WARN,
                                   metadata={"reason": f"no loss to compare: {values.get('reason')}"})
    if change is None:
        return dg.AssetCheckResult(asset_key=key, check_name=REGRESSION_CHECK, passed=True,
                                   metadata={"reason": "first evaluation: nothing to compare with", "loss": values["loss"]})
    passed = change <= tolerance
    return dg.AssetCheckResult(
        asset_key=key, check_name=REGRESSION_CHECK, passed=passed, severity=dg.AssetCheckSeverity.WARN,
        metadata={"loss": values["loss"], "previous_loss": values["previous_loss"], "change_fraction": change,
                  "tolerance": tolerance,
                  "reason": (f"loss {values['loss']:.6g} is {change:+.2%} against {values['previous_loss']:.6g}, "
                             f"{'within' if passed else 'beyond'} the tolerance {tolerance:.0%}")})


def _log_to_mlflow(context: dg.AssetExecutionContext, tracking_uri: str, mlflow_run_id: str | None, record: dict,
                   out: Path) -> None:
    """The figures and samples into the stage's own MLflow run (one place to look); logged, not fatal, on failure."""
    if not mlflow_run_id or mlflow_run_id == "none":
        context.log.info("evaluation: the stage has no MLflow run; figures and samples are in the asset's metadata")
        return
    from mlflow.tracking import MlflowClient

    from trainer.heldout import metric_names
    from trainer.observe.tracking import resolve_tracking_uri

    step = int(record.get("checkpoint_step") or 0)
    try:
        client = MlflowClient(tracking_uri=resolve_tracking_uri(tracking_uri))
        for name, value in metric_names(record["loss"], prefix=record["split"]).items():
            client.log_metric(mlflow_run_id, name, value, step=step)
        samples_dir = Path(record["samples"].get("dir") or out / "samples")
        if samples_dir.is_dir():
            client.log_artifacts(mlflow_run_id, str(samples_dir), artifact_path=f"evaluation/step_{step}")
        client.log_artifact(mlflow_run_id, str(out / "evaluation.json"), artifact_path=f"evaluation/step_{step}")
    except Exception as error:  # the tracking server may be down: the asset's own record stands
        from trainer.launch.redact import redact_uri  # the error's message may hold the store's URI

        context.log.error(f"evaluation: not logged to MLflow run {mlflow_run_id}: "
                          f"{redact_uri(f'{type(error).__name__}: {error}')}")
