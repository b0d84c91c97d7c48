"""When a rank dies, the recorded error names the dead rank and how it ended (issue 9, item 9).

The real case: pretrain materialized through Dagster on 2 torchrun ranks reading shards with a
DataLoader worker each; rank 1 sends itself SIGKILL at step 2 (faults.exit_signal), the way the
OOM killer or a lost node ends a rank. Rank 0 then fails on its own (the broken collective, its
worker torn down) and records that error; the Dagster failure must name rank 1 and SIGKILL.
The root-cause rule itself (trainer/supervisor/failure_report.py) is tested on torchelastic's failure records.

Run: python -m pytest tests/test_rank_death.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from test_secrets_and_lineage import StageLab, stage_lab, stage_run_config  # noqa: F401 (the fixture)

from assets import training
from resources.launcher import rank_failure
from trainer.supervisor.failure_report import describe_exit, failure_entries, record_rank_error, root_cause, summary


def _entry(rank: int, exitcode: int, *, recorded: str | None = None, timestamp: int = 100) -> dict:
    return {"rank": rank, "local_rank": rank, "pid": 1000 + rank, "exitcode": exitcode, "exit": describe_exit(exitcode),
            "recorded_error": recorded, "timestamp": timestamp}


def test_a_rank_that_died_without_recording_is_the_cause_even_when_a_survivor_failed_first() -> None:
    survivor = _entry(0, 1, recorded="RuntimeError: DataLoader worker (pid 77) is killed by signal", timestamp=99)
    killed = _entry(1, -9, timestamp=101)  # torchelastic stamps unrecorded deaths when it notices them
    cause = root_cause([survivor, killed])
    assert cause["rank"] == 1 and cause["exit"] == "killed by signal SIGKILL (exit -9)"
    assert summary(cause) == ("rank 1 (local rank 1, pid 1001) killed by signal SIGKILL (exit -9) without "
                              "recording an error (killed, or exited without cleanup)")


def test_torchruns_own_stop_signal_is_not_the_cause() -> None:
    stopped = _entry(0, -15, timestamp=99)
    exited = _entry(1, 17, timestamp=100)
    assert root_cause([stopped, exited])["rank"] == 1
    assert root_cause([_entry(0, 143, timestamp=99), exited])["rank"] == 1


@pytest.mark.parametrize("stop_exit", [-15, 143])
def test_a_rank_torchrun_stopped_without_a_file_is_not_the_cause_of_a_recorded_oom(stop_exit: int) -> None:
    """Review 7: torchrun's SIGTERM leaves no error file; that must not make rank 0 the cause."""
    stopped = _entry(0, stop_exit, timestamp=99)
    oom = _entry(1, 1, recorded="torch.OutOfMemoryError: CUDA out of memory", timestamp=100)
    cause = root_cause([stopped, oom])
    assert cause["rank"] == 1 and summary(cause).endswith("exited with code 1: torch.OutOfMemoryError: "
                                                          "CUDA out of memory")


def test_recorded_errors_in_the_same_second_are_ordered_by_nanoseconds() -> None:
    later = {**_entry(0, 1, recorded="RuntimeError: a peer left", timestamp=100), "timestamp_ns": 100_900_000_000}
    earlier = {**_entry(1, 1, recorded="ValueError: bad batch", timestamp=100), "timestamp_ns": 100_100_000_000}
    assert root_cause([later, earlier])["rank"] == 1


