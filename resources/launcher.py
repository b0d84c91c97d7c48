"""Training launchers: start the trainer as its own processes and talk to it through Dagster Pipes.

``LocalTorchrunLauncher`` runs ``torchrun --standalone --nproc-per-node N -m trainer.train`` on this
machine (through ``trainer.supervisor.elastic``: torchrun itself, plus a report of which rank died first), for
one named ``StageLaunch`` (trainer/launch/stage_launch.py): its config, its overrides, its world size. The
overrides go to the trainer in a file only this user can read (``<run_dir>/launch/<dagster run
id>.overrides.json``, mode 0600), never on the command line, which every user sees in ``ps`` and
which is logged here; secret fields arrive in them only as ``${env:NAME}`` references
(assets/training.py refuses literals). When the ranks fail, the Dagster failure names the rank that
died first and how it ended (killed by which signal, or its exit code), from torchelastic's records,
not whichever survivor failed next. The Pipes environment passes through torchrun to every rank;
rank 0 opens the Pipes session, so logs, metrics and the committed checkpoint come back as the
asset's metadata. Cancelling the Dagster run sends SIGTERM to torchrun, which forwards it to every
rank; the trainer stops all ranks at the same step boundary, saves a checkpoint there, and exits
143; the launcher kills what is left of torchrun's process group after ``termination_timeout_s``. A
cluster launcher (``srun torchrun`` under SLURM) implements the same ``launch`` signature.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from ops import process_tree
from ops.publish import objstore, paths
from trainer.launch.stage_launch import StageLaunch

# Read by trainer.supervisor.elastic and its failure_report (kept in step with them: resources do not import the trainer).
FAILURE_REPORT_ENV = "TRAINYARD_FAILURE_REPORT"
RUN_DIR_ENV = "TRAINYARD_RUN_DIR"
LAUNCH_ID_ENV = "TRAINYARD_LAUNCH_ID"
MAX_BAD_SAMPLES_ENV = "TRAINYARD_MAX_BAD_SAMPLES"
BUDGET_DECISIONS = ("restart", "requeue")
CANCEL_MARKER = "CANCELED"  # run_dir/launch/CANCELED: trainer.supervisor.elastic.cancel_marker


class RequeueFailure(dg.Failure):
    """A launch that ended preempted with retry budget left: the one failure a Dagster retry policy
    retries (the next launch resumes from the last committed checkpoint). Every other failure of a
    stage is raised with allow_retries=False (assets/training.py)."""


def read_attempts(run_dir: str | Path) -> list[dict[str, Any]]:
    """run_dir/attempts.jsonl (trainer/supervisor/elastic.py): one line per attempt; a torn last line is left out."""
    path = Path(run_dir) / "attempts.jsonl"
    if not path.is_file():
        return []
    attempts = []
    for line in path.read_text().splitlines():
        try:
            attempts.append(json.loads(line))
        except ValueError:
            continue
    return attempts


def attempts_metadata(run_dir: str | Path, budget: int) -> dict[str, Any]:
    """The retry budget, what is spent, and why each attempt of the run ended, for the stage's metadata."""
    attempts = read_attempts(run_dir)
    spent = sum(entry.get("decision") in BUDGET_DECISIONS for entry in attempts)
    rows = ["| attempt | launch | class | step | resumed from | decision | why |", "| --- | --- | --- | --- | --- | --- | --- |"]
    rows += [f"| {entry['attempt']} | {str(entry.get('launch_id', ''))[:8]} | {entry['failure_class']} | {entry['step']} "
             f"| {entry.get('restored_step') if entry.get('restored_step') is not None else 'start'} "
             f"| {entry['decision']} | {str(entry['why']).replace('|', '/')} |" for entry in attempts]
    return {"retry_budget": budget, "retries_spent": spent, "num_attempts": len(attempts),
            "attempt_classes": ",".join(entry["failure_class"] for entry in attempts) or "none",
            "attempts": dg.MetadataValue.md("\n".join(rows))}


