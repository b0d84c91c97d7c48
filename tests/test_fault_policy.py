"""Issue 11: every end of a run gets one class, and the launch's fault policy retries only what is
transient, within the run's budget (trainer/endings.py, trainer/supervisor/elastic.py, trainer/faults.py).

The unit tests feed the classifier and the policy the records real runs leave; the torchrun tests
run the real launch (``python -m trainer.supervisor.elastic`` with ``$TRAINYARD_RUN_DIR``, as the launchers
run it) on 2 gloo ranks of the tiny preset. The fault drill (tests/test_training_assets.py) runs
every injection end to end through Dagster.

Run: python -m pytest tests/test_fault_policy.py -q
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pytest
import yaml

from ops.publish.paths import REPO_ROOT
from trainer.launch.config import load_config
from trainer.endings import BadSampleError, classify, read_rank_ends, run_ending, write_rank_end
from trainer.faults import FaultInjector
from trainer.checkpointing.checkpointer import NoVerifiedCheckpoint
from trainer.supervisor.elastic import decide, read_attempts, retries_spent
from trainer.launch.config_sections import FaultConfig


class CheckpointSaveError(RuntimeError):
    """Named as trainer.checkpointing.checkpointer's: classified by name."""


# ---------------------------------------------------------------------------------------------
# Classification of one rank's end


@pytest.mark.parametrize(("status", "error", "expected"), [
    ("canceled", None, "preempted"),
    ("failed", BadSampleError(["clip-7"], "shape mismatch"), "bad_sample"),
    ("failed", OSError(errno.ENOSPC, "No space left on device"), "storage_error"),
    ("failed", CheckpointSaveError("checkpoint for step 4 was not saved"), "storage_error"),
    # The real exception: every checkpoint of the run fails verification. Retrying cannot change that.
    ("failed", NoVerifiedCheckpoint("/runs/r", [("step_000002", "COMMITTED.json: truncated")]),
     "checkpoint_unverifiable"),
    ("failed", RuntimeError("wrapped"), "error"),
])
def test_new_classes_come_from_the_error(status, error, expected) -> None:
    assert classify(status, error) == expected


@pytest.mark.parametrize("damage", [b'{"step": 1, "checkp', b"\xff not json", b"[" * 100_000, b"[]"])
def test_a_damaged_known_good_pin_is_corruption_never_retried(tmp_path: Path, damage: bytes) -> None:
    """The errors the Checkpointer really raises on a damaged KNOWN_GOOD.json, on resume and after a
    save (retention reads the pin): record_corrupt, which the policy stops on (issue 32, item 9)."""
    import test_checkpoint_toy as toy

    from ops.checkpoints import store as store

    app_state = toy.build("none")
    toy.checkpointer(tmp_path).save(1, app_state)
    store.pin_known_good(tmp_path, 1, {"drill": "ok"})
    (store.checkpoints_dir(tmp_path) / store.KNOWN_GOOD_NAME).write_bytes(damage)
    raised = []
    for action in (lambda ckpt: ckpt.load(toy.build("none")), lambda ckpt: ckpt.save(2, app_state)):
        with pytest.raises(Exception) as error:  # noqa: PT011 - the class is what is checked below
            action(toy.checkpointer(tmp_path))
        raised.append(error.value)
        assert store.KNOWN_GOOD_NAME in str(error.value)
        assert classify("failed", error.value) == "record_corrupt"
    ending = {**_ending("record_corrupt"), "error": str(raised[0])}
    decision, why = decide(ending, run_dir=tmp_path, restarts_left=5, max_bad_samples=4)
    assert decision == "stop" and "not retried" in why


@pytest.mark.parametrize("damage", [b'{"samples": {"clip-1": {"st', b"[]", b'{"samples": ["clip-1"]}', b"\xff"])
def test_a_damaged_quarantine_list_is_corruption_never_retried_nor_read_as_empty(tmp_path: Path, damage) -> None:
    from trainer.supervisor.elastic import RunRecordCorrupt, bad_samples_path, read_bad_samples

    bad_samples_path(tmp_path).parent.mkdir(parents=True)
    bad_samples_path(tmp_path).write_bytes(damage)
    with pytest.raises(RunRecordCorrupt, match="bad_samples.json: a damaged quarantine list") as refused:
        read_bad_samples(tmp_path)  # what the launch and every rank's loop read before training
    assert classify("failed", refused.value) == "record_corrupt"


