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

import json
import subprocess
import threading
import time
import uuid
from pathlib import Path

import mlflow
import pytest
import torch
from slurm_lab import (SlurmLab, cluster_up, materialization, pretrain_config, processes_of_job,
                       require_cluster, slurm_lab)

from ops.drills.restore import compare, comparison_rule, continuation_record
from ops.publish import paths
from resources.slurm import SlurmLauncher, run_slurm
from resources.slurm_nodes import node_states

NODES_SH = paths.REPO_ROOT / "deploy" / "slurm" / "nodes.sh"


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


def _bring_back(node: str) -> None:
    """The node's link up and its slurmd running, then back in service."""
    _node_sh("ty_node_link", _index(node), "up")
    probe = subprocess.run(["bash", "-c", f'. "{NODES_SH}" && ty_node_running {_index(node)}'], timeout=30)
    if probe.returncode != 0:
        _node_sh("ty_node_start", _index(node))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        state = node_states([node], run=run_slurm)[node]
        if not state.lost and not state.draining and state.state.split("+")[0] in ("IDLE", "MIXED", "ALLOCATED"):
            return
        if "DOWN" in state.flags:
            subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=30)
        time.sleep(1)
    raise AssertionError(f"{node} did not come back: {node_states([node], run=run_slurm)[node]}")


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


def test_a_two_node_pretrain_is_bit_identical_to_one_node_and_names_every_host(lab: SlurmLab, two_node_run) -> None:
    one_node = SlurmLauncher(**{**lab.launcher.model_dump(), "nodes": 1})
    one = materialization(lab.materialize(pretrain_config(nproc=2, steps=STEPS, overrides=["name=nodes-1x2", *_TRAIN]),
                                          launcher=one_node))
    two = two_node_run
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


def _lose_a_node_after_a_checkpoint(lab: SlurmLab, run_id: str, how: str, seen: dict) -> None:
    """Once the run committed step 2, lose the node of its rank 1: ``kill`` (every process in the
    node's namespace, slurmd too) or ``link`` (the node's link down; its processes keep running)."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        jobs = lab.job_ids(run_id)
        runs = [run for run in (lab.base / "data" / "runs").glob("pretrain-*")
                if (run / "launch.json").is_file() and run_id in (run / "launch.json").read_text()]
        committed = [run for run in runs if (run / "checkpoints" / "step_000002").is_dir()
                     and (run / "hosts.json").is_file()]
        if jobs and committed:
            hosts = json.loads((committed[0] / "hosts.json").read_text())["ranks"]
            node = hosts["1"]
            seen.update(job=jobs[0], node=node, run_dir=str(committed[0]), at=time.time())
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
            _bring_back(seen["node"])
    assert seen.get("job"), "the run never committed step 2 on two nodes"
    assert result.success, [event.message for event in result.all_events if event.is_failure]
    return materialization(result), seen, run_id


def _check_node_lost_attempt(lab: SlurmLab, metadata: dict, seen: dict, run_id: str) -> dict:
    attempts = [json.loads(line) for line in (Path(metadata["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    lost, last = attempts[0], attempts[-1]
    assert metadata["attempt_classes"] == "node_lost,completed", attempts
    assert lost["failure_class"] == "node_lost" and lost["host"] == seen["node"] and lost["ranks"] == [1], lost
    assert isinstance(lost["step"], int) and lost["step"] >= 2 and lost["decision"] == "requeue"
    assert last["restored_step"] is not None and 2 <= last["restored_step"] <= lost["step"], attempts
    ending = json.loads((Path(metadata["run_dir"]) / "endings" / "attempt_0.json").read_text())
    assert ending["failure_class"] == "node_lost" and seen["node"] in ending["error"] and ending["evidence"]
    # Bounded: SLURM sees the node silent (SlurmdTimeout + MessageTimeout), the launcher's grace and
    # polls, from the loss to the job's end (resources/slurm_nodes.py: node_loss_bound_s).
    bound = lab.launcher.node_loss_bound_s() + 2 * lab.launcher.poll_s
    took = _job_end_time(lab, run_id, seen["job"]) - seen["at"]
    assert took <= bound, f"the job ended {took:.0f} s after the node was lost; the stated bound is {bound:.0f} s"
    placement = json.loads(Path(metadata["launch_manifest"]).read_text())["placement"]
    assert len(placement) == 2 and seen["node"] in placement[0]["nodes"]
    assert seen["node"] not in placement[1]["nodes"] and seen["node"] in placement[1]["excluded"]
    return {"attempts": attempts, "placement": placement, "took_s": took}


def test_a_node_whose_processes_are_killed_is_node_lost_and_the_run_continues_bit_identically_on_a_spare(
        lab: SlurmLab, two_node_run) -> None:
    metadata, seen, run_id = _run_losing_a_node(lab, "kill", min_nodes=0, name="nodes-kill")
    checked = _check_node_lost_attempt(lab, metadata, seen, run_id)
    assert checked["placement"][1]["node_count"] == 2 and metadata["world_size"] == 2  # a spare node took its place
    truth, resumed = _params(two_node_run["run_dir"]), _params(metadata["run_dir"])
    assert all(torch.equal(truth[name], resumed[name]) for name in truth)
    assert _final(metadata)["losses"] == _final(two_node_run)["losses"]


def test_a_node_whose_link_goes_down_is_node_lost_and_the_run_continues_on_fewer_nodes(lab: SlurmLab,
                                                                                        two_node_run) -> None:
    metadata, seen, run_id = _run_losing_a_node(lab, "link", min_nodes=1, name="nodes-link")
    checked = _check_node_lost_attempt(lab, metadata, seen, run_id)
    assert checked["placement"][1]["node_count"] == 1 and checked["placement"][1]["world_size"] == 1
    restored = checked["attempts"][-1]["restored_step"]
    # World size 2 -> 1: the same global batch and sample order, sums reassociated (the drill's rule).
    judged = compare(continuation_record(two_node_run["run_dir"], name="original"),
                     continuation_record(metadata["run_dir"], name="continued"), from_step=restored, to_step=STEPS,
                     same_world=False, rule=comparison_rule({}, same_world=False))
    assert judged.passed, judged.reasons
