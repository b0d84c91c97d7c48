"""Import weight: the Definitions and the trainer's config load without torch, PyAV or webdataset.

The webserver, every sensor tick and every run worker import ``pipelines/definitions.py``; each
import of torch there cost about 3 s (issue 10). Heavy libraries are imported where they are
used, so these tests import in a fresh interpreter (this one has torch loaded by other tests)
and read back ``sys.modules``. The last test holds the trainer's modules to an import graph
without cycles, counting ``TYPE_CHECKING`` imports too: config <-> memory <-> parallel was one.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path


from ops.publish.paths import REPO_ROOT

HEAVY = ("torch", "av", "webdataset")


def _heavy_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter at the repo root; the heavy modules it left loaded, and what it printed."""
    probe = code + f"\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    *printed, heavy = done.stdout.strip().splitlines()
    return {"heavy": json.loads(heavy), "printed": printed}


def test_loading_the_definitions_imports_no_torch_av_or_webdataset() -> None:
    # Resolve the whole graph and every job, as the webserver does, not just the module import.
    result = _heavy_after(
        "import dagster as dg\n"
        "from pipelines.definitions import defs\n"
        "dg.Definitions.validate_loadable(defs)\n"
        "graph = defs.resolve_asset_graph()\n"
        "print(len(graph.get_all_asset_keys()))\n")
    assert int(result["printed"][-1]) >= 11, "the Definitions resolved fewer assets than the design names"
    assert result["heavy"] == [], f"importing the Definitions loaded {result['heavy']}; import them where they are used"


def test_loading_and_checking_a_config_imports_no_torch() -> None:
    # What the training assets do before launch: resolve a stage's YAML and its overrides.
    config = REPO_ROOT / "configs" / "demo.yaml"
    result = _heavy_after(
        "from trainer.launch.config import load_config, check_no_literal_secrets, secret_field_paths\n"
        "import trainer.launch.preflight, trainer.launch.memory, trainer.launch.config_sections\n"
        f"config = load_config({str(config)!r}, ['train.steps=3', 'optim.lr=1e-3'])\n"
        "check_no_literal_secrets(['train.steps=3'])\n"
        "print(config.train.steps, sorted(secret_field_paths())[:1])\n")
    assert result["printed"][-1].startswith("3 ")
    assert result["heavy"] == [], f"loading a config loaded {result['heavy']}"


def test_the_moved_config_sections_still_count_as_training_code() -> None:
    # ModelConfig's defaults shape the model: moving them out of trainer/models/video.py must not take
    # them out of the code version every training materialization records.
    from ops.lineage import TRAINING_ENTRY_MODULES, code_modules_of
    from trainer.launch.config_sections import DataConfig, ModelConfig, OptimConfig

    modules = set(code_modules_of(*TRAINING_ENTRY_MODULES))
    assert {cls.__module__ for cls in (ModelConfig, DataConfig, OptimConfig)} <= modules


def _trainer_edges(root: Path) -> dict[str, set[str]]:
    """trainer.X -> the trainer modules it imports at module level or under TYPE_CHECKING (not in functions)."""
    paths = sorted((root / "trainer").rglob("*.py"))

    def name(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    known = {name(path) for path in paths}
    edges: dict[str, set[str]] = {}
    for path in paths:
        module = name(path)
        edges[module] = set()
        statements = list(ast.parse(path.read_text(), str(path)).body)
        while statements:
            node = statements.pop()
            if isinstance(node, ast.If | ast.Try):  # TYPE_CHECKING blocks, guarded imports
                statements += node.body + node.orelse + getattr(node, "finalbody", [])
                statements += [stmt for handler in getattr(node, "handlers", []) for stmt in handler.body]
            names = ([node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
                     if isinstance(node, ast.ImportFrom) else
                     [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            edges[module] |= known.intersection(names)
        edges[module].discard(module)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target] if target in path else [module, target]
            if target not in state and (found := visit(target, path + [target])):
                return found
        state[module] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_cycle_finder_finds_a_planted_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a"}}) is None


def test_trainer_modules_import_each_other_without_cycles() -> None:
    edges = _trainer_edges(REPO_ROOT)
    assert {"trainer.launch.config", "trainer.launch.memory", "trainer.parallel", "trainer.launch.preflight"} <= set(edges)
    assert "trainer.launch.memory" in edges["trainer.launch.preflight"], "the scanner must see module-level imports"
    assert "trainer.launch.config" in edges["trainer.launch.memory"], "the scanner must see TYPE_CHECKING imports"
    assert _cycle(edges) is None, f"import cycle among trainer modules: {' -> '.join(_cycle(edges))}"
