"""benchmarks/gpu_check.py --dry: the prepared GPU check's plumbing, on CPU, as the lent machine
would run it: a python whose PyAV, webdataset, MLflow, Dagster and pandera cannot be imported
(that machine's image has none of them), each check in its own process, one JSON line each.

Run: python -m pytest tests/test_gpu_check.py -q   (~2-3 minutes on 2 cores: it compiles once)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from ops.publish.paths import REPO_ROOT

ABSENT = ("av", "webdataset", "mlflow", "dagster", "dagster_pipes", "pandera")
# A sitecustomize that makes the packages the GPU machine lacks unimportable in every process
# started with it on PYTHONPATH (the checks' children and their torchrun ranks inherit it).
BLOCKER = f'''
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ImportError(f"{{name}} is not installed on the GPU machine (tests/test_gpu_check.py)")
        return None
sys.meta_path.insert(0, _Absent())
'''


def run_check(tmp_path: Path, *args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)])}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> tuple[subprocess.CompletedProcess, list[dict]]:
    done = run_check(tmp_path_factory.mktemp("gpu_check"), "--dry")
    return done, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_the_dry_run_passes_every_check_without_the_packages_the_gpu_machine_lacks(dry) -> None:
    done, lines = dry
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    *records, summary = lines
    assert [record["check"] for record in records] == list(gpu_check.CHECKS)
    assert all(record["ok"] for record in records), [r for r in records if not r["ok"]]
    assert summary["benchmark"] == "gpu_check" and summary["dry"] and summary["all_ok"]
    environment = records[0]
    assert not any(environment["packages"][name] for name in ("av", "webdataset", "mlflow", "dagster", "pandera"))


def test_the_dry_run_reports_each_figure(dry) -> None:
    _done, lines = dry
    records = {record["check"]: record for record in lines[:-1]}
    assert all(value > 0 for key, value in records["gemm"].items() if key.endswith("_tflops"))
    assert records["attention"]["math"]["available"] and records["attention"]["math"]["fwd_bwd_tflops"] > 0
    assert records["attention"]["efficient"]["available"] is False and records["attention"]["efficient"]["reason"]
    for name, compiled in (("mfu_eager", False), ("mfu_compile", True)):
        mfu = records[name]
        assert mfu["compile"] is compiled and mfu["precision"] == "bf16" and mfu["mfu"] > 0
        assert mfu["batch"] >= 1 and mfu["batches_tried"][-1] == mfu["batch"]
        assert mfu["memory_estimate"]["total_bytes"] > 0 and mfu["peak_memory_bytes"] > 0
    assert records["mfu_compile"]["batch"] == records["mfu_eager"]["batch"]  # compile reuses the fitted batch
    assert records["empty_micro_batch"]["loss"] == 0.0 and records["empty_micro_batch"]["grads_finite"]
    two = records["two_device"]
    assert two["backend"] == "gloo" and two["ddp"]["status"] == two["fsdp"]["status"] == "completed"
    assert two["max_loss_rel_diff_fsdp_vs_ddp"] < 1e-5  # fp32 on CPU (precision auto): reassociation only


def test_a_check_that_hangs_is_cut_at_its_timeout_and_the_others_still_run(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_check, "DRY_TIMEOUT_S", 0.05)  # no child can even import torch in that time
    summary = gpu_check.run_all(["environment", "empty_micro_batch"], dry=True, budget_s=60)
    assert summary["ok"] == {"environment": False, "empty_micro_batch": False} and not summary["all_ok"]


def test_a_check_past_the_budget_is_skipped_and_says_so(capsys) -> None:
    summary = gpu_check.run_all(["environment"], dry=True, budget_s=1)
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["skipped"].startswith("budget") and summary["all_ok"] is False


def test_without_a_gpu_the_real_run_says_so_instead_of_measuring_a_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the real check would run")
    done = run_check(tmp_path, "--only", "environment", timeout_s=120)
    record = json.loads(done.stdout.splitlines()[0])
    assert done.returncode == 1 and record["ok"] is False and "sees no CUDA device" in record["error"]