class TorchrunLauncher(dg.ConfigurableResource):
    """What every launcher shares: the stages read ``tracking_uri`` and ``default_world_size`` and
    call ``launch(context, stage_launch, extras=...)``, which each launcher defines (this machine's
    below, SLURM's in resources/slurm.py)."""

    nproc_per_node: int = 2
    """Ranks to start (per node); a stage may ask for fewer (the single-device baseline asks for 1)."""
    termination_timeout_s: float = 30.0
    """After SIGTERM on cancel, how long ranks get to stop at a step boundary before SIGKILL."""
    mlflow_tracking_uri: str = ""
    """Passed to the trainer as MLFLOW_TRACKING_URI; empty means the embedded default."""

    @property
    def tracking_uri(self) -> str:
        """The MLflow store the trainer logs to (the assets look up earlier attempts there)."""
        return self.mlflow_tracking_uri or paths.mlflow_tracking_uri()

    @property
    def default_world_size(self) -> int:
        """Ranks of a stage that does not ask for a number (StageRunConfig.nproc=0)."""
        return self.nproc_per_node

    @property
    def runs_data_on_cluster(self) -> bool:
        """Whether data work (clip_shards backfills, probing) goes to the cluster as array jobs
        (SlurmLauncher.run_tasks) instead of running in the Dagster step on this machine."""
        return False

    def _record_root_cause(self, context: dg.AssetExecutionContext, description: str,
                           metadata: Mapping[str, Any] | None = None) -> None:
        record_root_cause(self.tracking_uri, context, description, metadata)


