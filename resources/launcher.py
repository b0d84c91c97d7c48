"""Training launchers: start the trainer as its own processes and talk to it through Dagster Pipes.

``LocalTorchrunLauncher`` runs ``torchrun --standalone --nproc-per-node N -m trainer.train`` on
this machine. The Pipes environment passes through torchrun to every rank; rank 0 opens the
Pipes session, so logs, metrics and the committed checkpoint come back as the asset's
metadata. Cancelling the Dagster run sends SIGTERM to torchrun, which forwards it to every
rank; the trainer stops all ranks at the same step boundary (exit 143), and the launcher kills
what is left after ``termination_timeout_s``. A cluster launcher (``srun torchrun`` under
SLURM) implements the same ``launch`` signature.
"""

from __future__ import annotations

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

    def command(self, config_path: Path, overrides: Sequence[str], *, nproc: int) -> list[str]:
        sets = [item for override in overrides for item in ("--set", override)]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "-m", "trainer.train", "--config", str(config_path), *sets]

    def launch(self, context: dg.AssetExecutionContext, *, config_path: Path, overrides: Sequence[str] = (),
               nproc: int | None = None, extras: Mapping[str, Any] | None = None) -> dg.PipesClientCompletedInvocation:
        nproc = nproc or self.nproc_per_node
        client = dg.PipesSubprocessClient(cwd=str(paths.REPO_ROOT), forward_termination=True,
                                          termination_timeout_seconds=self.termination_timeout_s)
        env = {"MLFLOW_TRACKING_URI": self.mlflow_tracking_uri or paths.mlflow_tracking_uri(),
               "PYTHONUNBUFFERED": "1"}
        context.log.info(f"launching {nproc} rank(s): {' '.join(self.command(config_path, overrides, nproc=nproc))}")
        return client.run(context=context, command=self.command(config_path, overrides, nproc=nproc),
                          env=env, extras=dict(extras or {}))
