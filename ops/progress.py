"""Progress on long work: counts, rate and time left, where a person is looking.

Long operations (scanning and hashing a media root, probing, writing a shard, a dry run) open a
``task`` and advance it. Where that shows up is chosen once by whoever runs them, with
``reporting``:

- the CLI: ``reporting(console=True)``: a rich progress bar on a terminal; on a pipe or a log
  file, one plain line every ``every_s`` seconds (a bar's carriage returns would be noise there);
- a Dagster asset: ``reporting(log=context.log.info)``: one line every ``every_s`` seconds in the
  run's log, and a last line when the task ends, so no stretch of minutes is silent;
- nothing chosen (library use, tests): silent.

A line reads ``probing: 120/400 objects (30%), 35.2 objects/s, about 8 s left``. The rate is the
average since the task started (an honest denominator: no smoothing that hides a stall), and the
time left is what the rest takes at that rate.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

DEFAULT_EVERY_S = 10.0


@dataclass(frozen=True, slots=True)
class _Sink:
    log: Callable[[str], None] | None
    console: bool
    every_s: float
    stream: TextIO | None


_SINK: contextvars.ContextVar[_Sink | None] = contextvars.ContextVar("trainyard_progress_sink", default=None)


@contextlib.contextmanager
def reporting(*, log: Callable[[str], None] | None = None, console: bool = False, every_s: float = DEFAULT_EVERY_S,
              stream: TextIO | None = None) -> Iterator[None]:
    """Show the progress of every task opened inside: as log lines (``log``), or on the console."""
    if every_s <= 0:
        raise ValueError(f"every_s must be > 0, got {every_s}")
    token = _SINK.set(_Sink(log=log, console=console, every_s=every_s, stream=stream))
    try:
        yield
    finally:
        _SINK.reset(token)


def duration(seconds: float) -> str:
    """``seconds`` as a person says it: 40 s, 12 min, 3.5 h."""
    seconds = max(0, round(seconds))
    if seconds < 90:
        return f"{seconds} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def describe(name: str, done: int, total: int | None, unit: str, elapsed_s: float) -> str:
    """One progress line: counts, share, rate and time left (when the total is known and the rate is not 0)."""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    if total:
        text = f"{name}: {done}/{total} {unit} ({100 * done / total:.0f}%)"
    else:
        text = f"{name}: {done} {unit}"
    text += f", {rate:.1f} {unit}/s"
    if total and done < total:
        text += f", about {duration((total - done) / rate)} left" if rate > 0 else ", time left unknown yet"
    elif total:
        text += f", done in {duration(elapsed_s)}"
    return text


class Task:
    """One long task; ``advance`` or ``update`` it, and it reports where ``reporting`` says."""

    def __init__(self, name: str, total: int | None, unit: str, sink: _Sink | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.total, self.unit, self.sink, self.clock = name, total, unit, sink, clock
        self.done = 0
        self.started = self.last_line = clock()
        self.lines: list[str] = []
        self._bar = None
        if sink is not None and sink.log is None and sink.console:
            stream = sink.stream or sys.stderr
            if stream.isatty():
                from rich.console import Console
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn,
                                           TextColumn, TimeRemainingColumn)

                self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TaskProgressColumn(), _RateColumn(unit), TimeRemainingColumn(),
                                     console=Console(file=stream), transient=False)
                self._bar_task = self._bar.add_task(name, total=total)
                self._bar.start()

    def advance(self, count: int = 1) -> None:
        self.update(self.done + count)

    def update(self, done: int) -> None:
        self.done = done
        if self._bar is not None:
            self._bar.update(self._bar_task, completed=done)
            return
        if self.sink is None:
            return
        now = self.clock()
        if now - self.last_line >= self.sink.every_s:
            self.last_line = now
            self._emit()

    def _emit(self) -> None:
        line = describe(self.name, self.done, self.total, self.unit, self.clock() - self.started)
        self.lines.append(line)
        if self.sink.log is not None:
            self.sink.log(line)
        else:
            print(line, file=self.sink.stream or sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.sink is not None and (self.sink.log is not None or self.sink.console):
            self._emit()  # the last line: how many, in how long


def _rate_column_class():
    from rich.progress import ProgressColumn
    from rich.text import Text

    class RateColumn(ProgressColumn):
        """Items per second since the start (rich's own speed column formats bytes)."""

        def __init__(self, unit: str) -> None:
            super().__init__()
            self.unit = unit

        def render(self, task) -> Text:
            elapsed = task.elapsed or 0.0
            rate = task.completed / elapsed if elapsed > 0 else 0.0
            return Text(f"{rate:.1f} {self.unit}/s")

    return RateColumn


def _RateColumn(unit: str):  # noqa: N802 (a class built on first use: rich is imported only for a terminal)
    return _rate_column_class()(unit)


@contextlib.contextmanager
def task(name: str, total: int | None = None, *, unit: str = "items",
         clock: Callable[[], float] = time.monotonic) -> Iterator[Task]:
    """A long task reported where the innermost ``reporting`` says (nowhere when there is none)."""
    current = Task(name, total, unit, _SINK.get(), clock=clock)
    try:
        yield current
    finally:
        current.close()
