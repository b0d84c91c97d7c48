"""Run identity: which folder a stage run trains in, and which earlier attempt a launch retries.

A stage run's folder is named by what the run computes: its redacted resolved config and data,
less the fields that only say how it is watched, retried and stopped (``run_identity``). So a
retry of the same run resumes its own checkpoint, while a new config is a new run:

    run_dir = run_dir_for(data_root, "pretrain", resolved)      # <data>/runs/pretrain-<12 hex>
    retry_of = previous_attempt(run_dir.name, tracking_uri, "trainyard")   # MLflow run id or None
    resolved = with_run_fields(resolved, launch.named(run_dir=run_dir, ...))

Torch-free and Dagster-free: the Dagster process names a run before any process starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from ops.publish.hashing import digest_json
from trainer.launch.redact import redacted_dict

if TYPE_CHECKING:
    from trainer.launch.stage_launch import StageLaunch

RUN_NAME_DIGEST_CHARS = 12
# How a run is watched, retried and stopped, not what it computes: changing one resumes the same
# run folder.
_POLICY_FIELDS = ("run_dir", "watchdog_s", "retry_budget", "max_bad_samples", "preempt_signals", "preempt_grace_s",
                  "eval_every")
# Fields that came after runs were named: at their defaults, a folder keeps the name it had.
_LATER_TRAIN_DEFAULTS = {"loss_spike_factor": 0.0, "loss_spike_window": 8}
_LATER_FAULT_DEFAULTS = {"stall_in": "step", "exit_in": "step", "sigterm_at_step": 0, "sigterm_rank": 0,
                         "sigterm_count": 1, "preempt_with": "SIGTERM", "raise_on_sample": "",
                         "corrupt_checkpoint_at_step": 0, "attempt": 0,
                         "spike_loss_at_steps": [], "oom_at_step": 0, "disk_full_at_step": 0}


def run_identity(resolved) -> dict:
    """What names a stage run's folder: its redacted config and data, less train.run_dir. Configs
    resolve from an unnamed launch, which leaves stage.dagster_run_id and stage.retry_of unset."""
    identity = redacted_dict(resolved)
    identity["train"] = {k: v for k, v in identity["train"].items()
                         if k not in _POLICY_FIELDS and not (k in _LATER_TRAIN_DEFAULTS and v == _LATER_TRAIN_DEFAULTS[k])}
    identity["faults"] = {k: v for k, v in identity.get("faults", {}).items()
                          if not (k in _LATER_FAULT_DEFAULTS and v == _LATER_FAULT_DEFAULTS[k])}
    # start_over says what to do with this run's own failed checkpoints, so it must name the same
    # run folder; pinned to its default (not dropped) so existing runs keep their folder names.
    identity["stage"] = {**identity["stage"], "start_over": False}
    # rights came later: a run that accepts no tainted parent keeps the name it had (one that does is another run).
    if not any((identity.get("rights") or {}).get("accept_tainted", {}).values()):
        identity.pop("rights", None)
    if not (identity.get("sweep") or {}).get("study"):  # likewise the sweep section, set only for a sweep's trials
        identity.pop("sweep", None)
    else:  # where the study lives is not what the trial trains
        identity["sweep"] = {k: v for k, v in identity["sweep"].items() if k not in ("storage", "mlflow_parent")}
    identity.pop("eval", None)  # what a run measures of itself, not what it trains (trainer/launch/config_sections.py:EvalConfig)
    if not identity["model"].get("factory"):  # the built-in model keeps the names its runs had
        identity["model"].pop("factory", None)
    # stage.mirror says where copies of the checkpoints go, not what the run is (and came later).
    identity["stage"].pop("mirror", None)
    # checkpoint_io names another run where it is not the default: a run resumes only the checkpoints
    # of its own kind, so a change of place must not resume as the same run (and start from step 0).
    if identity["stage"].get("checkpoint_io") == "local":
        identity["stage"].pop("checkpoint_io")
    return identity


def run_name(stage: str, resolved) -> str:
    """``<stage>-<digest of the run's identity>``: the run folder's name and the run's id."""
    return f"{stage}-{digest_json(run_identity(resolved))[:RUN_NAME_DIGEST_CHARS]}"


def run_dir_for(data_root: Path, stage: str, resolved) -> Path:
    """The folder a stage run of ``resolved`` trains in under the data root."""
    return Path(data_root) / "runs" / run_name(stage, resolved)


def previous_attempt(run_id: str, tracking_uri: str, experiment_name: str) -> str | None:
    """MLflow id of the latest earlier attempt of this stage run, if any. An MLflow error is raised
    with the store's credentials redacted (its message holds the URI; Dagster stores the message)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from trainer.launch.redact import redact_uri

    try:
        client = MlflowClient(tracking_uri=tracking_uri)
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is None:
            return None
        runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.run_id = '{run_id}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
    except MlflowException as error:
        raise MlflowException(redact_uri(str(error))) from None  # not chained: the original holds the URI
    return runs[0].info.run_id if runs else None


def with_run_fields(resolved, launch: StageLaunch):
    """The config the trainer resolves from the named launch's overrides: the unnamed one's, plus
    the run fields they add last (plain strings), so the YAML is read and checked once."""
    stage = {"dagster_run_id": launch.dagster_run_id} | ({"retry_of": launch.retry_of} if launch.retry_of else {})
    return dataclasses.replace(resolved, train=dataclasses.replace(resolved.train, run_dir=launch.run_dir),
                               stage=dataclasses.replace(resolved.stage, **stage))
