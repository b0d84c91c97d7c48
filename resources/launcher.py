"""Training launchers: start the trainer as its own processes and talk to it through Dagster Pipes.

``LocalTorchrunLauncher`` runs ``torchrun --standalone --nproc-per-node N -m trainer.train`` on this
machine (through ``trainer.elastic``: torchrun itself, plus a report of which rank died first), for
one named ``StageLaunch`` (trainer/stage_launch.py): its config, its overrides, its world size. The
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
import signal
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from ops import paths
from trainer.stage_launch import StageLaunch

# Read by trainer.elastic (kept in step with it: resources do not import the trainer).
FAILURE_REPORT_ENV = "TRAINYARD_FAILURE_REPORT"


class LocalTorchrunLauncher(dg.ConfigurableResource):
    """torchrun on this machine (gloo on CPU, NCCL on GPUs), one process per rank."""

    nproc_per_node: int = 2
    """Ranks to start; a stage may ask for fewer (the single-device baseline asks for 1)."""
    termination_timeout_s: float = 30.0
    """After SIGTERM on cancel, how long ranks get to stop at a step boundary before SIGKILL."""
    mlflow_tracking_uri: str = ""
    """Passed to the trainer as MLFLOW_TRACKING_URI; empty means the embedded default."""

    @property
    def tracking_uri(self) -> str:
        """The MLflow store the trainer logs to (the assets look up earlier attempts there)."""
        return self.mlflow_tracking_uri or paths.mlflow_tracking_uri()

    def command(self, config_path: Path, overrides: Sequence[str] = (), *, nproc: int,
                overrides_file: Path | None = None) -> list[str]:
        """The torchrun command; with ``overrides_file`` the overrides stay in that file."""
        sets = [item for override in overrides for item in ("--set", override)]
        if overrides_file is not None:
            sets = ["--overrides-file", str(overrides_file)]
        return [sys.executable, "-m", "trainer.elastic", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "trainer.train", "--config", str(config_path), *sets]

    def launch(self, context: dg.AssetExecutionContext, stage_launch: StageLaunch, *,
               extras: Mapping[str, Any] | None = None) -> dg.PipesClientCompletedInvocation:
        """Run the ranks of ``stage_launch``; its run folder's ``launch/`` keeps this attempt's
        overrides file and failure report beside the launch record."""
        if not stage_launch.run_dir:
            raise ValueError(f"{stage_launch.stage}: a launch runs in its run folder; name it first (StageLaunch.named)")
        folder = Path(stage_launch.run_dir) / "launch"
        overrides_file = write_overrides_file(folder / f"{context.run.run_id}.overrides.json", stage_launch.overrides())
        failure_report = folder / f"{context.run.run_id}.failure.json"
        failure_report.unlink(missing_ok=True)  # an earlier attempt's report says nothing about this one
        nproc = stage_launch.world_size
        command = self.command(Path(stage_launch.config_path), nproc=nproc, overrides_file=overrides_file)
        env = {"MLFLOW_TRACKING_URI": self.tracking_uri, "PYTHONUNBUFFERED": "1", FAILURE_REPORT_ENV: str(failure_report)}
        return self._run(context, command, env, nproc=nproc, extras=extras, failure_report=failure_report)

    def _run(self, context: dg.AssetExecutionContext, command: list[str], env: dict[str, str], *, nproc: int,
             extras: Mapping[str, Any] | None, failure_report: Path) -> dg.PipesClientCompletedInvocation:
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
                returncode = process.wait()
            except dg.DagsterExecutionInterruptedError:
                self._stop(context, process)
                raise
            if returncode != 0:
                failure = rank_failure(returncode, failure_report)
                if failure_report.is_file():
                    self._record_root_cause(context, failure.description)
                raise failure
        return dg.PipesClientCompletedInvocation(session)

    def _record_root_cause(self, context: dg.AssetExecutionContext, description: str) -> None:
        """Tag this attempt's MLflow run with the root cause: its own trainyard.error is rank 0's view
        (often a consequence, such as a DataLoader worker torn down after a peer died)."""
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        try:
            experiments = [experiment.experiment_id for experiment in client.search_experiments()]
            runs = client.search_runs(experiments, filter_string=f"tags.dagster_run_id = '{context.run.run_id}'")
            for run in runs:
                client.set_tag(run.info.run_id, "trainyard.root_cause", description[:5000])
        except MlflowException as error:  # the Dagster failure still names the cause
            context.log.warning(f"MLflow: root cause not tagged ({error})")

    def _stop(self, context: dg.AssetExecutionContext, process: subprocess.Popen) -> None:
        """SIGTERM to torchrun (it forwards it to every rank); SIGKILL to what is left after the timeout."""
        context.log.info(f"run canceled: SIGTERM to torchrun (pid {process.pid}), the ranks stop at a step boundary")
        process.terminate()
        try:
            process.wait(timeout=self.termination_timeout_s)
        except subprocess.TimeoutExpired:
            context.log.warning(f"torchrun still running {self.termination_timeout_s} s after SIGTERM: SIGKILL")
        try:
            os.killpg(process.pid, signal.SIGKILL)  # torchrun, if still there, and any rank it left behind
        except ProcessLookupError:
            pass  # the group is empty: everything stopped in time
        process.wait()


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


def rank_failure(returncode: int, failure_report: Path) -> dg.Failure:
    """The Dagster failure of a failed launch: the root-cause rank and its exit, when torchrun
    reported failed ranks (trainer.elastic), else torchrun's own exit status."""
    if not failure_report.is_file():  # torchrun failed before any rank ran, or was stopped itself
        return dg.Failure(f"torchrun exited with code {returncode}; the ranks' log lines above say why")
    report = json.loads(failure_report.read_text())
    cause = report["root_cause"]
    others = [f"rank {entry['rank']} {entry['exit']}" for entry in report["failures"] if entry["rank"] != cause["rank"]]
    description = (f"{report['summary']}; torchrun exited with code {returncode}"
                   + (f" (also failed, after it: {', '.join(others)})" if others else ""))
    return dg.Failure(description=description, metadata={
        "root_cause_rank": cause["rank"], "root_cause_exitcode": cause["exitcode"], "root_cause_exit": cause["exit"],
        "failure_report": str(failure_report), "num_failed_ranks": len(report["failures"])})