def test_a_cause_down_the_chain_is_found_and_its_sample_ids_kept(tmp_path: Path) -> None:
    try:
        try:
            raise BadSampleError(["clip-7", "clip-9"], "decoder returned 0 frames")
        except BadSampleError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        record = write_rank_end(tmp_path, rank=1, world_size=2, status="failed", step=3, error=outer,
                                redact=lambda text: text)
    assert record["failure_class"] == "bad_sample" and record["sample_ids"] == ["clip-7", "clip-9"]


# ---------------------------------------------------------------------------------------------
# The run's class, from the ranks' records and torchelastic's report


def _report(rank: int, exitcode: int, recorded: str | None = None) -> dict:
    exit_text = f"killed by signal SIGKILL (exit {exitcode})" if exitcode < 0 else f"exited with code {exitcode}"
    cause = {"rank": rank, "local_rank": rank, "pid": 1, "exitcode": exitcode, "exit": exit_text,
             "recorded_error": recorded, "timestamp": 0, "timestamp_ns": 0}
    return {"root_cause": cause, "summary": f"rank {rank} {exit_text}", "failures": [cause]}


def _rank(run_dir: Path, rank: int, status: str, error: BaseException | None, step: int = 3) -> None:
    write_rank_end(run_dir, rank=rank, world_size=2, status=status, step=step, error=error, redact=lambda t: t)


def test_a_killed_rank_is_a_rank_crash_with_its_rank_host_and_last_log_lines(tmp_path: Path) -> None:
    _rank(tmp_path, 0, "failed", RuntimeError("[gloo] Connection closed by peer"))
    log = tmp_path / "stdout.log"
    log.write_text("".join(f"line {i} token=hunter2\n" for i in range(100)))
    ending = run_ending(tmp_path, _report(1, -9), attempt=0, logs=lambda rank: [log] if rank == 1 else [],
                        redact=lambda text: text.replace("hunter2", "***"))
    assert ending["failure_class"] == "rank_crash" and ending["rank"] == 1 and ending["host"]
    assert ending["step"] == 3 and ending["ranks"]["0"]["failure_class"] == "peer_lost"
    assert len(ending["log_tail"]) == 40 and ending["log_tail"][-1] == "line 99 token=***"
    assert {"python", "torch", "platform"} <= set(ending["versions"])
    assert json.loads((tmp_path / "ending.json").read_text()) == ending


@pytest.mark.parametrize(("exitcode", "expected"), [(2, "config_error"), (124, "hang"), (3, "diverged"),
                                                    (143, "preempted"), (17, "rank_crash")])
def test_exit_codes_name_the_class_when_the_rank_left_no_record(tmp_path: Path, exitcode: int, expected: str) -> None:
    assert run_ending(tmp_path, _report(0, exitcode), attempt=0)["failure_class"] == expected


def test_survivors_stopped_by_torchrun_do_not_hide_the_real_failure(tmp_path: Path) -> None:
    _rank(tmp_path, 1, "failed", BadSampleError(["clip-3"], "crash"))
    _rank(tmp_path, 0, "canceled", None)  # torchrun's SIGTERM to the survivor: its stop at a boundary
    ending = run_ending(tmp_path, _report(0, 143), attempt=2)
    assert ending["failure_class"] == "bad_sample" and ending["sample_ids"] == ["clip-3"] and ending["attempt"] == 2


def _two_rank_report(rank_0: tuple[int, str | None, int], rank_1: tuple[int, str | None, int]) -> dict:
    """trainer.supervisor.failure_report's report of two failures, each (exit code, recorded error, unix second), its
    root cause picked by trainer.supervisor.failure_report's own rule."""
    from trainer.supervisor.failure_report import describe_exit, root_cause

    entries = [{"rank": rank, "local_rank": rank, "pid": 100 + rank, "exitcode": code, "exit": describe_exit(code),
                "recorded_error": recorded, "timestamp": second, "timestamp_ns": second * 10**9 + 5}
               for rank, (code, recorded, second) in enumerate((rank_0, rank_1))]
    cause = root_cause(entries)
    return {"root_cause": cause, "summary": f"rank {cause['rank']} {cause['exit']}", "failures": entries}


