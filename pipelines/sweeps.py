"""``trainyard sweep run FILE``: register a declared sweep and run its trials as Dagster runs.

    trainyard sweep run configs/sweeps/demo_lr.yaml [--retries 1] [--register-only]

1. Registers the sweep (trainer.launch.sweep.register): its Optuna study holds the planned trials in order;
   their ids become ``sweep_trials`` partitions, the sweep a ``sweeps`` partition; the ``sweep`` pool's
   limit is set to the sweep's concurrency; the sweep's MLflow parent run is created once (the trials'
   runs are its children). ``--register-only`` stops here: the trials can then be run from the UI as a
   backfill of ``sweep_trial_job``, which the same pool limits.
2. Starts every pending trial, each a Dagster run of ``sweep_trial_job`` in its own process (on SLURM: one
   array job per round, ``--array=<numbers>%<concurrency>``, resources/sweep_array.py). The
   orchestrator enforces the concurrency: a trial step waits for a slot of the ``sweep`` pool, so at most
   ``concurrency`` trials train at any moment (tests/test_sweep_runs.py measures it from the event log).
3. A trial whose launch failed is retried while its class is retryable (trainer/endings.py RETRYABLE, or
   the process was killed) and ``--retries`` rounds are left; otherwise the study marks it failed with its
   class and the sweep goes on without it. A diverged trial is ``diverged``, never retried.
4. Materializes ``sweep_report`` for the sweep and closes the parent run with the best trial.

Killed mid-sweep (this process, or the Dagster process of a trial), a second ``sweep run`` of the same
file loses nothing: finished trials stay finished; a trial whose process still lives (its lock held) is
waited for, never started twice; a trial whose process is gone has its Dagster run marked failed and its
pool slot freed, and is started again, resuming its run folder's last committed checkpoint. One driver per
sweep at a time (a lock under the Trainyard home): a second is refused, naming the first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dagster as dg

from assets.sweeps import (
    SWEEP_POOL, SWEEP_TRIALS, SWEEPS, held_lock, lock_is_held, locks_dir, ranks_lock, trial_lock_path)
from ops.publish import paths
from pipelines import environment
from pipelines.instance import ensure_dagster_home

PROCESS_TAG = "trainyard/sweep_process"
SWEEP_TAG = "trainyard/sweep"
POLL_S = 1.0


def queue_lock_path(trial_id: str) -> Path:
    """Held by a trial's process from its start (while it waits for a pool slot too) to its end."""
    return trial_lock_path(trial_id).with_suffix(".queued")


def trial_busy(trial_id: str, run_dir: str | None = None) -> bool:
    """A process of the trial lives: its queue or trial lock is held, or a rank still trains in its run folder."""
    return (lock_is_held(queue_lock_path(trial_id)) or lock_is_held(trial_lock_path(trial_id))
            or (run_dir is not None and lock_is_held(ranks_lock(run_dir))))


def _busy(trial) -> bool:
    return trial_busy(trial.user_attrs["trial_id"], trial.user_attrs.get("run_dir"))


def register_sweep(spec, instance: dg.DagsterInstance, *, log=print):
    """The study (trials enqueued), the partitions, the pool limit and the MLflow parent run (module docstring)."""
    from trainer.launch.sweep import register, study_storage_url

    study = register(spec, study_storage_url())
    ids = [trial.user_attrs["trial_id"] for trial in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)]
    known = set(instance.get_dynamic_partitions(SWEEP_TRIALS.name))
    instance.add_dynamic_partitions(SWEEP_TRIALS.name, [trial_id for trial_id in ids if trial_id not in known])
    if spec.name not in instance.get_dynamic_partitions(SWEEPS.name):
        instance.add_dynamic_partitions(SWEEPS.name, [spec.name])
    instance.event_log_storage.set_concurrency_slots(SWEEP_POOL, spec.concurrency)
    if not study.user_attrs.get("mlflow_parent_run"):
        study.set_user_attr("mlflow_parent_run", _mlflow_parent(spec))
    log(f"sweep {spec.name}: {len(ids)} trial(s) registered, pool {SWEEP_POOL!r} limited to {spec.concurrency}, "
        f"MLflow parent run {study.user_attrs['mlflow_parent_run']}")
    return study


def _mlflow_parent(spec) -> str:
    from mlflow.tracking import MlflowClient

    from trainer.launch.config import load_config

    client = MlflowClient(tracking_uri=paths.mlflow_tracking_uri())
    name = load_config(_base(spec), list(spec.overrides)).stage.mlflow_experiment
    experiment = client.get_experiment_by_name(name)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
    run = client.create_run(experiment_id, run_name=f"sweep/{spec.name}",
                            tags={"trainyard.sweep": spec.name, "trainyard.sweep.id": spec.digest,
                                  "trainyard.sweep.file": spec.path, "trainyard.sweep.sampler": spec.sampler,
                                  "trainyard.sweep.seed": str(spec.seed), "trainyard.sweep.pruner": spec.pruner.kind})
    return run.info.run_id


