"""Training stages on a real SLURM cluster (issue 12): the local single-node cluster of
``make slurm-up`` (deploy/slurm/up.sh: munge, MariaDB + slurmdbd, slurmctld, slurmd), which
.ci/run starts. Stages run through Dagster with ``SlurmLauncher``: sbatch, srun torchrun, Pipes
through files, scancel, requeue on the preemption exit.

Without a cluster these tests are skipped, unless TRAINYARD_REQUIRE_SLURM=1 (as .ci/run sets it),
where a missing cluster fails them.

Run: sudo make slurm-up && python -m pytest tests/test_slurm.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from slurm_lab import (CONFIG, SlurmLab, materialization, pretrain_config, processes_of_job, require_cluster,
                       sacct_state, slurm_lab as make_lab)

from ops.checkpoints import store
from resources.slurm import SlurmLauncher, run_slurm, seconds
from trainer.launch.stage_launch import StageLaunch

require_cluster()
_pretrain_config, _metadata, _sacct, _processes_of_job = pretrain_config, materialization, sacct_state, processes_of_job


def _job_ids(result, instance) -> list[str]:
    return [message.split("submitted SLURM job ")[1].split()[0] for message in
            (entry.message or "" for entry in instance.all_logs(result.run_id)) if "submitted SLURM job " in message]


@pytest.fixture(scope="module")
def slurm_lab(demo_manifest, demo_validation, tmp_path_factory: pytest.TempPathFactory):
    launcher = SlurmLauncher(nproc_per_node=2, cpus_per_task=2, time_limit="00:10:00", poll_s=0.5)
    with make_lab(demo_manifest, demo_validation, tmp_path_factory.mktemp("slurm"), launcher,
                  key="slurm-module-key") as lab:
        yield lab


def _bring_back(host: str) -> None:
    """The node up again for the tests after this one (ReturnToService may already have done it)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        state = run_slurm("sinfo", "-h", "-n", host, "-o", "%T").strip()
        if state.startswith(("idle", "mix", "alloc")):
            return
        subprocess.run(["scontrol", "update", f"nodename={host}", "state=resume"], capture_output=True, timeout=30)
        time.sleep(1)
    raise AssertionError(f"node {host} did not come back: {state}")


def _launch(lab: SlurmLab, **fields) -> StageLaunch:
    return lab.launch(**fields)


# ---------------------------------------------------------------------------------------------
# Before submission


@pytest.mark.parametrize(("fields", "needle"), [
    ({"partition": "nope"}, "SlurmLauncher.partition: nope does not exist on this cluster (partitions: debug, gpu"),
    ({"nodes": 3, "nproc_per_node": 1}, "SlurmLauncher.nodes=3"),
    ({"time_limit": "UNLIMITED"}, "SlurmLauncher.time_limit is not set"),
    ({"time_limit": "05:00:00"}, "exceeds partition debug's MaxTime 04:00:00"),
    ({"cpus_per_task": 64}, "64 CPUs"),
    ({"mem": "100T"}, "100T memory"),
    ({"gpus_per_node": 1}, "1 GPUs"),
    ({"partition": "gpu", "gpus_per_node": 8}, "SlurmLauncher.shared_paths is empty, but partition nodes gpu1"),
    ({"partition": "gpu", "gpus_per_node": 8, "shared_paths": ["/nfs"]}, "is not under SlurmLauncher.shared_paths"),
    ({"time_limit": "ten minutes"}, "not a SLURM time limit"),
])
def test_an_impossible_request_is_refused_before_submission_naming_the_setting(slurm_lab, fields, needle) -> None:
    launcher = SlurmLauncher(**{**slurm_lab.launcher.model_dump(), **fields})
    world = fields.get("nodes", 1) * launcher.nproc_per_node if "nodes" in fields else 2
    problems = launcher.check(_launch(slurm_lab, world_size=world))
    assert any(needle in problem for problem in problems), problems


def test_a_request_that_fits_passes_the_checks(slurm_lab) -> None:
    assert slurm_lab.launcher.check(_launch(slurm_lab)) == []
    assert seconds("1-5") == 29 * 3600 and seconds("30") == 1800 and seconds("2:30") == 150


def test_a_refused_stage_never_reaches_the_queue(slurm_lab) -> None:
    before = run_slurm("squeue", "-h", "-o", "%i").split()
    result = slurm_lab.materialize(_pretrain_config(), ok=False,
                                   launcher=SlurmLauncher(**{**slurm_lab.launcher.model_dump(), "partition": "nope"}))
    messages = " ".join(event.message or "" for event in result.all_events if event.is_failure)
    failure = [e.step_failure_data for e in result.all_events if e.is_step_failure][0].user_failure_data
    assert "SLURM job refused before submission" in failure.description and "partition: nope" in failure.description, messages
    assert run_slurm("squeue", "-h", "-o", "%i").split() == before
    assert not any(e.event_type_value == "STEP_UP_FOR_RETRY" for e in result.all_events)


