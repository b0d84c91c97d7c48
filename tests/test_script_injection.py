"""No value reaches a generated sbatch script unchecked (issue 32, item 6).

A newline in the run folder, the partition or ``mem`` would end its ``#SBATCH`` line and start
one of its own: a second option (``--wrap``) or a shell command the job runs. Every field that
reaches the script is tried here with a table of hostile values; each is refused by name
(``SbatchSettingError``, a ``ValueError``) before a line is written. Pure rendering: no SLURM runs.

Run: python -m pytest tests/test_script_injection.py -q
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ops.clips.shard_ref import ShardIndexRef
from resources.sbatch_script import SbatchSettingError, check_extra_options, check_script
from resources.slurm import SlurmLauncher, seconds
from trainer.launch.stage_launch import StageLaunch

# Each ends a line, hides one, or means something to the shell or to sbatch.
HOSTILE = {
    "newline": "x\n#SBATCH --wrap=id", "cr": "x\r#SBATCH --wrap=id", "nul": "x\x00y", "semicolon": "x;id",
    "command-substitution": "x$(id)", "backticks": "x`id`", "line-separator": "x\u2028#SBATCH --wrap=id",
    "next-line": "x\x85#SBATCH --wrap=id", "paragraph-separator": "x\u2029id", "vertical-tab": "x\x0bid",
    "blank": "x --wrap=id", "quote": "x'id'", "trailing-newline": "x\n",
}
# mem's own attack: a valid size, then a second #SBATCH line.
MEM_SMUGGLE = "1G\n#SBATCH --wrap=id"


def _launch(tmp_path: Path, **fields) -> StageLaunch:
    return StageLaunch(**{"stage": "pretrain", "config_path": str(tmp_path / "exp.yaml"),
                          "data": ShardIndexRef(path=str(tmp_path / "shards"), version="v1", manifest_version="m1"),
                          "steps": 2, "world_size": 2, "run_dir": str(tmp_path / "runs" / "pretrain-abc"), **fields})


def _hostile(base: str, attack: str) -> str:
    """The attack inside a value that would otherwise be valid for its setting."""
    return base + attack.removeprefix("x")


# setting -> (how the launcher or launch gets the value, a valid value the attack is appended to)
LAUNCHER_FIELDS = {"partition": "debug", "account": "ml", "mem": "16G", "time_limit": "00:30:00",
                   "warning_signal": "USR1@120", "python": "/usr/bin/python3"}
LAUNCH_FIELDS = {"stage": "pretrain", "run_dir": "/data/runs/pretrain-abc", "config_path": "/repo/configs/demo.yaml"}


def test_an_ordinary_launch_renders_and_every_sbatch_line_is_one_the_launcher_set(tmp_path: Path) -> None:
    launcher = SlurmLauncher(partition="gpu,debug", account="ml-team", mem="16G", time_limit="2-00:00:00",
                             gpus_per_node=8, extra_sbatch=["--exclusive", "--qos=high"])
    script = launcher.render(_launch(tmp_path), overrides_file=tmp_path / "runs" / "o.json")
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --mem=16G" in header and "#SBATCH --partition=gpu,debug" in header
    assert header[-2:] == ["#SBATCH --exclusive", "#SBATCH --qos=high"] and len(header) == 16
    assert script.count("\n") == len(script.splitlines())


@pytest.mark.parametrize("attack", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("setting", LAUNCHER_FIELDS)
def test_a_hostile_launcher_setting_is_refused_naming_it(tmp_path: Path, setting: str, attack: str) -> None:
    launcher = SlurmLauncher(**{setting: _hostile(LAUNCHER_FIELDS[setting], attack)})
    with pytest.raises(SbatchSettingError) as refused:
        launcher.render(_launch(tmp_path))
    assert refused.value.setting == f"SlurmLauncher.{setting}"


@pytest.mark.parametrize("attack", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("setting", LAUNCH_FIELDS)
def test_a_hostile_run_folder_stage_or_config_path_is_refused_naming_it(tmp_path: Path, setting: str,
                                                                         attack: str) -> None:
    """Refused by the launch itself (a line end or control character: StageLaunch names the field),
    else by the renderer's grammar (naming the setting); either way before a line is written."""
    value = _hostile(LAUNCH_FIELDS[setting], attack)
    if any(ord(char) < 0x20 or char in "\x85\u2028\u2029" for char in value):
        with pytest.raises(ValueError, match=rf"StageLaunch\.{setting} must be text without control characters"):
            _launch(tmp_path, **{setting: value})
        return
    with pytest.raises(SbatchSettingError) as refused:
        SlurmLauncher().render(_launch(tmp_path, **{setting: value}))
    assert {"stage": "stage.stage", "run_dir": "train.run_dir", "config_path": "config path"}[setting] \
        in refused.value.setting


