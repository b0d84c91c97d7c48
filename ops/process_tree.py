"""Stop a launched process with everything it started, tracked by pid, never matched by name.

``killpg`` on the launcher's own group is not enough for torchrun: torch elastic starts every
rank with ``start_new_session=True`` (torch/distributed/elastic/multiprocessing/subprocess_handler),
so each rank leads its own session and process group. Killing torchrun's group alone leaves the
ranks running as orphans, still writing to the run's log and holding its files. Here the launched
process is frozen first (SIGSTOP: it can start no new rank), its descendants are read from
``/proc/<pid>/task/<tid>/children`` and frozen as they are found, and then each of them and every
group they lead is killed. No third-party package does this without a dependency (psutil is not in the stack),
and Linux's ``/proc`` is the one source of truth for who started whom.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

_PROC = Path("/proc")


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's), empty when it is gone or ``/proc`` lacks the file."""
    found: list[int] = []
    try:
        tasks = list((_PROC / str(pid) / "task").iterdir())
    except OSError:
        return found
    for task in tasks:
        try:
            found.extend(int(word) for word in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue  # the thread ended while it was read
    return found


def descendants(pid: int, *, stop: bool = False) -> list[int]:
    """Every process below ``pid``, parents before children. With ``stop`` each is frozen (SIGSTOP) as
    it is found, before its own children are read: a frozen process neither reaps a child that ends
    (so no pid found here can be reused by another process before it is killed) nor starts one."""
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in children(pending.pop()):
            if child not in found:
                if stop:
                    try:
                        os.kill(child, signal.SIGSTOP)
                    except ProcessLookupError:
                        continue  # ended and reaped between the read and the signal
                found.append(child)
                pending.append(child)
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass  # the group is already empty


def kill_tree(process: subprocess.Popen) -> list[int]:
    """SIGKILL ``process`` (started with ``start_new_session=True``), its group and every group its
    descendants lead, then reap it. Returns the descendants it found."""
    own_group = os.getpgrp()
    below: list[int] = []
    if process.poll() is None:  # not reaped: until it is, its pid (and group id) cannot name another process
        _signal_group(process.pid, signal.SIGSTOP)  # no new rank can be started while the tree is read
        below = descendants(process.pid, stop=True)
    groups = []
    for pid in below:
        try:
            group = os.getpgid(pid)
        except ProcessLookupError:
            continue
        if group != own_group and group not in groups:
            groups.append(group)
    for pid in below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for group in groups:
        _signal_group(group, signal.SIGKILL)  # a rank's own children (data loader workers) share its group
    _signal_group(process.pid, signal.SIGKILL)
    process.wait()
    return below
