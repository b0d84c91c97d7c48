"""SLURM's commands as the launcher and the node tools run them: ``run_slurm`` (a clear error for a
missing command, a controller that does not answer, or a failure) and ``parse_records`` for
``scontrol show ... -o`` output. The base of resources/slurm.py, slurm_nodes.py and node_health.py."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping


class SlurmError(RuntimeError):
    """A SLURM command failed; the message holds its output."""


def run_slurm(*command: str, env: Mapping[str, str] | None = None, timeout_s: float = 60) -> str:
    try:
        completed = subprocess.run(list(command), capture_output=True, text=True, timeout=timeout_s,
                                   env=dict(env) if env is not None else None)
    except FileNotFoundError as error:
        raise SlurmError(f"{command[0]} not found: is this a SLURM submit host? (make slurm-up starts a local "
                         f"cluster)") from error
    except subprocess.TimeoutExpired as error:
        raise SlurmError(f"{' '.join(command)} did not answer in {timeout_s:g} s: is slurmctld up?") from error
    if completed.returncode != 0:
        raise SlurmError(f"{' '.join(command)} failed ({completed.returncode}): "
                         f"{(completed.stderr or completed.stdout).strip()}")
    return completed.stdout


def parse_records(text: str) -> list[dict[str, str]]:
    """``scontrol show ... -o`` output: one record per line, ``Key=Value`` fields (values may hold
    spaces only where scontrol puts the field last, such as Reason)."""
    records = []
    for line in text.splitlines():
        if not line.strip():
            continue
        record: dict[str, str] = {}
        for field in re.split(r" (?=[A-Za-z:/]+=)", line.strip()):
            key, _, value = field.partition("=")
            record[key] = value
        records.append(record)
    return records
