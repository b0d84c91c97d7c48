"""Tests of ``trainyard compare`` (cli/compare.py) on real training runs.

Six tiny_cpu runs (0.15M parameters, a fraction of a second a step) are trained once for the
module through the trainer's own entry point, so every final.json is what the trainer writes:
two of one config, one with another learning rate, a longer one, and one resumed from its own
checkpoint, and one that measures its validation loss. Older records and a skipped evaluation
are made by editing a copy of a real record, and say so where they do.

Run: .venv/bin/python -m pytest -q tests/test_compare.py
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import statistics
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from cli.compare import NOT_RECORDED, compare_runs, render_table, write_plot
from cli.main import EXIT_BAD_INPUT, EXIT_OK, main
from ops.publish import paths
from ops.clips.shard_ref import ShardIndexRef
from trainer.launch.redact import Redactor
from trainer.launch.stage_launch import StageLaunch
from trainer.train import main as train_main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BATCH_SIZE = 8  # the tiny_cpu preset's global batch


def _train(config: Path, run_dir: Path, *overrides: str) -> None:
    code = train_main(["--config", str(config), "--set", f"train.run_dir={run_dir}",
                       *(arg for override in overrides for arg in ("--set", override))])
    assert code == 0, f"training {run_dir.name} exited {code}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Run folders by name, trained in this process (one torch import for all of them)."""
    root = tmp_path_factory.mktemp("compare")
    config = root / "tiny.yaml"
    config.write_text("preset: tiny_cpu\n")
    folders = {name: root / name for name in ("base", "again", "low_lr", "long", "resumed", "evaluated")}
    with pytest.MonkeyPatch.context() as env:  # the per-test locations do not exist yet at module scope
        env.setenv("TRAINYARD_HOME", str(root / "home"))
        env.setenv("TRAINYARD_DATA_ROOT", str(root / "data"))
        env.delenv("TRAINYARD_CHECKPOINT_ROOT", raising=False)
        env.delenv("TRAINYARD_CONTAINER_DIGEST", raising=False)
        _train(config, folders["base"], "train.steps=6")
        _train(config, folders["again"], "train.steps=6")
        _train(config, folders["low_lr"], "train.steps=6", "optim.lr=0.0003")
        _train(config, folders["long"], "train.steps=45")
        _train(config, folders["evaluated"], "train.steps=6", "train.eval_every=3", "eval.samples=0")
        # Stops at step 4 with a checkpoint; the second process resumes it and runs steps 5 and 6.
        checkpointed = ("stage.checkpoint=true", "train.checkpoint_every=2")
        _train(config, folders["resumed"], "train.steps=4", *checkpointed)
        _train(config, folders["resumed"], "train.steps=6", *checkpointed)
    return folders


def _final(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "final.json").read_text())


def _edited_copy(source: Path, destination: Path, edit) -> Path:
    shutil.copytree(source, destination)
    record = _final(destination)
    edit(record)
    (destination / "final.json").write_text(json.dumps(record))
    return destination


def _cli(*argv: Any) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["compare", *(str(arg) for arg in argv)])
    return code, stdout.getvalue(), stderr.getvalue()


def _expected_code_differences(*run_dirs: Path) -> list[str]:
    """The lineage fields that truly differ (the other engineer's edits can change code_version between runs)."""
    lineages = [_final(run_dir)["lineage"] for run_dir in run_dirs]
    return [key for key in ("git_commit", "git_dirty", "code_version", "container_digest", "env_digest")
            if len({lineage[key] for lineage in lineages}) > 1]


def _table_line(table: str, key: int) -> list[list[str]]:
    """The cells of each run's column group on the row for ``key``."""
    for line in table.splitlines():
        head, _, rest = line.partition(" | ")
        if head.strip() == str(key):
            return [group.split() for group in rest.split(" | ")]
    raise AssertionError(f"no row {key} in\n{table}")


# ---------------------------------------------------------------------------------------------
# Differences