TIMEOUT = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")


def test_a_frozen_rank_killed_by_torchruns_escalation_is_the_hang_not_a_crash(tmp_path: Path) -> None:
    """Issue 32, item 9: rank 1 SIGSTOPed; rank 0 timed out waiting on it at t=100; torchrun SIGTERMed
    rank 1, which cannot answer, and SIGKILLed it 30 s later (noticed at t=131, no record)."""
    _rank(tmp_path, 0, "failed", TIMEOUT)
    ending = run_ending(tmp_path, _two_rank_report((1, f"RuntimeError: {TIMEOUT}", 100), (-9, None, 131)), attempt=0)
    assert (ending["failure_class"], ending["rank"]) == ("hang", 1) and ending["retryable"]
    assert ending["error"].startswith("rank 1 stopped answering (frozen") and "rank 0 waited on it" in ending["error"]
    assert "SIGKILL (exit -9)" in ending["exit"]
    # A rank killed before its peer timed out (the OOM killer; NCCL's peers see only a timeout) crashed.
    crashed = run_ending(tmp_path, _two_rank_report((1, f"RuntimeError: {TIMEOUT}", 100), (-9, None, 97)), attempt=0)
    assert (crashed["failure_class"], crashed["rank"]) == ("rank_crash", 1)


def test_the_rank_whose_watchdog_fired_is_the_cause_not_the_peer_that_timed_out_on_it(tmp_path: Path) -> None:
    """Issue 32, item 9, as the real launch left it: rank 1 stalled in its data fetch; rank 0's collective
    timed out first (t=100), then rank 1's watchdog recorded the hang and exited 124 (t=103)."""
    from trainer.watchdog import HangDetected, marker_path

    _rank(tmp_path, 0, "failed", TIMEOUT)
    hang = HangDetected("rank 1: no progress for 6.0 s (limit train.watchdog_s=5); last progress: data fetch at step 2")
    _rank(tmp_path, 1, "failed", hang)
    report = _two_rank_report((1, f"RuntimeError: {TIMEOUT}", 100), (124, f"HangDetected: {hang}", 103))
    assert report["root_cause"]["rank"] == 0  # trainer.supervisor.failure_report's order: the earliest recorded error
    marker_path(tmp_path).write_text(json.dumps({"rank": 1, "step": 2, "error": str(hang)}))
    ending = run_ending(tmp_path, report, attempt=0)
    assert (ending["failure_class"], ending["rank"], ending["exit"]) == ("hang", 1, "exited with code 124")
    assert "data fetch at step 2" in ending["error"] and "rank 0 only waited on it" in ending["error"]
    marker_path(tmp_path).write_text(json.dumps({"rank": 0, "step": 2, "error": "x"}))  # rank 0's watchdog fired
    assert run_ending(tmp_path, report, attempt=0)["rank"] == 0


