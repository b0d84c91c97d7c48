"""Layering guardrails: who may import whom, read from the source with ``ast``.

The rules are the layer table of docs/design.md. Every import counts for the layer rules: at
module level, inside functions, under ``if TYPE_CHECKING:``, and ``importlib.import_module``
with a literal name, because a lazy import is still a dependency. Only imports that run when a
module is imported (module level, not under ``TYPE_CHECKING``) count for cycles, because only
they can meet a half-initialized module.

Run: .venv/bin/python -m pytest -q tests/test_layering.py
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# The Pipes client is the one piece of Dagster that may run inside the trainer: rank 0 reports
# logs, metrics and the committed checkpoint through it (docs/design.md, "Launch and Pipes").
PIPES_CLIENT = "dagster_pipes"


@dataclass(frozen=True, slots=True)
class ImportEdge:
    """One import found in one file."""

    importer: str
    """Dotted module name of the importing file (``ops.curation.manifest``; a package is its ``__init__``)."""
    imported: str
    """The project module it resolves to, or the dotted name as written for a third-party one."""
    path: Path
    lineno: int
    at_import_time: bool
    """True when the import runs as the module is imported: module level, not under TYPE_CHECKING."""
    runs_parent_init: bool = False
    """True for the implied edge to a parent package whose ``__init__`` runs first (cycles only)."""

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root)}:{self.lineno}"


@dataclass(frozen=True, slots=True)
class LayerRule:
    """What one top-level package must not import."""

    layer: str
    forbidden_layers: frozenset[str]
    """Project packages it must not import."""
    allows_dagster: bool
    """False: no ``dagster`` or ``dagster_*`` module except the Pipes client."""
    why: str


LIBRARY_ENTRY_POINTS = frozenset({"cli", "benchmarks"})  # programs on top; nothing imports them
LAYER_RULES: tuple[LayerRule, ...] = (
    LayerRule("ops", frozenset({"tools", "trainer", "resources", "assets", "pipelines"}) | LIBRARY_ENTRY_POINTS,
              allows_dagster=False,
              why="ops/ is the plain-Python base: every other layer and the trainer processes use it"),
    LayerRule("tools", frozenset({"trainer", "resources", "assets", "pipelines"}) | LIBRARY_ENTRY_POINTS,
              allows_dagster=False,
              why="tools/ (demo media, a local S3 server) stand beside the platform: the demo and tests use them"),
    LayerRule("trainer", frozenset({"tools", "resources", "assets", "pipelines"}) | LIBRARY_ENTRY_POINTS,
              allows_dagster=False,
              why="trainer/ runs under torchrun outside Dagster; it talks back only through Pipes"),
    LayerRule("resources", frozenset({"tools", "assets", "pipelines"}) | LIBRARY_ENTRY_POINTS, allows_dagster=True,
              why="resources/ are interfaces the assets receive; they know no asset or Definitions"),
    LayerRule("assets", frozenset({"tools", "pipelines"}) | LIBRARY_ENTRY_POINTS, allows_dagster=True,
              why="assets/ are collected by pipelines/, never the other way round"),
    LayerRule("pipelines", LIBRARY_ENTRY_POINTS, allows_dagster=True,
              why="pipelines/ builds the Definitions; the command line and benchmarks sit on top of it"),
    LayerRule("cli", frozenset({"benchmarks"}), allows_dagster=True, why="the command line is an entry point"),
    LayerRule("benchmarks", frozenset(), allows_dagster=True, why="benchmarks are entry points"),
)

# Known violations that the code still has, as (importer module, imported module) -> why it is
# tolerated and who removes it. Empty: the code keeps every rule above. An entry silences exactly
# that one import, so any new violation still fails; an entry that no longer matches fails too,
# so the list only shrinks.
ALLOWED_LAYER_VIOLATIONS: Mapping[tuple[str, str], str] = {}

# Known import-time cycles, as the frozenset of their modules -> why. Empty: there are none.
ALLOWED_CYCLES: Mapping[frozenset[str], str] = {}


# --- reading the source ----------------------------------------------------------------------


def project_packages(root: Path) -> list[str]:
    """The top-level packages that setuptools ships, read from pyproject.toml (one source of truth)."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(pattern.removesuffix("*") for pattern in patterns)


def discover_modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Every module of the given packages, by dotted name; a package is named by its ``__init__``."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _literal_import_call(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("x")`` or ``__import__("x")``, if literal."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in {"import_module", "__import__"} or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


