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


# ASCII digits, matched whole: "$" would also match before a trailing newline ("00:30:00\n").
_TIME = re.compile(r"(?:(?P<days>[0-9]+)-)?(?P<h>[0-9]{1,2})(?::(?P<m>[0-9]{2}))?(?::(?P<s>[0-9]{2}))?", re.ASCII)


def seconds(limit: str) -> int | None:
    """A SLURM time ("30", "1:00:00", "2-00:00:00", "UNLIMITED") in seconds; None for unlimited."""
    if limit in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    match = _TIME.fullmatch(limit)
    if not match:
        raise ValueError(f"not a SLURM time limit: {limit!r} (e.g. '00:30:00', '2-00:00:00')")
    days, h, m, s = (int(match.group(name) or 0) for name in ("days", "h", "m", "s"))
    if match.group("m") is None and match.group("s") is None:
        return days * 86400 + h * 3600 if days else h * 60  # "30" is minutes, "1-5" is a day and 5 hours
    if match.group("s") is None:
        return days * 86400 + h * 3600 + m * 60 if days else h * 60 + m  # "MM:SS", or "D-HH:MM"
    return days * 86400 + h * 3600 + m * 60 + s