@pytest.mark.parametrize("attack", HOSTILE.values(), ids=HOSTILE.keys())
@pytest.mark.parametrize("argument", ["overrides_file", "log_path"])
def test_a_hostile_overrides_file_or_log_path_is_refused(tmp_path: Path, argument: str, attack: str) -> None:
    with pytest.raises(SbatchSettingError):
        SlurmLauncher().render(_launch(tmp_path), **{argument: Path(_hostile("/data/runs/a/launch/f", attack))})


@pytest.mark.parametrize("attack", [*HOSTILE.values(), "--wrap=id", "--output=/tmp/elsewhere", "-J x",
                                    "--comment=a b", "--qos=high;id", "#SBATCH --wrap=id"])
def test_a_hostile_extra_sbatch_option_is_refused(tmp_path: Path, attack: str) -> None:
    with pytest.raises(SbatchSettingError) as refused:
        SlurmLauncher(extra_sbatch=["--exclusive", attack]).render(_launch(tmp_path))
    assert refused.value.setting == "SlurmLauncher.extra_sbatch"


def test_mem_cannot_smuggle_another_sbatch_option(tmp_path: Path) -> None:
    launcher = SlurmLauncher(mem=MEM_SMUGGLE)
    with pytest.raises(SbatchSettingError, match=r"SlurmLauncher\.mem: '1G\\n#SBATCH"):
        launcher.render(_launch(tmp_path))
    with pytest.raises(ValueError):
        launcher.check(_launch(tmp_path))  # refused before any scontrol call: no cluster needed here


@pytest.mark.parametrize("limit", ["00:30:00\n", "00:30:00\n#SBATCH --wrap=id", "\u0661:00:00", "30 "])
def test_a_time_limit_is_read_whole_and_in_ascii_digits(limit: str) -> None:
    """``$`` also matches before a trailing newline, and ``\\d`` takes other scripts' digits."""
    with pytest.raises(ValueError, match="not a SLURM time limit"):
        seconds(limit)


def test_every_value_of_the_launch_is_checked_not_only_the_ones_named_here(tmp_path: Path) -> None:
    """The whole class: every string field of StageLaunch that the script holds is checked; a new
    field that reaches the script needs a grammar (this test lists the ones that do not)."""
    script = SlurmLauncher().render(_launch(tmp_path))
    reaching = {field.name for field in dataclasses.fields(StageLaunch)
                if isinstance(getattr(_launch(tmp_path), field.name), str) and getattr(_launch(tmp_path), field.name)
                and getattr(_launch(tmp_path), field.name) in script}
    assert reaching <= set(LAUNCH_FIELDS), reaching - set(LAUNCH_FIELDS)


# ---------------------------------------------------------------------------------------------
# The guard on the whole script: a value a future renderer forgets to check still adds no line


@pytest.mark.parametrize("line", ["#SBATCH --mem=1G\n#SBATCH --wrap=id", "echo ok\rid", "echo \u2028id",
                                  "echo \x85id", "echo \x00", "echo \x1eid"])
def test_the_guard_refuses_a_line_that_holds_a_line_end(line: str) -> None:
    lines = ["#!/bin/bash", line, ""]
    with pytest.raises(SbatchSettingError, match="the sbatch script"):
        check_script("\n".join(lines), lines=lines, header=[])


def test_the_guard_refuses_an_sbatch_line_the_renderer_did_not_emit() -> None:
    lines = ["#!/bin/bash", "#SBATCH --nodes=1", "#SBATCH --wrap=id", ""]
    with pytest.raises(SbatchSettingError, match="not the ones rendered"):
        check_script("\n".join(lines), lines=lines, header=["--nodes=1"])
    assert check_script("\n".join(lines), lines=lines, header=["--nodes=1", "--wrap=id"])


@pytest.mark.parametrize(("limit", "expected_s"), [("30", 1800), ("30:15", 1815), ("1:00:00", 3600),
                                                   ("1-5", 104400), ("1-02:30", 95400), ("UNLIMITED", None)])
def test_a_time_limit_reads_as_slurm_reads_it(limit: str, expected_s: int | None) -> None:
    """A bare number is minutes, MM:SS, D-HH and D-HH:MM (sbatch --time)."""
    assert seconds(limit) == expected_s


@pytest.mark.parametrize("option", ["--time=1", "--output=/tmp/x", "-o", "--wrap=id", "--chdir=/", "--export=ALL"])
def test_extra_options_the_launcher_sets_itself_are_refused(option: str) -> None:
    with pytest.raises(SbatchSettingError, match=f"{option.split('=')[0]} is set by SlurmLauncher itself"):
        check_extra_options("SlurmLauncher.extra_sbatch", [option])
    assert check_extra_options("x", ["--exclusive", "--qos=high", "--constraint=[a100|h100]&nvlink"]) == [
        "--exclusive", "--qos=high", "--constraint=[a100|h100]&nvlink"]