def test_the_learning_rate_is_the_one_config_difference(runs) -> None:
    comparison = compare_runs([runs["base"], runs["low_lr"]])
    assert [(d.key, d.values) for d in comparison.differences_in("config")] == [("optim.lr", (0.001, 0.0003))]
    assert comparison.differences_in("data") == []
    code = _expected_code_differences(runs["base"], runs["low_lr"])
    assert [d.key for d in comparison.differences_in("code")] == code
    table = render_table(comparison)
    assert "  config: optim.lr: 0.001 | 0.0003\n" in table
    assert "  data: none\n" in table
    assert ("  code: none" in table) == (not code)


def test_identical_configs_have_no_config_difference(runs) -> None:
    base, again = _final(runs["base"]), _final(runs["again"])
    assert base["config"]["train"]["run_dir"] != again["config"]["train"]["run_dir"]  # per-run noise, left out
    comparison = compare_runs([runs["base"], runs["again"]])
    assert comparison.differences_in("config") == []
    assert "  config: none\n" in render_table(comparison)
    assert [row.cells[0].train_loss for row in comparison.rows] == base["losses"] == again["losses"]


def test_a_stage_launch_names_the_shard_index_versions_that_differ(runs, tmp_path: Path) -> None:
    folders = []
    for name, version in (("first", "index-v1"), ("second", "index-v2")):
        folder = shutil.copytree(runs["base"], tmp_path / name)
        data = ShardIndexRef(path="/shards", version=version, manifest_version="manifest-v1")
        launch = StageLaunch(stage="pretrain", config_path="/configs/test_tiny.yaml", data=data, steps=6, world_size=1)
        launch.named(run_dir=folder, dagster_run_id=f"dagster-{name}", retry_of=None).write(
            folder / "launch.json", redactor=Redactor.for_config(None))
        folders.append(folder)
    comparison = compare_runs(folders)
    assert [(d.key, d.values) for d in comparison.differences_in("data")] == [
        ("shard_index.version", ("index-v1", "index-v2"))]
    assert comparison.differences_in("config") == []
    # A run launched by hand has no launch.json: its version is unknown, not different.
    assert compare_runs([folders[0], runs["base"]]).differences_in("data") == []


# ---------------------------------------------------------------------------------------------
# Aligned rows and the table


def test_rows_hold_each_runs_own_values_at_matching_steps(runs) -> None:
    comparison = compare_runs([runs["base"], runs["low_lr"]])
    finals = [_final(runs["base"]), _final(runs["low_lr"])]
    assert [row.key for row in comparison.rows] == list(range(1, 7))
    table = render_table(comparison)
    for row in comparison.rows:
        groups = _table_line(table, row.key)
        for cell, group, final in zip(row.cells, groups, finals, strict=True):
            step, samples, _, samples_per_s = final["step_log"][row.key - 1]
            assert (cell.step, cell.train_loss, cell.grad_norm) == (row.key, final["losses"][row.key - 1],
                                                                    final["grad_norms"][row.key - 1])
            assert (step, cell.samples, cell.samples_estimated, cell.samples_per_s) == (row.key, samples, False,
                                                                                       samples_per_s)
            # samples, train loss, grad norm, samples/s: no val loss was evaluated, so that cell is blank
            assert group == [str(samples), f"{cell.train_loss:.6f}", f"{cell.grad_norm:.4f}", f"{samples_per_s:.1f}"]
    assert finals[0]["losses"] != finals[1]["losses"]  # else matching columns would prove nothing


