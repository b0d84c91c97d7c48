"""A sweep's trials as one SLURM array job (resources/sweep_array.py), rendered without a cluster: the array's
%N is the sweep's concurrency, the task trains where it runs, and a setting that would change the script's
meaning (a newline, a shell metacharacter) is refused before sbatch sees it. tests/test_slurm.py runs one."""

from __future__ import annotations

from pathlib import Path

import pytest

from resources.sbatch_script import SbatchSettingError
from resources.slurm import SlurmLauncher
from resources.sweep_array import render


def _render(tmp_path: Path, **changes) -> str:
    fields = {"name": "demo_lr", "numbers": [0, 2, 5], "concurrency": 2, "cpus": 1, "log_dir": tmp_path,
              "task_env": "local"} | changes
    launcher = changes.pop("launcher", None) or SlurmLauncher(time_limit="00:20:00", partition="debug")
    fields.pop("launcher", None)
    return render(launcher, **fields)


def test_the_trials_are_one_array_of_their_numbers_at_most_concurrency_at_once(tmp_path: Path) -> None:
    script = _render(tmp_path)
    assert "#SBATCH --array=0,2,5%2" in script
    assert "#SBATCH --cpus-per-task=1" in script and "#SBATCH --time=00:20:00" in script
    assert "#SBATCH --partition=debug" in script and "#SBATCH --no-requeue" in script
    assert "export TRAINYARD_ENV=local" in script  # the ranks start inside the task's allocation
    assert script.rstrip().endswith("-m pipelines.sweeps slurm-trial demo_lr")
    assert "demo_lr-trial-%a-job-%A.log" in script


@pytest.mark.parametrize("changes, needle", [
    ({"name": "demo\nrm -rf /"}, "sweep's name"),
    ({"name": "demo;reboot"}, "sweep's name"),
    ({"task_env": "local\nexport X=1"}, "TRAINYARD_ENV"),
    ({"launcher": SlurmLauncher(time_limit="00:20:00\n#SBATCH --uid=0")}, "time_limit"),
    ({"launcher": SlurmLauncher(partition="debug$(id)")}, "partition"),
])
def test_a_setting_that_would_change_the_script_is_refused_naming_it(tmp_path: Path, changes, needle) -> None:
    with pytest.raises(SbatchSettingError, match=needle):
        _render(tmp_path, **changes)


@pytest.mark.parametrize("changes", [{"numbers": []}, {"numbers": [-1]}, {"concurrency": 0}, {"cpus": 0}])
def test_an_empty_or_unbounded_array_is_refused(tmp_path: Path, changes) -> None:
    with pytest.raises(ValueError):
        _render(tmp_path, **changes)
