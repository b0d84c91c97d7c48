"""`make install` reinstalls torch when the torch choice changes, and the choice sticks.

The recipe runs for real against a venv whose `python` records its arguments instead of running
pip: no wheel index is reachable here, and what is under test is the Makefile's decisions.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ops.publish.paths import REPO_ROOT

CUDA_INDEX = "https://download.pytorch.org/whl/cu128"


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {tmp_path / "calls.log"}\n')
    python.chmod(0o755)
    return tmp_path / "venv"


def install(venv: Path, *assignments: str) -> list[str]:
    """Run `make install` with the given variables; the pip calls it made."""
    log = venv.parent / "calls.log"
    log.unlink(missing_ok=True)
    subprocess.run(["make", "-s", "-C", str(REPO_ROOT), "install", f"VENV={venv}", *assignments],
                   check=True, capture_output=True, text=True, timeout=60)
    return log.read_text().splitlines() if log.exists() else []


def torch_calls(calls: list[str]) -> list[str]:
    return [call for call in calls if "torch" in call and "constraints" not in call]


def test_a_new_index_replaces_the_installed_torch_and_the_choice_sticks(venv: Path) -> None:
    first = install(venv)
    assert torch_calls(first) == ["-m pip uninstall --quiet --yes torch", "-m pip install --quiet torch==2.13.0"]
    assert install(venv) == []  # up to date: nothing runs

    cuda = install(venv, f"TORCH_INDEX={CUDA_INDEX}")
    # Uninstalled first: pip would take the installed 2.13.0+cpu as torch==2.13.0 from the CUDA index.
    assert torch_calls(cuda) == ["-m pip uninstall --quiet --yes torch",
                                 f"-m pip install --quiet torch==2.13.0 --index-url {CUDA_INDEX}"]
    assert (venv / "torch-source").read_text() == f"torch==2.13.0\n{CUDA_INDEX}\n"
    assert install(venv) == []  # a later `make test` keeps the CUDA build

    back = install(venv, "TORCH_INDEX=")
    assert torch_calls(back) == ["-m pip uninstall --quiet --yes torch", "-m pip install --quiet torch==2.13.0"]
    assert install(venv) == []


def test_a_venv_from_before_the_record_is_reinstalled_once(venv: Path) -> None:
    (venv / "bin" / ".installed").touch()  # the stamp an older Makefile left: no torch-source record
    assert "-m pip uninstall --quiet --yes torch" in install(venv, f"TORCH_INDEX={CUDA_INDEX}")
    assert not (venv / "bin" / ".installed").exists()
