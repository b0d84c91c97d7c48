"""Early stopping of a sweep's trial by the sweep's stated rule (docs/training.md, "Sweeps").

Rank 0 of a trial (``config.sweep.study`` set) reports each evaluation's validation loss to the trial in
the study's RDB storage and asks the sweep's pruner (Optuna's median or successive-halving pruner: the
rule is Optuna's, never reimplemented here) whether to stop. The loop shares the answer with one
all-reduce, so every rank stops at the same step boundary; the checkpoint of that step is committed and
the run ends ``pruned`` (trainer/endings.py), exit 0, never retried, resumable later.

The decision is recorded so it can be audited: the rule and its settings, the step, the trial's value
and the values it was compared with (every other trial's value at that step, and for the median rule
the median of the completed ones, which is what Optuna's rule compares), in final.json ("pruning"),
the MLflow run's tags and the trial's user attributes in the study.

A storage that stops answering mid-run never ends a trial: the report is logged and the trial trains on
(pruning saves time; it must not cost a run). Only public Optuna APIs: the storage's trial calls and
``BasePruner.prune(study, frozen_trial)``.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

log = logging.getLogger("trainer")


class PruningJudge:
    """Rank 0's link to its trial: report a value at a step, and say whether the rule stops it there."""

    def __init__(self, sweep, *, eval_every: int) -> None:
        import optuna

        from trainer.launch.sweep import PrunerSpec, study_storage_url

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.config = sweep
        self.spec = PrunerSpec(kind=sweep.pruner, warmup_steps=sweep.warmup_steps, min_trials=sweep.min_trials,
                               reduction_factor=sweep.reduction_factor, min_resource=sweep.min_resource)
        self.pruner = self.spec.build(eval_every)
        self.storage = optuna.storages.RDBStorage(sweep.storage or study_storage_url(),
                                                  engine_kwargs={"pool_pre_ping": True})
        self.study = optuna.load_study(study_name=sweep.study, storage=self.storage,
                                       pruner=self.pruner or optuna.pruners.NopPruner())
        study_id = self.storage.get_study_id_from_name(sweep.study)
        self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, sweep.trial)

    def judge(self, step: int, value: float, *, may_stop: bool) -> dict[str, Any] | None:
        """Report ``value`` at ``step``; the recorded decision when the rule stops the trial here, else None."""
        from optuna.trial import TrialState

        try:
            self.storage.set_trial_intermediate_value(self.trial_id, step, float(value))
            if self.pruner is None or not may_stop:
                return None
            trial = self.storage.get_trial(self.trial_id)
            if not self.pruner.prune(self.study, trial):
                return None
            others = [t for t in self.study.get_trials(deepcopy=False) if t.number != trial.number]
        except Exception as error:  # noqa: BLE001 (the storage's many errors: the trial trains on)
            from trainer.launch.redact import redact_uri

            log.warning("step %d: the sweep's study could not be told or asked (%s): training on without "
                        "early stopping at this step", step, redact_uri(f"{type(error).__name__}: {error}")[:300])
            return None
        compared = {str(t.number): t.intermediate_values[step] for t in others if step in t.intermediate_values}
        completed = [t.intermediate_values[step] for t in others
                     if t.state == TrialState.COMPLETE and step in t.intermediate_values]
        decision = {"rule": self.spec.kind, "settings": {"warmup_steps": self.spec.warmup_steps,
                                                         "min_trials": self.spec.min_trials,
                                                         "reduction_factor": self.spec.reduction_factor,
                                                         "min_resource": self.spec.min_resource},
                    "study": self.config.study, "trial": self.config.trial, "step": step, "value": float(value),
                    "compared": compared, "completed_median": statistics.median(completed) if completed else None}
        try:
            self.storage.set_trial_user_attr(self.trial_id, "pruning", decision)
        except Exception as error:  # noqa: BLE001 (final.json and MLflow keep it too)
            log.warning("the pruning decision could not be written to the study: %s", type(error).__name__)
        return decision


def describe(decision: dict[str, Any]) -> str:
    """One line: why the trial stopped."""
    median = decision.get("completed_median")
    against = f" (median of completed trials {median:.6f})" if median is not None else ""
    return (f"pruned at step {decision['step']} by the {decision['rule']} rule: val/loss {decision['value']:.6f}"
            f"{against}, compared with {len(decision['compared'])} other trial(s)")