class LocalTorchrunLauncher(TorchrunLauncher):
    """torchrun on this machine (gloo on CPU, NCCL on GPUs), one process per rank."""

    def command(self, config_path: Path, overrides: Sequence[str] = (), *, nproc: int,
                overrides_file: Path | None = None, max_restarts: int = 0) -> list[str]:
        """The torchrun command; with ``overrides_file`` the overrides stay in that file.
        ``max_restarts`` is what is left of the run's retry budget (trainer/supervisor/elastic.py spends it)."""
        sets = [item for override in overrides for item in ("--set", override)]
        if overrides_file is not None:
            sets = ["--overrides-file", str(overrides_file)]
        return [sys.executable, "-m", "trainer.supervisor.elastic", "--standalone", f"--nproc-per-node={nproc}",
                f"--max-restarts={max_restarts}", "-m", "trainer.train", "--config", str(config_path), *sets]

    def launch(self, context: dg.AssetExecutionContext, stage_launch: StageLaunch, *,
               extras: Mapping[str, Any] | None = None,
               cancel: threading.Event | None = None) -> dg.PipesClientCompletedInvocation:
        """Run the ranks of ``stage_launch``; its run folder's ``launch/`` keeps this attempt's
        overrides file and failure report beside the launch record. ``cancel``: for a launch from a
        worker thread, which never sees Dagster's interrupt; setting it stops the launch as a cancel."""
        if not stage_launch.run_dir:
            raise ValueError(f"{stage_launch.stage}: a launch runs in its run folder; name it first (StageLaunch.named)")
        folder = Path(stage_launch.run_dir) / "launch"
        overrides_file = write_overrides_file(folder / f"{context.run.run_id}.overrides.json", stage_launch.overrides())
        failure_report = folder / f"{context.run.run_id}.failure.json"
        failure_report.unlink(missing_ok=True)  # an earlier attempt's report says nothing about this one
        (folder / CANCEL_MARKER).unlink(missing_ok=True)  # an earlier launch's cancel is not this one's
        nproc = stage_launch.world_size
        budget, max_bad = retry_settings(stage_launch)
        spent = attempts_metadata(stage_launch.run_dir, budget)["retries_spent"]
        command = self.command(Path(stage_launch.config_path), nproc=nproc, overrides_file=overrides_file,
                               max_restarts=max(0, budget - spent))
        env = {"MLFLOW_TRACKING_URI": self.tracking_uri, "PYTHONUNBUFFERED": "1", FAILURE_REPORT_ENV: str(failure_report),
               RUN_DIR_ENV: str(stage_launch.run_dir), LAUNCH_ID_ENV: context.run.run_id,
               MAX_BAD_SAMPLES_ENV: str(max_bad),
               **objstore.role_credentials("training")}  # the ranks read data and write checkpoints only
        return self._run(context, command, env, nproc=nproc, extras=extras, failure_report=failure_report,
                         run_dir=Path(stage_launch.run_dir), budget=budget, cancel=cancel)

    def _run(self, context: dg.AssetExecutionContext, command: list[str], env: dict[str, str], *, nproc: int,
             extras: Mapping[str, Any] | None, failure_report: Path, run_dir: Path,
             budget: int, cancel: threading.Event | None = None) -> dg.PipesClientCompletedInvocation:
        context.log.info(f"launching {nproc} rank(s): {' '.join(command)}")
        # Not PipesSubprocessClient: on cancel it sends SIGINT, which the trainer takes as a crash
        # (no agreed stop step, no final checkpoint); SIGTERM is its graceful stop.
        with dg.open_pipes_session(context=context, context_injector=dg.PipesTempFileContextInjector(),
                                   message_reader=dg.PipesTempFileMessageReader(),
                                   extras=dict(extras or {})) as session:
            # Its own process group, so what outlives the timeout is killed with its ranks.
            process = subprocess.Popen(command, cwd=str(paths.REPO_ROOT), start_new_session=True,
                                       env={**os.environ, **env, **session.get_bootstrap_env_vars()})
            try:
                returncode = _wait(process, cancel)
            except dg.DagsterExecutionInterruptedError:
                # A cancel, not a preemption: the policy must not ask for a requeue (trainer/supervisor/elastic.py).
                (run_dir / "launch" / CANCEL_MARKER).write_text(f"canceled: Dagster run {context.run.run_id}\n")
                self._stop(context, process)
                raise
            if returncode != 0:
                failure = rank_failure(returncode, failure_report, run_dir=run_dir, budget=budget)
                if failure_report.is_file() or (run_dir / "ending.json").is_file():
                    self._record_root_cause(context, failure.description, failure.metadata)
                raise failure
        return dg.PipesClientCompletedInvocation(session)

    def _stop(self, context: dg.AssetExecutionContext, process: subprocess.Popen) -> None:
        """SIGTERM to torchrun (it forwards it to every rank); SIGKILL to what is left after the timeout."""
        context.log.info(f"run canceled: SIGTERM to torchrun (pid {process.pid}), the ranks stop at a step boundary")
        process.terminate()
        sent = time.monotonic()
        try:
            process.wait(timeout=self.termination_timeout_s)
            context.log.info(f"torchrun exited {time.monotonic() - sent:.1f} s after SIGTERM")
        except subprocess.TimeoutExpired:
            context.log.warning(f"torchrun still running {self.termination_timeout_s} s after SIGTERM: SIGKILL")
        left = process_tree.kill_tree(process)  # torchrun, if still there, and every rank it started
        if left:
            context.log.warning(f"killed what was still running below torchrun: pids {left}")


def raise_if_canceled(cancel: threading.Event | None) -> None:
    """A launch in a worker thread is stopped through ``cancel``: Dagster raises its interrupt in the
    main thread only, so the thread raises it here for the launch's cancel handling to run."""
    if cancel is not None and cancel.is_set():
        raise dg.DagsterExecutionInterruptedError("canceled: the step that started this launch was interrupted")


def _wait(process: subprocess.Popen, cancel: threading.Event | None) -> int:
    if cancel is None:
        return process.wait()
    while True:
        raise_if_canceled(cancel)
        try:
            return process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass


