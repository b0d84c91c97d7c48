"""Report assets (assets/reports.py) over ops/drills/reports.py: real spawned ranks, real trainer runs, real run folders.

One module-scoped data root: the scaling and canary workloads run once (configs/test_tiny.yaml, 4
steps) and the cost report then prices the run folders they left.
"""

import json
import shutil
from pathlib import Path

import dagster as dg
import pytest

from assets.reports import canary, canary_passed, comm_benchmark, cost_report, scaling_report
from ops.drills import reports
from resources import LineageResource, StorageResource

TINY = "configs/test_tiny.yaml"
WORKLOAD = {"config_path": TINY, "steps": 4, "warmup_steps": 2, "per_device_batch": 2}


def _resources(data: Path) -> dict:
    return {"storage": StorageResource(media_root=str(data / "media"), data_root=str(data)), "lineage": LineageResource()}


def _materialize(assets, data: Path, op: str, config: dict, **kwargs) -> dg.ExecuteInProcessResult:
    return dg.materialize(assets, resources=_resources(data), run_config={"ops": {op: {"config": config}}}, **kwargs)


def _metadata(result: dg.ExecuteInProcessResult, key: str) -> dict:
    [event] = result.asset_materializations_for_node(key)
    return {name: value.value for name, value in event.metadata.items()}


@dg.asset(deps=["canary"])
def promoted() -> int:
    """Stands for whatever a passing candidate is promoted into."""
    return 1


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, all_reduce, gather", [(2, 10.0, 5.0), (4, 15.0, 7.5), (8, 17.5, 8.75)])
def test_bus_bandwidth_follows_nccl_tests(n, all_reduce, gather):
    # By hand, algbw 10 GB/s: all_reduce x 2(n-1)/n; all_gather and reduce_scatter x (n-1)/n.
    assert reports.bus_bandwidth("all_reduce", 10.0, n) == pytest.approx(all_reduce)
    assert reports.bus_bandwidth("all_gather", 10.0, n) == pytest.approx(gather)
    assert reports.bus_bandwidth("reduce_scatter", 10.0, n) == pytest.approx(gather)
    with pytest.raises(ValueError, match="broadcast"):
        reports.bus_bandwidth("broadcast", 10.0, n)


