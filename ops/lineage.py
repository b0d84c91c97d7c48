"""Lineage: which code, container, environment, data and config produced a result.

Every Dagster materialization and MLflow run carries the same seven fields
(see docs/lineage.md): ``git_commit``, ``git_dirty``, ``container_digest``, ``env_digest``,
``manifest_version``, ``config_hash``, ``code_version``.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from ops.publish.hashing import digest_json
from ops.publish.paths import REPO_ROOT

# The deployment sets this (e.g. the image digest of the running container); outside a
# container it is the explicit string "none", never a guess.
CONTAINER_DIGEST_ENV = "TRAINYARD_CONTAINER_DIGEST"


@dataclass(kw_only=True, slots=True, frozen=True)
class Lineage:
    git_commit: str
    """Commit of the checkout that ran, or "unknown" outside a git checkout."""
    git_dirty: bool
    """True when tracked files differ from the commit (the commit alone does not describe the code)."""
    container_digest: str
    """Image digest from $TRAINYARD_CONTAINER_DIGEST, or "none"."""
    env_digest: str
    """sha256 over the installed Python distributions and their versions."""
    manifest_version: str
    """Data version of the manifest the result was built from ("none" before one exists)."""
    config_hash: str
    """sha256 of the canonical JSON of the config that ran."""
    code_version: str
    """Code version of the asset / program (hash of its source modules)."""

    def as_metadata(self) -> dict[str, str | bool]:
        return asdict(self)

    def as_tags(self) -> dict[str, str]:
        """String-valued form, for MLflow tags and Dagster run tags."""
        return {key: str(value).lower() if isinstance(value, bool) else str(value)
                for key, value in asdict(self).items()}


def _git(*args: str, cwd: Path) -> str | None:
    try:
        # GIT_OPTIONAL_LOCKS=0: `git status` must not take index.lock to refresh the index, or a
        # materialization running beside a developer's `git commit` can make that commit fail.
        result = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                                check=False, env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.TimeoutExpired):
        return None  # no git binary or a hung filesystem: reported as "unknown" by the caller
    return result.stdout.strip() if result.returncode == 0 else None


def git_state(repo: Path = REPO_ROOT) -> tuple[str, bool]:
    """(commit, dirty) of the checkout at ``repo``; ("unknown", True) when not a checkout.

    Unknown counts as dirty: nothing vouches that the code matches any commit.
    """
    commit = _git("rev-parse", "HEAD", cwd=repo)
    if not commit:
        return "unknown", True
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=repo)
    return commit, status is None or bool(status)


def container_digest() -> str:
    return os.environ.get(CONTAINER_DIGEST_ENV, "").strip() or "none"


def environment_paths() -> list[str]:
    """Where this interpreter's environment installs distributions (site-packages of its prefix)."""
    paths = sysconfig.get_paths()
    return sorted({paths["purelib"], paths["platlib"]})


@functools.lru_cache(maxsize=1)
def environment_pins() -> tuple[str, ...]:
    """What ``env_digest`` hashes: the interpreter (``cpython==3.11.9``) first, then every distribution
    installed in this interpreter's environment as ``name==version`` (PEP 503 name), sorted, each once.

    Only the environment's install locations are read, not ``sys.path``: ``sys.path`` depends on
    how a process was started (``python -m`` from the checkout puts the checkout first, and with it
    a stale ``*.egg-info`` there; ``dagster dev`` puts its script folder first), which made the Dagster
    process and the trainer disagree about one environment. Cached: installs do not change mid-process.
    Checkpoint records keep this list (the environment's exact freeze), so a reproduction names the
    packages that differ (ops/drills/reproduce.py).
    """
    pins = set()
    for dist in importlib.metadata.distributions(path=environment_paths()):
        metadata = dist.metadata  # parsed on every access (name and version would parse it thrice)
        if metadata["Name"]:
            pins.add(f"{_normalized(metadata['Name'])}=={metadata['Version']}")
    return (f"{sys.implementation.name}=={platform.python_version()}", *sorted(pins))


def digest_of_pins(pins: Sequence[str]) -> str:
    """``env_digest`` of an environment whose `environment_pins` are ``pins`` (interpreter first)."""
    return hashlib.sha256("\n".join(pins).encode()).hexdigest()


def env_digest() -> str:
    """Digest of the Python interpreter (implementation, version) and of every distribution installed
    in its environment, by normalized name and version (`environment_pins`)."""
    return digest_of_pins(environment_pins())