def test_runs_of_different_length_leave_blank_cells_and_long_tables_are_thinned(runs) -> None:
    comparison = compare_runs([runs["base"], runs["long"]])
    assert [d.key for d in comparison.differences_in("config")] == ["train.steps"]
    assert len(comparison.rows) == 45
    assert all(row.cells[0] is None for row in comparison.rows[6:])
    long_losses = _final(runs["long"])["losses"]
    assert [row.cells[1].train_loss for row in comparison.rows] == long_losses
    table = render_table(comparison)
    assert table.startswith("aligned by step: 40 of 45 rows (evenly spaced, and the last)")
    shown = [line.partition(" | ")[0].strip() for line in table.splitlines() if re.match(r" *\d+ \| ", line)]
    assert shown[0] == "1" and shown[-1] == "45" and len(shown) == 40
    first, second = _table_line(table, 45)
    assert first == [] and second[1] == f"{long_losses[44]:.6f}"


def test_a_resumed_run_estimates_the_samples_before_its_resume(runs) -> None:
    resumed = _final(runs["resumed"])
    assert [entry[0] for entry in resumed["step_log"]] == [5, 6]  # the second process ran only these
    comparison = compare_runs([runs["base"], runs["resumed"]], align="samples")
    points = comparison.points[1]
    assert [(p.samples, p.samples_estimated) for p in points[:4]] == [(step * BATCH_SIZE, True) for step in range(1, 5)]
    assert [(p.samples, p.samples_estimated) for p in points[4:]] == [(entry[1], False) for entry in resumed["step_log"]]
    # Aligned on samples the resumed run's steps meet the base run's at the same counts.
    assert [(row.key, row.cells[0].step, row.cells[1].step) for row in comparison.rows] == [
        (step * BATCH_SIZE, step, step) for step in range(1, 7)]
    table = render_table(comparison)
    assert _table_line(table, 8)[1][0] == "~1" and _table_line(table, 40)[1][0] == "5"
    assert any("steps 1-4 are not in the step log" in note for note in comparison.runs[1].notes)
    assert comparison.runs[1].median_samples_per_s == statistics.median(entry[3] for entry in resumed["step_log"])


def test_a_record_from_before_step_log_lineage_and_evaluations_still_compares(runs, tmp_path: Path) -> None:
    def as_older_trainer_wrote_it(record: dict) -> None:
        for field in ("lineage", "step_log", "evaluations"):
            del record[field]

    older = _edited_copy(runs["base"], tmp_path / "older", as_older_trainer_wrote_it)
    comparison = compare_runs([older, runs["low_lr"]])
    assert [d.key for d in comparison.differences_in("config")] == ["optim.lr"]
    assert comparison.differences_in("code") == []
    assert comparison.not_recorded == {"code": ("older",)}
    points = comparison.points[0]
    assert [(p.samples, p.samples_estimated, p.samples_per_s) for p in points] == [
        (step * BATCH_SIZE, True, None) for step in range(1, 7)]
    summary = comparison.runs[0]
    assert summary.median_samples_per_s == _final(runs["base"])["performance"]["samples_per_s"]
    notes = " / ".join(summary.notes)
    assert "no step_log" in notes and "no lineage" in notes and "no evaluations" in notes
    table = render_table(comparison)
    assert "  code: not recorded for older" in table
    assert _table_line(table, 1)[0][0] == f"~{BATCH_SIZE}"


def test_val_loss_comes_from_the_ok_evaluations(runs, tmp_path: Path) -> None:
    measured = [(item["step"], item["loss"]) for item in _final(runs["evaluated"])["evaluations"]]
    assert [step for step, _ in measured] == [3, 6]
    comparison = compare_runs([runs["evaluated"], runs["base"]])
    assert [(row.key, row.cells[0].val_loss) for row in comparison.rows if row.cells[0].val_loss is not None] == measured
    assert all(row.cells[1].val_loss is None for row in comparison.rows)
    summary = comparison.runs[0]
    assert (summary.last_val_loss, summary.last_val_step) == (measured[-1][1], 6)
    assert _table_line(render_table(comparison), 3)[0][2] == f"{measured[0][1]:.6f}"
    # Evaluation never changes training: the same config without it trained the same losses.
    assert [row.cells[0].train_loss for row in comparison.rows] == [row.cells[1].train_loss for row in comparison.rows]

    # A skipped evaluation (an empty split: made by editing a copy of the real record) gives no val loss, and a note.
    def skipped_at_six(record: dict) -> None:
        record["evaluations"][-1] = {"step": 6, "split": "val", "status": "skipped",
                                     "reason": "no val split in the shard index"}

    edited = compare_runs([_edited_copy(runs["evaluated"], tmp_path / "skipped", skipped_at_six), runs["base"]])
    assert (edited.runs[0].last_val_loss, edited.runs[0].last_val_step) == (measured[0][1], 3)
    assert any("skipped (step 6: no val split" in note for note in edited.runs[0].notes)