def _base(spec) -> Path:
    return paths.REPO_ROOT / spec.base if (paths.REPO_ROOT / spec.base).is_file() else Path(spec.base)


def _free_dead_runs(instance: dg.DagsterInstance, name: str, log) -> None:
    """Trial runs that did not end but whose process is gone (killed): marked failed, their pool slots freed."""
    records = instance.get_run_records(dg.RunsFilter(tags={SWEEP_TAG: name},
                                                     statuses=[dg.DagsterRunStatus.STARTED,
                                                               dg.DagsterRunStatus.STARTING,
                                                               dg.DagsterRunStatus.NOT_STARTED]))
    for record in records:
        run = record.dagster_run
        trial_id = run.tags.get("dagster/partition", "")
        if trial_id and trial_busy(trial_id):
            continue
        log(f"sweep {name}: run {run.run_id[:8]} of {trial_id} ended without a word (its process is gone): "
            "marked failed, its pool slot freed")
        instance.report_run_failed(run)
        instance.event_log_storage.free_concurrency_slots_for_run(run.run_id)


def run_sweep(path: str | Path, *, retries: int = 1, register_only: bool = False, log=print) -> dict:
    """Register and run the sweep (module docstring); the report's summary."""
    from optuna.trial import TrialState

    from assets.sweeps import _set_attr
    from trainer.endings import RETRYABLE
    from trainer.launch.sweep import load_sweep, trial_states

    spec = load_sweep(path)
    ensure_dagster_home()
    with held_lock(locks_dir(spec.name) / "driver.lock", f"sweep run {spec.name}"), dg.DagsterInstance.get() as instance:
        study = register_sweep(spec, instance, log=log)
        if register_only:
            return {"sweep": spec.name, "registered": True}
        slurm = environment.current().slurm
        if slurm:  # a round a killed `sweep run` submitted: its trials are waited for, never submitted twice
            _wait_for_array(study, log)
        _free_dead_runs(instance, spec.name, log)
        started: dict[int, int] = {}
        while True:
            trials = {t.number: t for t in study.get_trials(deepcopy=False)}
            states = trial_states(study)
            for number, trial in trials.items():  # a failed trial: retried while retryable, else the sweep goes on
                attempts = trial.user_attrs.get("attempts", [])
                if states[number] == "RUNNING" and attempts and not _busy(trial) and (
                        len(attempts) > retries or attempts[-1]["failure_class"] not in RETRYABLE):
                    log(f"sweep {spec.name}: {trial.user_attrs['trial_id']} failed ({attempts[-1]['failure_class']}, "
                        f"{len(attempts)} attempt(s)): the sweep goes on without it")
                    study.tell(number, state=TrialState.FAIL)
                    states[number] = "FAIL"
            pending = [n for n, state in states.items() if state in ("WAITING", "RUNNING")]
            if not pending:
                break
            busy = [n for n in pending if _busy(trials[n])]
            to_start = [n for n in pending if n not in busy]
            stuck = [n for n in to_start if started.get(n, 0) > retries + 1]
            if stuck:  # started again and again without a recorded attempt: never loop forever
                for number in stuck:
                    log(f"sweep {spec.name}: {trials[number].user_attrs['trial_id']} ended {started[number]} times "
                        "without finishing or recording why: the sweep goes on without it")
                    _set_attr(study, number, "failure_class", "lost")  # the report names it
                    study.tell(number, state=TrialState.FAIL)
                continue
            if busy:
                log(f"sweep {spec.name}: waiting for {len(busy)} trial(s) running in another process")
            for number in to_start:
                started[number] = started.get(number, 0) + 1
            if slurm:
                if to_start:  # every pending trial may be running elsewhere: nothing to submit, only to wait for
                    _run_array(spec, study, to_start, log)
            else:
                processes = [_start_trial(instance, trials[number].user_attrs["trial_id"], spec.name)
                             for number in to_start]  # in trial order: each waits in the pool's queue first
                for process in processes:
                    process.wait()
            _free_dead_runs(instance, spec.name, log)
            while True:  # the trials that were running elsewhere, and any rank a killed trial left training
                current = {t.number: t for t in study.get_trials(deepcopy=False)}
                if not any(_busy(current[n]) for n in pending if states[n] in ("WAITING", "RUNNING")
                           and current[n].state.name == "RUNNING"):
                    break
                time.sleep(POLL_S)
        report = _materialize_report(instance, spec.name)
        _close_parent(study, report)
    counts = report.get("num_complete", 0), report.get("num_pruned", 0)
    log(f"sweep {spec.name}: {counts[0]} complete, {counts[1]} pruned; best {report.get('best_trial', 'none')} "
        f"({report.get('best_objective', 'none')}); `make ui` shows sweep_report/{spec.name}")
    return {"sweep": spec.name, **report}


