"""Training across machines (issue 35) on the real multi-node cluster of ``make slurm-up NODES=3``:
three compute nodes, each a network and UTS namespace with its own address on a bridge, its own
slurmd and one CPU (deploy/slurm/nodes.sh). .ci/run starts it; without it these tests fail under
TRAINYARD_REQUIRE_SLURM=1 and are skipped otherwise.

- a 2-node pretrain through Dagster is bit-identical to the same world size on one node, and its
  records name every host;
- a node lost mid-run (every process in its namespace SIGKILLed, or its link down with the processes
  alive) ends the job within the stated bound, is classified ``node_lost`` naming the host, the ranks
  and the step, and the run continues without it: at the same world size on a spare node
  (bit-identical), or on the remaining node at a smaller world size (the drill's reassociation rule).

Run: sudo make slurm-up NODES=3 && python -m pytest tests/test_slurm_nodes.py -q
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import dagster as dg
import mlflow
import pyarrow.parquet as pq
import pytest
import torch
from helpers import captured_fds
from slurm_lab import (SlurmLab, cluster_up, failure_of, materialization, pretrain_config, processes_of_job,
                       require_cluster, slurm_lab)

from assets import reports as reports_assets
from assets.reports import comm_benchmark
from ops.drills import comm_pairs, reports
from ops.drills.restore import compare, comparison_rule, continuation_record
from ops.publish import paths
from resources import LineageResource, StorageResource
from resources.node_health import DrainRule, NodeHistory
from resources.slurm import SlurmLauncher, run_slurm
from resources.slurm_nodes import node_states

NODES_SH = paths.REPO_ROOT / "deploy" / "slurm" / "nodes.sh"
LOSE_NODE_SH = paths.REPO_ROOT / "deploy" / "slurm" / "lose-node.sh"


def _nodes_partition() -> list[str]:
    try:
        listed = run_slurm("sinfo", "-h", "-p", "nodes", "-o", "%N").strip()
        return run_slurm("scontrol", "show", "hostnames", listed).split() if listed else []
    except Exception:  # noqa: BLE001 - no cluster: require_cluster says so below
        return []


require_cluster("a SLURM cluster with 3 namespace nodes (partition nodes)",
                ready=cluster_up() and len(_nodes_partition()) >= 3)


def _node_sh(function: str, *args: str) -> None:
    """A function of deploy/slurm/nodes.sh (the project's own node faults), as root."""
    subprocess.run(["bash", "-c", f'. "{NODES_SH}" && {function} "$@"', "nodes.sh", *args], check=True, timeout=60)


def _index(node: str) -> str:
    return node.removeprefix("node")


def _bring_back(node: str, *, resume: bool = True) -> None:
    """The node's link up, its slurmd running and answering SLURM (deploy/slurm/lose-node.sh restore),
    then back in service (or left drained: ``resume=False``)."""
    subprocess.run(["bash", str(LOSE_NODE_SH), "restore", node], check=True, timeout=150)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = node_states([node], run=run_slurm)[node]
        if not state.lost and (not state.draining or not resume) and state.state.split("+")[0] in (
                "IDLE", "MIXED", "ALLOCATED"):
            return
        if resume and ("DOWN" in state.flags or state.draining):  # else ReturnToService brings it back drained
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=30)
        time.sleep(1)
    raise AssertionError(f"{node} did not come back: {node_states([node], run=run_slurm)[node]}")


# ---------------------------------------------------------------------------------------------
# Communication by node pair (comm_benchmark's pair mode): before any node is lost below, in this
# module, so that no other module's node loss or drain meets these jobs (one xdist worker runs a
# whole module). The plain parts are tested in tests/test_slurm_comm.py.

from test_slurm_comm import NODES, PAIRS, PARTITION, SIZES, SLOW_LINK, settings  # noqa: E402


@pytest.fixture
def cluster() -> None:
    require_cluster()
    _, states = comm_pairs.partition_states(PARTITION) if cluster_up() else ("", {})
    require_cluster(f"partition {PARTITION!r} with {', '.join(NODES)} up",
                    ready=all(comm_pairs.usable(states.get(name, "down")) for name in NODES))


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