# ---------------------------------------------------------------------------------------------
# The plot


def test_the_plot_is_a_png_with_the_runs_drawn(runs, tmp_path: Path) -> None:
    comparison = compare_runs([runs["base"], runs["low_lr"], runs["long"]])
    path = write_plot(comparison, tmp_path / "curves.png")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 1000 and image.height >= 300
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # axes, text and three coloured curves, not a blank canvas
    with pytest.raises(ValueError, match="name it"):
        write_plot(comparison, tmp_path / "curves.pdf")


# ---------------------------------------------------------------------------------------------
# The command line


def test_the_command_prints_the_table_and_writes_the_plot(runs, tmp_path: Path) -> None:
    png = tmp_path / "out" / "compare.png"
    code, stdout, stderr = _cli(runs["base"], runs["low_lr"], "--out", png)
    assert (code, stderr) == (EXIT_OK, "")
    assert "  config: optim.lr: 0.001 | 0.0003\n" in stdout and stdout.rstrip().endswith(f"plot: {png}")
    assert png.read_bytes()[:8] == PNG_SIGNATURE


def test_the_json_output_is_one_parseable_object(runs, tmp_path: Path) -> None:
    png = tmp_path / "compare.png"
    code, stdout, _ = _cli(runs["base"], runs["long"], "--json", "--align", "samples", "--out", png)
    assert code == EXIT_OK
    report = json.loads(stdout)
    assert report["png"] == str(png) and png.is_file()
    assert report["align"] == "samples" and len(report["rows"]) == 45
    assert report["differences"]["config"] == [{"key": "train.steps", "values": [6, 45]}]
    assert report["rows"][-1]["cells"][0] is None
    assert report["rows"][0]["cells"][0]["train_loss"] == _final(runs["base"])["losses"][0]
    assert [run["label"] for run in report["runs"]] == ["base", "long"]


def test_a_run_id_is_looked_up_under_the_data_root(runs) -> None:
    shutil.copytree(runs["low_lr"], paths.data_root() / "runs" / "pretrain-0123abcd")
    comparison = compare_runs([runs["base"], "pretrain-0123abcd"])
    assert comparison.runs[1].run_dir == str((paths.data_root() / "runs" / "pretrain-0123abcd").resolve())
    assert [d.key for d in comparison.differences_in("config")] == ["optim.lr"]


@pytest.mark.parametrize("missing", ["half-done", "no-such-run"])
def test_a_run_without_final_json_exits_2_naming_it(runs, tmp_path: Path, missing: str) -> None:
    if missing == "half-done":
        (tmp_path / missing).mkdir()  # a folder the trainer has not finished
        target = tmp_path / missing
    else:
        target = missing  # neither a folder nor a run id under the data root
    code, stdout, stderr = _cli(runs["base"], target, "--out", tmp_path / "x.png")
    assert code == EXIT_BAD_INPUT and stdout == ""
    assert stderr.startswith("trainyard: error: run ") and missing in stderr and "Traceback" not in stderr
    assert not (tmp_path / "x.png").exists()


def test_a_record_this_code_cannot_read_exits_2_naming_it(runs, tmp_path: Path) -> None:
    broken = _edited_copy(runs["base"], tmp_path / "broken", lambda record: record.update(step_log=[[1]]))
    code, _, stderr = _cli(runs["base"], broken, "--out", tmp_path / "x.png")
    assert code == EXIT_BAD_INPUT and f"{broken / 'final.json'}: not a run record" in stderr