def record_root_cause(tracking_uri: str, context: dg.AssetExecutionContext, description: str,
                      metadata: Mapping[str, Any] | None = None) -> None:
    """Tag the launch's last MLflow run with the root cause and the run's failure_class: its own
    trainyard.error and failure_class are rank 0's view (often a consequence, such as a lost peer
    or a DataLoader worker torn down after a peer died)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    try:
        experiments = [experiment.experiment_id for experiment in client.search_experiments()]
        # The last attempt's run: earlier attempts of this launch were tagged as they ended (trainer/supervisor/elastic.py).
        runs = client.search_runs(experiments, filter_string=f"tags.dagster_run_id = '{context.run.run_id}'",
                                  order_by=["attributes.start_time DESC"], max_results=1)
        failure_class = (metadata or {}).get("failure_class")
        failure_class = getattr(failure_class, "value", failure_class)
        for run in runs:
            client.set_tag(run.info.run_id, "trainyard.root_cause", description[:5000])
            if failure_class:
                client.set_tag(run.info.run_id, "failure_class", str(failure_class))
    except MlflowException as error:  # the Dagster failure still names the cause
        from trainer.launch.redact import redact_uri

        context.log.warning(f"MLflow: root cause not tagged ({redact_uri(str(error))})")  # its URI's credentials


def write_overrides_file(path: Path, overrides: Sequence[str]) -> Path:
    """``overrides`` as a JSON list in a file only this user can read (trainer --overrides-file).

    Written to a new file under a random name, created by this call (``O_EXCL``: never an
    existing file, which would keep its wider mode) and never through a symlink (``O_NOFOLLOW``:
    a link planted at a guessable name cannot redirect the write), mode 0600 from birth, then
    renamed over ``path`` (a rename replaces a link at ``path`` itself, never its target).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    descriptor = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "w") as handle:
            json.dump(list(overrides), handle, indent=1)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written file with the overrides left behind
        raise
    return path


def retry_settings(stage_launch: StageLaunch) -> tuple[int, int]:
    """(train.retry_budget, train.max_bad_samples) of the launch's resolved config."""
    train = (stage_launch.config or {}).get("train", {})
    return int(train.get("retry_budget", 2)), int(train.get("max_bad_samples", 16))


def _ending(run_dir: Path | None) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / "ending.json").read_text()) if run_dir is not None else None
    except (OSError, ValueError):
        return None


def rank_failure(returncode: int, failure_report: Path, *, run_dir: Path | None = None, budget: int = 0) -> dg.Failure:
    """The Dagster failure of a failed launch: the run's class (trainer/supervisor/elastic.py's ending.json), the
    root-cause rank and its exit when torchrun reported failed ranks (trainer.supervisor.failure_report), else
    torchrun's own exit status. A RequeueFailure only when the policy asked for a requeue."""
    ending = _ending(run_dir)
    metadata: dict[str, Any] = {}
    description = f"torchrun exited with code {returncode}; the ranks' log lines above say why"
    if failure_report.is_file():
        report = json.loads(failure_report.read_text())
        cause = report["root_cause"]
        others = [f"rank {entry['rank']} {entry['exit']}" for entry in report["failures"] if entry["rank"] != cause["rank"]]
        description = (f"{report['summary']}; torchrun exited with code {returncode}"
                       + (f" (also failed, after it: {', '.join(others)})" if others else ""))
        metadata |= {"root_cause_rank": cause["rank"], "root_cause_exitcode": cause["exitcode"],
                     "root_cause_exit": cause["exit"], "failure_report": str(failure_report),
                     "num_failed_ranks": len(report["failures"])}
    requeue = False
    if ending is not None:
        description = f"{ending['failure_class']} ({ending['decision']}: {ending['why']}): {description}"
        metadata |= {"failure_class": ending["failure_class"], "failure_rank": ending["rank"],
                     "failure_host": ending["host"], "failure_step": ending["step"],
                     "failure_sample_ids": ",".join(ending["sample_ids"]) or "none",
                     "decision": ending["decision"], "ending": str(run_dir / "ending.json"),
                     "log_tail": dg.MetadataValue.md("```\n" + "\n".join(ending.get("log_tail", [])[-20:]) + "\n```"),
                     **attempts_metadata(run_dir, budget)}
        requeue = ending["decision"] == "requeue"
    if requeue:
        return RequeueFailure(description=description, metadata=metadata, allow_retries=True)
    return dg.Failure(description=description, metadata=metadata, allow_retries=False)
