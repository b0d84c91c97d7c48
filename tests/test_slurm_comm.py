"""comm_benchmark's node-pair mode (ops/drills/comm_pairs.py) on the namespace nodes of
``make slurm-up NODES=3``: every pair of node1..node3 timed by its own 2-node job, a link slowed with
a token bucket named as the outlier, and the bad inputs refused by name.

The outlier rule and the choice of mode are plain functions, tested everywhere; the tests that need
the cluster skip without it, or fail under TRAINYARD_REQUIRE_SLURM=1 (tests/slurm_lab.py).

Run: .venv/bin/python -m pytest -q -n 0 tests/test_slurm_comm.py
"""

from __future__ import annotations

import json
import subprocess
from contextlib import contextmanager
from pathlib import Path

import dagster as dg
import pytest
from slurm_lab import cluster_up, require_cluster

from assets.reports import CommBenchmarkConfig, comm_benchmark, pair_mode
from ops.drills import comm_pairs, reports
from resources import LineageResource, StorageResource
from resources.launcher import LocalTorchrunLauncher
from resources.slurm import SlurmLauncher

PARTITION = "nodes"
NODES = ("node1", "node2", "node3")
PAIRS = {"node1-node2", "node1-node3", "node2-node3"}
SIZES = (65536, 262144)  # small: under a 20 mbit link each collective still takes ~0.1 s at most
SLOW_LINK = "ty-node2-h"  # the host side of node2's veth (deploy/slurm/nodes.sh)


@pytest.fixture
def cluster() -> None:
    require_cluster()
    _, states = comm_pairs.partition_states(PARTITION) if cluster_up() else ("", {})
    require_cluster(f"partition {PARTITION!r} with {', '.join(NODES)} up",
                    ready=all(comm_pairs.usable(states.get(name, "down")) for name in NODES))


def settings(out_dir: Path, **fields) -> comm_pairs.PairSettings:
    return comm_pairs.PairSettings(**{"partition": PARTITION, "nodes": NODES, "sizes_bytes": SIZES,
                                      "out_dir": out_dir, "iterations": 5, "warmup": 1, **fields})


# ---------------------------------------------------------------------------------------------
# Plain functions


def test_outlier_rule_names_the_node_whose_pairs_are_all_slow():
    hosts = {"a-b": ("a", "b"), "a-c": ("a", "c"), "b-c": ("b", "c")}
    summary = comm_pairs.outliers({"a-b": 3e6, "a-c": 700e6, "b-c": 2e6}, hosts, 0.5)
    # Two slow pairs of three: the median pair (3e6) is slow, so the reference is the median node's best.
    assert summary["reference_bytes_per_s"] == 700e6
    assert summary["outlier_nodes"] == ["b"]
    assert summary["outlier_pairs"] == ["b-c", "a-b"] and summary["outlier"] == "b-c"
    assert "0.5 x the median node bandwidth" in summary["outlier_rule"]


def test_outlier_rule_names_a_slow_link_between_healthy_nodes_and_nothing_when_even():
    names = ["a-b", "a-c", "a-d", "b-c", "b-d", "c-d"]
    hosts = {name: tuple(name.split("-")) for name in names}
    one_link = comm_pairs.outliers({name: 100e6 if name != "a-c" else 10e6 for name in names}, hosts, 0.5)
    assert one_link["outlier_pairs"] == ["a-c"] and one_link["outlier_nodes"] == []
    even = comm_pairs.outliers({name: 100e6 * (1 + 0.1 * index) for index, name in enumerate(names)}, hosts, 0.5)
    assert even["outlier"] is None and even["outlier_pairs"] == even["outlier_nodes"] == []


def test_pair_bandwidth_is_the_median_collective_at_the_largest_size():
    rows = [{"collective": name, "size_bytes": size, "algbw_bytes_per_s": bandwidth}
            for name, size, bandwidth in [("all_reduce", 10, 1.0), ("all_gather", 10, 2.0), ("reduce_scatter", 10, 3.0),
                                          ("all_reduce", 99, 50.0), ("all_gather", 99, 7.0),
                                          ("reduce_scatter", 99, 9.0)]]
    assert comm_pairs.pair_bandwidth(rows) == 9.0


