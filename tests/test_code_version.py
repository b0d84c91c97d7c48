"""Code versions are derived from imports (ops.lineage.code_modules_of), and checkpoint paths
come only from ops.checkpoints.store: one owner per fact (issue 10, item 4).

Run: .venv/bin/python -m pytest -q tests/test_code_version.py
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ops import lineage
from ops.publish.paths import REPO_ROOT


def _write(root: Path, relative: str, text: str) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _copy_code(destination: Path) -> Path:
    """The repository's code packages (sources only), so a test can edit one file of a real closure."""
    for package in lineage.CODE_PACKAGES:
        shutil.copytree(REPO_ROOT / package, destination / package,
                        ignore=lambda _folder, names: [n for n in names if n == "__pycache__"])
    return destination


@pytest.fixture
def toy_repo(tmp_path: Path) -> Path:
    """A tiny repository whose entry module imports in every way the walk has to follow."""
    _write(tmp_path, "ops/__init__.py", '"""ops."""\n')
    _write(tmp_path, "ops/entry.py", (
        "import json\n"
        "import ops.top\n"
        "from ops.named import VALUE\n"
        "from . import relative_sibling\n"
        "\n\n"
        "def lazy() -> None:\n"
        "    from ops import only_in_function  # a submodule named in a from-import, inside a function\n"
        "    import importlib\n"
        "    importlib.import_module('trainer.by_name')\n"
        "    import torch  # not repository code: env_digest covers it\n"))
    _write(tmp_path, "ops/top.py", "X = 1\n")
    _write(tmp_path, "ops/named.py", "from ops.deeper import Y as VALUE\n")
    _write(tmp_path, "ops/deeper.py", "Y = 2\n")
    _write(tmp_path, "ops/relative_sibling.py", "Z = 3\n")
    _write(tmp_path, "ops/only_in_function.py", "W = 4\n")
    _write(tmp_path, "ops/unrelated.py", "import ops.top\n")
    _write(tmp_path, "trainer/__init__.py", "")
    _write(tmp_path, "trainer/by_name.py", "V = 5\n")
    return tmp_path


def test_the_walk_follows_every_kind_of_import_and_nothing_else(toy_repo: Path) -> None:
    modules = lineage.code_modules_of("ops.entry", root=toy_repo)
    assert modules == ("ops", "ops.deeper", "ops.entry", "ops.named", "ops.only_in_function",
                       "ops.relative_sibling", "ops.top", "trainer", "trainer.by_name")
    assert "ops.unrelated" not in modules  # it imports a closure module, but nothing imports it


def test_a_module_imported_only_inside_a_function_changes_the_version(toy_repo: Path) -> None:
    def version() -> str:
        return lineage.source_digest(*lineage.code_modules_of("ops.entry", root=toy_repo), root=toy_repo)

    before = version()
    _write(toy_repo, "ops/unrelated.py", "import ops.top\nCHANGED = True\n")
    assert version() == before, "an edit to a module the entry never imports must not change its version"
    _write(toy_repo, "ops/only_in_function.py", "W = 5\n")
    assert version() != before


def test_a_new_import_is_followed_after_the_file_was_read_once(toy_repo: Path) -> None:
    # The per-file import cache must notice an edit, or a second closure in one process is stale.
    assert "ops.unrelated" not in lineage.code_modules_of("ops.entry", root=toy_repo)
    entry = toy_repo / "ops" / "entry.py"
    entry.write_text(entry.read_text() + "\n\ndef later() -> None:\n    import ops.unrelated\n")
    assert "ops.unrelated" in lineage.code_modules_of("ops.entry", root=toy_repo)


def test_the_order_of_entry_modules_does_not_matter(toy_repo: Path) -> None:
    forward = lineage.code_modules_of("ops.entry", "ops.unrelated", root=toy_repo)
    assert lineage.code_modules_of("ops.unrelated", "ops.entry", root=toy_repo) == forward
    assert (lineage.code_version_of("ops.media.scan", "ops.curation.manifest")
            == lineage.code_version_of("ops.curation.manifest", "ops.media.scan"))


