"""Tests of the ``trainyard`` command line: exit codes, reports, JSON output, errors."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import DEMO_MAX_QUARANTINE_FRACTION, copy_media

from cli.main import EXIT_BAD_INPUT, EXIT_CHECK_FAILED, EXIT_OK, main

GATES = ("accepted_rows_conform", "no_duplicate_assets", "no_split_leakage", "quarantine_rate",
         "train_split_nonempty", "objects_unchanged")
RELAXED = ["--max-quarantine-fraction", str(DEMO_MAX_QUARANTINE_FRACTION)]


def _run(argv: list[str]) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main([str(arg) for arg in argv])
    return code, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def built(demo, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """`trainyard manifest build` on the demo media: (version folder, stdout)."""
    out = tmp_path_factory.mktemp("cli") / "manifests"
    code, stdout, stderr = _run(["manifest", "build", demo.out_dir, "--out", out])
    assert code == EXIT_OK
    # stderr holds progress only (ops.progress: a line at the end of each task when it is not a terminal)
    assert [line.split(":")[0] for line in stderr.splitlines()] == ["scanning", "probing"], stderr
    (version_dir,) = out.iterdir()
    return version_dir, stdout


def _expected_reasons(demo) -> Counter:
    return Counter([*demo.bad.values(), "split_leakage"])


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "trainyard"
    completed = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    assert "demo-media" in completed.stdout and "manifest" in completed.stdout


def test_build_prints_the_version_it_published(built) -> None:
    version_dir, stdout = built
    assert stdout.startswith(f"manifest {version_dir.name}: 28 rows -> {version_dir}")
    assert (version_dir / "manifest.parquet").is_file()
    assert "flagged at ingest: empty_file" in stdout


def test_validate_reports_every_reason_and_passes(demo, built) -> None:
    version_dir, _ = built
    code, stdout, _ = _run(["manifest", "validate", version_dir, *RELAXED])
    assert code == EXIT_OK, stdout
    for reason, count in _expected_reasons(demo).items():
        assert f"    {reason:<24} {count}\n" in stdout, reason
    for gate in GATES:
        assert f"[PASS] {gate}:" in stdout


def test_validate_exits_1_and_names_the_failing_check(built) -> None:
    version_dir, _ = built
    code, stdout, _ = _run(["manifest", "validate", version_dir, "--max-quarantine-fraction", "0.0"])
    assert code == EXIT_CHECK_FAILED
    assert "[FAIL] quarantine_rate:" in stdout
    assert [gate for gate in GATES if f"[FAIL] {gate}:" in stdout] == ["quarantine_rate"]


def test_validate_json_is_one_parseable_object(demo, built) -> None:
    version_dir, _ = built
    code, stdout, _ = _run(["manifest", "validate", version_dir, "--json", "--verify", "off", *RELAXED])
    assert code == EXIT_OK
    report = json.loads(stdout)
    assert report["manifest_version"] == version_dir.name
    assert Counter(report["reason_counts"]) == _expected_reasons(demo)
    assert {row["uri"] for row in report["quarantine"]} >= set(demo.bad)
    # --verify off: the object recheck is not a gate.
    assert {gate["name"]: gate["passed"] for gate in report["gates"]} == dict.fromkeys(GATES[:-1], True)


def test_validate_notices_a_vanished_object(demo, tmp_path: Path) -> None:
    media = copy_media(demo.out_dir, tmp_path / "media")
    assert _run(["manifest", "build", media, "--out", tmp_path / "out"])[0] == EXIT_OK
    (version_dir,) = (tmp_path / "out").iterdir()
    (media / demo.good[0]).unlink()
    code, stdout, _ = _run(["manifest", "validate", version_dir, "--json", *RELAXED])
    report = json.loads(stdout)
    assert {row["uri"]: row["reason"] for row in report["quarantine"]}[demo.good[0]] == "missing_object"
    assert code == EXIT_OK  # the recheck quarantined it, so accepted objects are all present


@pytest.mark.parametrize("argv", [
    ["manifest", "validate", "{tmp}/no_such_manifest"],
    ["manifest", "build", "{tmp}/no_such_media", "--out", "{tmp}/out"],
    ["manifest", "build", "{tmp}", "--out", "{tmp}/out", "--workers", "0"],
    ["manifest", "validate", "{manifest}", "--max-quarantine-fraction", "1.5"],
])
def test_bad_input_exits_2_with_one_line(built, argv: list[str], tmp_path: Path) -> None:
    code, stdout, stderr = _run([arg.format(tmp=tmp_path, manifest=built[0]) for arg in argv])
    assert code == EXIT_BAD_INPUT
    assert stderr.startswith("trainyard: error: ") and stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr and stdout == ""


def test_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as raised, contextlib.redirect_stderr(io.StringIO()):
        main(["manifest", "frobnicate"])
    assert raised.value.code == 2


def test_demo_media_writes_files_and_refuses_a_non_empty_dir(tmp_path: Path) -> None:
    target = tmp_path / "demo"
    code, stdout, _ = _run(["demo-media", target, "--num-good", "4"])
    assert code == EXIT_OK
    assert stdout.startswith("wrote 4 good clips and ")
    assert (target / "PROVENANCE.md").is_file()
    assert len(list((target / "clips").glob("clip_*"))) == 8  # 4 clips, 4 sidecars
    before = sorted(path.name for path in (target / "clips").iterdir())

    code, stdout, stderr = _run(["demo-media", target, "--num-good", "4"])
    assert code == EXIT_BAD_INPUT
    assert "not empty" in stderr and stderr.count("\n") == 1
    assert sorted(path.name for path in (target / "clips").iterdir()) == before
