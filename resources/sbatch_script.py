"""What may reach a generated sbatch script: one grammar per setting, and a guard on the whole script.

    check_setting("SlurmLauncher.mem", "16G", MEM)        # the value, or SbatchSettingError naming the setting
    check_path("the run folder (train.run_dir)", run_dir)  # a path that is safe in an #SBATCH line
    check_script(text, header=options)                     # every line is one the renderer meant to write

A newline in a partition, a memory size or the run folder would end the ``#SBATCH`` line it sits on
and start a line of its own: another ``#SBATCH`` option (``--wrap``, a second ``--output``) or, below
the header, a shell command the job runs. Every value is therefore checked against the grammar of its
SLURM option before it is written, and refused by name (``SbatchSettingError``, a ``ValueError``) when
it does not fit: never repaired, because a repaired value is a job other than the one asked for.

Two layers, because a grammar can be forgotten for the next field someone adds:

1. ``check_setting`` / ``check_path``: each value against its grammar (ASCII only: ``\\d`` would also
   take other scripts' digits, and ``$`` in a Python regex matches before a trailing newline, so
   every pattern here is matched whole with ``fullmatch``).
2. ``check_script``: the rendered text has no character that ends a line other than ``\\n`` (CR,
   NUL, vertical tab, form feed, U+0085, U+2028, U+2029 and every other control character), its
   lines are exactly the ones the renderer built, and its ``#SBATCH`` lines are exactly the options
   it emitted, in order.

Values on the script's command line (the interpreter, the config and overrides paths) are also
passed through ``shlex.quote``; the path grammar keeps them on one line first.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from typing import Any

# One SLURM option each. ASCII only (re.ASCII), matched whole (fullmatch).
NAME = re.compile(r"[A-Za-z0-9_.-]+", re.ASCII)
"""account, qos, reservation, a single partition, a job-name part: SLURM's own name characters."""
PARTITIONS = re.compile(r"[A-Za-z0-9_.-]+(?:,[A-Za-z0-9_.-]+)*", re.ASCII)
"""--partition takes a comma-separated list."""
MEM = re.compile(r"[0-9]+[KMGTkmgt]?", re.ASCII)
"""--mem: a number, optionally with a K, M, G or T suffix (megabytes without one)."""
TIME = re.compile(r"(?:[0-9]+-)?[0-9]+(?::[0-9]+){0,2}|UNLIMITED|INFINITE", re.ASCII)
"""--time: minutes, minutes:seconds, hours:minutes:seconds, days-hours[:minutes[:seconds]]."""
SIGNAL = re.compile(r"(?:SIG)?[A-Z0-9]+(?:@[0-9]+)?", re.ASCII)
"""--signal=B:<this>: a signal name or number, optionally @seconds before the time limit."""
# An extra #SBATCH option: --name, --name=value or -X value-less; the value has no blank, quote,
# shell character or line end (& | [ ] * ! are --constraint's operators; #SBATCH lines reach
# sbatch, not a shell). Options the renderer sets itself are refused (SlurmLauncher's field wins).
EXTRA_OPTION = re.compile(r"(--[A-Za-z][A-Za-z0-9-]*(?:=[A-Za-z0-9_.,:@%+/=&|*!\[\]-]+)?|-[A-Za-z])", re.ASCII)
OWN_OPTIONS = frozenset({
    "--job-name", "-J", "--nodes", "-N", "--ntasks-per-node", "--cpus-per-task", "-c", "--time", "-t", "--signal",
    "--requeue", "--no-requeue", "--output", "-o", "--error", "-e", "--open-mode", "--chdir", "-D",
    "--gpus-per-node", "--mem", "--partition", "-p", "--account", "-A", "--exclude", "-x", "--wrap", "--export",
    "--parsable",
    "--input", "-i"})
# A path in an #SBATCH line or on the command line: no blank, quote, shell or sbatch pattern character
# except the ones named here, which a path on a cluster filesystem does not need anything beyond.
PATH = re.compile(r"[A-Za-z0-9_.,:@+=/~-]+", re.ASCII)
_LINE_ENDS = "\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