def test_bucket_bytes_follow_ddp_caps():
    # Ready order is the reverse of the parameter order; the first bucket closes past 1 MiB, the rest at 25 MiB.
    mib = 1024 * 1024
    numels = [mib // 4] * 3 + [8 * mib] * 4  # three 1 MiB and four 32 MiB fp32 gradients
    assert reports.bucket_bytes(numels) == [32 * mib, 32 * mib, 32 * mib, 32 * mib, 3 * mib]
    assert reports.bucket_bytes([10, 20, 30]) == [240]


def test_comm_benchmark_times_real_collectives(tmp_path):
    sizes = [4096, 65536]
    result = _materialize([comm_benchmark], tmp_path, "comm_benchmark",
                          {"config_path": TINY, "sizes_bytes": sizes, "iterations": 3, "warmup": 1})
    metadata = _metadata(result, "comm_benchmark")
    assert metadata["backend"] == "gloo" and metadata["world_size"] == 2 and metadata["dtype"] == "float32"
    assert metadata["plot"].startswith("![comm_benchmark](data:image/png;base64,")
    report = json.loads(Path(metadata["report_path"]).read_text())
    assert report["model"]["gradient_bytes"] == 4 * report["model"]["num_params"] == sum(report["model"]["bucket_bytes"])
    assert sorted((row["collective"], row["size_bytes"]) for row in report["rows"]) == sorted(
        (name, size) for name in reports.COLLECTIVES for size in sizes)
    for row in report["rows"]:
        assert row["time_s"] > 0
        assert row["algbw_gbps"] == pytest.approx(row["size_bytes"] / row["time_s"] / 1e9)
        factor = 1.0 if row["collective"] == "all_reduce" else 0.5  # 2 ranks: 2(n-1)/n and (n-1)/n
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
    assert (Path(metadata["report_path"]).parent / "plot.png").read_bytes().startswith(b"\x89PNG")


def test_cost_report_empty_state(tmp_path):
    metadata = _metadata(_materialize([cost_report], tmp_path, "cost_report", {}), "cost_report")
    assert metadata["status"] == "empty"
    assert "no training run folders" in metadata["empty_reason"]


# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reports_data")


@pytest.fixture(scope="module")
def scaling(data_root):
    result = _materialize([scaling_report], data_root, "scaling_report", {**WORKLOAD, "world_sizes": [1, 2]})
    return _metadata(result, "scaling_report")


def test_scaling_report_weak_scaling(scaling, data_root):
    report = json.loads(Path(scaling["report_path"]).read_text())
    rows = {row["world_size"]: row for row in report["rows"]}
    assert sorted(rows) == [1, 2] and report["warmup_steps_excluded"] == 2
    assert [rows[n]["global_batch"] for n in (1, 2)] == [2, 4] and {row["per_device_batch"] for row in rows.values()} == {2}
    finals = {json.loads(path.read_text())["world_size"]: json.loads(path.read_text())
              for path in data_root.glob("runs/scaling_report-*/final.json")}
    throughput = {n: finals[n]["performance"]["samples_per_s"] for n in (1, 2)}
    assert rows[2]["efficiency"] == pytest.approx(throughput[2] / (2 * throughput[1]))
    assert scaling["efficiency_2"] == pytest.approx(rows[2]["efficiency"]) and scaling["efficiency_1"] == pytest.approx(1)
    assert report["baseline_step_profile"] == {"status": "not materialized yet"}
    assert scaling["plot"].startswith("![scaling_report](data:image/png;base64,")


@pytest.mark.parametrize(("env", "nodes", "extra", "message"), [
    ({}, [1, 2], {}, "needs the SLURM deployment (TRAINYARD_ENV=slurm"),
    ({"TRAINYARD_ENV": "slurm", "TRAINYARD_SLURM_NODES": "2"}, [1, 3], {},
     "must be between 1 and the launcher's nodes (2"),
    ({"TRAINYARD_ENV": "slurm", "TRAINYARD_SLURM_NODES": "2"}, [0, 1], {}, "must be between 1"),
    ({}, [1, 2], {"world_sizes": [1, 2]}, "world_sizes [1, 2] and nodes across SLURM nodes do not go together"),
    ({}, [1, 2], {"steps": 2, "warmup_steps": 2}, "steps (2) must exceed warmup_steps (2)"),
], ids=["no_slurm", "more_than_the_launcher", "zero", "world_sizes_too", "no_steady_step"])
def test_scaling_across_nodes_refuses_what_it_cannot_run_before_any_job(data_root, monkeypatch, env, nodes, extra,
                                                                        message):
    monkeypatch.delenv("TRAINYARD_ENV", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = _materialize([scaling_report], data_root, "scaling_report", {**WORKLOAD, "nodes": nodes, **extra},
                          raise_on_error=False)
    [failure] = [event.step_failure_data for event in result.all_events if event.is_step_failure]
    assert message in failure.user_failure_data.description, failure.user_failure_data.description


CANARY = {**WORKLOAD, "checkpoint_every": 2, "arm_a": ["train.precision=fp32"], "label_b": "test"}


def _canary(data_root: Path, arm_b: list[str], **kwargs) -> dg.ExecuteInProcessResult:
    return _materialize([canary, canary_passed, promoted], data_root, "canary", {**CANARY, "arm_b": arm_b}, **kwargs)


@pytest.fixture(scope="module")
def canary_same(data_root):
    return _canary(data_root, ["train.precision=fp32"])


def test_canary_passes_identical_arms_and_promotes(canary_same):
    metadata = _metadata(canary_same, "canary")
    assert metadata["status"] == "passed" and metadata["passed"] is True
    report = json.loads(Path(metadata["report_path"]).read_text())
    assert report["num_steps"] == 4 and report["arms"]["a"] != report["arms"]["b"]  # two runs, not one twice
    [check] = canary_same.get_asset_check_evaluations()
    assert check.passed
    assert canary_same.asset_materializations_for_node("promoted")


def test_canary_fails_a_perturbed_candidate_and_blocks_promotion(canary_same, data_root):
    result = _canary(data_root, ["train.precision=fp32", "optim.lr=0.01"], raise_on_error=False)
    metadata = _metadata(result, "canary")
    assert metadata["status"] == "failed" and metadata["passed"] is False
    report = json.loads(Path(metadata["report_path"]).read_text())
    assert report["failed_steps"]  # the step-1 loss is the same (same init, same data); the updates differ
    # The verdict is the stated tolerances' (CanaryConfig's defaults), recomputed here by hand per step.
    tol = report["tolerances"]
    assert (tol["loss_rtol"], tol["loss_atol"], tol["grad_norm_rtol"], tol["grad_norm_atol"]) == (0.02, 1e-4, 0.05, 1e-4)
    by_hand = [row["step"] for row in report["steps"]
               if abs(row["loss_b"] - row["loss_a"]) > 1e-4 + 0.02 * abs(row["loss_a"])
               or abs(row["grad_norm_b"] - row["grad_norm_a"]) > 1e-4 + 0.05 * abs(row["grad_norm_a"])]
    assert report["failed_steps"] == by_hand
    [check] = result.get_asset_check_evaluations()
    assert not check.passed
    assert not result.asset_materializations_for_node("promoted")  # blocking: the candidate is not promoted


def test_canary_refuses_arms_that_saw_different_data(canary_same, data_root):
    with pytest.raises(dg.Failure, match=r"canary refused: canary arms saw different samples at step 1"):
        _canary(data_root, ["train.precision=fp32", "data.shuffle=false"])


def test_cost_report_prices_every_run_folder(scaling, canary_same, data_root):
    # An abandoned run: a real run folder whose rank 0 never wrote final.json, launched on a shard index.
    # Each canary materialization runs its arms anew (folders named by the Dagster run): any finished one.
    done = next(path for path in sorted(data_root.glob("runs/canary_a-*")) if (path / "final.json").exists())
    abandoned = data_root / "runs" / "pretrain-abandoned"
    shutil.copytree(done, abandoned)
    final = json.loads((abandoned / "final.json").read_text())
    (abandoned / "final.json").unlink()
    (abandoned / "launch.json").write_text(json.dumps(
        {"stage": "pretrain", "world_size": 1, "shard_index_version": "idx-v1", "manifest_version": "man-v1",
         "config": final["config"]}))
    with pytest.raises(reports.PriceMissing, match="'cpu'"):
        reports.cost_report(data_root, {"NVIDIA H200": 3.5})
    result = _materialize([cost_report], data_root, "cost_report", {"prices_per_hour": {"cpu": 36.0}})
    report = json.loads(Path(_metadata(result, "cost_report")["report_path"]).read_text())
    runs = {Path(row["run_dir"]).name: row for row in report["runs"]}
    assert len(runs) == len(list(data_root.glob("runs/*"))) and report["num_unfinished"] == 1
    lost = runs["pretrain-abandoned"]
    assert lost["status"] == "abandoned (no final.json)" and lost["elapsed_s"] > 0
    assert lost["stage"] == "pretrain" and lost["data_version"] == "idx-v1 (manifest man-v1)"
    assert report["by_data_version"]["idx-v1 (manifest man-v1)"] == pytest.approx(lost["cost"])
    assert lost["cost"] == pytest.approx(lost["elapsed_s"] / 100)  # 36 per machine-hour
    assert {"scaling_report", "canary_a", "canary_b", "pretrain"} <= set(report["by_stage"])
    assert report["total_cost"] == pytest.approx(sum(report["by_stage"].values()))
    saved = runs[done.name]
    assert saved["num_checkpoints"] == 2 and saved["checkpoint_s"] > 0
    assert report["checkpoint_cost"] > 0


def test_cost_report_asset_names_the_unpriced_device(scaling, data_root):
    with pytest.raises(dg.Failure, match="no price for device type.*'cpu'"):
        _materialize([cost_report], data_root, "cost_report", {"prices_per_hour": {"NVIDIA H200": 3.5}})


def test_cost_report_survives_slurm_and_torn_attempt_lines_and_bills_a_drills_copy_once(scaling, data_root, tmp_path):
    """SLURM appends an attempt line without a duration when it ends a job first; a killed writer leaves
    a torn last line; a restore drill keeps a copy of the original run's records. None of them crash
    the report or bill the original twice."""
    root = tmp_path / "data"
    [source] = [path for path in data_root.glob("runs/scaling_report-*") if (path / "final.json").exists()][:1]
    run = root / "runs" / "pretrain-x"
    shutil.copytree(source, run)
    (run / "attempts.jsonl").write_text(
        json.dumps({"attempt": 0, "duration_s": 30.0, "decision": "requeue"}) + "\n"
        + json.dumps({"attempt": 1, "decision": "requeue", "why": "SLURM PREEMPTED"}) + "\n"
        + '{"attempt": 2, "durat')
    shutil.copytree(run, root / "drills" / "drill-1" / "original_records")
    report = reports.cost_report(root, {"cpu": 36.0})
    [row] = report["runs"]
    assert Path(row["run_dir"]) == run and row["elapsed_s"] == pytest.approx(30.0)
    assert "1 attempt(s) without a duration" in row["elapsed_from"]
