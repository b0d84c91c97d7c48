"""Refusals before launch: one line a researcher can act on. Torch-free.

    raise Refusal("config", key="data.batch_size",
                  found="data.batch_size=6 is not divisible by world_size 4 x train.grad_accum 1 = 4",
                  fix="set data.batch_size to a multiple of 4, or --world-size to a divisor of 6")
    str(error)  # 'config: data.batch_size=6 is not ...; fix: set data.batch_size to ...'

Every check that can refuse a run before any process starts (config loading, preflight, the data
and rights checks, the SLURM launcher's checks in ``trainyard dry-run --slurm``) raises a Refusal:
its category says who fixes it, ``found`` names the key and what was wrong with it, ``fix`` says
what to change. ``str()`` is exactly one line whatever the values hold (a newline in a path or a
config value is escaped, never obeyed), so a command line prints it as is (cli/main.py) and a
Dagster stage reports it as a Failure's description (assets/stage_runs.py). A Refusal is a
ValueError, so the existing ``except ValueError`` callers (exit 2, ``config_error``) still hold.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CATEGORIES = ("config", "data", "rights", "memory", "cluster", "credentials")
"""config: the YAML, an override or the launch's own settings; data: the shard index and what the
config says of it; rights: the rights ledger refuses the data; memory: the estimate exceeds the
budget; cluster: the machine or the scheduler cannot run it; credentials: a secret given wrongly
or not given."""

_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x0b": "\\x0b", "\x0c": "\\x0c",
            "\x1c": "\\x1c", "\x1d": "\\x1d", "\x1e": "\\x1e", "\x85": "\\x85", "\u2028": "\\u2028",
            "\u2029": "\\u2029"}


def one_line(text: object) -> str:
    """``text`` with every line break (each character str.splitlines splits at) and tab escaped."""
    return str(text).translate(str.maketrans(_ESCAPES))


def nearest(name: str, choices: Iterable[str]) -> str | None:
    """The choice closest to a misspelt ``name`` (difflib), or None when none is close."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return close[0] if close else None


class Refusal(ValueError):
    """A run refused before launch: ``category`` (CATEGORIES), ``found`` (what was found, naming the
    key), ``fix`` (what to change) and ``key`` (the dotted config key or setting, when there is one)."""

    def __init__(self, category: str, found: str, fix: str, *, key: str = "") -> None:
        if category not in CATEGORIES:
            raise TypeError(f"Refusal category must be one of {CATEGORIES}, got {category!r}")
        self.category, self.found, self.fix, self.key = category, one_line(found), one_line(fix), one_line(key)
        super().__init__(f"{self.category}: {self.found}; fix: {self.fix}")

    def __reduce__(self):  # pickles (a spawned process, a Dagster error record) with its fields
        return (_rebuild, (type(self), self.category, self.found, self.fix, self.key))

    def cli_line(self) -> str:
        """The line a command prints: ``refused (<category>) <found>; fix: <fix>``."""
        return f"refused ({self.category}) {self.found}; fix: {self.fix}"

    def metadata(self) -> dict[str, str]:
        return {"refusal_category": self.category, "refusal_key": self.key}


def _rebuild(cls: type[Refusal], category: str, found: str, fix: str, key: str) -> Refusal:
    refusal = cls.__new__(cls)  # past a subclass's own __init__ signature (LiteralSecretError's, ...)
    Refusal.__init__(refusal, category, found, fix, key=key)
    return refusal