def test_a_record_cut_short_by_a_kill_is_ignored(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank_1.json").write_text('{"rank": 1, "failure_cl')
    assert read_rank_ends(tmp_path) == {}
    assert run_ending(tmp_path, _report(1, -9), attempt=0)["failure_class"] == "rank_crash"


# ---------------------------------------------------------------------------------------------
# The policy


def _ending(failure_class: str, sample_ids=()) -> dict:
    return {"failure_class": failure_class, "sample_ids": list(sample_ids), "attempt": 0, "step": 3, "rank": 1,
            "error": "x"}


@pytest.mark.parametrize("failure_class", ["rank_crash", "collective_timeout", "hang", "storage_error"])
def test_transient_failures_restart_within_the_budget_and_stop_when_it_is_spent(tmp_path, failure_class) -> None:
    assert decide(_ending(failure_class), run_dir=tmp_path, restarts_left=1, max_bad_samples=4)[0] == "restart"
    decision, why = decide(_ending(failure_class), run_dir=tmp_path, restarts_left=0, max_bad_samples=4)
    assert decision == "stop" and "budget" in why  # a budget of 0: never retried


@pytest.mark.parametrize("failure_class", ["diverged", "out_of_memory", "checkpoint_unverifiable", "record_corrupt",
                                           "config_error", "error"])
def test_deterministic_failures_are_never_retried(tmp_path: Path, failure_class: str) -> None:
    decision, why = decide(_ending(failure_class), run_dir=tmp_path, restarts_left=5, max_bad_samples=4)
    assert decision == "stop" and "not retried" in why


def test_a_preemption_is_requeued_only_with_budget_left(tmp_path: Path) -> None:
    assert decide(_ending("preempted"), run_dir=tmp_path, restarts_left=1, max_bad_samples=4)[0] == "requeue"
    assert decide(_ending("preempted"), run_dir=tmp_path, restarts_left=0, max_bad_samples=4)[0] == "stop"


def test_bad_samples_are_quarantined_once_and_a_repeat_or_a_flood_stops(tmp_path: Path) -> None:
    from trainer.supervisor.elastic import _quarantine

    assert decide(_ending("bad_sample", ["a"]), run_dir=tmp_path, restarts_left=0, max_bad_samples=2)[0] == "quarantine"
    _quarantine(tmp_path, _ending("bad_sample", ["a"]))
    decision, why = decide(_ending("bad_sample", ["a"]), run_dir=tmp_path, restarts_left=0, max_bad_samples=2)
    assert decision == "stop" and "again" in why
    assert decide(_ending("bad_sample", ["b", "c"]), run_dir=tmp_path, restarts_left=0, max_bad_samples=2)[0] == "stop"
    assert decide(_ending("bad_sample", []), run_dir=tmp_path, restarts_left=3, max_bad_samples=2)[0] == "stop"


def test_the_attempt_ledger_survives_a_torn_last_line(tmp_path: Path) -> None:
    (tmp_path / "attempts.jsonl").write_text('{"attempt": 0, "decision": "restart"}\n{"attempt": 1, "deci')
    attempts = read_attempts(tmp_path)
    assert attempts == [{"attempt": 0, "decision": "restart"}] and retries_spent(attempts) == 1


# ---------------------------------------------------------------------------------------------
# Fault and policy settings


def test_two_faults_at_the_same_step_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="exit_at_step and faults.sigterm_at_step both fire at step 3"):
        FaultConfig(exit_rank=1, exit_at_step=3, sigterm_at_step=3)
    with pytest.raises(ValueError, match="nan_loss_at_steps both fire at step 2"):
        FaultConfig(stall_rank=0, stall_at_step=2, stall_s=5, nan_loss_at_steps=[2])
    FaultConfig(sigterm_at_step=2, stall_rank=0, stall_at_step=2, stall_s=5, stall_in="save")  # the grace test