def test_usable_nodes_refuses_unknown_drained_and_too_few_by_name():
    states = {"node1": "idle", "node2": "drained", "node3": "mixed", "node4": "down", "node5": "idle*"}
    assert comm_pairs.usable_nodes("p", states) == ["node1", "node3"]
    with pytest.raises(ValueError, match="node 'node9' is not in partition 'p'"):
        comm_pairs.usable_nodes("p", states, nodes=["node1", "node9"])
    with pytest.raises(ValueError, match="node 'node2' of partition 'p' is drained"):
        comm_pairs.usable_nodes("p", states, nodes=["node1", "node2"])
    with pytest.raises(ValueError, match=r"at least 2 usable nodes in partition 'p', got \['node1'\]"):
        comm_pairs.usable_nodes("p", states, exclude=["node3"])


def test_pair_mode_follows_the_flag_and_the_slurm_launcher():
    config = CommBenchmarkConfig()
    assert pair_mode(config, None) is None
    assert pair_mode(config, LocalTorchrunLauncher()) is None
    assert pair_mode(config, SlurmLauncher(partition="nodes", nodes=1)) is None
    assert pair_mode(config, SlurmLauncher(partition="nodes", nodes=3, exclude=["node4"])) == ("nodes", ["node4"])
    assert pair_mode(CommBenchmarkConfig(node_pairs=True), None) == ("", [])
    assert pair_mode(CommBenchmarkConfig(node_pairs=True, partition="gpu"), SlurmLauncher(partition="nodes")) == (
        "gpu", [])


# ---------------------------------------------------------------------------------------------
# On the cluster


def check_pairs(report: dict, out_dir: Path) -> None:
    """Every pair of NODES measured on its own two hosts, each collective at each size."""
    assert set(report["pairs"]) == PAIRS
    assert len({pair["job_id"] for pair in report["pairs"].values()}) == 3
    for name, pair in report["pairs"].items():
        assert sorted(pair["hosts"]) == name.split("-")
        assert json.loads((out_dir / f"{name}.json").read_text())["hosts"] == pair["hosts"]
        assert sorted((row["collective"], row["size_bytes"]) for row in pair["rows"]) == sorted(
            (collective, size) for collective in reports.COLLECTIVES for size in SIZES)
        for row in pair["rows"]:
            assert row["time_s"] > 0
            assert row["algbw_bytes_per_s"] == pytest.approx(row["size_bytes"] / row["time_s"])
        assert pair["bandwidth_bytes_per_s"] == comm_pairs.pair_bandwidth(pair["rows"]) > 0


def test_every_pair_of_three_nodes_is_timed_on_its_hosts(cluster, tmp_path):
    report = comm_pairs.run_node_pairs(settings(tmp_path))
    check_pairs(report, tmp_path)
    # Unshaped links: every node reaches some peer at full speed (pairs sharing a CPU may be slower).
    assert report["outlier_nodes"] == [], report["node_bandwidth_bytes_per_s"]