def _recorded_failure(path: Path, monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    record_rank_error(error, redact=lambda text: text)


def test_error_files_carry_nanoseconds_that_break_a_same_second_tie(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The real chain: record_rank_error's files read back by torchelastic's own ProcessFailure.
    Rank 1 records first, rank 0 a moment later, within one whole second (torchelastic's tie)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    for _ in range(20):  # the two writes straddle a second boundary rarely: then write them again
        _recorded_failure(tmp_path / "rank1.json", monkeypatch, ValueError("bad batch"))
        _recorded_failure(tmp_path / "rank0.json", monkeypatch, RuntimeError("a peer left"))
        failures = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=1,
                                         error_file=str(tmp_path / f"rank{rank}.json")) for rank in (0, 1)}
        if failures[0].timestamp == failures[1].timestamp:
            break
    assert failures[0].timestamp == failures[1].timestamp, "could not write both files within one second"
    assert failures[0].timestamp_isoformat()  # torchrun still reads its whole-second timestamp
    entries = failure_entries(failures)
    assert entries[1]["timestamp_ns"] < entries[0]["timestamp_ns"]
    assert entries[0]["timestamp_ns"] // 1_000_000_000 == entries[0]["timestamp"]
    cause = root_cause(entries)
    assert cause["rank"] == 1 and cause["recorded_error"] == "ValueError: bad batch"


def test_when_every_rank_recorded_an_error_the_earliest_is_the_cause() -> None:
    late = _entry(0, 1, recorded="RuntimeError: late", timestamp=105)
    early = _entry(1, 1, recorded="ValueError: early", timestamp=101)
    cause = root_cause([late, early])
    assert cause["rank"] == 1 and summary(cause).endswith("exited with code 1: ValueError: early")


def test_a_launch_without_a_failure_report_says_torchruns_exit(tmp_path: Path) -> None:
    failure = rank_failure(2, tmp_path / "absent.json")
    assert "torchrun exited with code 2" in failure.description


def test_a_killed_rank_is_named_with_its_signal_not_a_survivors_error(stage_lab: StageLab) -> None:  # noqa: F811
    # A budget of 0: the policy (trainer/supervisor/elastic.py) would otherwise restart the crashed run and recover.
    overrides = ["data.num_workers=1", "faults.exit_rank=1", "faults.exit_at_step=2", "faults.exit_signal=SIGKILL",
                 "train.collective_timeout_s=30", "train.retry_budget=0"]
    result = stage_lab.materialize([training.pretrain], stage_run_config(steps=4, nproc=2, overrides=overrides),
                                   ok=False)
    assert not result.success
    (failure,) = [event.step_failure_data for event in result.all_events if event.is_step_failure]
    message = failure.user_failure_data.description
    assert message.startswith("rank_crash (stop: rank_crash is transient, but the retry budget"), message
    assert "): rank 1 (local rank 1, pid " in message, message
    assert "killed by signal SIGKILL (exit -9)" in message and "without recording an error" in message
    assert "DataLoader" not in message.split("; torchrun exited")[0].split("): ", 1)[1], message
    metadata = {key: getattr(value, "value", value) for key, value in failure.user_failure_data.metadata.items()}
    assert (metadata["root_cause_rank"], metadata["root_cause_exitcode"]) == (1, -9)
    assert metadata["failure_class"] == "rank_crash" and metadata["failure_rank"] == 1
    assert metadata["retry_budget"] == 0 and metadata["num_attempts"] == 1
    report = json.loads(Path(metadata["failure_report"]).read_text())
    assert report["root_cause"]["rank"] == 1
    # The survivor's own account stays on record, as its own: rank 0 failed after rank 1 died.
    for entry in report["failures"]:
        if entry["rank"] == 0:
            assert entry["recorded_error"], "rank 0 failed without recording why"
    run_dir = Path(report_path_parent(metadata["failure_report"]))
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "failed" and final["final_step"] == 1 and final["failure_class"] == "rank_crash"
    client = MlflowClient(stage_lab.mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("trainyard").experiment_id],
                                filter_string=f"tags.dagster_run_id = '{result.run_id}'")
    assert run.info.status == "FAILED" and run.data.tags["trainyard.root_cause"] == message
    assert run.data.tags["failure_class"] == "rank_crash"  # the run's class, not rank 0's lost peer


def report_path_parent(report_path: str) -> Path:
    """The run folder of a failure report (<run_dir>/launch/<dagster run id>.failure.json)."""
    return Path(report_path).parent.parent


