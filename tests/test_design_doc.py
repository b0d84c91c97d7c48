"""docs/design.md cannot drift from the code: what the Definitions hold, and where a newcomer starts.

The layer table is held by tests/test_layering.py (test_design_doc_states_the_rules_this_test_enforces).
This file holds the rest of the map:

- every asset, asset check, job, schedule and sensor of the Definitions is named in design.md, in
  backticks, so a new one cannot ship unmapped;
- the "Where to start" answers each name one file and a name defined in it, and both exist;
- the map's folder table names every subpackage of ``ops/`` and ``trainer/``, and no folder that is gone.

Run: .venv/bin/python -m pytest -q tests/test_design_doc.py
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
DESIGN = REPO_ROOT / "docs" / "design.md"

# Dagster's implicit job for materializing assets outside a named job; no one declares it.
IMPLICIT_JOBS = frozenset({"__ASSET_JOB"})


def _named(text: str) -> set[str]:
    """Every `backticked` word of the doc (an asset key such as `evaluation/pretrain` counts as one)."""
    return set(re.findall(r"`([^`\s]+)`", text))


def _definitions_names() -> dict[str, set[str]]:
    from pipelines.definitions import defs

    repository = defs.get_repository_def()
    assets = {key.to_user_string() for asset in repository.assets_defs_by_key.values() for key in asset.keys}
    checks = {spec.name for asset in repository.asset_checks_defs_by_key.values() for spec in asset.check_specs}
    checks |= {spec.name for asset in repository.assets_defs_by_key.values() for spec in asset.check_specs}
    return {
        "asset": assets,
        "asset check": checks,
        "job": {job.name for job in repository.get_all_jobs()} - IMPLICIT_JOBS,
        "schedule": {schedule.name for schedule in repository.schedule_defs},
        "sensor": {sensor.name for sensor in repository.sensor_defs},
    }


def test_every_definition_is_named_in_the_design_doc() -> None:
    named = _named(DESIGN.read_text())
    missing = [f"{kind} {name}" for kind, names in _definitions_names().items() for name in sorted(names - named)]
    assert not missing, "docs/design.md does not name these (add them, in backticks): " + ", ".join(missing)


def test_the_drift_check_sees_a_definition_the_doc_leaves_out() -> None:
    # The check above must be able to fail: a doc without one asset's name is caught.
    names = _definitions_names()
    assert {"pretrain", "validated_manifest"} <= names["asset"] and names["job"] and names["schedule"]
    text = DESIGN.read_text().replace("`pretrain`", "pretrain")
    assert "pretrain" not in _named(text)


# --- where a newcomer starts -----------------------------------------------------------------------

_ANSWER = re.compile(r"^- (?P<question>[^?\n]+\?) `(?P<path>[\w/]+\.py)`, `(?P<name>\w+)`", re.M)


def _where_to_start(text: str) -> list[re.Match[str]]:
    section = text.split("## Where to start", 1)
    assert len(section) == 2, "docs/design.md has no '## Where to start' section"
    return list(_ANSWER.finditer(section[1].split("\n## ", 1)[0]))


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef) and node.name == name
               for node in tree.body)


def test_each_newcomer_question_leads_to_one_file_that_defines_the_answer() -> None:
    answers = _where_to_start(DESIGN.read_text())
    questions = {match["question"].lower() for match in answers}
    for asked in ("where is a video accepted?", "where is a checkpoint committed?", "where is the sample order decided?"):
        assert asked in questions, f"docs/design.md's 'Where to start' must answer {asked!r}"
    for match in answers:
        path = REPO_ROOT / match["path"]
        assert path.is_file(), f"{match['question']} names {match['path']}, which does not exist"
        assert _defines(path, match["name"]), f"{match['path']} defines no {match['name']} ({match['question']})"


@pytest.mark.parametrize("package", ["ops", "trainer"])
def test_the_folder_map_names_every_subpackage_and_only_those(package: str) -> None:
    text = DESIGN.read_text()
    on_disk = {path.parent.name for path in (REPO_ROOT / package).glob("*/__init__.py")}
    mapped = set(re.findall(rf"`{package}/(\w+)/`", text))
    assert on_disk <= mapped, f"docs/design.md does not map {sorted(on_disk - mapped)} of {package}/"
    assert mapped <= on_disk, f"docs/design.md maps {sorted(mapped - on_disk)} of {package}/, which do not exist"


def test_no_folder_of_modules_grows_past_fifteen_files() -> None:
    # A flat folder is where a newcomer gets lost; split it by role before it grows (issue 33's bound).
    crowded = {}
    for package in ("ops", "trainer", "tools", "assets", "pipelines", "resources", "cli"):
        for folder in [REPO_ROOT / package, *(path.parent for path in (REPO_ROOT / package).glob("*/__init__.py"))]:
            modules = [path for path in folder.glob("*.py") if path.name != "__init__.py"]
            if len(modules) > 15:
                crowded[str(folder.relative_to(REPO_ROOT))] = len(modules)
    assert not crowded, f"folders with more than 15 modules: {crowded}"