def test_the_4_by_8_gpu_script_is_accepted_by_sbatch_test_only(slurm_lab, tmp_path: Path) -> None:
    launcher = SlurmLauncher(partition="gpu", nodes=4, nproc_per_node=8, gpus_per_node=8, cpus_per_task=32,
                             mem="512G", time_limit="12:00:00", shared_paths=["/"])
    launch = _launch(slurm_lab, world_size=32)
    assert launcher.check(launch) == []
    script = tmp_path / "job.sbatch"
    script.write_text(launcher.render(launch))
    text = script.read_text()
    assert "#SBATCH --nodes=4" in text and "#SBATCH --gpus-per-node=8" in text and "--nproc-per-node=8" in text
    assert '--rdzv-endpoint="$head_node:$port"' in text and 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    accepted = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, timeout=30)
    assert accepted.returncode == 0 and "gpu[1-4]" in accepted.stderr, accepted.stderr
    too_big = SlurmLauncher(**{**launcher.model_dump(), "nodes": 5})
    assert any("partition gpu has 4 node(s)" in problem for problem in too_big.check(_launch(slurm_lab, world_size=40)))


def test_dry_run_shows_the_rendered_script(slurm_lab) -> None:
    env = os.environ | {"TRAINYARD_SLURM_PARTITION": "debug", "TRAINYARD_SLURM_TIME": "00:20:00"}
    shown = subprocess.run([str(Path(os.sys.executable).parent / "trainyard"), "dry-run", CONFIG, "--slurm",
                            "--world-size", "2"], capture_output=True, text=True, env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "#SBATCH --partition=debug" in shown.stdout and "#SBATCH --time=00:20:00" in shown.stdout
    assert "the checks before submission pass" in shown.stderr


# ---------------------------------------------------------------------------------------------
# Real jobs


def _flaky_slurm_commands(folder: Path, failures: int) -> Path:
    """``scontrol show job`` and ``sacct`` in front of the real ones, failing their first ``failures``
    calls together as a slurmctld that is busy or restarting does (then the real commands answer)."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("scontrol", "sacct"):
        real = shutil.which(name)
        assert real is not None, f"{name} is not installed"
        script = folder / name
        script.write_text(f"""#!/bin/bash
if [ "{name}" = sacct ] || [ "$1 $2" = "show job" ]; then
  n=$(cat {folder}/failed 2>/dev/null || echo 0)
  if [ "$n" -lt {failures} ]; then
    echo $((n + 1)) > {folder}/failed
    echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2
    exit 1
  fi
fi
exec {real} "$@"
""")
        script.chmod(0o755)
    return folder


def test_a_two_rank_pretrain_submitted_through_dagster_completes(slurm_lab, monkeypatch, tmp_path: Path) -> None:
    # A slurmctld that does not answer for a few polls is asked again, not taken for the job's end.
    shim = _flaky_slurm_commands(tmp_path / "flaky", failures=4)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
    result = slurm_lab.materialize(_pretrain_config(overrides=["name=slurm-ref", "train.dump_final_params=true"]))
    assert (shim / "failed").read_text().strip() == "4"
    monkeypatch.undo()
    metadata = _metadata(result)
    assert metadata["status"] == "completed" and metadata["final_step"] == 6 and metadata["world_size"] == 2
    (job_id,) = _job_ids(result, slurm_lab.instance)
    assert _sacct(job_id) == "COMPLETED"
    report = store.verify(metadata["checkpoint"], store.configured_key(),
                                     expected_run_id=metadata["run_id"])
    assert report.ok and metadata["checkpoint_step"] == 6
    # The job's log streamed into the Dagster run, and rank 0 reported through Pipes files.
    logs = [entry.message or "" for entry in slurm_lab.instance.all_logs(result.run_id)]
    assert any(f"[trainyard] job {job_id} on 1 node(s)" in line for line in logs), logs[-20:]
    assert any(f"SLURM job {job_id}: no state (" in line and "asking again" in line for line in logs), logs[-20:]
    assert any("step 6" in line for line in logs)
    slurm_lab.reference = Path(metadata["run_dir"])


def test_a_job_warned_before_its_time_limit_checkpoints_requeues_and_resumes_bit_identically(slurm_lab) -> None:
    run_id = str(uuid.uuid4())
    warned: dict[str, str] = {}

    def warn_after_first_checkpoint() -> None:  # what --signal=B:USR1@120 does, at a moment the test picks
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            jobs = _job_ids_for(slurm_lab, run_id)
            runs = list((slurm_lab.base / "data" / "runs").glob("pretrain-*"))
            committed = [run for run in runs if run != slurm_lab.reference and (run / "checkpoints" / "step_000002").exists()]
            if jobs and committed:
                warned["job"] = jobs[0]
                run_slurm("scancel", "--signal=USR1", "--batch", jobs[0])
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=warn_after_first_checkpoint, daemon=True)
    watcher.start()
    result = slurm_lab.materialize(_pretrain_config(overrides=["name=slurm-requeue", "train.dump_final_params=true",
                                                               "train.checkpoint_every=2", "faults.stall_rank=0",
                                                               "faults.stall_at_step=3", "faults.stall_s=5"]),
                                   run_id=run_id)
    watcher.join()
    assert "job" in warned, "the job never committed its first checkpoint"
    metadata = _metadata(result)
    jobs = _job_ids(result, slurm_lab.instance)
    assert len(jobs) == 2 and jobs[0] == warned["job"], jobs
    assert metadata["attempt_classes"] == "preempted,completed" and metadata["retries_spent"] == 1
    run_dir = Path(metadata["run_dir"])
    attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert attempts[0]["decision"] == "requeue" and attempts[1]["restored_step"] == attempts[0]["step"] >= 2
    truth = torch.load(slurm_lab.reference / "final_params.pt", weights_only=True)
    resumed = torch.load(run_dir / "final_params.pt", weights_only=True)
    assert all(torch.equal(truth[name], resumed[name]) for name in truth)


def _job_ids_for(lab: SlurmLab, run_id: str) -> list[str]:
    return lab.job_ids(run_id)


def test_cancelling_the_dagster_run_cancels_the_job_and_leaves_nothing_behind(slurm_lab) -> None:
    import signal

    run_id = str(uuid.uuid4())
    cancelled: dict[str, str] = {}

    def interrupt_once_running() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            jobs = _job_ids_for(slurm_lab, run_id)
            if jobs and any((entry.message or "").startswith(("step 1 ", "step 1/"))
                            for entry in slurm_lab.instance.all_logs(run_id)):
                cancelled["job"] = jobs[0]
                os.kill(os.getpid(), signal.SIGINT)  # as `dagster` interrupts a run worker on termination
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=interrupt_once_running, daemon=True)
    watcher.start()
    result = slurm_lab.materialize(_pretrain_config(steps=5000, overrides=["name=slurm-cancel"]), ok=False,
                                   run_id=run_id)
    watcher.join()
    assert "job" in cancelled and not result.success
    assert _sacct(cancelled["job"]) == "CANCELLED"
    # Only what this test started: the job's own processes, never a pattern across the machine
    # (another checkout's trainer may run beside this one).
    deadline = time.monotonic() + 30  # slurmstepd signals, then kills after KillWait
    while (leftover := _processes_of_job(cancelled["job"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftover, leftover


def test_a_job_the_launcher_can_no_longer_follow_is_cancelled_not_left_running_unwatched(
        slurm_lab, monkeypatch, tmp_path: Path) -> None:
    import resources.slurm as slurm_module

    shim = _flaky_slurm_commands(tmp_path / "gone", failures=10**6)  # slurmctld never answers about the job
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(slurm_module, "JOB_STATE_PATIENCE_S", 3.0)
    run_id = str(uuid.uuid4())
    result = slurm_lab.materialize(_pretrain_config(steps=5000, overrides=["name=slurm-unwatched"]), ok=False,
                                   run_id=run_id)
    monkeypatch.undo()
    assert not result.success
    (job_id,) = _job_ids_for(slurm_lab, run_id)
    logs = [entry.message or "" for entry in slurm_lab.instance.all_logs(run_id)]
    assert any(f"SLURM job {job_id}: the launcher stopped watching it (SlurmError" in line and "cancelling it" in line
               for line in logs), logs[-10:]
    deadline = time.monotonic() + 60
    while _sacct(job_id) != "CANCELLED" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _sacct(job_id) == "CANCELLED"
    deadline = time.monotonic() + 30
    while (leftover := _processes_of_job(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftover, leftover


def test_a_job_process_is_found_by_its_job_id_and_no_other(tmp_path: Path) -> None:
    # The finder the cancel test relies on, on a real process with and without the job's id.
    import sys

    env = os.environ | {"SLURM_JOB_ID": "987654321"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        deadline = time.monotonic() + 10
        while not _processes_of_job("987654321") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [line.split(":")[0] for line in _processes_of_job("987654321")] == [str(child.pid)]
        assert _processes_of_job("98765432") == [] and _processes_of_job("9876543210") == []
    finally:
        child.kill()
        child.wait()
    assert _processes_of_job("987654321") == []


def test_a_node_that_goes_down_mid_job_is_a_classified_failure_not_a_hang(slurm_lab) -> None:
    host = run_slurm("scontrol", "show", "hostnames", run_slurm("sinfo", "-h", "-p", "debug", "-o", "%N").strip()).split()[0]
    run_id = str(uuid.uuid4())

    def down_once_running() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if any((entry.message or "").startswith(("step 1 ", "step 1/")) for entry in slurm_lab.instance.all_logs(run_id)):
                run_slurm("scontrol", "update", f"nodename={host}", "state=down", "reason=trainyard-test")
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=down_once_running, daemon=True)
    watcher.start()
    try:
        result = slurm_lab.materialize(_pretrain_config(steps=5000, overrides=["name=slurm-node-down"]), ok=False,
                                       run_id=run_id, launcher=SlurmLauncher(**{**slurm_lab.launcher.model_dump(),
                                                                                "requeue": False}))
    finally:
        watcher.join()
        _bring_back(host)
    failure = [e.step_failure_data for e in result.all_events if e.is_step_failure][0].user_failure_data
    metadata = {key: getattr(value, "value", value) for key, value in failure.metadata.items()}
    assert metadata["slurm_state"] == "NODE_FAIL", failure.description
    assert metadata["failure_class"] == "rank_crash" and metadata["failure_class"] != "hang"
    assert host in failure.description


# ---------------------------------------------------------------------------------------------
# A sweep on SLURM (issue 38): its trials are one array job whose %N is the sweep's concurrency.


def test_a_sweep_on_slurm_is_one_array_job_that_never_runs_more_trials_than_its_concurrency(
        slurm_lab, tmp_path: Path, monkeypatch) -> None:
    import dagster as dg
    import optuna
    import yaml

    from pipelines.sweeps import run_sweep

    home = tmp_path / "home"
    monkeypatch.setenv("TRAINYARD_HOME", str(home))
    monkeypatch.setenv("DAGSTER_HOME", str(home / "dagster_home"))
    monkeypatch.setenv("TRAINYARD_ENV", "slurm")
    monkeypatch.setenv("TRAINYARD_MEDIA_ROOT", str(slurm_lab.base / "media"))
    monkeypatch.setenv("TRAINYARD_DATA_ROOT", str(slurm_lab.storage.data_root))
    monkeypatch.setenv("TRAINYARD_SLURM_TIME", "00:10:00")
    monkeypatch.delenv("TRAINYARD_OPTUNA_STORAGE", raising=False)
    from pipelines.instance import ensure_dagster_home

    ensure_dagster_home()
    shard_index = slurm_lab.shard_index

    @dg.asset(name="shard_index")
    def fixed_shard_index() -> dict:  # the data the trials read, stored where sweep_trial's input loads it
        return shard_index

    with dg.DagsterInstance.get() as instance:
        assert dg.materialize([fixed_shard_index], instance=instance).success
    sweep = tmp_path / "slurm_lr.yaml"
    sweep.write_text(yaml.safe_dump({
        "name": "slurm_lr", "base": CONFIG, "stage": "pretrain", "steps": 4, "world_size": 1,
        # The lab's shards hold the train split only: the objective is measured on it here.
        "overrides": ["train.eval_every=2", "eval.samples=0", "eval.split=train", "eval.max_samples=8",
                      "train.parallelism=none"],
        "space": {"optim.lr": {"grid": [1.0e-3, 2.0e-3, 3.0e-3]}}, "objective": {"metric": "val/loss", "step": 4},
        "budget": 3, "concurrency": 2, "sampler": {"kind": "grid", "seed": 0}, "pruner": {"kind": "none"}}))
    lines: list[str] = []
    summary = run_sweep(sweep, log=lines.append)
    assert summary["num_complete"] == 3, "\n".join(lines)
    submitted = [line for line in lines if "submitted SLURM array job" in line]
    assert len(submitted) == 1, lines
    job_id = submitted[0].split("array job ")[1].split(":")[0]
    script = next((home / "sweeps" / "slurm_lr" / "slurm").glob("slurm_lr-*.sbatch")).read_text()
    assert "#SBATCH --array=0,1,2%2" in script and "export TRAINYARD_ENV=local" in script
    rows = [line.split("|") for line in run_slurm("sacct", "-j", job_id, "-X", "-P", "-n", "-o",
                                                   "JobID,State,Start,End,NodeList").splitlines()]
    assert len(rows) == 3 and {row[1] for row in rows} == {"COMPLETED"}, rows
    moments = sorted([(row[2], 1) for row in rows] + [(row[3], -1) for row in rows], key=lambda m: (m[0], m[1]))
    running = peak = 0
    for _, change in moments:
        running += change
        peak = max(peak, running)
    assert peak <= 2, rows  # SLURM's %2: never three trials at once
    study = optuna.load_study(study_name="slurm_lr", storage=f"sqlite:///{home / 'optuna' / 'studies.db'}")
    assert [trial.state.name for trial in study.trials] == ["COMPLETE"] * 3
    assert study.user_attrs["slurm_array_job"] == job_id