def test_a_crashed_stage_recovers_within_its_budget_and_its_metadata_says_how(stage_lab: StageLab) -> None:  # noqa: F811
    overrides = ["faults.exit_rank=1", "faults.exit_at_step=3", "faults.exit_signal=SIGKILL",
                 "train.checkpoint_every=2"]
    result = stage_lab.materialize([training.pretrain], stage_run_config(steps=4, nproc=2, overrides=overrides))
    metadata = stage_lab.metadata(result, "pretrain")
    assert metadata["status"] == "completed" and metadata["final_step"] == 4
    assert (metadata["retry_budget"], metadata["retries_spent"], metadata["num_attempts"]) == (2, 1, 2)
    assert metadata["attempt_classes"] == "rank_crash,completed"
    assert "| 0 |" in metadata["attempts"] and "restart" in metadata["attempts"]
    # The crashed attempt's MLflow run carries the run's class, not rank 0's view of a lost peer.
    client = MlflowClient(stage_lab.mlflow_uri)
    runs = client.search_runs([client.get_experiment_by_name("trainyard").experiment_id],
                              filter_string=f"tags.dagster_run_id = '{result.run_id}'", order_by=["attributes.start_time ASC"])
    assert [run.data.tags.get("failure_class") for run in runs] == ["rank_crash", "completed"]
    assert [run.data.tags.get("trainyard.attempt") for run in runs] == ["0", "1"]


def test_a_preempted_stage_is_requeued_by_its_retry_policy_and_resumes(stage_lab: StageLab) -> None:  # noqa: F811
    overrides = ["faults.sigterm_at_step=2", "train.checkpoint_every=0"]
    result = stage_lab.materialize([training.pretrain], stage_run_config(steps=4, nproc=2, overrides=overrides))
    assert any(event.event_type_value == "STEP_UP_FOR_RETRY" for event in result.all_events)
    metadata = stage_lab.metadata(result, "pretrain")
    assert metadata["status"] == "completed" and metadata["attempt_classes"] == "preempted,completed"
    assert metadata["retries_spent"] == 1 and metadata["retry_of"] != "none"


def test_a_config_error_is_not_retried_by_dagster(stage_lab: StageLab) -> None:  # noqa: F811
    result = stage_lab.materialize([training.pretrain], stage_run_config(steps=4, nproc=2, overrides=[
        "data.batch_size=3"]), ok=False)  # 3 samples do not divide over 2 ranks: refused before launch
    assert not any(event.event_type_value == "STEP_UP_FOR_RETRY" for event in result.all_events)


@pytest.mark.parametrize(("closed", "tags_again"), [
    ({"failure_class": "completed", "decision": "done", "attempt": 1}, False),
    ({"failure_class": "completed", "decision": "done", "attempt": 0}, True),   # an earlier attempt's mark
    (None, True),                                                              # rank 0 never closed it
], ids=["closed_by_rank_0", "another_attempt", "not_closed"])
def test_the_launch_starts_mlflow_after_the_ranks_only_for_a_run_rank_0_did_not_close_as_completed(
        tmp_path: Path, closed, tags_again: bool) -> None:
    """A completed attempt is tagged by rank 0 (trainer/observe/tracking.py); the policy's own tagging
    (seconds of MLflow start-up on every launch) runs only where that mark is missing or another's."""
    import subprocess
    import sys

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    (tmp_path / "ranks").mkdir()
    record = {"run_id": run_id, "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    (tmp_path / "ranks" / "mlflow.json").write_text(json.dumps({**record, **({"closed": closed} if closed else {})}))
    ending = {"failure_class": "completed", "decision": "done", "attempt": 1}
    code = ("import json, sys; from pathlib import Path; from trainer.supervisor.elastic import _tag_mlflow_run; "
            f"_tag_mlflow_run(Path({str(tmp_path)!r}), {ending!r}); print(json.dumps('mlflow' in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) is tags_again
    assert (client.get_run(run_id).data.tags.get("trainyard.attempt") == "1") is tags_again