class _ImportCollector(ast.NodeVisitor):
    """Walks one file, noting for each import whether it runs at import time."""

    def __init__(self, module: str, path: Path, modules: Mapping[str, Path]) -> None:
        self.module, self.path, self.modules = module, path, modules
        self.is_package = path.name == "__init__.py"
        self.edges: list[ImportEdge] = []
        self._deferred_depth = 0  # > 0 inside a function body or a TYPE_CHECKING block

    def _resolve(self, name: str) -> str:
        """The longest project module that ``name`` starts with, else ``name`` itself."""
        parts = name.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in self.modules:
                return ".".join(parts[:end])
        return name

    def _add(self, name: str, lineno: int) -> None:
        imported = self._resolve(name)
        self.edges.append(ImportEdge(self.module, imported, self.path, lineno, self._deferred_depth == 0))
        # Importing a submodule runs its parent packages' __init__ first; the importer's own
        # ancestors are already being initialized, so they add no new edge.
        parts = imported.split(".")
        for end in range(1, len(parts)):
            parent = ".".join(parts[:end])
            if parent in self.modules and not self.module.startswith(parent + ".") and parent != self.module:
                self.edges.append(ImportEdge(self.module, parent, self.path, lineno, self._deferred_depth == 0,
                                             runs_parent_init=True))

    def _visit_deferred(self, nodes: Iterable[ast.AST]) -> None:
        self._deferred_depth += 1
        for node in nodes:
            self.visit(node)
        self._deferred_depth -= 1

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        # Decorators, defaults and annotations run at definition time; only the body is deferred.
        for child in (*node.decorator_list, node.args):
            self.visit(child)
        self._visit_deferred(node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.args)
        self._visit_deferred([node.body])

    def visit_If(self, node: ast.If) -> None:
        if not _is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._visit_deferred(node.body)
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self._absolute_base(node)
        # `from ops import manifest` imports the module ops.curation.manifest; `from ops.x import f` imports ops.x.
        targets = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in self.modules else base for alias in node.names}
        for target in sorted(targets):
            self._add(target, node.lineno)

    def _absolute_base(self, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        package = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        return ".".join([*anchor, *([node.module] if node.module else [])])

    def visit_Call(self, node: ast.Call) -> None:
        name = _literal_import_call(node)
        if name is not None:
            self._add(name, node.lineno)
        self.generic_visit(node)


def collect_edges(modules: Mapping[str, Path]) -> list[ImportEdge]:
    edges: list[ImportEdge] = []
    for module, path in modules.items():
        collector = _ImportCollector(module, path, modules)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        edges.extend(collector.edges)
    return edges


# --- the rules -------------------------------------------------------------------------------


def _is_forbidden_dagster(imported: str) -> bool:
    top = imported.split(".")[0]
    return (top == "dagster" or top.startswith("dagster_")) and top != PIPES_CLIENT


def rule_breaches(edges: Iterable[ImportEdge], rules: Iterable[LayerRule]) -> list[tuple[ImportEdge, LayerRule]]:
    by_layer = {rule.layer: rule for rule in rules}
    breaches = []
    for edge in edges:
        rule = by_layer.get(edge.importer.split(".")[0])
        if rule is None or edge.runs_parent_init:  # the explicit import on that line is judged already
            continue
        imported_layer = edge.imported.split(".")[0]
        if imported_layer in rule.forbidden_layers or (not rule.allows_dagster and _is_forbidden_dagster(edge.imported)):
            breaches.append((edge, rule))
    return breaches


def _strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative so a deep import chain cannot hit the recursion limit."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def _one_cycle(start: str, component: set[str], edge_at: Mapping[tuple[str, str], ImportEdge]) -> list[ImportEdge]:
    """A shortest cycle through ``start`` inside its component, as the imports that form it."""
    came_from: dict[str, ImportEdge] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for (importer, imported), edge in sorted(edge_at.items()):
                if importer != node or imported not in component or imported in came_from:
                    continue
                came_from[imported] = edge
                following.append(imported)
        if start in came_from:
            break
        frontier = following
    cycle, node = [], start
    while True:
        cycle.append(came_from[node])
        node = came_from[node].importer
        if node == start:
            return cycle[::-1]


def import_cycles(edges: Iterable[ImportEdge], modules: Iterable[str], *,
                  import_time_only: bool = True) -> list[list[ImportEdge]]:
    """Cycles among project modules, until every module in a cycle is named.

    ``import_time_only``: only the imports that run when a module is imported (the cycles that can
    meet a half-initialized module). False counts every import, in functions and under TYPE_CHECKING
    too: a dependency cycle hidden in a function-level import is still two modules that need each other.
    """
    graph: dict[str, set[str]] = {module: set() for module in modules}
    edge_at: dict[tuple[str, str], ImportEdge] = {}
    for edge in edges:
        if (edge.at_import_time or not import_time_only) and edge.imported in graph:
            graph[edge.importer].add(edge.imported)
            edge_at.setdefault((edge.importer, edge.imported), edge)
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) == 1 and not any(module in graph[module] for module in component):
            continue
        named: set[str] = set()
        for start in sorted(component):
            if start not in named:
                cycles.append(_one_cycle(start, component, edge_at))
                named |= {edge.importer for edge in cycles[-1]}
    return cycles


