"""ops/process_tree.py: a killed launch takes every process it started, ranks in their own sessions included.

torchrun starts each rank with ``start_new_session=True``; killing torchrun's group alone left the ranks
running (a reproduction's train.log grew after its timeout). These tests start real torchrun processes and
track the pids they started; nothing is matched by name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from ops import process_tree

SLEEPER = """
import os, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
(folder / f"rank{os.environ.get('RANK', 'x')}.pid").write_text(str(os.getpid()))
with open(folder / f"rank{os.environ.get('RANK', 'x')}.log", "a") as log:
    while True:
        log.write("alive\\n"); log.flush(); time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        return _state(pid) != "Z"  # a zombie waits for init to reap it
    except FileNotFoundError:
        return False


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def _wait_for(paths: list[Path], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(path.exists() and path.read_text() for path in paths):
        assert time.monotonic() < deadline, f"not started: {paths}"
        time.sleep(0.1)


def _torchrun(folder: Path, nproc: int = 2) -> subprocess.Popen:
    script = folder / "sleeper.py"
    script.write_text(SLEEPER)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                             str(script), str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def test_every_rank_of_torchrun_goes_with_it_though_each_leads_its_own_session(tmp_path: Path) -> None:
    process = _torchrun(tmp_path)
    pid_files = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
    try:
        _wait_for(pid_files)
        ranks = [int(path.read_text()) for path in pid_files]
        # The premise: a rank is not in torchrun's group, so killpg on torchrun's group alone misses it.
        assert all(os.getpgid(rank) != process.pid for rank in ranks)
        found = process_tree.kill_tree(process)
        assert set(ranks) <= set(found)
        assert process.returncode is not None
        deadline = time.monotonic() + 10
        while any(_alive(rank) for rank in ranks):
            assert time.monotonic() < deadline, f"ranks still alive after kill_tree: {ranks}"
            time.sleep(0.05)
        sizes = [(tmp_path / f"rank{rank}.log").stat().st_size for rank in (0, 1)]
        time.sleep(0.5)
        assert sizes == [(tmp_path / f"rank{rank}.log").stat().st_size for rank in (0, 1)]
    finally:
        for path in pid_files:  # never leave a rank behind when the test fails
            if path.exists() and path.read_text():
                try:
                    os.kill(int(path.read_text()), 9)
                except ProcessLookupError:
                    pass
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_process_that_already_ended_is_reaped_and_nothing_else_is_touched(tmp_path: Path) -> None:
    neighbour = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        process = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
        while process.poll() is None:
            time.sleep(0.05)
        assert process_tree.kill_tree(process) == []
        assert neighbour.poll() is None  # not its child: left alone
    finally:
        neighbour.kill()
        neighbour.wait()


def test_descendants_lists_grandchildren_in_other_sessions(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild.pid"
    code = ("import subprocess, sys, time, pathlib; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True); "
            f"pathlib.Path({str(marker)!r}).write_text(str(p.pid)); time.sleep(30)")
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        _wait_for([marker])
        grandchild = int(marker.read_text())
        assert grandchild in process_tree.descendants(process.pid)
        assert _state(grandchild) != "T"  # read only: left running
        assert grandchild in process_tree.descendants(process.pid, stop=True)
        deadline = time.monotonic() + 10  # a signal is delivered when the process is next scheduled
        while _state(grandchild) != "T":  # frozen as found: it can neither reap nor start a process now
            assert time.monotonic() < deadline, _state(grandchild)
            time.sleep(0.02)
        process_tree.kill_tree(process)
        deadline = time.monotonic() + 10
        while _alive(grandchild):
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if marker.exists():
            try:
                os.kill(int(marker.read_text()), 9)
            except ProcessLookupError:
                pass