def _normalized(name: str) -> str:
    """PEP 503 name: "Foo_Bar" and "foo-bar" are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


# The top-level packages of this repository whose modules count as code: an import of anything
# else (stdlib, torch, dagster) is the environment's business, recorded in env_digest.
CODE_PACKAGES = ("assets", "cli", "ops", "pipelines", "resources", "tools", "trainer")
# A training stage's code: the stage assets declare the code version of these entries' closure as
# their Dagster code_version, and the trainer records the same value as each run's code_version.
TRAINING_ENTRY_MODULES = ("assets.training", "trainer.train")


class CodeModuleError(ValueError):
    """An entry module, or a repository module imported from one, has no source file."""


def module_path(name: str, root: Path | None = None) -> Path | None:
    """Source file of the dotted module ``name`` under ``root`` (a package is its __init__.py), or None."""
    base = (root or REPO_ROOT).joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def source_digest(*modules: str, root: Path | None = None) -> str:
    """Code version from the source text of ``modules`` (dotted names): edits change it, nothing else does."""
    digest = hashlib.sha256()
    for name in sorted(set(modules)):
        path = module_path(name, root)
        if path is None:
            raise CodeModuleError(f"module {name} has no source file under {root or REPO_ROOT}")
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def code_modules_of(*entry_modules: str, root: Path | None = None) -> tuple[str, ...]:
    """``entry_modules`` and every repository module they import, directly or not, sorted.

    Read with ``ast``, never imported (the Definitions must load without torch). Every import
    counts: module level, inside functions (lazy imports are still code that runs), under
    ``TYPE_CHECKING``, and ``importlib.import_module`` with a literal name. A package whose
    submodule is imported counts too: Python runs its ``__init__`` first.
    """
    root = root or REPO_ROOT
    found: set[str] = set()
    pending = list(entry_modules)
    while pending:
        name = pending.pop()
        if name in found:
            continue
        path = module_path(name, root)
        if path is None:
            raise CodeModuleError(f"module {name} has no source file under {root}; fix the import of it "
                                  f"or the entry module list {entry_modules}")
        found.add(name)
        pending.extend(_parent_packages(name))
        pending.extend(_imported_modules(name, path, root))
    return tuple(sorted(found))


def code_version_of(*entry_modules: str) -> str:
    """Code version of ``entry_modules``: the source digest of their import closure in the repository.

    Cached per process (the assets compute it at import): source files do not change under a
    running process, and a changed file on disk is a new process's code anyway.
    """
    return _cached_code_version(tuple(sorted(set(entry_modules))), REPO_ROOT)


def training_code_version() -> str:
    """What the training stage assets declare and each training run records as code_version."""
    return code_version_of(*TRAINING_ENTRY_MODULES)


@functools.cache
def _cached_code_version(entry_modules: tuple[str, ...], root: Path) -> str:
    return source_digest(*code_modules_of(*entry_modules, root=root), root=root)


def _parent_packages(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]


def _imported_modules(name: str, path: Path, root: Path) -> list[str]:
    """The repository modules that the source of module ``name`` imports anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported: list[str] = []
    for module, taken in _import_statements(path.read_bytes(), str(path), package):
        if module.split(".")[0] not in CODE_PACKAGES:
            continue
        imported.append(module)
        # ``from ops import shards``: shards is a submodule (its source counts), not just a name.
        imported.extend(f"{module}.{item}" for item in taken if module_path(f"{module}.{item}", root) is not None)
    return imported


# Keyed by the source text: the assets' several closures share most files and parse each once,
# while an edited file (a test's, or a developer's between two calls) is parsed again.
@functools.lru_cache(maxsize=4096)
def _import_statements(source: bytes, filename: str, package: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Every import in ``source`` as (module, names a from-import takes from it), relative ones resolved."""
    statements: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            statements.extend((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            taken = tuple(alias.name for alias in node.names if alias.name != "*")
            statements.append((_from_import_base(node, package), taken))
        elif isinstance(node, ast.Call) and (literal := _literal_import_call(node)):
            statements.append((literal, ()))
    return tuple(statements)


def _from_import_base(node: ast.ImportFrom, package: str) -> str:
    """The module of ``from <base> import ...``; a relative one resolved against ``package``."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")  # "." is the importing module's package, ".." its parent, ...
    anchor = parts[: len(parts) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def _literal_import_call(node: ast.Call) -> str | None:
    """The module named by ``importlib.import_module("x")`` or ``__import__("x")`` when it is a literal."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if called not in {"import_module", "__import__"} or not node.args:
        return None
    first = node.args[0]
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def collect(*, manifest_version: str, config: object, code_version: str) -> Lineage:
    commit, dirty = git_state()
    return Lineage(
        git_commit=commit,
        git_dirty=dirty,
        container_digest=container_digest(),
        env_digest=env_digest(),
        manifest_version=manifest_version,
        config_hash=digest_json(asdict(config) if is_dataclass(config) else config),
        code_version=code_version,
    )