@pytest.mark.parametrize(("override", "needle"), [
    ("train.retry_budget=-1", "retry_budget"), ("train.preempt_signals=[SIGKILL]", "preempt_signals"),
    ("train.preempt_signals=[]", "at least one"), ("train.loss_spike_factor=0.5", "loss_spike_factor"),
    ("faults.exit_in=later", "exit_in"), ("faults.sigterm_count=9", "sigterm_count"),
    ("faults.preempt_with=SIGNOPE", "preempt_with"),
])
def test_settings_that_cannot_work_are_refused(override: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        load_config(REPO_ROOT / "configs" / "test_tiny.yaml", [override, "train.run_dir=/tmp/x"])


def test_faults_fire_only_on_their_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    config = FaultConfig(raise_on_sample="k")
    monkeypatch.setenv("TRAINYARD_ATTEMPT", "1")
    FaultInjector(config, rank=0).check_batch(1, ["k"])  # attempt 1: disarmed
    with pytest.raises(BadSampleError):
        FaultInjector(FaultConfig(raise_on_sample="k", attempt=-1), rank=0).check_batch(1, ["k"])
    monkeypatch.setenv("TRAINYARD_ATTEMPT", "0")
    with pytest.raises(BadSampleError, match="bad sample k"):
        FaultInjector(config, rank=0).check_batch(1, ["j", "k"])


def test_the_policy_fields_do_not_rename_a_run_folder() -> None:
    from trainer.launch.run_identity import run_identity
    from ops.publish.hashing import digest_json

    base = ["train.run_dir=/tmp/x"]
    names = {digest_json(run_identity(load_config(REPO_ROOT / "configs" / "test_tiny.yaml", base + extra)))
             for extra in ([], ["train.retry_budget=0"], ["train.preempt_signals=[SIGTERM,SIGUSR1]"],
                           ["train.preempt_grace_s=5"], ["train.max_bad_samples=1"])}
    assert len(names) == 1
    spiky = load_config(REPO_ROOT / "configs" / "test_tiny.yaml", base + ["train.loss_spike_factor=4"])
    assert digest_json(run_identity(spiky)) not in names  # a spike limit changes how the run can end


# ---------------------------------------------------------------------------------------------
# Dagster: only a requeue is retried


def test_the_launch_failure_carries_the_class_and_only_a_requeue_allows_a_retry(tmp_path: Path) -> None:
    from assets.stage_runs import only_requeues_retry
    from resources.launcher import RequeueFailure, rank_failure

    (tmp_path / "attempts.jsonl").write_text(json.dumps({
        "attempt": 0, "launch_id": "abc", "failure_class": "preempted", "step": 3, "restored_step": None,
        "decision": "requeue", "why": "preempted"}) + "\n")
    ending = {**_ending("preempted"), "host": "h", "decision": "requeue", "why": "preempted", "log_tail": ["x"]}
    (tmp_path / "ending.json").write_text(json.dumps(ending))
    failure = rank_failure(143, tmp_path / "absent.json", run_dir=tmp_path, budget=2)
    assert isinstance(failure, RequeueFailure) and failure.allow_retries
    assert failure.metadata["failure_class"].value == "preempted" and failure.metadata["retries_spent"].value == 1
    (tmp_path / "ending.json").write_text(json.dumps({**ending, "failure_class": "diverged", "decision": "stop"}))
    stopped = rank_failure(1, tmp_path / "absent.json", run_dir=tmp_path, budget=2)
    assert not isinstance(stopped, RequeueFailure) and not stopped.allow_retries
    assert stopped.description.startswith("diverged (stop")
    with pytest.raises(ValueError, match="batch does not divide"), only_requeues_retry():
        raise ValueError("batch does not divide")  # final: no retry requested
    with pytest.raises(dg.RetryRequested) as requested, only_requeues_retry():
        raise failure
    assert requested.value.max_retries >= 1 and isinstance(requested.value.__cause__, RequeueFailure)


# ---------------------------------------------------------------------------------------------
# Real launches: trainer.supervisor.elastic under the policy, 2 gloo ranks, the tiny preset


@dataclass
class Launch:
    returncode: int
    output: str
    run_dir: Path

    @property
    def attempts(self) -> list[dict]:
        return read_attempts(self.run_dir)

    @property
    def final(self) -> dict:
        return json.loads((self.run_dir / "final.json").read_text())


def launch(run_dir: Path, *overrides: str, budget: int = 2, timeout_s: float = 240) -> Launch:
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir.parent / f"{run_dir.name}.yaml"
    config_path.write_text(yaml.safe_dump({"preset": "tiny_cpu"}))
    sets = [arg for override in ("train.parallelism=ddp", "stage.checkpoint=true", "train.steps=4",
                                 "train.checkpoint_every=2", "train.dump_final_params=true", f"train.run_dir={run_dir}",
                                 *overrides) for arg in ("--set", override)]
    command = [sys.executable, "-m", "trainer.supervisor.elastic", "--standalone", "--nproc-per-node=2",
               f"--max-restarts={budget}",
               "-m", "trainer.train", "--config", str(config_path), *sets]
    result = subprocess.run(command, cwd=REPO_ROOT, env=os.environ | {"TRAINYARD_RUN_DIR": str(run_dir)},
                            capture_output=True, text=True, timeout=timeout_s)
    return Launch(result.returncode, result.stdout + result.stderr, run_dir)


def test_the_retry_budget_is_respected(tmp_path: Path) -> None:
    # A rank that dies at step 3 on every attempt: one restart (budget 1), then the policy stops.
    job = launch(tmp_path / "run", "faults.exit_rank=1", "faults.exit_at_step=3", "faults.attempt=-1", budget=1)
    assert job.returncode != 0, job.output
    assert [entry["decision"] for entry in job.attempts] == ["restart", "stop"], job.attempts
    assert "budget" in job.attempts[-1]["why"] and job.attempts[1]["restored_step"] == 2
    assert job.final["failure_class"] == "rank_crash" and job.final["ending"]["rank"] == 1


def test_a_budget_of_zero_never_retries_and_a_frozen_rank_is_the_hang(tmp_path: Path) -> None:
    """Rank 1 freezes itself with a real SIGSTOP at step 3 (issue 32, item 9): rank 0 times out waiting
    on it, torchrun SIGKILLs it (its escalation, ~30 s later); the run's class is rank 1's hang."""
    job = launch(tmp_path / "run", "faults.exit_rank=1", "faults.exit_at_step=3", "faults.exit_signal=SIGSTOP",
                 "train.collective_timeout_s=3", budget=0)
    assert job.returncode != 0 and [entry["decision"] for entry in job.attempts] == ["stop"], job.output
    ending = job.final["ending"]
    assert (ending["failure_class"], ending["rank"]) == ("hang", 1), ending
    assert "SIGKILL" in ending["exit"] and ending["error"].startswith("rank 1 stopped answering"), ending
    ranks = json.loads((job.run_dir / "endings" / "attempt_0.json").read_text())["ranks"]
    assert ranks["0"]["failure_class"] == "collective_timeout" and "1" not in ranks  # rank 1 could record nothing


def test_a_divergence_on_the_very_first_step_stops_unretried_with_its_window(tmp_path: Path) -> None:
    job = launch(tmp_path / "run", "faults.nan_loss_at_steps=[1]", "train.max_consecutive_nonfinite=1")
    assert job.returncode != 0 and len(job.attempts) == 1, job.output
    assert job.attempts[0]["failure_class"] == "diverged" and job.attempts[0]["decision"] == "stop"
    window = json.loads((job.run_dir / "divergence.json").read_text())
    assert window["reason"].startswith("non_finite") and window["step"] == 1
    (entry,) = window["window"]
    assert entry["step"] == 1
    assert entry["loss"] is None or entry["loss"] != entry["loss"]  # NaN: null in JSON
    assert len(entry["sample_ids"]) == 8  # both ranks' samples of the global batch
    assert job.final["divergence"]["window"] == window["window"]


def test_a_loss_spike_over_the_threshold_is_a_divergence(tmp_path: Path) -> None:
    spiked = launch(tmp_path / "spiked", "faults.spike_loss_at_steps=[4]", "train.loss_spike_factor=10",
                    "train.loss_spike_window=2", "train.steps=5")
    final = spiked.final
    assert final["failure_class"] == "diverged" and final["divergence"]["reason"].startswith("loss_spike"), spiked.output
    assert final["divergence"]["step"] == 4 and [e["step"] for e in final["divergence"]["window"]] == [3, 4]
    assert len(spiked.attempts) == 1


def test_sigterm_twice_still_stops_at_a_step_boundary_with_a_checkpoint(tmp_path: Path) -> None:
    job = launch(tmp_path / "run", "faults.sigterm_at_step=2", "faults.sigterm_count=2")
    assert job.returncode == 143, job.output
    assert job.attempts[0]["failure_class"] == "preempted" and job.attempts[0]["decision"] == "requeue"
    assert "again while stopping" in job.output
    assert (job.run_dir / "checkpoints" / "latest").is_file() or any((job.run_dir / "checkpoints").glob("step_*"))
    assert job.final["final_step"] == 2 and job.final["stop_signals"] == ["SIGTERM", "SIGTERM"]
    # The requeue that resumes it, bit-identically, is the fault drill's "preempted" (tests/test_end_to_end.py).


def test_the_warning_signal_preempts_only_when_configured(tmp_path: Path) -> None:
    warned = launch(tmp_path / "warned", "faults.sigterm_at_step=2", "faults.preempt_with=SIGUSR1",
                    "train.preempt_signals=[SIGTERM,SIGUSR1]")
    assert warned.returncode == 143 and warned.attempts[0]["failure_class"] == "preempted", warned.output
    unconfigured = launch(tmp_path / "plain", "faults.sigterm_at_step=2", "faults.preempt_with=SIGUSR1", budget=0)
    assert unconfigured.attempts[0]["failure_class"] == "rank_crash", unconfigured.output  # SIGUSR1 killed it


def test_a_stop_that_outlasts_the_grace_period_exits_without_a_checkpoint(tmp_path: Path) -> None:
    job = launch(tmp_path / "run", "faults.sigterm_at_step=2", "faults.stall_rank=0", "faults.stall_at_step=2",
                 "faults.stall_in=save", "faults.stall_s=60", "train.preempt_grace_s=2", "train.checkpoint_every=0",
                 budget=0)
    assert job.returncode != 0 and "no step boundary within train.preempt_grace_s=2" in job.output, job.output
    assert job.attempts[0]["failure_class"] == "preempted"
    assert not any((job.run_dir / "checkpoints").glob("step_*")) if (job.run_dir / "checkpoints").exists() else True


@pytest.mark.parametrize("canceled", [False, True])
def test_a_signal_to_the_launch_is_a_preemption_unless_its_operator_cancelled(tmp_path: Path, canceled: bool) -> None:
    """A scheduler's SIGTERM to the whole launch (SLURM preemption, a node going down) requeues
    (exit 143); the launcher's cancel, marked as such (launch/CANCELED), is never retried."""
    import signal
    import time

    from trainer.supervisor.elastic import cancel_marker

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config_path = tmp_path / "exp.yaml"
    config_path.write_text(yaml.safe_dump({"preset": "tiny_cpu"}))
    sets = [arg for override in ("train.parallelism=ddp", "stage.checkpoint=true", "train.steps=100000",
                                 "train.checkpoint_every=2", "stage.keep_last_k=2", f"train.run_dir={run_dir}")
            for arg in ("--set", override)]
    process = subprocess.Popen([sys.executable, "-m", "trainer.supervisor.elastic", "--standalone", "--nproc-per-node=2",
                                "--max-restarts=2", "-m", "trainer.train", "--config", str(config_path), *sets],
                               cwd=REPO_ROOT, env=os.environ | {"TRAINYARD_RUN_DIR": str(run_dir)},
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "checkpoints" / "step_000002").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if canceled:
        cancel_marker(run_dir).parent.mkdir(parents=True, exist_ok=True)
        cancel_marker(run_dir).write_text("canceled\n")
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=120)
    (attempt,) = read_attempts(run_dir)
    assert attempt["failure_class"] == "preempted", output
    if canceled:
        assert process.returncode != 143 and attempt["decision"] == "stop" and "operator" in attempt["why"], output
    else:
        assert process.returncode == 143 and attempt["decision"] == "requeue", output
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "canceled" and final["final_step"] >= 2  # stopped at a boundary, checkpointed