def test_a_missing_entry_or_a_stale_repository_import_is_a_named_error(toy_repo: Path) -> None:
    with pytest.raises(lineage.CodeModuleError, match="ops.nowhere has no source file"):
        lineage.code_modules_of("ops.nowhere", root=toy_repo)
    _write(toy_repo, "ops/entry.py", "def later() -> None:\n    from ops.removed import thing\n")
    with pytest.raises(lineage.CodeModuleError, match="ops.removed"):
        lineage.code_modules_of("ops.entry", root=toy_repo)


def test_the_decode_path_is_training_code() -> None:
    # ops/clips/shards.py and ops/media/codec.py decode every training sample; the hand-written list missed them.
    modules = lineage.code_modules_of(*lineage.TRAINING_ENTRY_MODULES)
    assert {"ops.clips.shards", "ops.media.codec", "ops.loading.loader", "ops.loading.sampling", "trainer.train",
            "trainer.models.video", "trainer.launch.config_sections", "trainer.data",
            "trainer.checkpointing.checkpointer", "assets.training"} <= set(modules)
    # Only what the trainer and the stage assets import: no validation, profiling or CLI code.
    assert not {"ops.curation.validation", "ops.curation.quarantine", "ops.clips.profile", "cli.main",
                "pipelines.definitions"} & set(modules)


def test_an_edit_to_the_decode_path_changes_the_training_code_version(tmp_path: Path) -> None:
    root = _copy_code(tmp_path)

    def version() -> str:
        return lineage.source_digest(*lineage.code_modules_of(*lineage.TRAINING_ENTRY_MODULES, root=root), root=root)

    before = version()
    assert before == lineage.training_code_version()  # the copy is the same code
    media_io = root / "ops" / "media" / "codec.py"
    media_io.write_text(media_io.read_text() + "\n# a decode change\n")
    assert version() != before


def test_the_stage_assets_declare_the_training_code_version() -> None:
    from assets import clips, data, training

    assert training.TRAINING_CODE_VERSION == lineage.training_code_version()
    assert {assets_def.code_versions_by_key[key] for assets_def in (training.pretrain, training.finetune)
            for key in assets_def.keys} == {lineage.training_code_version()}
    # Every asset's version covers at least the modules the old hand-written lists named.
    assert data.VALIDATION_CODE_VERSION == lineage.source_digest(*lineage.code_modules_of("ops.curation.validation",
                                                                                           "ops.curation.quarantine"))
    assert {"ops.curation.reason_codes", "ops.publish.hashing"} <= set(lineage.code_modules_of("ops.media.scan"))
    assert {"ops.media.codec"} <= set(lineage.code_modules_of("ops.clips.profile", "ops.clips.shards"))
    assert ({"ops.loading.loader", "ops.loading.sampling", "ops.clips.shards", "ops.media.codec"}
            <= set(lineage.code_modules_of("ops.clips.throughput")))
    assert clips.SHARD_CODE_VERSION != clips.PROFILE_CODE_VERSION


def test_computing_the_training_code_version_imports_none_of_it() -> None:
    # The assets compute it when the Definitions load, which must stay free of torch (test_import_weight).
    probe = ("import sys\nfrom ops.lineage import training_code_version\ntraining_code_version()\n"
             "print(sorted(m for m in ('torch', 'av', 'webdataset', 'trainer.train', 'assets.training')"
             " if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


# Ways of spelling a checkpoint path by hand: a step folder name, the checkpoints folder, latest.
_HAND_BUILT_PATH = re.compile(r"step_\{[^}]*:06d\}|/ *[\"'](checkpoints|latest)[\"']|[\"']checkpoints[\"'] */")


def test_checkpoint_paths_come_only_from_the_checkpoint_store() -> None:
    store = REPO_ROOT / "ops" / "checkpoints" / "store.py"
    offenders = [f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
                 for package in lineage.CODE_PACKAGES for path in sorted((REPO_ROOT / package).rglob("*.py"))
                 if path != store
                 for number, line in enumerate(path.read_text().splitlines(), 1) if _HAND_BUILT_PATH.search(line)]
    assert not offenders, ("build checkpoint paths with ops.checkpoints.store (checkpoints_dir, step_dir_name, "
                           "LATEST_NAME), not by hand:\n" + "\n".join(offenders))
