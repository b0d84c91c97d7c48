"""Where a multi-node stage's ranks go, and what the script says about it (resources/slurm.py): no
cluster needed. The jobs themselves run in tests/test_slurm_nodes.py.

Run: .venv/bin/python -m pytest -q tests/test_slurm_placement.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ops.clips.shard_ref import ShardIndexRef
from resources.sbatch_script import SbatchSettingError
from resources.slurm import SlurmLauncher
from resources.slurm_nodes import NodeState, NodeWatch, node_lost_ending, ranks_on
from trainer.launch.stage_launch import LaunchRecordError, StageLaunch, record_placement
from trainer.launch.redact import Redactor


def _launch(tmp_path: Path, world_size: int = 2) -> StageLaunch:
    return StageLaunch(stage="pretrain", config_path=str(tmp_path / "exp.yaml"),
                       data=ShardIndexRef(path=str(tmp_path / "shards"), version="v1", manifest_version="m1"),
                       steps=2, world_size=world_size, run_dir=str(tmp_path / "runs" / "pretrain-abc"),
                       dagster_run_id="r1")


@pytest.mark.parametrize(("nodes", "per_node", "world", "placed"), [
    (1, 2, 5, (1, 5)),      # one node: every rank there, whatever nproc_per_node says
    (2, 1, 2, (2, 1)),
    (2, 1, 1, (1, 1)),      # the drill's world-size-1 continuation: one node
    (4, 8, 32, (4, 8)),
    (4, 8, 16, (2, 8)),     # fewer whole nodes
    (4, 8, 4, (1, 4)),      # less than one node's ranks
])
def test_a_stage_is_placed_on_whole_nodes(nodes: int, per_node: int, world: int, placed: tuple[int, int]) -> None:
    assert SlurmLauncher(nodes=nodes, nproc_per_node=per_node).placement(world) == placed


@pytest.mark.parametrize("world", [12, 40])
def test_ranks_that_do_not_fill_whole_nodes_or_exceed_the_nodes_are_refused_naming_the_settings(world: int) -> None:
    with pytest.raises(ValueError, match=r"SlurmLauncher.nodes x nproc_per_node \(4 x 8\)"):
        SlurmLauncher(nodes=4, nproc_per_node=8).placement(world)


def test_a_multi_node_script_excludes_lost_nodes_and_leaves_requeue_to_the_launcher(tmp_path: Path) -> None:
    launcher = SlurmLauncher(nodes=2, nproc_per_node=1, exclude=["node9"], shared_paths=["/"])
    script = launcher.render(_launch(tmp_path), exclude=["node2"])
    assert "#SBATCH --nodes=2" in script and "--nproc-per-node=1" in script
    assert "#SBATCH --exclude=node9,node2" in script and "#SBATCH --no-requeue" in script
    single = SlurmLauncher(nodes=2, nproc_per_node=2).render(_launch(tmp_path))
    assert "#SBATCH --nodes=1" in single and "#SBATCH --requeue" in single and "--nproc-per-node=2" in single
    assert "--exclude" not in single


@pytest.mark.parametrize("name", ["node2\n#SBATCH --wrap=id", "node2,node3", "node 2", "nøde2", ""])
def test_an_excluded_node_name_that_is_not_one_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(SbatchSettingError, match="SlurmLauncher.exclude"):
        SlurmLauncher(nodes=2, nproc_per_node=1).render(_launch(tmp_path), exclude=[name])


def test_the_excluded_option_cannot_be_smuggled_through_extra_sbatch(tmp_path: Path) -> None:
    with pytest.raises(SbatchSettingError, match="--exclude is set by SlurmLauncher itself"):
        SlurmLauncher(extra_sbatch=["--exclude=node1"]).render(_launch(tmp_path))


def test_from_env_reads_the_node_loss_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_SLURM_NODES", "3")
    monkeypatch.setenv("TRAINYARD_SLURM_MIN_NODES", "2")
    monkeypatch.setenv("TRAINYARD_SLURM_EXCLUDE", "node4,node5")
    launcher = SlurmLauncher.from_env()
    assert (launcher.nodes, launcher.min_nodes, launcher.exclude) == (3, 2, ["node4", "node5"])


def test_the_placement_joins_the_launch_manifest_and_a_missing_one_is_named(tmp_path: Path) -> None:
    launch = _launch(tmp_path)
    Path(launch.run_dir).mkdir(parents=True)
    with pytest.raises(LaunchRecordError, match="launch.json: cannot add the job's placement"):
        record_placement(launch, job_id="1", hosts=["node1"], per_node=1, partition="nodes", excluded=[])
    launch.write(Path(launch.run_dir) / "launch.json", redactor=Redactor.for_config(None))
    record_placement(launch, job_id="7", hosts=["node1", "node2"], per_node=1, partition="nodes", excluded=[])
    record_placement(launch, job_id="8", hosts=["node1", "node3"], per_node=1, partition="nodes", excluded=["node2"])
    placement = json.loads((Path(launch.run_dir) / "launch.json").read_text())["placement"]
    assert [entry["job_id"] for entry in placement] == ["7", "8"] and placement[1]["excluded"] == ["node2"]
    assert StageLaunch.read(Path(launch.run_dir) / "launch.json").world_size == 2  # still a valid launch record


@pytest.mark.parametrize(("state", "lost", "draining"), [
    ("IDLE", False, False), ("ALLOCATED", False, False), ("IDLE*", True, False), ("DOWN+NOT_RESPONDING", True, False),
    ("ALLOCATED+NOT_RESPONDING", True, False), ("IDLE+DRAIN", False, True), ("MIXED+DRAIN", False, True),
    ("IDLE+CLOUD+POWERED_DOWN", False, False), ("DOWN+DRAIN", True, True),
])
def test_a_node_state_says_lost_and_draining_from_slurm_flags(state: str, lost: bool, draining: bool) -> None:
    node = NodeState("n", "10.0.0.1", state)
    assert (node.lost, node.draining) == (lost, draining)


def test_a_node_lost_for_longer_than_the_grace_is_overdue_and_not_before() -> None:
    now = [0.0]
    states = {"node2": "ALLOCATED"}
    answers: dict[str, str | None] = {"10.0.0.2": None}

    def scontrol(*args: str) -> str:
        return "\n".join(f"NodeName={name} NodeAddr=10.0.0.2 State={state}" for name, state in states.items())

    watch = NodeWatch(["node2"], grace_s=10, run=scontrol, every_s=2, clock=lambda: now[0],
                      probe=lambda address, port: answers[address])
    assert watch.check() == []
    now[0], states["node2"] = 3.0, "ALLOCATED+NOT_RESPONDING"
    assert watch.check() == [] and watch.seen == {"node2": 3.0} and "SLURM says" in watch.evidence["node2"]
    now[0] = 13.0
    assert watch.check() == []
    now[0] = 13.5
    assert watch.check() == ["node2"]


def test_a_dead_slurmd_is_seen_before_slurm_marks_its_node_and_a_node_that_answers_again_is_forgiven() -> None:
    now = [0.0]
    answers: dict[str, str | None] = {"10.0.0.2": None}

    def scontrol(*args: str) -> str:  # SLURM has not noticed yet: still ALLOCATED throughout
        return "NodeName=node2 NodeAddr=10.0.0.2 State=ALLOCATED"

    watch = NodeWatch(["node2"], grace_s=10, run=scontrol, every_s=2, clock=lambda: now[0],
                      probe=lambda address, port: answers[address])
    answers["10.0.0.2"] = "slurmd at 10.0.0.2:6818 refused the connection (no slurmd runs there)"
    now[0] = 2.0
    assert watch.check() == [] and watch.seen == {"node2": 2.0} and "refused" in watch.evidence["node2"]
    now[0], answers["10.0.0.2"] = 8.0, None  # one missed answer, then it answers again within the grace
    assert watch.check() == [] and watch.seen == {} and watch.evidence == {}
    now[0], answers["10.0.0.2"] = 10.0, "refused"
    assert watch.check() == [] and watch.seen == {"node2": 10.0}
    now[0] = 20.5
    assert watch.check() == ["node2"]


def test_a_node_lost_ending_names_host_ranks_step_and_keeps_the_first_error() -> None:
    ranks = ranks_on({0: "node1", 1: "node2", 2: "node2", 3: "node3"}, ["node2"])
    assert ranks == [1, 2]
    ending = node_lost_ending(job_id="9", job_state="NODE_FAIL", lost={"node2": "SLURM says DOWN"}, ranks=ranks,
                              step=4, attempt=0, ranks_view={"error": "Connection closed by peer", "log_tail": ["x"]},
                              decision="requeue", why="w", detected_after_s=3.0)
    assert ending["failure_class"] == "node_lost" and ending["host"] == "node2" and ending["rank"] == 1
    assert "at step 4" in ending["error"] and "ranks 1, 2" in ending["error"]
    assert ending["first_error"] == "Connection closed by peer" and ending["evidence"] == {"node2": "SLURM says DOWN"}


# ---------------------------------------------------------------------------------------------
# The measuring workload's script (resources/slurm_workload.py): scaling_report across nodes.

from resources.slurm_workload import Workload, render_workload  # noqa: E402


def _workload(tmp_path: Path, **fields) -> Workload:
    return Workload(**{"name": "scaling_report-2n", "run_dir": tmp_path / "run", "config_path": tmp_path / "c.yaml",
                       "overrides": ("data.source=synthetic", "optim.lr=1e-3\nrm -rf /"), "nodes": 2,
                       "ranks_per_node": 1, **fields})


def test_a_workload_runs_on_nodes_of_its_own_with_its_overrides_in_a_file(tmp_path: Path) -> None:
    launcher = SlurmLauncher(partition="nodes", nodes=2, nproc_per_node=1, cpus_per_task=1, exclude=["node3"])
    script = render_workload(launcher, _workload(tmp_path), overrides_file=tmp_path / "o.json",
                             log_path=tmp_path / "job.log")
    assert "#SBATCH --nodes=2" in script and "#SBATCH --exclusive" in script and "#SBATCH --no-requeue" in script
    assert "#SBATCH --partition=nodes" in script and "#SBATCH --exclude=node3" in script
    assert "--nproc-per-node=1" in script and '--rdzv-endpoint="$head_node:$port"' in script
    assert "rm -rf" not in script and "optim.lr" not in script  # the overrides are read from the file only
    assert f"--overrides-file {tmp_path / 'o.json'}" in script


@pytest.mark.parametrize(("fields", "setting"), [
    ({"name": "x\nrm -rf /"}, "the workload name"), ({"name": "a b"}, "the workload name"),
    ({"config_path": Path("/tmp/c.yaml\n#SBATCH --uid=0")}, "the config path"),
])
def test_a_workload_value_that_could_change_the_script_is_refused_naming_it(tmp_path: Path, fields, setting) -> None:
    with pytest.raises(SbatchSettingError, match=setting):
        render_workload(SlurmLauncher(nodes=2), _workload(tmp_path, **fields), overrides_file=tmp_path / "o.json",
                        log_path=tmp_path / "job.log")


@pytest.mark.parametrize("nodes", [0, -1, 1.5])
def test_a_workload_of_no_whole_nodes_is_refused(tmp_path: Path, nodes) -> None:
    with pytest.raises(ValueError, match="nodes"):
        render_workload(SlurmLauncher(nodes=2), _workload(tmp_path, nodes=nodes), overrides_file=tmp_path / "o.json",
                        log_path=tmp_path / "job.log")


# ---------------------------------------------------------------------------------------------
# Which host a multi-node collective timeout is held against (resources/slurm_nodes.py).

from resources.slurm_nodes import collective_timeout_suspects  # noqa: E402

HOSTS = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}


def _timeout_ending(views: dict[int, str | None], failure_class: str = "collective_timeout") -> dict:
    return {"failure_class": failure_class,
            "ranks": {str(rank): {"failure_class": view, "host": HOSTS[rank]} for rank, view in views.items()}}


@pytest.mark.parametrize(("views", "hosts", "failure_class", "suspects"), [
    ({0: "collective_timeout", 1: "collective_timeout", 2: None, 3: None}, HOSTS, "collective_timeout", ["node2"]),
    ({0: "collective_timeout", 1: None, 2: None, 3: None}, HOSTS, "collective_timeout", ["node2"]),
    ({0: "collective_timeout", 2: "collective_timeout"}, HOSTS, "collective_timeout", []),
    ({0: None, 1: None, 2: None, 3: None}, HOSTS, "collective_timeout", []),
    ({0: "collective_timeout", 2: None}, HOSTS, "rank_crash", []),
    ({0: "collective_timeout", 1: None}, {0: "node1", 1: "node1"}, "collective_timeout", []),
    ({0: "collective_timeout", 2: None}, {}, "collective_timeout", []),
], ids=["node2_waited_on", "one_waiter_is_enough", "both_waited", "no_waiter", "another_class", "one_host",
        "hosts_unknown"])
def test_a_collective_timeout_is_held_against_the_hosts_the_others_waited_on(views, hosts, failure_class,
                                                                             suspects) -> None:
    found = collective_timeout_suspects(_timeout_ending(views, failure_class), hosts)
    assert sorted(found) == suspects
    for host in found:
        assert "timed out waiting" in found[host] and f"on {host} recorded no timeout" in found[host]


def test_a_host_whose_rank_recorded_its_timeout_after_the_ending_was_written_is_not_blamed() -> None:
    # The first node's supervisor wrote the ending when its own ranks exited; node2's ranks timed out in
    # the same collective a moment later, and only their own records (read after the job ended) say so.
    ending = _timeout_ending({0: "collective_timeout", 1: "collective_timeout"})
    assert sorted(collective_timeout_suspects(ending, HOSTS)) == ["node2"]
    late = {2: {"rank": 2, "failure_class": "collective_timeout", "host": "node2"}}
    assert collective_timeout_suspects(ending, HOSTS, late) == {}
    # A late record without a class (cut short, or a rank still running) does not clear anything.
    assert sorted(collective_timeout_suspects(ending, HOSTS, {2: {"rank": 2}})) == ["node2"]


@pytest.mark.parametrize("ranks", [{"zero": {"failure_class": "collective_timeout"}}, {"0": "collective_timeout"},
                                   ["0"], None])
def test_an_ending_with_malformed_ranks_blames_no_host(ranks) -> None:
    assert collective_timeout_suspects({"failure_class": "collective_timeout", "ranks": ranks}, HOSTS) == {}


@pytest.mark.parametrize("ending", ['{"failure_class": "collective_timeout", "ranks": {"0": ', '[1, 2]',
                                    '{"failure_class": "collective_timeout", "ranks": {"0": {"failure_class": '
                                    '"collective_timeout"}}, "step": 2}'],
                         ids=["cut_short", "not_an_object", "hosts_json_forged"])
def test_a_malformed_ending_or_hosts_file_never_hides_the_jobs_own_failure(tmp_path: Path, ending: str) -> None:
    import time

    import dagster as dg

    from resources.slurm import JobState

    launch = _launch(tmp_path)
    run_dir = Path(launch.run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / "ending.json").write_text(ending)
    (run_dir / "hosts.json").write_text('{"ranks": {"0": ["node1"], "x": 3}}')
    state = JobState(job_id="7", state="FAILED", exit_code=1, signal=0, nodes="node[1-2]",
                     submitted_at=time.time() - 60)
    context = dg.build_asset_context()
    SlurmLauncher(nodes=2, nproc_per_node=1)._suspects(context, state, launch)  # logs; never raises


def test_slurmd_is_probed_only_once_a_rank_has_ended() -> None:
    probed: list[str] = []
    cause = [False]

    def probe(address: str, port: int) -> str | None:
        probed.append(address)
        return "refused"

    watch = NodeWatch(["node2"], grace_s=10, run=lambda *args: "NodeName=node2 NodeAddr=10.0.0.2 State=ALLOCATED",
                      every_s=0, probe=probe, suspect=lambda: cause[0])
    assert watch.check() == [] and watch.seen == {} and probed == []  # a healthy job: no knocking on slurmd
    cause[0] = True
    watch.check()
    assert probed == ["10.0.0.2"] and "node2" in watch.seen


# ---------------------------------------------------------------------------------------------
# The node_lost line in attempts.jsonl (resources/slurm.py).


@pytest.mark.parametrize(("last", "kept_lines"), [
    ('{"attempt": 0, "started_at": "t0", "failure_class": "peer_lost", "decision": "stop"}', 0),
    ('{"attempt": 0, "started_at": "t0", "fail', 1),              # cut short: kept, the node_lost line added
    ('{"attempt": 3, "started_at": "t9", "decision": "stop"}', 1),  # another attempt's: never replaced
    ('[0]', 1),
], ids=["same_attempt", "cut_short", "another_attempt", "not_an_object"])
def test_a_node_lost_line_replaces_only_the_same_attempts_line(tmp_path: Path, last: str, kept_lines: int) -> None:
    from resources.slurm import _replace_or_append_attempt

    earlier = '{"attempt": -1, "decision": "requeue"}'
    (tmp_path / "attempts.jsonl").write_text(f"{earlier}\n{last}\n")
    _replace_or_append_attempt(tmp_path, {"attempt": 0, "failure_class": "node_lost", "decision": "requeue"},
                               replace=True)
    lines = (tmp_path / "attempts.jsonl").read_text().splitlines()
    assert lines[0] == earlier and lines[1:1 + kept_lines] == [last][:kept_lines] and len(lines) == 2 + kept_lines
    new = json.loads(lines[-1])
    assert new["failure_class"] == "node_lost" and new["decision"] == "requeue"
    assert new.get("started_at") == ("t0" if kept_lines == 0 else None)