@contextmanager
def slow_link(device: str, rate: str = "20mbit"):
    """A token bucket on ``device`` (netem is not in this kernel), always removed."""
    subprocess.run(["tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst", "32kbit",
                    "latency", "400ms"], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", device, "root"], check=True, capture_output=True)


def test_a_slowed_link_names_its_node_and_pairs(cluster, tmp_path):
    with slow_link(SLOW_LINK):
        report = comm_pairs.run_node_pairs(settings(tmp_path))
    assert "tbf" not in subprocess.run(["tc", "qdisc", "show", "dev", SLOW_LINK], capture_output=True,
                                       text=True).stdout
    check_pairs(report, tmp_path)
    bandwidth = report["pair_bandwidth_bytes_per_s"]
    assert report["outlier_nodes"] == ["node2"], bandwidth
    assert set(report["outlier_pairs"]) == {"node1-node2", "node2-node3"}, bandwidth
    assert report["outlier"] in ("node1-node2", "node2-node3")
    assert max(bandwidth["node1-node2"], bandwidth["node2-node3"]) < 0.1 * bandwidth["node1-node3"]  # 2.5 MB/s tbf


def test_bad_nodes_are_refused_by_name_before_any_job(cluster, tmp_path):
    out_dir = tmp_path / "pairs"
    with pytest.raises(ValueError, match="node 'node9' is not in partition 'nodes'"):
        comm_pairs.run_node_pairs(settings(out_dir, nodes=("node1", "node9")))
    with pytest.raises(ValueError, match=r"at least 2 usable nodes in partition 'nodes', got \['node1'\]"):
        comm_pairs.run_node_pairs(settings(out_dir, nodes=("node1",)))
    with pytest.raises(ValueError, match="unknown SLURM partition 'nope'"):
        comm_pairs.run_node_pairs(settings(out_dir, partition="nope"))
    assert not out_dir.exists()  # refused before submitting: no job was started


def test_a_failing_job_names_its_pair(cluster, tmp_path):
    with pytest.raises(comm_pairs.PairJobFailed, match=r"node pair node1-node2: SLURM job \d+ ended FAILED") as error:
        comm_pairs.run_node_pairs(settings(tmp_path, python=str(tmp_path / "no-python")))
    assert "no-python" in str(error.value)  # the job log's tail says why


def test_a_job_past_its_deadline_is_cancelled(cluster, tmp_path, monkeypatch):
    hang = tmp_path / "hang.sh"
    hang.write_text("#!/bin/sh\nsleep 300\n")
    hang.chmod(0o755)
    monkeypatch.setattr(comm_pairs, "RUN_GRACE_S", 2.0)  # give up 3 s after it starts, not at SLURM's minute
    submitted = []
    real_slurm = comm_pairs._slurm

    def recording(*command, **kwargs):
        out = real_slurm(*command, **kwargs)
        if command[0] == "sbatch":
            submitted.append(out.strip().split(";")[0])
        return out

    monkeypatch.setattr(comm_pairs, "_slurm", recording)
    with pytest.raises(comm_pairs.PairJobFailed, match=r"node pair node1-node2: SLURM job \d+ ran past"):
        comm_pairs.run_node_pairs(settings(tmp_path, python=str(hang), time_limit_s=1))
    [job_id] = submitted
    assert comm_pairs.job_state(job_id)[0] == "CANCELLED"


def test_comm_benchmark_times_node_pairs_under_a_multi_node_slurm_launcher(cluster, tmp_path, monkeypatch):
    # The deployment's launcher (TRAINYARD_ENV=slurm, pipelines/definitions.py) spans 3 nodes: pair mode.
    monkeypatch.setenv("TRAINYARD_ENV", "slurm")
    monkeypatch.setenv("TRAINYARD_SLURM_PARTITION", PARTITION)
    monkeypatch.setenv("TRAINYARD_SLURM_NODES", "3")
    monkeypatch.setenv("TRAINYARD_SLURM_NPROC_PER_NODE", "1")
    data = tmp_path / "data"
    config = {"config_path": "configs/test_tiny.yaml", "sizes_bytes": list(SIZES), "iterations": 3, "warmup": 1}
    result = dg.materialize([comm_benchmark], resources={
        "storage": StorageResource(media_root=str(tmp_path / "media"), data_root=str(data)),
        "lineage": LineageResource()}, run_config={"ops": {"comm_benchmark": {"config": config}}})
    [event] = result.asset_materializations_for_node("comm_benchmark")
    metadata = {name: value.value for name, value in event.metadata.items()}
    assert metadata["mode"] == "node_pairs" and metadata["partition"] == PARTITION and metadata["num_pairs"] == 3
    assert metadata["outlier_rule"].startswith("pair bandwidth = median over collectives")
    for name in PAIRS:
        assert f"| {name} | all_reduce | 262144 |" in metadata["table"]
        assert f"| {name} | " in metadata["pair_bandwidths"]
    report = json.loads(Path(metadata["report_path"]).read_text())
    check_pairs(report, data / "reports" / "comm_benchmark" / "pairs" / result.run_id)
    assert report["model"]["fsdp_unit_bytes"] and sum(report["model"]["fsdp_unit_bytes"]) == report["model"][
        "gradient_bytes"]
    assert metadata["outlier"] == (report["outlier"] or "none")