def _run_array(spec, study, numbers: list[int], log) -> None:
    """On SLURM: the round's trials as one array job, ``%concurrency`` (resources/sweep_array.py); waits for it."""
    from resources import sweep_array
    from resources.slurm import SlurmLauncher

    launcher = SlurmLauncher.from_env()
    deployment = environment.current()
    job_id = sweep_array.submit(launcher, name=spec.name, numbers=numbers, concurrency=spec.concurrency,
                                cpus=max(1, spec.world_size), work_dir=locks_dir(spec.name) / "slurm",
                                task_env="cluster" if deployment.cluster else "local", env=os.environ)
    study.set_user_attr("slurm_array_job", job_id)
    log(f"sweep {spec.name}: submitted SLURM array job {job_id}: trials {numbers}, at most {spec.concurrency} at once")
    sweep_array.wait(job_id, poll_s=launcher.poll_s, log=log)


def _wait_for_array(study, log) -> None:
    from resources import sweep_array
    from resources.slurm import SlurmLauncher

    job_id = study.user_attrs.get("slurm_array_job")
    if job_id and sweep_array.live_numbers(job_id):
        log(f"sweep {study.study_name}: SLURM array job {job_id} of an earlier `sweep run` still holds trials "
            f"{sorted(sweep_array.live_numbers(job_id))}: waiting for it")
        sweep_array.wait(job_id, poll_s=SlurmLauncher.from_env().poll_s, log=log)


def _start_trial(instance: dg.DagsterInstance, trial_id: str, name: str) -> subprocess.Popen:
    """One trial's Dagster run in its own process; returns once its step holds a slot of the pool or waits in
    the pool's queue (or the process ended). The pool grants waiting steps first come, first served, so the
    trials start in their number's order whatever the processes' start-up times: the early-stopping rule
    then compares each trial with the same earlier ones on every run of the sweep."""
    tag = uuid.uuid4().hex
    process = subprocess.Popen([sys.executable, "-m", "pipelines.sweeps", "trial", trial_id, name, tag],
                               cwd=str(paths.REPO_ROOT), env=dict(os.environ))
    while process.poll() is None:
        runs = instance.get_run_records(dg.RunsFilter(tags={PROCESS_TAG: tag}), limit=1)
        if runs:
            run_id = runs[0].dagster_run.run_id
            info = instance.event_log_storage.get_concurrency_info(SWEEP_POOL)
            if run_id in info.pending_run_ids or run_id in info.assigned_run_ids or runs[0].dagster_run.is_finished:
                break
        time.sleep(0.2)
    return process


def _run_trial(trial_id: str, name: str, tag: str) -> int:
    """The trial's process: its queue lock held from now to its end, one run of sweep_trial_job."""
    ensure_dagster_home()
    with held_lock(queue_lock_path(trial_id), f"trial {trial_id}"):
        from pipelines.definitions import defs

        with dg.DagsterInstance.get() as instance:
            result = defs.resolve_job_def("sweep_trial_job").execute_in_process(
                instance=instance, partition_key=trial_id, raise_on_error=False,
                run_config={"loggers": {"console": {"config": {"log_level": "INFO"}}}},
                tags={SWEEP_TAG: name, PROCESS_TAG: tag, "trainyard/source": "trainyard sweep run"})
    return 0 if result.success else 1


def _materialize_report(instance: dg.DagsterInstance, name: str) -> dict:
    from pipelines.definitions import defs

    result = defs.resolve_job_def("sweep_report_job").execute_in_process(
        instance=instance, partition_key=name, raise_on_error=False, tags={SWEEP_TAG: name})
    if not result.success:
        raise RuntimeError(f"sweep_report for {name} failed; the Dagster run {result.run_id} says why")
    event = instance.get_latest_materialization_event(dg.AssetKey("sweep_report"))
    metadata = event.asset_materialization.metadata if event else {}
    return {key: getattr(value, "value", value) for key, value in metadata.items()
            if key in ("status", "best_trial", "best_objective", "best_checkpoint", "report_path", "num_complete",
                       "num_pruned", "num_fail", "num_diverged")}