class SbatchSettingError(ValueError):
    """A value that would reach a generated sbatch script does not fit its option's grammar; names
    the setting, and shows the value only as ``repr`` (so a newline in it is visible, not obeyed)."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


def queue_options(launcher: Any, exclude: Sequence[str] = ()) -> list[str]:
    """The queue placement options every Trainyard job script shares, each setting checked first (a value
    outside its grammar is refused naming it): --mem, --partition, --account, --exclude (the launcher's
    nodes and ``exclude``) and the launcher's checked extra_sbatch options."""
    for setting, grammar, example in (("partition", PARTITIONS, "e.g. 'debug'"), ("account", NAME, "e.g. 'ml-team'"),
                                      ("mem", MEM, "e.g. '16G'")):
        if getattr(launcher, setting):
            check_setting(f"SlurmLauncher.{setting}", getattr(launcher, setting), grammar, example)
    excluded = list(dict.fromkeys([*launcher.exclude, *exclude]))
    for node in excluded:
        check_setting("SlurmLauncher.exclude", node, NAME, "a node name such as 'node2'")
    options = [f"--mem={launcher.mem}"] if launcher.mem else []
    options += [f"--partition={launcher.partition}"] if launcher.partition else []
    options += [f"--account={launcher.account}"] if launcher.account else []
    options += [f"--exclude={','.join(excluded)}"] if excluded else []
    return options + check_extra_options("SlurmLauncher.extra_sbatch", launcher.extra_sbatch)


def check_setting(setting: str, value: str, grammar: re.Pattern[str], example: str) -> str:
    """``value`` when it fits ``grammar`` whole; else SbatchSettingError naming ``setting``."""
    if not isinstance(value, str) or not grammar.fullmatch(value):
        raise SbatchSettingError(setting, f"{_shown(value)} is not a valid value ({example}); it would be written "
                                          f"into the sbatch script, so it is refused rather than repaired")
    return value


def check_path(setting: str, path: str, *, allow: str = "") -> str:
    """A path that stays one token on one line of the script (``allow``: more characters the caller
    writes itself, such as the ``%j`` of the default log name)."""
    text = str(path)
    grammar = PATH if not allow else re.compile(rf"[A-Za-z0-9_.,:@+=/~{re.escape(allow)}-]+", re.ASCII)
    if not text or not grammar.fullmatch(text):
        bad = sorted({char for char in text if not grammar.fullmatch(char)})
        raise SbatchSettingError(setting, f"{_shown(text)} holds {', '.join(_shown(char) for char in bad) or 'nothing'}; "
                                          f"a path written into an sbatch script may hold only letters, digits and "
                                          f"_ . , : @ + = / ~ - (sbatch splits #SBATCH lines on blanks, reads % as a "
                                          f"pattern, and a line end would start a line of its own): move it, or "
                                          f"rename the folder")
    return text


def check_extra_options(setting: str, options: Sequence[str]) -> list[str]:
    """``extra_sbatch``: each one option in SLURM's syntax, none that the launcher sets itself."""
    checked = []
    for option in options:
        check_setting(setting, option, EXTRA_OPTION, "one option such as '--exclusive' or '--qos=high'")
        name = option.partition("=")[0]
        if name in OWN_OPTIONS:
            raise SbatchSettingError(setting, f"{name} is set by SlurmLauncher itself (its own field, or the launch's "
                                              f"run folder); setting it twice would make a job Trainyard does not follow")
        checked.append(option)
    return checked


def check_script(text: str, *, lines: Sequence[str], header: Sequence[str]) -> str:
    """``text`` when it is exactly ``lines`` joined by newlines, no line holds a character that ends
    or hides a line, and its ``#SBATCH`` lines are exactly ``header``; else SbatchSettingError."""
    for number, line in enumerate(lines, start=1):
        bad = [char for char in line if char in _LINE_ENDS or (unicodedata.category(char) in ("Cc", "Zl", "Zp")
                                                               and char != "\t")]
        if bad:
            raise SbatchSettingError("the sbatch script", f"line {number} holds {_shown(bad[0])}, which ends or hides a "
                                                          f"line: a value reached the script unchecked")
    parsed = text.split("\n")
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.lstrip().startswith("#SBATCH")]
    if parsed != list(lines) or text.splitlines() != [*lines[:-1], *([lines[-1]] if lines[-1] else [])] \
            or sbatch != list(header):
        raise SbatchSettingError("the sbatch script", "its lines are not the ones rendered (a value added a line or an "
                                                      "#SBATCH option)")
    return text


def _shown(value: object) -> str:
    """A value as it may be shown: repr (line ends escaped), cut short."""
    text = ascii(value)
    return text if len(text) <= 80 else text[:77] + "..."