def describe_cycle(cycle: list[ImportEdge], root: Path) -> str:
    hops = " -> ".join(f"{edge.importer} ({edge.where(root)})" for edge in cycle)
    return f"{hops} -> {cycle[0].importer}"


# --- the repository itself -------------------------------------------------------------------


@pytest.fixture(scope="module")
def repo_modules() -> dict[str, Path]:
    return discover_modules(REPO_ROOT, project_packages(REPO_ROOT))


@pytest.fixture(scope="module")
def repo_edges(repo_modules: dict[str, Path]) -> list[ImportEdge]:
    return collect_edges(repo_modules)


def test_every_shipped_package_has_a_layer_rule() -> None:
    # A new top-level package must take a place in the layer table before it ships.
    assert set(project_packages(REPO_ROOT)) == {rule.layer for rule in LAYER_RULES}


def test_layers_import_only_downwards(repo_edges: list[ImportEdge]) -> None:
    breaches = [(edge, rule) for edge, rule in rule_breaches(repo_edges, LAYER_RULES)
                if (edge.importer, edge.imported) not in ALLOWED_LAYER_VIOLATIONS]
    report = [f"{edge.where(REPO_ROOT)}: {edge.importer} imports {edge.imported} ({rule.why})"
              for edge, rule in breaches]
    assert not report, "layering broken (docs/design.md, 'Layers'):\n" + "\n".join(report)


def test_allowed_layer_violations_still_exist(repo_edges: list[ImportEdge]) -> None:
    found = {(edge.importer, edge.imported) for edge, _ in rule_breaches(repo_edges, LAYER_RULES)}
    stale = sorted(set(ALLOWED_LAYER_VIOLATIONS) - found)
    assert not stale, f"these imports are gone; remove them from ALLOWED_LAYER_VIOLATIONS: {stale}"


def test_no_import_cycles_between_project_modules(repo_edges: list[ImportEdge],
                                                  repo_modules: dict[str, Path]) -> None:
    cycles = import_cycles(repo_edges, repo_modules)
    new = [cycle for cycle in cycles if frozenset(edge.importer for edge in cycle) not in ALLOWED_CYCLES]
    assert not new, "import cycles at module level:\n" + "\n".join(describe_cycle(c, REPO_ROOT) for c in new)
    stale = set(ALLOWED_CYCLES) - {frozenset(edge.importer for edge in cycle) for cycle in cycles}
    assert not stale, f"these cycles are gone; remove them from ALLOWED_CYCLES: {sorted(map(sorted, stale))}"


def test_no_dependency_cycles_even_through_function_level_imports(repo_edges: list[ImportEdge],
                                                                  repo_modules: dict[str, Path]) -> None:
    # A lazy import hides a cycle from Python, not from a reader: two modules that import each other,
    # anywhere, are one module in two files (the supervisor and its policy were, before they merged).
    cycles = import_cycles(repo_edges, repo_modules, import_time_only=False)
    assert not cycles, "dependency cycles (any import counts):\n" + "\n".join(describe_cycle(c, REPO_ROOT) for c in cycles)


def test_the_scan_sees_function_level_imports(repo_edges: list[ImportEdge]) -> None:
    # Guards the guard: if the walker stopped entering function bodies, the rules above would
    # pass vacuously on every lazy import (and heavy libraries are imported lazily on purpose).
    assert any(edge.imported == PIPES_CLIENT for edge in repo_edges if edge.importer.startswith("trainer"))
    assert any(not edge.at_import_time for edge in repo_edges if edge.importer.startswith(("ops", "trainer")))


def _design_doc_layer_table(text: str) -> dict[str, tuple[frozenset[str], bool]]:
    """docs/design.md's layer table: layer -> (packages it must not import, whether Dagster is allowed)."""
    table: dict[str, tuple[frozenset[str], bool]] = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        folder = re.fullmatch(r"`(\w+)/`", cells[0]) if len(cells) == 3 else None
        if folder:
            forbidden = frozenset(re.findall(r"`(\w+)/`", cells[2]))
            if "any other project package" in cells[2]:
                forbidden |= {rule.layer for rule in LAYER_RULES} - {folder.group(1)}
            table[folder.group(1)] = (forbidden, not cells[2].startswith("Dagster"))
    return table


def test_design_doc_states_the_rules_this_test_enforces() -> None:
    documented = _design_doc_layer_table((REPO_ROOT / "docs" / "design.md").read_text())
    enforced = {rule.layer: (rule.forbidden_layers, rule.allows_dagster) for rule in LAYER_RULES}
    assert documented == enforced, "update docs/design.md's layer table and LAYER_RULES together"


