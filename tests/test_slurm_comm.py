"""comm_benchmark's node-pair mode (ops/drills/comm_pairs.py): the plain parts, which need no
cluster: the outlier rule, the pair bandwidth, the refusal of unknown, drained and too few nodes,
and the choice of mode.

The jobs on the namespace nodes of ``make slurm-up NODES=3`` (every pair of node1..node3 timed by its
own 2-node job, a link slowed with a token bucket named as the outlier, bad nodes and failing or
hanging jobs) are in tests/test_slurm_nodes.py, which owns those nodes for its whole run: a module
here would meet its node losses and drains on the other pytest worker.

Run: .venv/bin/python -m pytest -q -n 0 tests/test_slurm_comm.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

from assets.reports import CommBenchmarkConfig, pair_mode
from ops.drills import comm_pairs
from resources.launcher import LocalTorchrunLauncher
from resources.slurm import SlurmLauncher

PARTITION = "nodes"
NODES = ("node1", "node2", "node3")
PAIRS = {"node1-node2", "node1-node3", "node2-node3"}
SIZES = (65536, 262144)  # small: under a 20 mbit link each collective still takes ~0.1 s at most
SLOW_LINK = "ty-node2-h"  # the host side of node2's veth (deploy/slurm/nodes.sh)


# The lab's three nodes share this machine's two cores with the rest of the suite: CPU contention
# alone has made an unshaped pair 5x slower than another (57 against 308 MB/s), while the shaped link
# is over 100x slower (2.5 MB/s). The rule at 0.1 x the median node tells the two apart here; on a
# real cluster the default (0.5) holds.
LAB_OUTLIER_FRACTION = 0.1


def settings(out_dir: Path, **fields) -> comm_pairs.PairSettings:
    return comm_pairs.PairSettings(**{"partition": PARTITION, "nodes": NODES, "sizes_bytes": SIZES,
                                      "out_dir": out_dir, "iterations": 5, "warmup": 1,
                                      "outlier_fraction": LAB_OUTLIER_FRACTION, **fields})


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