def _close_parent(study, report: dict) -> None:
    from mlflow.tracking import MlflowClient

    parent = study.user_attrs.get("mlflow_parent_run")
    if not parent:
        return
    client = MlflowClient(tracking_uri=paths.mlflow_tracking_uri())
    for key in ("best_trial", "num_complete", "num_pruned", "num_fail"):
        if key in report:
            client.set_tag(parent, f"trainyard.sweep.{key}", str(report[key]))
    if isinstance(report.get("best_objective"), float):
        client.log_metric(parent, "best/val_loss", report["best_objective"])
    client.set_terminated(parent, status="FINISHED")


class PromotionRefused(RuntimeError):
    pass


def promote(name: str, trial_id: str | None = None, *, log=print) -> dict:
    """Make a trial's committed checkpoint the parent of finetune: the best completed trial by default.

    Recorded as a materialization of ``pretrain`` (no run: Dagster's runless event) carrying the trial's
    run metadata, checkpoint and MLflow run, and ``promoted_from``; finetune starts from pretrain's latest
    materialization, so from this checkpoint. Refused: a trial that did not complete (a pruned trial's
    objective was never measured), a checkpoint that fails verification, an unknown trial."""
    from assets.checkpoint_checks import verify_checkpoint
    from assets.sweeps import load_registered
    from trainer.launch.sweep import sweep_report

    ensure_dagster_home()
    try:
        spec, study = load_registered(name)
    except dg.Failure as failure:
        raise PromotionRefused(failure.description) from None
    report = sweep_report(spec, study)
    rows = {row["trial_id"]: row for row in report["trials"]}
    if trial_id is None:
        if report["best"] is None:
            raise PromotionRefused(f"sweep {name} has no completed trial to promote")
        trial_id = report["best"]["trial_id"]
    row = rows.get(trial_id)
    if row is None:
        raise PromotionRefused(f"sweep {name} has no trial {trial_id!r}; its trials: {', '.join(rows)}")
    if row["state"] != "complete":
        why = (f" (stopped at step {row['pruning']['step']} by the {row['pruning']['rule']} rule)" if row["pruning"]
               else f" ({row['failure_class']})" if row["failure_class"] else "")
        raise PromotionRefused(f"{trial_id} is {row['state']}{why}: only a completed trial, whose objective was "
                               "measured, can be promoted")
    with dg.DagsterInstance.get() as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("sweep_trial"), asset_partitions=[trial_id]), limit=1).records
        if not records:
            raise PromotionRefused(f"{trial_id} has no materialization of sweep_trial in this Dagster home")
        metadata = dict(records[0].event_log_entry.asset_materialization.metadata)
        plain = {key: getattr(value, "value", value) for key, value in metadata.items()}
        if not plain.get("checkpoint") or plain.get("checkpoint") == "none":
            raise PromotionRefused(f"{trial_id} reports no committed checkpoint")
        verified = verify_checkpoint(plain["checkpoint"], expected_run_id=plain["run_id"])
        if not verified.ok:
            raise PromotionRefused(f"{trial_id}'s checkpoint {plain['checkpoint']} failed verification: "
                                   f"{verified.problems}")
        promoted = {**metadata, "promoted_from": f"sweep_trial/{trial_id}", "promoted_objective": row["objective"],
                    "promoted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        instance.report_runless_asset_event(dg.AssetMaterialization(
            asset_key="pretrain", metadata=promoted,
            tags={"trainyard/promoted_from_trial": trial_id}))
    log(f"promoted {trial_id} (objective {row['objective']:.6f}): its checkpoint {plain['checkpoint']} is "
        "pretrain's latest materialization, the parent finetune starts from")
    return {"trial_id": trial_id, "checkpoint": plain["checkpoint"], "run_id": plain["run_id"],
            "objective": row["objective"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="one sweep trial's process (started by run_sweep)")
    commands = parser.add_subparsers(dest="command", required=True)
    trial = commands.add_parser("trial")
    trial.add_argument("trial_id")
    trial.add_argument("name")
    trial.add_argument("tag", help="the run's trainyard/sweep_process tag, by which run_sweep finds it")
    array = commands.add_parser("slurm-trial", help="a SLURM array task: the trial whose number is the task id")
    array.add_argument("name")
    args = parser.parse_args(argv)
    if args.command == "slurm-trial":
        from trainer.launch.sweep import parse_trial_id

        number = int(os.environ["SLURM_ARRAY_TASK_ID"])
        trial_id = f"{args.name}-{number:03d}"
        parse_trial_id(trial_id)  # ValueError on a name that is no sweep's
        return _run_trial(trial_id, args.name, f"slurm-{os.environ.get('SLURM_ARRAY_JOB_ID', 'job')}-{number}")
    return _run_trial(args.trial_id, args.name, args.tag)


if __name__ == "__main__":
    sys.exit(main())
