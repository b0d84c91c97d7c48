"""The fault drill's judge (ops/drills/fault.py) on hand-written run records: a fault that must
leave the computation unchanged passes only when the recovered run's final parameters equal the
uninterrupted run's, bit for bit. The drill's real runs are in tests/test_training_assets.py.

Run: python -m pytest tests/test_fault_drill.py -q
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

from ops.drills.fault import FAULTS, judge

RANK_KILLED = next(fault for fault in FAULTS if fault.name == "rank_killed")


def _recovered_run(run_dir: Path, params: dict[str, torch.Tensor] | None) -> Path:
    """The records of a run whose rank died at step 4 and that resumed from step 4 and completed."""
    run_dir.mkdir(parents=True)
    attempts = [{"attempt": 0, "failure_class": "rank_crash", "decision": "restart", "step": 4,
                 "ended_at": "2026-01-01T00:00:10+00:00"},
                {"attempt": 1, "decision": "done", "restored_step": 4, "started_at": "2026-01-01T00:00:12+00:00",
                 "time_to_first_step_s": 1.5}]
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in attempts))
    (run_dir / "final.json").write_text(json.dumps({"status": "completed"}))
    if params is not None:
        torch.save(params, run_dir / "final_params.pt")
    return run_dir


@pytest.mark.parametrize(("candidate", "passed", "problem"), [
    ({"w": torch.tensor([1.0, 2.0])}, True, "none"),
    ({"w": torch.tensor([1.0, 2.0000002])}, False, "final parameters differ from the uninterrupted run's"),
    (None, False, "final parameters not comparable with the uninterrupted run's"),
], ids=["equal", "one_ulp_apart", "not_dumped"])
def test_a_recovery_that_must_be_bit_identical_passes_only_with_equal_final_parameters(
        tmp_path: Path, candidate, passed: bool, problem: str) -> None:
    reference = _recovered_run(tmp_path / "reference", {"w": torch.tensor([1.0, 2.0])})
    result = judge(RANK_KILLED, _recovered_run(tmp_path / "run", candidate), reference)
    assert result["outcome"] == "recovered" and result["steps_lost"] == 0 and result["time_to_recover_s"] == 3.5
    assert result["passed"] is passed and result["problems"] == problem


# ---------------------------------------------------------------------------------------------
# The node faults' parts that need no cluster: the command a node name reaches, the watch that
# picks the node, the restore, and the judge's "excluded" check. The case itself runs on the
# multi-node cluster in tests/test_slurm_nodes.py.

from ops.checkpoints import store  # noqa: E402
from ops.drills.fault import NODE_FAULTS, NodeLoss, node_command  # noqa: E402

NODE_LOST = NODE_FAULTS[0]


@pytest.mark.parametrize("node", ["node2;rm -rf /", "node2\nnode3", "$(id)", "-rf", "../etc", "", "a" * 64, "nöde"])
def test_a_node_name_that_is_not_a_host_name_never_reaches_a_command(node: str) -> None:
    with pytest.raises(ValueError, match="is not a host name"):
        node_command("ssh {node} sudo systemctl kill slurmd", node)


def test_a_node_command_is_split_like_a_shell_but_run_without_one_and_must_name_the_node() -> None:
    assert node_command("ssh -o 'ConnectTimeout 5' {node} 'kill $(pidof slurmd)'", "gpu-07.rack2") == [
        "ssh", "-o", "ConnectTimeout 5", "gpu-07.rack2", "kill $(pidof slurmd)"]
    with pytest.raises(ValueError, match="does not name"):
        node_command("systemctl kill slurmd", "node2")


def _commit_step_2(run_dir: Path, ranks: dict[str, str], nodes: list[str] | None = None) -> None:
    """Step 2 committed, the ranks' hosts recorded, and SLURM's nodes for the job (by default the hosts)."""
    step_dir = store.checkpoints_dir(run_dir) / store.step_dir_name(2)
    step_dir.mkdir(parents=True)
    (run_dir / "hosts.json").write_text(json.dumps({"attempt": 0, "ranks": ranks}))
    nodes = sorted(set(ranks.values())) if nodes is None else nodes
    (run_dir / "launch.json").write_text(json.dumps({"placement": [{"nodes": nodes, "excluded": []}]}))
    (step_dir / store.RECORD_NAME).write_text("{}")


def _recorder(tmp_path: Path, what: str) -> str:
    """A command that records the node it was given (a real process, no shell)."""
    return f"{sys.executable} -c \"import pathlib, sys; pathlib.Path(sys.argv[1]).write_text(sys.argv[2])\" " \
           f"{tmp_path / what} {{node}}"


def test_the_node_of_the_highest_rank_is_lost_once_step_2_is_committed_and_brought_back_after(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    loss = NodeLoss(run_dir, how="kill", fault_command=_recorder(tmp_path, "lost"),
                    restore_command=_recorder(tmp_path, "restored")).start()
    time.sleep(0.6)
    (run_dir / "hosts.json").write_text(json.dumps({"attempt": 0, "ranks": {"0": "n1", "1": "n1", "2": "n3"}}))
    time.sleep(0.6)
    assert loss.node is None and not (tmp_path / "lost").exists()  # hosts known, step 2 not committed: not yet
    _commit_step_2(run_dir, {"0": "n1", "1": "n1", "2": "n3", "3": "n3"})
    deadline = time.monotonic() + 10
    while loss.node is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "lost").read_text() == "n3" and loss.node == "n3" and loss.lost_at
    time.sleep(0.6)
    assert not (tmp_path / "restored").exists()  # the launcher has not recorded the loss yet
    loss.finish()
    assert (tmp_path / "restored").read_text() == "n3" and loss.problems == []


def test_the_lost_node_comes_back_as_soon_as_the_launcher_has_recorded_the_loss(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _commit_step_2(run_dir, {"0": "n1", "1": "n2"})
    loss = NodeLoss(run_dir, how="kill", fault_command=_recorder(tmp_path, "lost"),
                    restore_command=_recorder(tmp_path, "restored")).start()
    with open(run_dir / "attempts.jsonl", "w") as handle:
        handle.write('{"attempt": 0, "failure_class": "node_lo')  # a line half appended: read again
        handle.flush()
        time.sleep(1.0)
        handle.write('st", "host": "n2", "decision": "requeue"}\n')
    deadline = time.monotonic() + 10
    while not (tmp_path / "restored").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "restored").read_text() == "n2" and loss.restored  # before the drill's finish
    (tmp_path / "restored").unlink()
    loss.finish()
    assert not (tmp_path / "restored").exists() and loss.problems == []  # brought back once, not twice


@pytest.mark.parametrize(("ranks", "fault", "problem"), [
    ({"0": "n1", "1": "n1"}, "true {node}", "all ran on n1: no node of a multi-node job to lose"),
    ({"0": "n1", "1": "n2"}, "false {node}", "exited 1"),
    ({"0": "n1", "1": "n2;reboot"}, "true {node}", "is not a host name"),
    ({"0": "n1", "1": "n2"}, "/no/such/program {node}", "FileNotFoundError"),
    ({"0": "n1", "1": "login-host"}, "true {node}", "not one of the nodes SLURM gave the job (n1, n2)"),
], ids=["one_node", "command_fails", "forged_host", "no_program", "not_the_jobs_node"])
def test_a_node_loss_that_did_not_happen_as_stated_is_a_problem(tmp_path: Path, ranks, fault, problem) -> None:
    run_dir = tmp_path / "run"
    _commit_step_2(run_dir, ranks, nodes=["n1", "n2"] if "login-host" in ranks.values() else None)
    loss = NodeLoss(run_dir, how="kill", fault_command=fault, restore_command="true {node}").start()
    deadline = time.monotonic() + 10
    while not loss.problems and loss.node is None and time.monotonic() < deadline:
        time.sleep(0.1)
    loss.finish()
    assert any(problem in text for text in loss.problems), loss.problems


def test_a_run_that_never_commits_step_2_loses_no_node_and_says_so(tmp_path: Path) -> None:
    loss = NodeLoss(tmp_path, how="kill", fault_command="false {node}", restore_command="false {node}",
                    give_up_s=0.5).start()
    time.sleep(1.0)
    loss.finish()
    assert loss.node is None and "never committed step 2" in " ".join(loss.problems)


def test_the_lab_commands_refuse_a_node_that_is_not_the_labs(tmp_path: Path) -> None:
    _commit_step_2(tmp_path, {"0": "node1", "1": "node97"})
    loss = NodeLoss(tmp_path, how="kill").start()  # the defaults: deploy/slurm/lose-node.sh
    deadline = time.monotonic() + 20
    while loss.node is None and time.monotonic() < deadline:
        time.sleep(0.1)
    loss._stop.set()
    assert any("node97 is not a node of this machine's lab cluster" in text for text in loss.problems), loss.problems
    assert any("set FaultDrillConfig.node_fault_command" in text for text in loss.problems)


def _node_lost_run(run_dir: Path, placement: list[dict], host: str = "node2") -> Path:
    run_dir.mkdir(parents=True)
    attempts = [{"attempt": 0, "failure_class": "node_lost", "host": host, "decision": "requeue", "step": 3,
                 "ended_at": "2026-01-01T00:00:10+00:00"},
                {"attempt": 1, "decision": "done", "restored_step": 2, "started_at": "2026-01-01T00:00:40+00:00",
                 "time_to_first_step_s": 1.5}]
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in attempts))
    (run_dir / "final.json").write_text(json.dumps({"status": "completed"}))
    (run_dir / "launch.json").write_text(json.dumps({"placement": placement}))
    torch.save({"w": torch.tensor([1.0])}, run_dir / "final_params.pt")
    return run_dir


@pytest.mark.parametrize(("placement", "problem"), [
    ([{"nodes": ["node1", "node2"], "excluded": []}, {"nodes": ["node1", "node3"], "excluded": ["node2"]}], "none"),
    ([{"nodes": ["node1", "node2"], "excluded": []}, {"nodes": ["node1", "node2"], "excluded": []}],
     "not without the lost host node2"),
    ([{"nodes": ["node1", "node2"], "excluded": []}, {"nodes": ["node1", "node3"], "excluded": []}],
     "not without the lost host node2"),
    ([{"nodes": ["node1", "node3"], "excluded": []}, {"nodes": ["node1", "node3"], "excluded": ["node2"]}],
     "is not a node of the first job"),
    ([{"nodes": ["node1", "node2"], "excluded": []}], "a lost node needs a second job without it"),
], ids=["excluded", "same_nodes", "not_excluded", "not_its_node", "one_job"])
def test_a_node_lost_run_passes_only_when_the_next_job_ran_without_that_node(tmp_path: Path, placement,
                                                                              problem: str) -> None:
    reference = _recovered_run(tmp_path / "reference", {"w": torch.tensor([1.0])})
    result = judge(NODE_LOST, _node_lost_run(tmp_path / "lost", placement), reference)
    assert result["class_recorded"] == "node_lost" and result["outcome"] == "recovered"
    assert (problem in result["problems"]) and result["passed"] == (problem == "none"), result


def test_a_node_lost_run_must_name_the_node_the_drill_lost_and_a_step(tmp_path: Path) -> None:
    reference = _recovered_run(tmp_path / "reference", {"w": torch.tensor([1.0])})
    placement = [{"nodes": ["node1", "node2"], "excluded": []}, {"nodes": ["node1", "node3"], "excluded": ["node2"]}]
    run_dir = _node_lost_run(tmp_path / "lost", placement)
    assert judge(NODE_LOST, run_dir, reference, lost_node="node2")["passed"]
    other = judge(NODE_LOST, run_dir, reference, lost_node="node3")
    assert not other["passed"] and "names node2 as lost, but the drill lost node3" in other["problems"]
    lines = (run_dir / "attempts.jsonl").read_text().splitlines()
    (run_dir / "attempts.jsonl").write_text("\n".join([json.dumps({**json.loads(lines[0]), "step": None}),
                                                       *lines[1:]]) + "\n")
    stepless = judge(NODE_LOST, run_dir, reference, lost_node="node2")
    assert not stepless["passed"] and stepless["steps_lost"] is None and "recorded no step" in stepless["problems"]


def test_the_node_faults_say_why_they_cannot_run_before_asking_the_cluster() -> None:
    from assets.training_faults import FaultDrillConfig, _node_faults_why_not
    from resources.launcher import TorchrunLauncher
    from resources.slurm import SlurmLauncher

    assert "runs every rank on this machine" in _node_faults_why_not(TorchrunLauncher(), FaultDrillConfig())
    one_node = SlurmLauncher(nodes=2, nproc_per_node=2)
    assert "on one node" in _node_faults_why_not(one_node, FaultDrillConfig())
    two_nodes = SlurmLauncher(nodes=2, nproc_per_node=1)
    for config in (FaultDrillConfig(node_fault_command="ssh {node} sudo systemctl kill slurmd"),
                   FaultDrillConfig(node_restore_command="ssh {node} sudo systemctl start slurmd")):
        assert "together" in _node_faults_why_not(two_nodes, config)
    # A template that cannot lose a node is refused before the drill's first run, naming the setting.
    for config, problem in [
        (FaultDrillConfig(node_fault_command="systemctl kill slurmd", node_restore_command="ssh {node} true"),
         "node_fault_command: node command 'systemctl kill slurmd' does not name {node}"),
        (FaultDrillConfig(node_fault_command="ssh {node} true", node_restore_command="ssh '{node}"),
         "node_restore_command: No closing quotation"),
    ]:
        assert problem in _node_faults_why_not(two_nodes, config)