def test_scaling_report_measures_one_node_against_two_with_its_denominators_stated(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_ENV", "slurm")
    for name, value in (("PARTITION", PARTITION), ("NODES", "2"), ("NPROC_PER_NODE", "1"), ("CPUS_PER_TASK", "1"),
                        ("TIME", "00:10:00")):
        monkeypatch.setenv(f"TRAINYARD_SLURM_{name}", value)
    config = {"config_path": "configs/test_tiny.yaml", "steps": 8, "warmup_steps": 3, "per_device_batch": 2}
    result = dg.materialize([reports_assets.scaling_report], resources={
        "storage": StorageResource(media_root=str(tmp_path / "media"), data_root=str(tmp_path / "data")),
        "lineage": LineageResource()}, run_config={"ops": {"scaling_report": {"config": config}}})
    [event] = result.asset_materializations_for_node("scaling_report")
    metadata = {name: value.value for name, value in event.metadata.items()}
    report = json.loads(Path(metadata["report_path"]).read_text())
    one, two = report["rows"]
    assert metadata["mode"] == report["mode"] == "nodes" and (one["nodes"], two["nodes"]) == (1, 2)
    assert (one["world_size"], two["world_size"]) == (1, 2) and one["per_device_batch"] == two["per_device_batch"] == 2
    assert (one["global_batch"], two["global_batch"]) == (2, 4)  # weak scaling: the same batch on every device
    assert len(one["hosts"]) == 1 and len(set(two["hosts"])) == 2 and set(one["hosts"] + two["hosts"]) <= set(NODES)
    assert one["num_steady_steps"] == two["num_steady_steps"] == 8 - 3  # the warm-up steps are not in the figure
    # The denominator: n times the one-node throughput measured here, on the node named in its row.
    assert one["efficiency"] == 1.0 and metadata["efficiency_1n"] == 1.0
    assert two["efficiency"] == two["samples_per_s"] / (2 * one["samples_per_s"]) == metadata["efficiency_2n"]
    assert 0 < two["efficiency"] and two["samples_per_s_per_node"] == two["samples_per_s"] / 2
    assert "steady steps only" in report["efficiency_rule"] and "--exclusive" in report["efficiency_rule"]
    for row in (one, two):  # the ranks themselves say where they ran
        [run_dir] = (tmp_path / "data" / "runs").glob(f"scaling_report-*-{row['nodes']}n")
        final = json.loads((run_dir / "final.json").read_text())
        assert sorted(final["environment"]["hosts"].split(",")) == sorted(row["hosts"]), final["environment"]
        assert "--exclusive" in (run_dir / "launch" / f"scaling_report-{row['nodes']}n.sbatch").read_text()


# ---------------------------------------------------------------------------------------------
# Data work across nodes (issue 36): probing and clip_shards backfills as SLURM array jobs, on
# node1 and node2 (node3 is left out, except where a node is lost), before any training test
# below loses or drains a node.

from helpers import copy_media  # noqa: E402

from assets import clips as clip_assets, data as data_assets  # noqa: E402
from ops.clips import plan as plan_ops  # noqa: E402
from ops.curation import rights  # noqa: E402
from ops.publish.hashing import sha256_file  # noqa: E402
from resources.launcher import LocalTorchrunLauncher  # noqa: E402

CLIPS_PER_SHARD = 4  # the demo's 40 clips in 11 shards
DATA_QUIET = {"console": {"config": {"log_level": "WARNING"}}}


class DataLab:
    """The demo media built twice through the same data assets: on this machine (the reference: its
    manifest, plan and shards, every partition in one run of the local path) and on the cluster,
    whose probing and shard writing run as array jobs."""

    def __init__(self, base: Path, demo) -> None:
        self.base = base
        self.media = copy_media(demo.out_dir, base / "media")
        self.data = base / "data"
        self.local_data = base / "local-data"
        self._instances = contextlib.ExitStack()
        self.instance = self._new_instance("dagster")
        self.local_instance = self._new_instance("dagster-local")
        built = self.build(LocalTorchrunLauncher(), local=True)
        assert built.success, [event.message for event in built.all_events if event.is_failure]
        self.local_versions = _versions(built)
        self.plan = plan_ops.read_plan(self.local_data / "shards" / self.local_versions["plan_version"])
        self.reference = self.local_data / "shards" / self.plan.version
        written = self.backfill(LocalTorchrunLauncher(), self.plan.shards, local=True)
        assert written.success, [event.message for event in written.all_events if event.is_failure]
        self.local_events = _partition_events(written)
        self.sha256 = {shard: _plain(self.local_events[shard])["sha256"] for shard in self.plan.shards}
        # The rights ledger as this machine's build left it: a revocation's ledger event (with its
        # time) is part of the validated set's decisions, so both builds judge with the same ledger.
        shutil.copytree(rights.rights_dir(self.local_data), rights.rights_dir(self.data))

    def _new_instance(self, name: str) -> dg.DagsterInstance:
        (self.base / name).mkdir()
        return self._instances.enter_context(dg.DagsterInstance.local_temp(tempdir=str(self.base / name)))

    def launcher(self, **fields) -> SlurmLauncher:
        return SlurmLauncher(**{"partition": "nodes", "exclude": ["node3"], "poll_s": 0.5, "array_parallel": 2,
                                "probe_objects_per_task": 8, "array_task_time": "00:05:00",
                                "shared_paths": [str(self.base), str(paths.REPO_ROOT), "/tmp"], **fields})

    def job(self, launcher, *, local: bool = False) -> dg.JobDefinition:
        data = self.local_data if local else self.data
        resources = {"storage": StorageResource(media_root=str(self.media), data_root=str(data)),
                     "lineage": LineageResource(), "launcher": launcher}
        return dg.Definitions(assets=[data_assets.raw_media, data_assets.dataset_manifest,
                                      data_assets.validated_manifest_and_quarantine, clip_assets.clip_plan,
                                      clip_assets.clip_shards],
                              resources=resources).resolve_implicit_global_asset_job_def()

    def build(self, launcher, *, local: bool = False) -> dg.ExecuteInProcessResult:
        """raw_media .. clip_plan, the probing through ``launcher``."""
        config = {"loggers": DATA_QUIET, "ops": {"clip_plan": {"config": {"clips_per_shard": CLIPS_PER_SHARD}}}}
        with captured_fds(self.base / "output.log", append=True):
            return self.job(launcher, local=local).execute_in_process(
                instance=self.local_instance if local else self.instance, run_config=config, raise_on_error=False,
                asset_selection=[dg.AssetKey(name) for name in ("raw_media", "dataset_manifest", "validated_manifest",
                                                                 "quarantine", "clip_plan")])

    def backfill(self, launcher, partitions: list[str], *, run_id: str | None = None,
                 local: bool = False) -> dg.ExecuteInProcessResult:
        """One run of clip_shards over ``partitions`` (a range of the dynamic partitions), as a backfill
        policy groups them."""
        instance = self.local_instance if local else self.instance
        keys = instance.get_dynamic_partitions("clip_shards")
        assert partitions == keys[keys.index(partitions[0]):keys.index(partitions[-1]) + 1], "a contiguous range"
        with captured_fds(self.base / "output.log", append=True):
            return self.job(launcher, local=local).execute_in_process(
                instance=instance, run_config={"loggers": DATA_QUIET}, raise_on_error=False, run_id=run_id,
                asset_selection=[dg.AssetKey("clip_shards")],
                tags={"dagster/asset_partition_range_start": partitions[0],
                      "dagster/asset_partition_range_end": partitions[-1]})

    def logs(self, run_id: str) -> list[str]:
        try:
            return [entry.message or "" for entry in self.instance.all_logs(run_id)]
        except Exception:  # noqa: BLE001 - the run may not be in storage yet
            return []

    def array_jobs(self, run_id: str) -> list[str]:
        return [line.split("submitted SLURM array job ")[1].split(":")[0] for line in self.logs(run_id)
                if "submitted SLURM array job " in line]

    def close(self) -> None:
        self._instances.close()


def _versions(result: dg.ExecuteInProcessResult) -> dict[str, str]:
    versions = {}
    for event in result.get_asset_materialization_events():
        for name in ("manifest_version", "validated_version", "plan_version"):
            if event.asset_key.to_user_string() in ("dataset_manifest", "validated_manifest", "clip_plan"):
                value = _plain(event.materialization).get(name)
                if value and event.asset_key.to_user_string() == {"manifest_version": "dataset_manifest",
                                                                  "validated_version": "validated_manifest",
                                                                  "plan_version": "clip_plan"}[name]:
                    versions[name] = value
    return versions


def _partition_events(result: dg.ExecuteInProcessResult) -> dict[str, dg.AssetMaterialization]:
    return {event.materialization.partition: event.materialization for event in result.get_asset_materialization_events()
            if event.asset_key == dg.AssetKey("clip_shards")}


def _plain(materialization: dg.AssetMaterialization) -> dict:
    return {name: getattr(value, "value", getattr(value, "text", value)) for name, value in materialization.metadata.items()}


def _array_processes(job_id: str) -> list[tuple[int, str, str]]:
    """(pid, node, array task id) of the live task processes of array job ``job_id`` (their environment)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = dict(item.split("=", 1) for item in (proc / "environ").read_bytes().decode(errors="replace")
                           .split("\0") if "=" in item)
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if environ.get("SLURM_ARRAY_JOB_ID") == job_id and "ops.array_tasks" in cmdline and state != "Z":
            found.append((int(proc.name), environ.get("SLURMD_NODENAME", ""), environ.get("SLURM_ARRAY_TASK_ID", "")))
    return found


def _staging_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob(".*tmp*"))


@pytest.fixture(scope="module")
def data_lab(demo, tmp_path_factory: pytest.TempPathFactory):
    require_cluster()
    base = tmp_path_factory.mktemp("slurm-data")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINYARD_HOME", str(base / "home"))
        patch.setenv("TRAINYARD_DATA_ROOT", str(base / "data"))
        lab = DataLab(base, demo)
        try:
            yield lab
        finally:
            lab.close()


@pytest.fixture(scope="module")
def cluster_built(data_lab: DataLab) -> dg.ExecuteInProcessResult:
    result = data_lab.build(data_lab.launcher())
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    return result


def test_a_probe_across_two_nodes_gives_the_one_machine_manifest_version_and_quarantine(data_lab: DataLab,
                                                                                        cluster_built) -> None:
    versions = _versions(cluster_built)
    assert versions == data_lab.local_versions, "the manifest, and so the validated set and plan, of one machine"
    assert set(versions) == {"manifest_version", "validated_version", "plan_version"}
    here = pq.read_table(data_lab.local_data / "validated" / versions["validated_version"] / "quarantine.parquet")
    there = pq.read_table(data_lab.data / "validated" / versions["validated_version"] / "quarantine.parquet")
    assert sorted(zip(*(there.column(name).to_pylist() for name in ("uri", "reason")))) == sorted(
        zip(*(here.column(name).to_pylist() for name in ("uri", "reason")))) and here.num_rows > 0
    # The listing was cut into array tasks of 8 objects, and both nodes probed.
    [probe_run] = [path for path in (data_lab.data / "probes").iterdir()]
    chunks = [json.loads(path.read_text()) for path in sorted((probe_run / "results").glob("probe-chunk-*.json"))]
    assert len(chunks) >= 3 and all(len(chunk["results"]) <= 8 for chunk in chunks)
    assert {chunk["node"] for chunk in chunks} == {"node1", "node2"}, [chunk["node"] for chunk in chunks]
    assert not list(data_lab.local_data.glob("probes")), "the local path probes in the step"


def test_a_backfill_of_every_partition_across_two_nodes_is_byte_identical_to_the_local_path(data_lab: DataLab,
                                                                                           cluster_built) -> None:
    partitions = data_lab.instance.get_dynamic_partitions("clip_shards")
    assert partitions == data_lab.plan.shards and len(partitions) >= 8
    run_id = str(uuid.uuid4())
    # At most 5 tasks per array job (a cluster's MaxArraySize, lowered): 11 tasks go as 3 jobs.
    result = data_lab.backfill(data_lab.launcher(array_max_size=5), partitions, run_id=run_id)
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    events = _partition_events(result)
    assert sorted(events) == sorted(partitions), "one materialization per partition"
    out_dir = data_lab.data / "shards" / data_lab.plan.version
    for partition in partitions:
        metadata = _plain(events[partition])
        assert metadata["sha256"] == data_lab.sha256[partition] == sha256_file(out_dir / f"{partition}.tar")
        assert (out_dir / f"{partition}.tar").read_bytes() == (data_lab.reference / f"{partition}.tar").read_bytes()
        assert (out_dir / f"{partition}.index.parquet").read_bytes() == (
            data_lab.reference / f"{partition}.index.parquet").read_bytes()
        assert events[partition].tags["dagster/data_version"] == data_lab.sha256[partition][:20]
    nodes = {_plain(events[partition])["node"] for partition in partitions}
    assert nodes == {"node1", "node2"}, nodes
    assert not _staging_files(out_dir)
    # Each task's log lines and progress reached the Dagster run through Pipes.
    streamed = [line for line in data_lab.logs(run_id) if line.startswith("[task ") and " written (1/1 " in line]
    assert {line.split()[3].rstrip("]") for line in streamed} == {"node1", "node2"}
    assert len(streamed) == len(partitions), streamed
    # Split at the array size; each job's script caps its running tasks at array_parallel.
    jobs = data_lab.array_jobs(run_id)
    assert len(jobs) == 3, jobs
    scripts = sorted((data_lab.data / "backfills" / run_id / "round-1").glob("clip_shards-tasks-*.sbatch"))
    assert [script.name for script in scripts] == [f"clip_shards-tasks-{n}.sbatch" for n in (0, 10, 5)]
    assert all("#SBATCH --array=0-" in script.read_text() and "%2\n" in script.read_text() for script in scripts)
    # The report: per node, and the queue wait apart from the work.
    report = json.loads((data_lab.data / "backfills" / run_id / "report.json").read_text())
    assert report["num_written"] == len(partitions) and report["where"] == "slurm"
    assert sum(stats["partitions_written"] for stats in report["nodes"].values()) == len(partitions)
    assert all(stats["bytes_read"] > 0 and stats["bytes_written"] > 0 and stats["decode_s"] > 0
               for stats in report["nodes"].values())
    assert report["queue_wait_s"]["tasks"] == len(partitions) and report["queue_wait_s"]["max"] > 0
    # The same metadata and lineage as the partition written on this machine.
    here, there = _plain(data_lab.local_events[partitions[0]]), _plain(events[partitions[0]])
    assert set(here) == set(there)
    for name in ("sha256", "plan_version", "size_bytes", "dagster/row_count", "num_failed_clips", "git_commit",
                 "code_version", "manifest_version", "config_hash", "env_digest", "container_digest"):
        assert here[name] == there[name], name
    assert here["slurm_job"] == "none" and there["slurm_job"].split("_")[0] in jobs


def test_a_lost_node_and_a_hung_task_rerun_only_their_partitions_and_the_shards_still_match(data_lab: DataLab,
                                                                                           cluster_built) -> None:
    partitions = data_lab.instance.get_dynamic_partitions("clip_shards")
    run_id = str(uuid.uuid4())
    seen: dict[str, object] = {}

    def faults() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not ("lost" in seen and "hung" in seen):
            jobs = data_lab.array_jobs(run_id)
            for pid, node, task in _array_processes(jobs[0]) if jobs else []:
                if node == "node2" and "lost" not in seen:
                    seen["lost"] = task
                    # SIGKILL to every process of node2, slurmd too (the project's own node fault).
                    subprocess.run(["bash", str(LOSE_NODE_SH), "kill", "node2"], check=True, timeout=60)
                elif node == "node1" and "hung" not in seen:
                    seen["hung"] = task
                    os.kill(pid, signal.SIGSTOP)  # it stops answering: only its time limit ends it
            time.sleep(0.05)

    watcher = threading.Thread(target=faults, daemon=True)
    watcher.start()
    try:
        # All three nodes: node3 is where the lost node's work goes while node1 is held by the hung task.
        # A 20 s limit: the launcher ends a task past it (SLURM's own --time is whole minutes).
        result = data_lab.backfill(data_lab.launcher(exclude=[], array_parallel=3, array_task_time="0:20"),
                                   partitions, run_id=run_id)
    finally:
        watcher.join()
        _bring_back("node2")
    assert "lost" in seen and "hung" in seen, seen
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    report = json.loads((data_lab.data / "backfills" / run_id / "report.json").read_text())
    attempts = {partition: entry["attempts"] for partition, entry in report["partitions"].items()}
    by_task = {str(lines[0]["task"]): partition for partition, lines in attempts.items()}
    lost, hung = by_task[str(seen["lost"])], by_task[str(seen["hung"])]
    assert [line["class"] for line in attempts[lost]] == ["node_lost", "ok"], attempts[lost]
    assert attempts[lost][0]["node"] == "node2" and attempts[lost][1]["node"] != "node2"
    assert [line["class"] for line in attempts[hung]] == ["timeout", "ok"], attempts[hung]
    assert "time limit" in attempts[hung][0]["reason"]
    kept = [partition for partition in partitions if partition not in (lost, hung)]
    assert all(len(attempts[partition]) == 1 for partition in kept), "only the failed partitions ran again"
    out_dir = data_lab.data / "shards" / data_lab.plan.version
    for partition in partitions:
        assert sha256_file(out_dir / f"{partition}.tar") == data_lab.sha256[partition]
    assert not _staging_files(out_dir)
    assert report["nodes"]["node2"]["failures"] >= 1
    assert not _array_processes(data_lab.array_jobs(run_id)[0])


def test_two_backfills_of_the_same_partitions_at_once_leave_one_version_and_no_staging_file(data_lab: DataLab,
                                                                                           cluster_built) -> None:
    partitions = data_lab.instance.get_dynamic_partitions("clip_shards")[:4]
    plan_dir = data_lab.data / "shards" / data_lab.plan.version

    @dg.asset(name="clip_plan")
    def fixed_plan() -> dict:
        return {"version": data_lab.plan.version, "path": str(plan_dir), "media_root": str(data_lab.media),
                "shards": data_lab.plan.shards}

    resources = {"storage": StorageResource(media_root=str(data_lab.media), data_root=str(data_lab.data)),
                 "lineage": LineageResource(), "launcher": data_lab.launcher()}
    job = dg.Definitions(assets=[fixed_plan, clip_assets.clip_shards],
                         resources=resources).resolve_implicit_global_asset_job_def()
    results: dict[int, dg.ExecuteInProcessResult] = {}
    # Two run workers of one deployment; in one test process, so without Dagster's capture of the
    # process's stdout and stderr, which two runs at once in one process would contend for.
    no_capture = {"compute_logs": {"module": "dagster.core.storage.noop_compute_log_manager",
                                   "class": "NoOpComputeLogManager"}}
    (data_lab.base / "dagster-twice").mkdir()
    with dg.DagsterInstance.local_temp(tempdir=str(data_lab.base / "dagster-twice"), overrides=no_capture) as instance:
        instance.add_dynamic_partitions("clip_shards", data_lab.plan.shards)
        job.execute_in_process(instance=instance, asset_selection=[dg.AssetKey("clip_plan")],
                               run_config={"loggers": DATA_QUIET})

        def run(number: int) -> None:
            results[number] = job.execute_in_process(
                instance=instance, run_config={"loggers": DATA_QUIET}, raise_on_error=False,
                asset_selection=[dg.AssetKey("clip_shards")],
                tags={"dagster/asset_partition_range_start": partitions[0],
                      "dagster/asset_partition_range_end": partitions[-1]})

        threads = [threading.Thread(target=run, args=(number,)) for number in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert all(result.success for result in results.values()), [
        event.message for result in results.values() for event in result.all_events if event.is_failure]
    for partition in partitions:
        versions = {_partition_events(result)[partition].tags["dagster/data_version"] for result in results.values()}
        assert versions == {data_lab.sha256[partition][:20]}
        assert sha256_file(plan_dir / f"{partition}.tar") == data_lab.sha256[partition]
    assert not _staging_files(plan_dir)


def test_a_cancelled_backfill_leaves_no_task_and_no_half_shard(data_lab: DataLab, cluster_built) -> None:
    partitions = data_lab.instance.get_dynamic_partitions("clip_shards")
    run_id = str(uuid.uuid4())
    cancelled: dict[str, str] = {}

    def interrupt_once_running() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            jobs = data_lab.array_jobs(run_id)
            if jobs and _array_processes(jobs[0]):
                cancelled["job"] = jobs[0]
                os.kill(os.getpid(), signal.SIGINT)  # as `dagster` interrupts a run worker on termination
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=interrupt_once_running, daemon=True)
    watcher.start()
    result = data_lab.backfill(data_lab.launcher(), partitions, run_id=run_id)
    watcher.join()
    assert "job" in cancelled and not result.success
    deadline, states = time.monotonic() + 30, []
    while time.monotonic() < deadline:  # slurmdbd records the tasks' ends a moment after the controller
        states = [line.split()[0] for line in run_slurm("sacct", "-j", cancelled["job"], "-X", "-n", "-P", "-o",
                                                        "State").splitlines() if line.strip()]
        if states and all(state in ("CANCELLED", "COMPLETED") for state in states):
            break
        time.sleep(0.5)
    assert "CANCELLED" in states and set(states) <= {"CANCELLED", "COMPLETED"}, states
    assert not _array_processes(cancelled["job"])
    assert not _staging_files(data_lab.data / "shards" / data_lab.plan.version)


def test_a_backfill_the_nodes_could_not_read_is_refused_before_submission_naming_the_setting(
        data_lab: DataLab, cluster_built) -> None:
    partitions = data_lab.instance.get_dynamic_partitions("clip_shards")[:2]
    run_id = str(uuid.uuid4())
    result = data_lab.backfill(data_lab.launcher(shared_paths=[str(paths.REPO_ROOT)]), partitions, run_id=run_id)
    assert not result.success
    failure = [event for event in result.all_events if event.is_step_failure][0]
    message = failure.step_failure_data.user_failure_data.description
    assert "refused before submission" in message and "TRAINYARD_MEDIA_ROOT" in message, message
    assert "TRAINYARD_DATA_ROOT" in message and "shared_paths" in message
    assert not data_lab.array_jobs(run_id)
    # Media in a store the nodes cannot reach (its endpoint is this machine's loopback): named too.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRAINYARD_S3_ENDPOINT_URL", "http://127.0.0.1:8333")
        problems = data_lab.launcher().check_data({"the media root (TRAINYARD_MEDIA_ROOT)": "s3://bucket/media"})
    assert any(problem.startswith("TRAINYARD_S3_ENDPOINT_URL is http://127.0.0.1:8333") for problem in problems)


def test_the_backfill_benchmark_runs_with_smoke_and_its_line_keeps_the_schema(data_lab: DataLab) -> None:
    # Its smoke runs here, beside the other multi-node tests (benchmarks/harness.py, CLUSTER_BENCHMARKS).
    from benchmarks import harness

    done, line = harness.run("backfill")
    assert done.returncode == 0, done.stderr[-4000:]
    assert line is not None and line["smoke"] is True and line["benchmark"] == "backfill"
    assert harness.validate("backfill", line) == []
    assert line["byte_identical"] is True
    assert line["nodes_one"] == ["node1"] and line["nodes_two"] == ["node1", "node2"]


@pytest.fixture(scope="module")
def lab(demo_manifest, demo_validation, tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("slurm-nodes")
    # Two nodes of one rank each; every path the jobs touch is on this machine's filesystem, which
    # the namespace nodes share (the stand-in for a cluster's NFS).
    launcher = SlurmLauncher(partition="nodes", nodes=2, nproc_per_node=1, cpus_per_task=1, time_limit="00:10:00",
                             poll_s=0.5, node_loss_grace_s=10, shared_paths=[str(base), str(paths.REPO_ROOT), "/tmp"])
    with slurm_lab(demo_manifest, demo_validation, base, launcher, key="slurm-nodes-key") as lab:
        yield lab
    for node in _nodes_partition():
        _bring_back(node)


def _final(metadata: dict) -> dict:
    return json.loads((Path(metadata["run_dir"]) / "final.json").read_text())


def _params(run_dir: str | Path) -> dict[str, torch.Tensor]:
    return torch.load(Path(run_dir) / "final_params.pt", weights_only=True)


STEPS = 8
_TRAIN = ["train.dump_final_params=true", "train.checkpoint_every=2", "train.log_every=1"]


@pytest.fixture(scope="module")
def two_node_run(lab: SlurmLab) -> dict:
    """The uninterrupted 2-node run (world size 2): what the other tests compare against."""
    result = lab.materialize(pretrain_config(nproc=2, steps=STEPS, overrides=["name=nodes-2x1", *_TRAIN]))
    return materialization(result)


def test_a_two_node_pretrain_is_bit_identical_to_one_node_and_names_every_host(lab: SlurmLab, two_node_run,
                                                                                one_node_run) -> None:
    one, two = one_node_run, two_node_run
    assert one["world_size"] == two["world_size"] == 2 and one["status"] == two["status"] == "completed"
    final_one, final_two = _final(one), _final(two)
    assert final_one["losses"] == final_two["losses"] and len(final_two["losses"]) == STEPS
    assert final_one["grad_norms"] == final_two["grad_norms"]
    params_one, params_two = _params(one["run_dir"]), _params(two["run_dir"])
    assert params_one.keys() == params_two.keys()
    assert all(torch.equal(params_one[name], params_two[name]) for name in params_one)

    # Every host is named: the environment record, its Dagster metadata, MLflow, the launch manifest.
    nodes = _nodes_partition()
    env = final_two["environment"]
    hosts = env["hosts"].split(",")
    assert len(hosts) == 2 and set(hosts) <= set(nodes) and env["node_count"] == 2
    assert sorted(env["rank_hosts"].split(",")) == sorted(f"{rank}:{host}" for rank, host in enumerate(
        [env["rank_hosts"].split(",")[r].split(":")[1] for r in range(2)]))
    assert two["env/hosts"] == env["hosts"] and two["env/node_count"] == 2
    assert final_one["environment"]["node_count"] == 1 and final_one["environment"]["hosts"] in nodes
    params = mlflow.MlflowClient(tracking_uri=lab.launcher.mlflow_tracking_uri).get_run(two["mlflow_run_id"]).data.params
    assert params["environment.hosts"] == env["hosts"] and params["environment.node_count"] == "2"
    placement = json.loads(Path(two["launch_manifest"]).read_text())["placement"]
    assert [sorted(entry["nodes"]) for entry in placement] == [sorted(hosts)]
    assert placement[0]["ranks_per_node"] == 1 and placement[0]["world_size"] == 2
    assert placement[0]["partition"] == "nodes"


@pytest.fixture(scope="module")
def one_node_run(lab: SlurmLab) -> dict:
    """The same run on one node of two ranks."""
    one_node = SlurmLauncher(**{**lab.launcher.model_dump(), "nodes": 1})
    return materialization(lab.materialize(pretrain_config(nproc=2, steps=STEPS, overrides=["name=nodes-1x2", *_TRAIN]),
                                           launcher=one_node))


@pytest.mark.parametrize("saved", ["two_nodes", "one_node"])
def test_a_checkpoint_restores_on_another_placement_bit_identically(lab: SlurmLab, two_node_run, one_node_run,
                                                                    saved: str) -> None:
    # 2 nodes x 1 rank saved, restored on 1 node x 2 ranks; and 1 x 2 saved, restored on 2 x 1. The
    # same world size: the drill's rule is bit-identical.
    parent, nodes = (two_node_run, 1) if saved == "two_nodes" else (one_node_run, 2)
    launcher = SlurmLauncher(**{**lab.launcher.model_dump(), "nodes": nodes})
    result = lab.drill(parent, launcher=launcher, other_world_size=2)
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    drilled = materialization(result, "restore_drill")
    assert drilled["passed"] and drilled["same_world/rule"] == "bit_identical", drilled
    continuation = Path(drilled["drill_dir"]) / "same_world"
    placement = json.loads((continuation / "launch.json").read_text())["placement"]
    assert [entry["node_count"] for entry in placement] == [nodes]
    saved_nodes = json.loads((Path(parent["run_dir"]) / "launch.json").read_text())["placement"][0]["node_count"]
    assert saved_nodes == 3 - nodes


def _lose_a_node_after_a_checkpoint(lab: SlurmLab, run_id: str, how: str, seen: dict) -> None:
    """Once the run committed step 2, lose the last-named node of its job (node2 on an idle cluster,
    so that both losses hit one node and it is drained on that evidence): ``kill`` (every process
    in the node's namespace, slurmd too) or ``link`` (the node's link down; its processes keep running)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        jobs = lab.job_ids(run_id)
        runs = [run for run in (lab.base / "data" / "runs").glob("pretrain-*")
                if (run / "launch.json").is_file() and run_id in (run / "launch.json").read_text()]
        committed = [run for run in runs if (run / "checkpoints" / "step_000002").is_dir()
                     and (run / "hosts.json").is_file()]
        if jobs and committed:
            hosts = json.loads((committed[0] / "hosts.json").read_text())["ranks"]
            node = max(hosts.values())
            seen.update(job=jobs[0], node=node, run_dir=str(committed[0]), at=time.time(),
                        ranks=sorted(int(rank) for rank, host in hosts.items() if host == node))
            if how == "kill":
                _node_sh("ty_node_lose_processes", _index(node))
            else:
                _node_sh("ty_node_link", _index(node), "down")
            return
        time.sleep(0.2)


def _job_end_time(lab: SlurmLab, run_id: str, job_id: str) -> float:
    """When the launcher saw the job end (its log line's timestamp)."""
    for entry in lab.instance.all_logs(run_id):
        if (entry.message or "").startswith(f"SLURM job {job_id}: ") and ", exit " in (entry.message or ""):
            return entry.timestamp
    raise AssertionError(f"no end of job {job_id} in the run's log")


def _run_losing_a_node(lab: SlurmLab, how: str, *, min_nodes: int, name: str) -> tuple[dict, dict, str]:
    run_id = str(uuid.uuid4())
    seen: dict = {}
    # Rank 0 waits 6 s at step 3 on the first job only (faults fire on attempt 0): the window in which
    # the node is lost, after step 2's checkpoint is committed.
    overrides = [f"name={name}", *_TRAIN, "faults.stall_rank=0", "faults.stall_at_step=3", "faults.stall_s=6",
                 "train.collective_timeout_s=600"]  # longer than the launcher's bound: the bound must end it
    watcher = threading.Thread(target=_lose_a_node_after_a_checkpoint, args=(lab, run_id, how, seen), daemon=True)
    watcher.start()
    launcher = SlurmLauncher(**{**lab.launcher.model_dump(), "min_nodes": min_nodes})
    try:
        result = lab.materialize(pretrain_config(nproc=2, steps=STEPS, overrides=overrides), run_id=run_id,
                                 launcher=launcher, ok=False)
    finally:
        watcher.join()
        if seen.get("job"):
            for line in processes_of_job(seen["job"]):  # what the partitioned node still ran: ours only
                subprocess.run(["kill", "-9", line.split(":")[0]], capture_output=True)
        if seen.get("node"):
            _bring_back(seen["node"], resume=False)  # drained by the launcher on its second loss: stays so
    assert seen.get("job"), "the run never committed step 2 on two nodes"
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    return materialization(result), seen, run_id


def _check_node_lost_attempt(lab: SlurmLab, run_dir: Path, seen: dict, run_id: str) -> dict:
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    lost, last = attempts[0], attempts[-1]
    assert [attempt["failure_class"] for attempt in attempts] == ["node_lost", "completed"], attempts
    assert lost["host"] == seen["node"] and lost["ranks"] == seen["ranks"], lost
    assert isinstance(lost["step"], int) and lost["step"] >= 2 and lost["decision"] == "requeue"
    assert last["restored_step"] is not None and 2 <= last["restored_step"] <= lost["step"], attempts
    ending = json.loads((run_dir / "endings" / "attempt_0.json").read_text())
    assert ending["failure_class"] == "node_lost" and seen["node"] in ending["error"] and ending["evidence"]
    # Bounded: SLURM sees the node silent (SlurmdTimeout + MessageTimeout), the launcher's grace and
    # polls, from the loss to the job's end (resources/slurm_nodes.py: node_loss_bound_s).
    bound = lab.launcher.node_loss_bound_s() + 2 * lab.launcher.poll_s
    took = _job_end_time(lab, run_id, seen["job"]) - seen["at"]
    assert took <= bound, f"the job ended {took:.0f} s after the node was lost; the stated bound is {bound:.0f} s"
    placement = json.loads((run_dir / "launch.json").read_text())["placement"]
    assert len(placement) == 2 and seen["node"] in placement[0]["nodes"]
    assert seen["node"] not in placement[1]["nodes"] and seen["node"] in placement[1]["excluded"]
    return {"attempts": attempts, "placement": placement, "took_s": took}


@pytest.fixture(scope="module")
def killed_node(lab: SlurmLab) -> dict:
    """The first kind of node loss, through the fault drill's node_lost case: every process of the
    node of the run's highest rank SIGKILLed (deploy/slurm/lose-node.sh), slurmd too, once step 2 is
    committed; the drill judges the continuation against its own uninterrupted run. (Module-scoped:
    it runs under the lab's TRAINYARD_HOME, where the node histories are.)"""
    before = _failures(lab)
    result = lab.fault_drill({"faults": ["node_lost"]})
    metadata = materialization(result, "fault_drill")
    (case,) = json.loads((Path(metadata["drill_dir"]) / "results.json").read_text())
    (check,) = [e.asset_check_evaluation_data for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
    run_dir = Path(metadata["drill_dir"]) / "node_lost"
    placement = json.loads((run_dir / "launch.json").read_text())["placement"]
    # One rank per node: the highest rank, 1, ran alone on the node the drill lost.
    seen = {"node": case["lost_node"], "ranks": [1], "at": case["lost_at"], "job": placement[0]["job_id"]}
    return {"case": case, "check": check, "run_dir": run_dir, "seen": seen, "run_id": result.run_id,
            "history_before": before, "history_after": _failures(lab)}


@pytest.fixture(scope="module")
def linked_node(lab: SlurmLab, two_node_run) -> tuple[dict, dict, str]:
    """The second kind: the link of the last-named node of the run's first job down, its processes
    alive; continued on the one node left (min_nodes=1)."""
    return _run_losing_a_node(lab, "link", min_nodes=1, name="nodes-link")


def test_a_node_whose_processes_are_killed_is_node_lost_and_the_fault_drill_continues_bit_identically_on_a_spare(
        lab: SlurmLab, killed_node) -> None:
    case = killed_node["case"]
    assert killed_node["check"].passed and case["passed"], case
    assert case["class_recorded"] == "node_lost" and case["outcome"] == "recovered"
    assert case["params_equal_uninterrupted"] is True and case["lost_node"] in _nodes_partition()
    checked = _check_node_lost_attempt(lab, killed_node["run_dir"], killed_node["seen"], killed_node["run_id"])
    assert checked["placement"][1]["node_count"] == 2 and checked["placement"][1]["world_size"] == 2  # a spare
    # Lost on purpose: no evidence against the node; and it is back in service.
    assert killed_node["history_after"] == killed_node["history_before"]
    state = node_states([case["lost_node"]], run=run_slurm)[case["lost_node"]]
    assert not state.lost, state


def test_a_node_whose_link_goes_down_is_node_lost_and_the_run_continues_on_fewer_nodes(lab: SlurmLab, two_node_run,
                                                                                        linked_node) -> None:
    metadata, seen, run_id = linked_node
    checked = _check_node_lost_attempt(lab, Path(metadata["run_dir"]), seen, run_id)
    assert metadata["attempt_classes"] == "node_lost,completed"
    assert checked["placement"][1]["node_count"] == 1 and checked["placement"][1]["world_size"] == 1
    restored = checked["attempts"][-1]["restored_step"]
    # World size 2 -> 1: the same global batch and sample order, sums reassociated (the drill's rule).
    judged = compare(continuation_record(two_node_run["run_dir"], name="original"),
                     continuation_record(metadata["run_dir"], name="continued"), from_step=restored, to_step=STEPS,
                     same_world=False, rule=comparison_rule({}, same_world=False))
    assert judged.passed, judged.reasons


@pytest.fixture(scope="module")
def timed_out(lab: SlurmLab, linked_node) -> dict:
    """A 2-node run whose last rank (on the job's second node) stops at step 2: rank 0 times out
    waiting on it (collective_timeout), and the node it waited on gets the failure."""
    before = _failures(lab)
    overrides = ["name=nodes-timeout", "train.collective_timeout_s=5", "train.retry_budget=0", "train.watchdog_s=0",
                 "faults.stall_rank=1", "faults.stall_at_step=2", "faults.stall_s=120"]
    result = lab.materialize(pretrain_config(nproc=2, steps=4, overrides=overrides), ok=False)
    [failure] = [event.step_failure_data for event in result.all_events if event.is_step_failure]
    run_dir = next(path for path in (lab.base / "data" / "runs").glob("pretrain-*") if "nodes-timeout" in
                   (path / "launch.json").read_text())
    hosts = json.loads((run_dir / "hosts.json").read_text())["ranks"]
    return {"failure": failure, "new": [event for event in _failures(lab) if event not in before], "hosts": hosts,
            "run_dir": run_dir}


def test_a_collective_timeout_across_nodes_goes_in_the_history_of_the_node_the_others_waited_on(timed_out) -> None:
    assert "collective_timeout" in timed_out["failure"].error.message, timed_out["failure"].error.message
    new, hosts = timed_out["new"], timed_out["hosts"]
    assert [event["failure_class"] for event in new] == ["collective_timeout"], new
    assert new[0]["node"] == hosts["1"] != hosts["0"] and "rank(s) 0 on " + hosts["0"] in new[0]["evidence"]


# ---------------------------------------------------------------------------------------------
# Suspect nodes


def _trainyard(lab: SlurmLab, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRAINYARD_HOME": str(lab.base / "home")}
    return subprocess.run([str(Path(sys.executable).parent / "trainyard"), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_a_node_that_failed_twice_is_drained_on_that_evidence_gets_no_stage_and_returns_only_after_a_check(
        lab: SlurmLab, linked_node, timed_out) -> None:
    (_, link, _) = linked_node
    node, runs = link["node"], [Path(link["run_dir"]).name, timed_out["run_dir"].name]
    assert timed_out["new"][0]["node"] == node, \
        f"SLURM placed the two failures on {node} and {timed_out['new'][0]['node']}: the drain needs one node"
    state = node_states([node], run=run_slurm)[node]
    assert state.draining, state
    assert "2 x collective_timeout/node_lost" in state.reason and all(run in state.reason for run in runs), state.reason
    listed = _trainyard(lab, "nodes", "--json")
    assert listed.returncode == 0, listed.stderr
    mine = {entry["node"]: entry for entry in json.loads(listed.stdout)}[node]
    assert [event["failure_class"] for event in mine["failures"]] == ["node_lost", "collective_timeout"]
    assert mine["drains"] and mine["drains"][-1]["runs"] == runs

    # A drained node gets no stage: the launcher does not count it, and SLURM places the job elsewhere.
    three = SlurmLauncher(**{**lab.launcher.model_dump(), "nodes": 3})
    problems = three.check(lab.launch(world_size=3))
    assert any(f"drained or down: {node}" in problem for problem in problems), problems
    placed = materialization(lab.materialize(pretrain_config(nproc=2, steps=2, overrides=["name=nodes-drained"])))
    placement = json.loads(Path(placed["launch_manifest"]).read_text())["placement"]
    assert node not in placement[-1]["nodes"] and placement[-1]["node_count"] == 2

    # A check that fails (a floor no node meets) keeps it drained, naming the part; one that passes returns it.
    failed = _trainyard(lab, "nodes", "check", node, "--floor", "compute_gflops=1e12")
    assert failed.returncode == 1 and "compute_gflops" in failed.stdout and "failed: drained" in failed.stdout, failed
    state = node_states([node], run=run_slurm)[node]
    assert state.draining and "trainyard check failed: compute_gflops" in state.reason, state
    passed = _trainyard(lab, "nodes", "check", node, "--json")
    assert passed.returncode == 0, passed.stdout + passed.stderr
    result = json.loads(passed.stdout)
    assert result["passed"] and set(result["figures"]) == {"compute_gflops", "memory_gbps", "disk_write_mbps",
                                                           "allreduce_gbps"}
    assert all(result["figures"][name] >= floor for name, floor in result["floors"].items())
    assert not node_states([node], run=run_slurm)[node].draining
    kinds = [event["kind"] for event in NodeHistory(lab.base / "home" / "nodes" / "history.jsonl").events(node)]
    assert kinds[-4:] == ["check", "kept_drained", "check", "resume"], kinds


def test_a_check_of_an_unknown_down_or_draining_node_is_refused_with_a_clear_message(lab: SlurmLab) -> None:
    unknown = _trainyard(lab, "nodes", "check", "node99")
    assert unknown.returncode == 2 and "unknown node 'node99'" in unknown.stderr, unknown.stderr
    spare = _nodes_partition()[-1]
    # Down for real: with ReturnToService=2 a node marked down that still answers SLURM's next ping
    # returns to service at once (once within 0.1 s here), so its link goes down first.
    subprocess.run(["bash", str(LOSE_NODE_SH), "link", spare], check=True, timeout=60)
    run_slurm("scontrol", "update", f"nodename={spare}", "state=down", "reason=trainyard-test")
    try:
        down = _trainyard(lab, "nodes", "check", spare)
        assert down.returncode == 2 and f"node {spare} is down" in down.stderr, down.stderr
    finally:
        # Back in service: resumed here, unless slurmd's next registration already returned it
        # (ReturnToService=2), when SLURM refuses a resume of a node that is not down.
        _bring_back(spare)
    job = run_slurm("sbatch", "--parsable", "-p", "nodes", "-w", spare, "--time=00:02:00", "--output=/dev/null",
                    "--wrap", "sleep 120").strip().split(";")[0]
    try:
        deadline = time.monotonic() + 60
        while not node_states([spare], run=run_slurm)[spare].flags & {"ALLOCATED", "MIXED"}:
            assert time.monotonic() < deadline, "the blocking job never started"
            time.sleep(0.5)
        run_slurm("scontrol", "update", f"nodename={spare}", "state=drain", "reason=trainyard-test")
        draining = _trainyard(lab, "nodes", "check", spare)
        assert draining.returncode == 2 and "still draining" in draining.stderr, draining.stderr
    finally:
        run_slurm("scancel", job)
        _bring_back(spare)


def test_the_drain_rule_counts_suspect_failures_in_the_window_since_the_last_passed_check(tmp_path: Path) -> None:
    history = NodeHistory(tmp_path / "history.jsonl")
    rule = DrainRule(threshold=2, window_h=1.0)
    now = datetime.now(UTC)
    old = {"at": (now - timedelta(hours=2)).isoformat(), "node": "n", "kind": "failure",
           "failure_class": "node_lost", "run_id": "a"}
    history.path.write_text(json.dumps(old) + "\n")
    history.append({"node": "n", "kind": "failure", "failure_class": "rank_crash", "run_id": "b"})  # not suspect
    history.append({"node": "n", "kind": "failure", "failure_class": "collective_timeout", "run_id": "c"})
    assert [event["run_id"] for event in history.suspect_failures("n", rule)] == ["c"]
    history.append({"node": "n", "kind": "failure", "failure_class": "node_lost", "run_id": "d"})
    assert [event["run_id"] for event in history.suspect_failures("n", rule)] == ["c", "d"]
    history.append({"node": "n", "kind": "check", "passed": True})
    assert history.suspect_failures("n", rule) == []
    assert history.suspect_failures("other", rule) == []
    history.path.write_text(history.path.read_text() + "{cut sh")
    with pytest.raises(ValueError, match="line 6 is not JSON"):
        history.events()


# ---------------------------------------------------------------------------------------------
# The fault drill's node_lost case: last in this module, after the drain tests, since it loses a
# node of its own (and must leave no mark in that node's history).


def _failures(lab: SlurmLab) -> list[dict]:
    history = NodeHistory(lab.base / "home" / "nodes" / "history.jsonl")
    return [event for node in _nodes_partition() for event in history.events(node) if event["kind"] == "failure"]


def test_the_node_faults_are_left_out_or_refused_without_a_spare_node(lab: SlurmLab) -> None:
    from assets.training_faults import FaultDrillConfig, _node_faults_why_not

    why = _node_faults_why_not(SlurmLauncher(**{**lab.launcher.model_dump(), "exclude": [_nodes_partition()[-1]]}),
                               FaultDrillConfig())
    assert "has 2 usable node(s)" in why and "it needs 3" in why, why
    assert _node_faults_why_not(lab.launcher, FaultDrillConfig()) == ""
    result = lab.fault_drill({"faults": ["node_lost"]}, launcher=SlurmLauncher(**{**lab.launcher.model_dump(),
                                                                                  "nodes": 1}), ok=False)
    failure, _ = failure_of(result)
    assert "node_lost cannot run: SlurmLauncher places the drill's 2 ranks on one node" in failure.description
