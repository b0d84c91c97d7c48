"""`make test` runs in pytest-xdist workers: each module whole on one worker, longest modules first.

A module split across workers builds its module-scoped fixtures once per worker (the demo graph
twice, the cluster demo twice) and its tests that share state race. `--dist loadgroup` did exactly
that, silently, on pytest 9.2: xdist 3.8 names a group by rewriting ``item._nodeid``, which
pytest 9.2's ``nodeid`` no longer reads, so every group was ignored and the suite ran slower than in
one process. These tests run the Makefile's own flags on a tiny generated suite.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest

REPO = Path(__file__).resolve().parent.parent


def _make_test_flags() -> list[str]:
    """The xdist flags of the Makefile's test recipe (with PYTEST_WORKERS at its default)."""
    makefile = (REPO / "Makefile").read_text()
    workers = re.search(r"^PYTEST_WORKERS \?= (\d+)$", makefile, re.M).group(1)
    recipe = re.search(r"^test: install\n\t(.*)$", makefile, re.M).group(1)
    flags = re.search(r",(-n \$\(PYTEST_WORKERS\)[^)]*)\)", recipe).group(1)
    return flags.replace("$(PYTEST_WORKERS)", workers).split()


def test_make_test_keeps_each_module_on_one_worker(tmp_path: Path) -> None:
    flags = _make_test_flags()
    assert flags[:2] == ["-n", "2"], flags
    suite = tmp_path / "suite"
    suite.mkdir()
    for module in ("alpha", "beta", "gamma"):
        (suite / f"test_{module}.py").write_text(
            "import os, time\n\n"
            + "".join(f"def test_{i}():\n    time.sleep(0.05)\n    with open({str(tmp_path / 'seen')!r}, 'a') as f:\n"
                      f"        f.write('{module} ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n\n" for i in range(6)))
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *flags, str(suite)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    workers: dict[str, set[str]] = {}
    for line in (tmp_path / "seen").read_text().splitlines():
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    assert sorted(workers) == ["alpha", "beta", "gamma"]
    assert all(len(seen) == 1 for seen in workers.values()), workers
    assert len(set().union(*workers.values())) == 2, workers  # both workers had work


def test_a_worker_orders_modules_longest_first_and_keeps_each_modules_order(tmp_path: Path, monkeypatch) -> None:
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"test_short.py": 5.0, "test_long.py": 300.0}))
    monkeypatch.setattr(conftest, "DURATIONS", durations)
    items = [SimpleNamespace(nodeid=f"tests/{module}::test_{i}")
             for module in ("test_short.py", "test_new.py", "test_long.py") for i in range(3)]
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    unchanged = list(items)
    conftest.pytest_collection_modifyitems(None, items)
    assert items == unchanged  # one process: collection order, as always
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    conftest.pytest_collection_modifyitems(None, items)
    assert [item.nodeid for item in items] == [
        *(f"tests/test_long.py::test_{i}" for i in range(3)),
        *(f"tests/test_new.py::test_{i}" for i in range(3)),  # unknown: conftest.UNKNOWN_MODULE_S
        *(f"tests/test_short.py::test_{i}" for i in range(3))]


def test_a_durations_file_that_does_not_parse_is_an_error_naming_it(tmp_path: Path, monkeypatch) -> None:
    durations = tmp_path / "durations.json"
    durations.write_text('{"test_long.py": 300.0,')  # cut short
    monkeypatch.setattr(conftest, "DURATIONS", durations)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    with pytest.raises(pytest.UsageError, match="durations.json"):
        conftest.pytest_collection_modifyitems(None, [SimpleNamespace(nodeid="tests/test_long.py::test_0")])
    for edited in ('{"test_long.py": "300"}', '[300.0]'):  # hand-edited: a string, a list
        durations.write_text(edited)
        with pytest.raises(pytest.UsageError, match="not seconds per module"):
            conftest.pytest_collection_modifyitems(None, [SimpleNamespace(nodeid="tests/test_long.py::test_0")])
    monkeypatch.setattr(conftest, "DURATIONS", tmp_path / "absent.json")
    items = [SimpleNamespace(nodeid=f"tests/test_{name}.py::test_0") for name in ("b", "a")]
    conftest.pytest_collection_modifyitems(None, items)  # no record: collection order
    assert [item.nodeid for item in items] == ["tests/test_b.py::test_0", "tests/test_a.py::test_0"]
