"""A measuring workload as a SLURM job on whole nodes: what scaling_report runs at 1 node and at 2.

Not a stage: no fault policy, no requeue, no checkpoint, no Pipes. The trainer on ``nodes`` nodes
(one torchrun per node, c10d rendezvous on the first, as SlurmLauncher's stage jobs), with the
launcher's partition, account, CPUs, memory and GPUs per node, on nodes it has to itself
(``--exclusive``: another job's ranks on a node would make its figures a measure of that job too).
The overrides go in a file only this user can read, never on a command line. The job's final.json is
the result; a job that does not complete raises WorkloadJobFailed with its log's tail.

    final, hosts = run_workload(launcher, Workload("scaling_report-2n", run_dir, config, overrides,
                                                   nodes=2, ranks_per_node=1))
"""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from resources.launcher import write_overrides_file
from resources.sbatch_script import NAME, check_extra_options, check_path, check_script, check_setting
from resources.slurm import SlurmLauncher
from resources.slurm_commands import SlurmError, run_slurm


class WorkloadJobFailed(RuntimeError):
    """The workload's job did not complete: its state and the log's last lines."""


@dataclass(frozen=True)
class Workload:
    name: str
    """Job name part and the script's name, e.g. ``scaling_report-2n``."""
    run_dir: Path
    config_path: Path
    overrides: tuple[str, ...]
    nodes: int
    ranks_per_node: int


def render_workload(launcher: SlurmLauncher, workload: Workload, *, overrides_file: Path, log_path: Path) -> str:
    """The sbatch script of ``workload`` under ``launcher``'s settings (validated as its stage scripts are)."""
    check_setting("the workload name", workload.name, NAME, "e.g. 'scaling_report-2n'")
    for name, value in (("nodes", workload.nodes), ("ranks per node", workload.ranks_per_node)):
        if type(value) is not int or value < 1:
            raise ValueError(f"the workload's {name}: {value!r} is not a whole number >= 1")
    python = check_path("SlurmLauncher.python", launcher.python or sys.executable)
    options = [f"--job-name=trainyard-{workload.name}"[:120], f"--nodes={workload.nodes}", "--ntasks-per-node=1",
               f"--cpus-per-task={launcher.cpus_per_task}", f"--time={launcher.time_limit}", "--exclusive",
               "--no-requeue", f"--output={check_path('the job log', str(log_path))}",
               f"--chdir={check_path('the repository', str(Path(__file__).resolve().parents[1]))}"]
    options += [f"--gpus-per-node={launcher.gpus_per_node}"] if launcher.gpus_per_node else []
    options += [f"--mem={launcher.mem}"] if launcher.mem else []
    options += [f"--partition={launcher.partition}"] if launcher.partition else []
    options += [f"--account={launcher.account}"] if launcher.account else []
    options += [f"--exclude={','.join(launcher.exclude)}"] if launcher.exclude else []
    options += check_extra_options("SlurmLauncher.extra_sbatch", launcher.extra_sbatch)
    trainer = [shlex.quote(python), "-m", "torch.distributed.run", "--nnodes=$SLURM_JOB_NUM_NODES",
               f"--nproc-per-node={workload.ranks_per_node}", "--rdzv-backend=c10d",
               '--rdzv-endpoint="$head_node:$port"', '--rdzv-id="$SLURM_JOB_ID"', "-m", "trainer.train",
               "--config", shlex.quote(check_path("the config path", str(workload.config_path))),
               "--overrides-file", shlex.quote(check_path("the overrides file", str(overrides_file)))]
    lines = ["#!/bin/bash", f"# workload {workload.name}: written by Trainyard (resources/slurm_workload.py)",
             *(f"#SBATCH {option}" for option in options), "",
             "set -euo pipefail",
             'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
             'head_node=$(echo "$nodes" | head -n 1)',
             f"port={launcher.rendezvous_port}",
             'echo "[trainyard] workload job $SLURM_JOB_ID on $SLURM_JOB_NUM_NODES node(s): $(echo $nodes)"',
             f"exec srun --kill-on-bad-exit=1 --ntasks-per-node=1 {' '.join(trainer)}", ""]
    return check_script("\n".join(lines), lines=lines, header=options)


def run_workload(launcher: SlurmLauncher, workload: Workload, *, timeout_s: float = 1800.0,
                 cancel: threading.Event | None = None, log=print) -> tuple[dict[str, Any], list[str]]:
    """Submit ``workload``, wait for it, and return its final.json record and the hosts it ran on.
    WorkloadJobFailed when it does not complete (or runs past ``timeout_s``, when it is cancelled);
    a set ``cancel`` cancels the job too."""
    run_dir = Path(workload.run_dir)
    folder = run_dir / "launch"
    folder.mkdir(parents=True, exist_ok=True)
    overrides_file = write_overrides_file(folder / f"{workload.name}.overrides.json",
                                          [*workload.overrides, f"train.run_dir={run_dir}"])
    log_path = folder / f"{workload.name}.slurm.log"
    script = folder / f"{workload.name}.sbatch"
    script.write_text(render_workload(launcher, workload, overrides_file=overrides_file, log_path=log_path))
    job_id = run_slurm("sbatch", "--parsable", str(script)).strip().split(";")[0]
    log(f"{workload.name}: SLURM job {job_id} on {workload.nodes} node(s) x {workload.ranks_per_node} rank(s)")
    deadline = time.monotonic() + timeout_s
    hosts: list[str] = []
    try:
        while True:
            state = launcher.job_state(job_id)
            if not hosts and state.nodes and state.state.startswith(("RUNNING", "COMPLETING", "COMPLETED")):
                hosts = run_slurm("scontrol", "show", "hostnames", state.nodes).split()
            if state.done:
                break
            if time.monotonic() > deadline:
                raise WorkloadJobFailed(f"{workload.name}: SLURM job {job_id} still {state.state} after "
                                        f"{timeout_s:g} s: cancelled")
            if cancel is not None and cancel.is_set():
                raise WorkloadJobFailed(f"{workload.name}: cancelled (SLURM job {job_id})")
            time.sleep(launcher.poll_s)
    except BaseException:  # the timeout, a cancel, Dagster's interrupt: the job goes too; always re-raised
        try:
            run_slurm("scancel", job_id)
        except SlurmError as error:
            log(f"{workload.name}: scancel {job_id} failed: {error}")
        raise
    try:
        final = json.loads((run_dir / "final.json").read_text())
    except (OSError, ValueError):
        final = {}
    if state.state.split()[0] != "COMPLETED" or final.get("status") != "completed":
        tail = log_path.read_text(errors="replace").splitlines()[-15:] if log_path.is_file() else []
        raise WorkloadJobFailed(f"{workload.name}: SLURM job {job_id} {state.state} (exit {state.exit_code}); "
                                f"final.json status {final.get('status', 'missing')}; {log_path}:\n" + "\n".join(tail))
    return final, hosts