@pytest.mark.parametrize("forgery", ["unsigned", "other_key"])
def test_a_forged_or_unsigned_published_record_is_record_corrupt_never_retried(tmp_path: Path, forgery) -> None:
    """A trainer that reads a plan or index whose digest record is unsigned or signed with another key
    would read the same bytes on a retry: record_corrupt (stopped), not a retried storage_error."""
    from ops.publish import storage

    folder = tmp_path / "plan"
    folder.mkdir()
    (folder / "plan.json").write_text('{"version": "v1"}')
    record = storage.write_record(folder, version="v1", files=["plan.json"],
                                  hmac_key=b"another deployment's key" if forgery == "other_key" else None)
    if forgery == "unsigned":
        body = json.loads(record.read_text())
        del body["signature"]
        record.write_text(json.dumps(body))
    expected = storage.PublishedRecordUnsigned if forgery == "unsigned" else storage.PublishedSignatureInvalid
    with pytest.raises(expected) as refused:
        storage.read_verified(folder, version="v1")
    assert classify("failed", refused.value) == "record_corrupt"
    # As the other ranks see rank 0's error: its type name and message as text.
    assert classify("failed", RuntimeError(f"rank 0: {type(refused.value).__name__}: {refused.value}")) == "record_corrupt"
    decision, why = decide({**_ending("record_corrupt"), "error": str(refused.value)}, run_dir=tmp_path,
                           restarts_left=5, max_bad_samples=4)
    assert decision == "stop" and "not retried" in why
