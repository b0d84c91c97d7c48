"""Training launchers: start the trainer as its own processes and talk to it through Dagster Pipes.

``LocalTorchrunLauncher`` runs ``torchrun --standalone --nproc-per-node N -m trainer.train`` on
this machine. The Pipes environment passes through torchrun to every rank; rank 0 opens the
Pipes session, so logs, metrics and the committed checkpoint come back as the asset's
metadata. Cancelling the Dagster run sends SIGTERM to torchrun, which forwards it to every
rank; the trainer stops all ranks at the same step boundary, saves a checkpoint there, and
exits 143; the launcher kills what is left of torchrun's process group after
``termination_timeout_s``. A cluster launcher (``srun torchrun`` under
SLURM) implements the same ``launch`` signature.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import dagster as dg

from ops import paths


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

    def command(self, config_path: Path, overrides: Sequence[str], *, nproc: int) -> list[str]:
        sets = [item for override in overrides for item in ("--set", override)]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "trainer.train", "--config", str(config_path), *sets]

    def launch(self, context: dg.AssetExecutionContext, *, config_path: Path, overrides: Sequence[str] = (),
               nproc: int | None = None, extras: Mapping[str, Any] | None = None) -> dg.PipesClientCompletedInvocation:
        nproc = nproc or self.nproc_per_node
        command = self.command(config_path, overrides, nproc=nproc)
        env = {"MLFLOW_TRACKING_URI": self.tracking_uri, "PYTHONUNBUFFERED": "1"}
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
                raise dg.Failure(f"torchrun exited with code {returncode}; the ranks' log lines above say why")
        return dg.PipesClientCompletedInvocation(session)

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