def test_every_pointer_to_a_doc_names_a_file_that_exists(repo_modules: dict[str, Path]) -> None:
    # A docstring that sends the reader to a page the repository does not have is a dead end
    # (the old pointers named a design map kept outside the repository).
    texts = [*repo_modules.values(), *(REPO_ROOT / "tests").glob("*.py"), *(REPO_ROOT / "docs").glob("*.md"),
             REPO_ROOT / "README.md"]
    dead = sorted({f"{path.relative_to(REPO_ROOT)}: {name}" for path in texts
                   for name in re.findall(r"(?:docs/)?[\w-]*DESIGN\.md|docs/[\w.-]+\.md", path.read_text())
                   if not (REPO_ROOT / name).is_file()})
    assert not dead, "pointers to missing docs:\n" + "\n".join(dead)


# --- the scanner on a tiny project of its own ------------------------------------------------


def _write_project(root: Path, files: Mapping[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return discover_modules(root, sorted({name.split("/")[0] for name in files}))


def test_scanner_finds_lazy_type_only_and_dynamic_imports(tmp_path: Path) -> None:
    modules = _write_project(tmp_path, {
        "ops/__init__.py": "",
        "ops/lazy.py": "def f():\n    import dagster\n",
        "ops/typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from assets import x\n",
        "ops/dynamic.py": "import importlib\nM = importlib.import_module('dagster.core')\n",
        "ops/pipes.py": "def g():\n    from dagster_pipes import open_dagster_pipes\n",
        "ops/other.py": "import dagster_aws.s3\n",
        "assets/__init__.py": "", "assets/x.py": "",
    })
    breaches = rule_breaches(collect_edges(modules), LAYER_RULES)
    found = {(edge.importer, edge.imported, edge.at_import_time) for edge, _ in breaches}
    assert found == {("ops.lazy", "dagster", False), ("ops.typed", "assets.x", False),
                     ("ops.dynamic", "dagster.core", True),
                     ("ops.other", "dagster_aws.s3", True)}


def test_scanner_resolves_relative_imports_and_reports_each_cycle(tmp_path: Path) -> None:
    modules = _write_project(tmp_path, {
        "ops/__init__.py": "from ops import a\n",
        "ops/a.py": "from . import b\n",
        "ops/b.py": "from .a import thing\n",           # cycle 1: ops.a <-> ops.b
        "ops/c.py": "def f():\n    import ops.d\n",   # deferred: no cycle
        "ops/d.py": "import ops.c\n",
        "trainer/__init__.py": "",
        "trainer/e.py": "from typing import TYPE_CHECKING\nimport trainer.f\nif TYPE_CHECKING:\n    import trainer.g\n",
        "trainer/f.py": "import trainer.e\n",          # cycle 2: trainer.e <-> trainer.f
        "trainer/g.py": "import trainer.e\n",          # type-only edge back: no cycle
    })
    cycles = import_cycles(collect_edges(modules), modules)
    assert sorted(sorted(edge.importer for edge in cycle) for cycle in cycles) == [
        ["ops.a", "ops.b"], ["trainer.e", "trainer.f"]]
    text = [describe_cycle(cycle, tmp_path) for cycle in cycles]
    assert "ops.a (ops/a.py:1) -> ops.b (ops/b.py:1) -> ops.a" in text


def test_importing_a_package_runs_its_init_and_can_close_a_cycle(tmp_path: Path) -> None:
    # resources.r imports ops.leaf; ops/__init__ runs first and imports resources.r back.
    modules = _write_project(tmp_path, {
        "ops/__init__.py": "import resources.r\n", "ops/leaf.py": "",
        "resources/__init__.py": "", "resources/r.py": "import ops.leaf\n",
    })
    cycles = import_cycles(collect_edges(modules), modules)
    assert [sorted(edge.importer for edge in cycle) for cycle in cycles] == [["ops", "resources.r"]]


def test_every_module_of_a_tangle_is_named_in_some_reported_cycle(tmp_path: Path) -> None:
    # ops.a <-> ops.b and ops.b <-> ops.c form one tangle; the shortest cycle through ops.a misses ops.c.
    modules = _write_project(tmp_path, {
        "ops/__init__.py": "", "ops/a.py": "import ops.b\n", "ops/b.py": "import ops.a\nimport ops.c\n",
        "ops/c.py": "import ops.b\n",
    })
    cycles = import_cycles(collect_edges(modules), modules)
    assert sorted(sorted(edge.importer for edge in cycle) for cycle in cycles) == [["ops.a", "ops.b"], ["ops.b", "ops.c"]]
