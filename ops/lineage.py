"""Lineage: which code, container, environment, data and config produced a result.

Every Dagster materialization and MLflow run carries the same seven fields
(see docs/lineage.md): ``git_commit``, ``git_dirty``, ``container_digest``, ``env_digest``,
``manifest_version``, ``config_hash``, ``code_version``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import sysconfig
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from ops.hashing import digest_json
from ops.paths import REPO_ROOT

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
def env_digest() -> str:
    """Digest of the Python interpreter (implementation, version) and of every distribution installed
    in its environment, by normalized name and version.

    Only the environment's install locations are read, not ``sys.path``: ``sys.path`` depends on
    how a process was started (``python -m`` from the checkout puts the checkout first, and with it
    a stale ``*.egg-info`` there; ``dagster dev`` puts its script folder first), which made the Dagster
    process and the trainer disagree about one environment. Cached: installs do not change mid-process.
    """
    pins = {f"{_normalized(dist.metadata['Name'])}=={dist.version}"
            for dist in importlib.metadata.distributions(path=environment_paths()) if dist.metadata["Name"]}
    interpreter = f"{sys.implementation.name}=={platform.python_version()}"
    return hashlib.sha256("\n".join([interpreter, *sorted(pins)]).encode()).hexdigest()


def _normalized(name: str) -> str:
    """PEP 503 name: "Foo_Bar" and "foo-bar" are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


# The modules whose source is a training stage's code: the stage assets declare their digest as
# their Dagster code_version, and the trainer records the same digest as code_version.
# trainer.schema holds the model, data and optimizer config sections (their defaults are training code).
TRAINING_CODE_MODULES = ("assets.training", "trainer.train", "trainer.model", "trainer.schema", "trainer.data",
                         "trainer.parallel", "trainer.precision", "trainer.optim", "trainer.checkpoint", "ops.loader",
                         "ops.sampling")


def source_digest(*modules: str) -> str:
    """Code version from the source text of ``modules`` (dotted names): edits change it, nothing else does."""
    digest = hashlib.sha256()
    for name in sorted(modules):
        path = REPO_ROOT / Path(*name.split(".")).with_suffix(".py")
        digest.update(name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


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
