"""Shared fixtures: isolated locations, and the demo media and its manifest built once per session.

Every test runs with TRAINYARD_HOME, DAGSTER_HOME, the media and data roots and the MLflow
store under its own tmp_path, so nothing is written into the checkout's ``.trainyard/``.
Tests that change media work on ``media_copy``, never on the shared ``demo`` folder.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
from helpers import DEMO_MAX_QUARANTINE_FRACTION, NUM_GOOD_CLIPS, copy_media

from ops.curation import manifest as manifest_ops
from ops.curation import validation as validation_ops
from ops.checkpoints.keys import HMAC_KEY_ENV
from tools.demo_media import DemoMediaReport, generate_demo_media


# Parallel runs (`make test`: pytest-xdist, ``-n 2 --dist loadfile``). Each worker is a process of its own,
# so on 2 cores two workers that each let torch take every core would fight over them: a worker takes its
# share of the cores instead (set before anything imports torch; subprocesses inherit it). Tests whose bits
# depend on the thread count pin it themselves, and both arms of every comparison run under the same value.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
# Seconds each test module took in the last full run (tests/durations.py writes it from a JUnit report):
# the longest modules start first, so the run does not end on one worker finishing a long module alone.
DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_MODULE_S = 30.0  # a module not in the file yet: neither first nor last


def pytest_configure(config: pytest.Config) -> None:
    # assets/__init__.py silences this at import, but pytest resets warning filters per test.
    config.addinivalue_line("filterwarnings", "ignore:Parameter `data_version`:dagster.BetaWarning")
    # Session- and module-scoped fixtures run before the per-test home below is set: give them a
    # home of their own too, so nothing (a checkpoint signing key, an MLflow store) lands in the
    # checkout's .trainyard/.
    session_home = Path(tempfile.mkdtemp(prefix="trainyard-test-home-"))
    os.environ["TRAINYARD_HOME"] = str(session_home)
    os.environ["DAGSTER_HOME"] = str(session_home / "dagster_home")
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{session_home / 'mlflow.db'}"
    (session_home / "dagster_home").mkdir()
    # One signing key for the session, the deployment way (an environment variable): published data
    # (plans, indexes, validated sets, manifests) is signed with it (ops.publish.storage), and module- and
    # session-scoped fixtures publish under the session home while tests read under their own.
    # Tests of the key file itself remove it (monkeypatch.delenv).
    os.environ[HMAC_KEY_ENV] = "trainyard-test-session-key"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker: the longest modules first.

    ``make test`` distributes whole modules (``--dist loadfile``), so a module's module-scoped
    fixtures (the demo graph, the cluster demo, a trained run, a SeaweedFS store) are built once, on
    the worker that runs all of its tests, in order. The scheduler hands out modules in the order the
    workers collected them (``--no-loadscope-reorder``); this puts the costliest first.
    """
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    try:
        seconds = json.loads(DURATIONS.read_text())
    except FileNotFoundError:  # no record (a fresh test layout): collection order
        return
    except ValueError as error:  # a committed file that does not parse is a mistake to fix, not to skip
        raise pytest.UsageError(f"{DURATIONS}: {error}; rewrite it with `python tests/durations.py junit.xml`") from error
    if not isinstance(seconds, dict) or not all(isinstance(value, int | float) for value in seconds.values()):
        raise pytest.UsageError(f"{DURATIONS}: not seconds per module; rewrite it with `python tests/durations.py junit.xml`")

    def cost(item: pytest.Item) -> float:
        return float(seconds.get(Path(item.nodeid.split("::", 1)[0]).name, UNKNOWN_MODULE_S))

    items.sort(key=lambda item: -cost(item))  # stable: tests keep their order within a module


@pytest.fixture(autouse=True)
def isolated_locations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point every embedded default location at this test's tmp_path."""
    home = tmp_path / "trainyard_home"
    (home / "dagster_home").mkdir(parents=True)
    monkeypatch.setenv("TRAINYARD_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster_home"))
    monkeypatch.setenv("TRAINYARD_MEDIA_ROOT", str(home / "media"))
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(home / "data"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
    # The caller's deployment settings must not leak into results that tests compare.
    monkeypatch.delenv("TRAINYARD_ENV", raising=False)
    monkeypatch.delenv("TRAINYARD_CONTAINER_DIGEST", raising=False)
    monkeypatch.delenv("TRAINYARD_CHECKPOINT_ROOT", raising=False)  # a run id repeats across tests
    monkeypatch.delenv("TRAINYARD_SHARD_ROOT", raising=False)
    return home


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> DemoMediaReport:
    """The demo media set, generated once: read-only for tests (copy it with media_copy to mutate)."""
    return generate_demo_media(tmp_path_factory.mktemp("demo") / "media", seed=0, num_good=NUM_GOOD_CLIPS)


@pytest.fixture
def media_copy(demo: DemoMediaReport, tmp_path: Path) -> Path:
    """A private copy of the demo media that a test may change."""
    return copy_media(demo.out_dir, tmp_path / "media")


@pytest.fixture(scope="session")
def demo_manifest(demo: DemoMediaReport) -> manifest_ops.Manifest:
    """The demo media's manifest with default limits and splits (built once, never written)."""
    return manifest_ops.build_manifest(demo.out_dir, manifest_ops.ManifestConfig())


@pytest.fixture(scope="session")
def demo_validation(demo_manifest: manifest_ops.Manifest) -> validation_ops.Validation:
    """The demo manifest validated with the quarantine gate raised for the small demo set."""
    config = validation_ops.ValidationConfig(max_quarantine_fraction=DEMO_MAX_QUARANTINE_FRACTION)
    return validation_ops.validate(demo_manifest, config)


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway S3 store (SeaweedFS) for the module, its variables set for ops.publish.objstore (tools.s3_server)."""
    from tools.s3_server import LocalS3

    with LocalS3(tmp_path_factory.mktemp("s3")) as server:
        yield server


@pytest.fixture
def s3_live(s3):
    """The module's store, started again if a test stopped it."""
    if s3.process is None:
        s3.start()
    yield s3
    if s3.process is None:
        s3.start()