def test_one_run_is_not_a_comparison(runs, tmp_path: Path) -> None:
    code, _, stderr = _cli(runs["base"], "--out", tmp_path / "x.png")
    assert code == EXIT_BAD_INPUT and "at least two runs" in stderr


def test_a_value_only_one_record_holds_is_shown_as_not_recorded(runs, tmp_path: Path) -> None:
    # A config key added to the schema after the older run was recorded.
    older = _edited_copy(runs["base"], tmp_path / "older", lambda record: record["config"]["optim"].pop("eps"))
    comparison = compare_runs([older, runs["base"]])
    assert [(d.key, d.values) for d in comparison.differences_in("config")] == [("optim.eps", (NOT_RECORDED, 1e-08))]


# Hostile final.json (issue 32, item 9): (where the raw JSON goes, the raw JSON). Every one must end
# with exit 2 naming the file, never a traceback, and write no plot.
_DEEP = 100_000
HOSTILE_RECORDS = {
    "nested_past_the_parser": ("losses", "[" * _DEEP + "]" * _DEEP),
    "config_nested_to_the_recursion_limit": ("config", '{"a": ' * 990 + "1" + "}" * 990),
    "loss_1e999": ("loss0", "1e999"),
    "loss_nan": ("loss0", "NaN"),
    "loss_infinity": ("loss0", "-Infinity"),
    "grad_norm_out_of_range": ("grad_norms", "[1e400]"),
    "losses_as_dicts": ("losses", '[{"value": 0.5}, {"value": 0.4}]'),
    "losses_as_an_object": ("losses", '{"1": 0.5}'),
    "loss_a_string": ("loss0", '"0.5"'),
    "loss_a_bool": ("loss0", "true"),
    "step_log_strings": ("step_log", '[[1, "8", 0.1, 80.0]]'),
    "step_log_rate_a_list": ("step_log", "[[1, 8, 0.1, [80.0]]]"),
    "final_step_a_string": ("final_step", '"6"'),
    "evaluation_loss_a_string": ("evaluations", '[{"step": 3, "status": "ok", "split": "val", "loss": "low"}]'),
    "evaluation_a_number": ("evaluations", "[3]"),
    "throughput_a_string": ("performance", '{"samples_per_s": "fast"}'),
    "batch_size_a_float": ("batch", "8.5"),
    "config_a_list": ("config", "[1, 2]"),
    "integer_too_long": ("final_step", "9" * 5000),
}


def _hostile_final(good: Path, destination: Path, where: str, raw: str) -> Path:
    """A copy of a real run whose final.json holds ``raw`` (JSON text, not always valid) at ``where``."""
    shutil.copytree(good, destination)
    record = _final(destination)
    if where == "loss0":
        record["losses"][0] = "__HOSTILE__"
    elif where == "batch":
        record["config"]["data"]["batch_size"] = "__HOSTILE__"
    else:
        record[where] = "__HOSTILE__"
    (destination / "final.json").write_text(json.dumps(record).replace('"__HOSTILE__"', raw))
    return destination


@pytest.mark.parametrize("case", sorted(HOSTILE_RECORDS))
def test_a_hostile_final_json_exits_2_naming_the_file(runs, tmp_path: Path, case: str) -> None:
    hostile = _hostile_final(runs["base"], tmp_path / "hostile", *HOSTILE_RECORDS[case])
    png = tmp_path / "x.png"
    for argv in ((runs["base"], hostile), (hostile, runs["base"], "--json", "--align", "samples")):
        code, stdout, stderr = _cli(*argv, "--out", png)
        assert (code, stdout) == (EXIT_BAD_INPUT, "")
        assert stderr.startswith(f"trainyard: error: {hostile / 'final.json'}: ") and "Traceback" not in stderr
        assert len(stderr) < 2000  # one readable line, not the file echoed back
    assert not png.exists()
