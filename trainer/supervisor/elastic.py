"""The launch: torchrun under the run's fault policy, with an account of which rank died first.

    python -m trainer.supervisor.elastic --standalone --nproc-per-node=2 -m trainer.train --config exp.yaml

is exactly torchrun (``torch.distributed.run``: same arguments, same processes, same exit status),
plus one file: when the job fails and ``$TRAINYARD_FAILURE_REPORT`` names a path, the failures
torchelastic collected are written there as JSON, with the root cause picked out
(trainer/supervisor/failure_report.py says how it is picked).

With ``$TRAINYARD_RUN_DIR`` set (the launchers set it), the launch runs torchrun through
``run_with_policy``: every attempt's end is classified and only transient failures are restarted.
torchrun's own ``--max-restarts`` restarts every failure alike, a divergence or an out-of-memory
that the same config will hit again included, so the flag is read here as the run's remaining
retry budget and torchrun runs each attempt with none:

    attempt 0: ranks run ... fail
        -> run_ending (trainer/endings.py): one class, from the ranks' records and torchelastic's files
        -> decision: restart (transient: rank_crash, collective_timeout, hang, storage_error, within
           the budget), quarantine (bad_sample: its ids go to quarantine/bad_samples.json, which every
           later attempt skips; outside the budget, up to $TRAINYARD_MAX_BAD_SAMPLES ids), requeue
           (preempted, within the budget: the launch exits 143, the only exit that means "requeue me",
           and the scheduler or the Dagster retry policy starts the next one), or stop (diverged,
           out_of_memory, checkpoint_unverifiable, record_corrupt, config_error, error; or the budget
           is spent)
    attempt 1: resumes from the last committed checkpoint ...

Every attempt appends one line to ``run_dir/attempts.jsonl`` (class, steps, timings, decision and
why) and leaves its ``ending.json`` copy in ``run_dir/endings/attempt_<N>.json``; the stage's
metadata shows them. Each attempt's rank logs are kept under ``run_dir/launch/logs/attempt_<N>``
(torchrun's ``--log-dir``, teed to the console), so the record holds the last lines of the rank
that failed, even one killed with SIGKILL. Faults (trainer/faults.py) fire on attempt
``faults.attempt`` only (0 by default), which ``$TRAINYARD_ATTEMPT`` tells each rank.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ops.publish.durable import iso_time, write_json_atomic
from trainer.endings import PREEMPTED_EXIT, RETRYABLE, ending_path, run_ending
from trainer.supervisor.failure_report import failure_report, write_failure_report

# With it, the launch follows the run's retry policy (``run_with_policy``) instead of torchrun's.
RUN_DIR_ENV = "TRAINYARD_RUN_DIR"
ATTEMPT_ENV = "TRAINYARD_ATTEMPT"
MAX_BAD_SAMPLES_ENV = "TRAINYARD_MAX_BAD_SAMPLES"
LAUNCH_ID_ENV = "TRAINYARD_LAUNCH_ID"
DEFAULT_MAX_BAD_SAMPLES = 16
# What counts against the retry budget: attempts the policy started (or asked a scheduler for).
BUDGET_DECISIONS = ("restart", "requeue")


def cancel_marker(run_dir: str | Path) -> Path:
    """Written by a launcher before it signals the launch because its operator cancelled the run
    (resources/launcher.py): that signal is a cancel, never retried. Any other signal to the launch
    (a scheduler's preemption, the node shutting down) is a preemption."""
    return Path(run_dir) / "launch" / "CANCELED"


def attempts_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "attempts.jsonl"


def bad_samples_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "quarantine" / "bad_samples.json"


def read_attempts(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every attempt of the run so far; a torn last line (a killed launch) is left out."""
    try:
        lines = attempts_path(run_dir).read_text().splitlines()
    except FileNotFoundError:
        return []
    attempts = []
    for line in lines:
        try:
            attempts.append(json.loads(line))
        except ValueError:
            continue
    return attempts


def retries_spent(attempts: list[Mapping[str, Any]]) -> int:
    return sum(entry.get("decision") in BUDGET_DECISIONS for entry in attempts)


class RunRecordCorrupt(ValueError):
    """A record the launch and every rank read (quarantine/bad_samples.json) is truncated, not JSON or
    not its shape: corruption, classified ``record_corrupt`` (trainer/endings.py) and never retried."""


def read_bad_samples(run_dir: str | Path) -> dict[str, dict[str, Any]]:
    """Quarantined sample id -> why (attempt, step, rank, error); every attempt skips these ids.
    RunRecordCorrupt naming the file when it is damaged (a silent empty list would train on them)."""
    path = bad_samples_path(run_dir)
    samples, problem = None, ""
    try:
        samples = json.loads(path.read_bytes())["samples"]
    except FileNotFoundError:
        return {}
    except (ValueError, RecursionError, KeyError, TypeError) as error:
        problem = f"{type(error).__name__}: {error}"
    if not problem and not (isinstance(samples, dict) and all(isinstance(why, dict) for why in samples.values())):
        problem = "not {\"samples\": {sample id: why}}"
    if problem:  # raised outside the except clause: the error names the file, not the parser's message
        raise RunRecordCorrupt(f"{path}: a damaged quarantine list ({problem}); restore or remove it")
    return dict(samples)


def _quarantine(run_dir: str | Path, ending: Mapping[str, Any]) -> None:
    samples = read_bad_samples(run_dir)
    for key in ending["sample_ids"]:
        samples.setdefault(key, {"attempt": ending["attempt"], "step": ending["step"], "rank": ending["rank"],
                                 "error": ending["error"], "quarantined_at": iso_time(time.time())})
    path = bad_samples_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"samples": samples})


def decide(ending: Mapping[str, Any], *, run_dir: str | Path, restarts_left: int, max_bad_samples: int) -> tuple[str, str]:
    """(decision, why) after one attempt (module docstring)."""
    failure_class = ending["failure_class"]
    if failure_class == "completed":
        return "done", "completed"
    if failure_class == "pruned":  # the sweep's rule stopped it on purpose: never retried
        return "done", "pruned by the sweep's early-stopping rule"
    if failure_class == "bad_sample":
        known = read_bad_samples(run_dir)
        new = [key for key in ending["sample_ids"] if key not in known]
        if not ending["sample_ids"]:
            return "stop", "a bad sample without an id cannot be quarantined"
        if not new:
            return "stop", f"sample(s) {ending['sample_ids']} failed again after quarantine: the skip did not hold"
        if len(known) + len(new) > max_bad_samples:
            return "stop", (f"{len(known) + len(new)} bad samples exceed train.max_bad_samples={max_bad_samples}: "
                            f"the data is broken, not a sample")
        return "quarantine", f"quarantined {', '.join(new)}; continuing from the last committed checkpoint"
    if failure_class == "record_corrupt":
        return "stop", ("a damaged run record (named in the error) fails the same way on every attempt: not retried; "
                        "restore or remove the file")
    if failure_class not in RETRYABLE:
        return "stop", f"{failure_class} is deterministic with an unchanged config: not retried"
    if restarts_left <= 0:
        return "stop", f"{failure_class} is transient, but the retry budget (train.retry_budget) is spent"
    if failure_class == "preempted":
        return "requeue", f"preempted: exit {PREEMPTED_EXIT}, to be requeued from the last committed checkpoint"
    return "restart", f"{failure_class} is transient: restarting from the last committed checkpoint"


def _clear_attempt_files(run_dir: Path) -> None:
    """What an attempt leaves that would speak for the next one: the ranks' records, the hang marker,
    final.json, ending.json (each attempt's copy stays in endings/)."""
    for path in [*(run_dir / "ranks").glob("rank_*.json"), run_dir / "ranks" / "hang.json", run_dir / "ranks" / "mlflow.json",
                 run_dir / "final.json", ending_path(run_dir)]:
        path.unlink(missing_ok=True)


def _startup(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "samples" / "rank_0.json").read_text()).get("startup", {})
    except (OSError, ValueError):
        return {}


def _log_files(log_dir: Path, world_local: int):
    def files(rank: int) -> list[Path]:
        local = rank % max(world_local, 1)
        return sorted(log_dir.glob(f"*/attempt_*/{local}/stdout.log")) + sorted(
            log_dir.glob(f"*/attempt_*/{local}/stderr.log"))
    return files


def _record_in_final(run_dir: Path, ending: Mapping[str, Any]) -> None:
    """final.json carries the run's class and ending; a run whose rank 0 died gets a final.json too."""
    path = run_dir / "final.json"
    try:
        final = json.loads(path.read_text())
    except (OSError, ValueError):
        final = {"status": "failed", "final_step": ending["step"], "error": ending["error"],
                 "written_by": "the launch: rank 0 did not write it"}
    final["failure_class"] = ending["failure_class"]
    final["ending"] = {key: value for key, value in ending.items() if key != "ranks"}
    write_json_atomic(path, final)


def _tag_mlflow_run(run_dir: Path, ending: Mapping[str, Any]) -> None:
    """The attempt's MLflow run (rank 0 recorded its id) gets the run's class: rank 0's own tag is
    its view (a lost peer, say), and a killed rank 0 tagged nothing."""
    try:
        record = json.loads((run_dir / "ranks" / "mlflow.json").read_text())
    except (OSError, ValueError):
        return  # no MLflow run in this attempt
    closed = record.get("closed") if isinstance(record, dict) else None
    if closed == {"failure_class": ending["failure_class"], "decision": ending.get("decision"),
                  "attempt": ending["attempt"]}:
        return  # rank 0 closed it with these very tags (trainer/observe/tracking.py): no MLflow start here
    try:
        from mlflow.tracking import MlflowClient

        from trainer.observe.tracking import connect_uri

        client = MlflowClient(tracking_uri=connect_uri(record["tracking_uri"]))  # the record holds no credentials
        for key, value in (("failure_class", ending["failure_class"]), ("trainyard.decision", ending["decision"]),
                           ("trainyard.attempt", str(ending["attempt"]))):
            client.set_tag(record["run_id"], key, value)
        if client.get_run(record["run_id"]).info.status == "RUNNING":  # its process died before closing it
            client.set_terminated(record["run_id"], status="FAILED")
    except Exception as error:  # noqa: BLE001 - the ending is on disk and in Dagster either way
        from trainer.launch.redact import redact_uri

        print(f"[trainyard] MLflow: attempt {ending['attempt']} not tagged ({redact_uri(str(error))})", flush=True)


def run_with_policy(args, run_dir: str | Path) -> None:
    """Attempts under the policy until done or stopped; raises (exit 1) or exits 143 after a failure."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from trainer.launch.redact import Redactor

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    budget = int(args.max_restarts)
    args.max_restarts = 0  # torchrun restarts nothing itself: the policy decides (module docstring)
    max_bad = int(os.environ.get(MAX_BAD_SAMPLES_ENV, DEFAULT_MAX_BAD_SAMPLES))
    user_log_dir = args.log_dir
    # Several nodes (srun torchrun under SLURM): each node runs this loop over its own agent, so no
    # node may restart alone; a transient end asks for the whole job again (requeue, exit 143), and
    # only the first node writes the run's records.
    multi_node = str(args.nnodes) not in ("1", "1:1")
    node_rank = int(os.environ.get("SLURM_NODEID", args.node_rank or 0))
    rendezvous_id = args.rdzv_id
    restarts = 0
    redact = Redactor.for_config(None).text
    while True:
        attempt = len(read_attempts(run_dir))
        if not multi_node or node_rank == 0:  # before the rendezvous: no rank of this attempt has written yet
            _clear_attempt_files(run_dir)
        os.environ[ATTEMPT_ENV] = str(attempt)
        if not args.standalone:  # a fresh rendezvous per attempt: the last one's is closed
            args.rdzv_id = f"{rendezvous_id}-attempt{attempt}"
        log_dir = Path(user_log_dir) if user_log_dir else run_dir / "launch" / "logs" / f"attempt_{attempt}"
        if not user_log_dir:
            args.log_dir, args.tee = str(log_dir), "3"
        started = time.time()
        report, failure, signaled = None, None, None
        try:
            run(args)
        except ChildFailedError as error:
            failure, report = error, failure_report(error.failures)
            write_failure_report(report)
        except SignalException as error:  # the launch itself was stopped (a cancelled Dagster run, scancel)
            signaled = error
        ending = run_ending(run_dir, report, attempt=attempt, logs=_log_files(log_dir, int(args.nproc_per_node)),
                            redact=redact, write=not multi_node or node_rank == 0)
        if signaled is not None:
            if ending["failure_class"] == "completed":
                ending["failure_class"] = "preempted"
            if cancel_marker(run_dir).is_file():
                decision, why = "stop", f"canceled by its operator (signal {signaled.sigval} to the launch): not retried"
            else:  # a scheduler's preemption or the machine going down: requeue-able like any preemption
                decision, why = decide(ending, run_dir=run_dir, restarts_left=budget - restarts, max_bad_samples=max_bad)
        else:
            decision, why = decide(ending, run_dir=run_dir, restarts_left=budget - restarts, max_bad_samples=max_bad)
        if multi_node and decision in ("restart", "quarantine"):
            if decision == "quarantine" and node_rank == 0:
                _quarantine(run_dir, ending)
            decision, why = "requeue", f"{why} (several nodes: the whole job is submitted again)"
        if multi_node and node_rank != 0:  # the first node keeps the records
            _end_launch(decision, signaled, failure)
            return
        startup = _startup(run_dir)
        entry = {"attempt": attempt, "launch_id": os.environ.get(LAUNCH_ID_ENV, ""),
                 "started_at": iso_time(started), "ended_at": iso_time(time.time()),
                 "duration_s": round(time.time() - started, 3), "failure_class": ending["failure_class"],
                 "rank": ending["rank"], "host": ending["host"], "step": ending["step"],
                 "restored_step": startup.get("restored_step"), "time_to_first_step_s": startup.get("time_to_first_step_s"),
                 "sample_ids": ending["sample_ids"], "decision": decision, "why": why}
        ending = {**ending, "decision": decision, "why": why}
        write_json_atomic(ending_path(run_dir), ending)
        endings = run_dir / "endings"
        endings.mkdir(exist_ok=True)
        write_json_atomic(endings / f"attempt_{attempt}.json", ending)
        _record_in_final(run_dir, ending)
        _tag_mlflow_run(run_dir, ending)
        with open(attempts_path(run_dir), "a") as handle:
            handle.write(json.dumps(entry) + "\n")
        print(f"[trainyard] attempt {attempt}: {ending['failure_class']} at step {ending['step']} "
              f"(rank {ending['rank']} on {ending['host']}): {decision}: {why}", flush=True)
        if decision == "quarantine" and signaled is None:
            _quarantine(run_dir, ending)
            continue
        if decision == "restart" and signaled is None:
            restarts += 1
            continue
        _end_launch(decision, signaled, failure)
        return


def _end_launch(decision: str, signaled: BaseException | None, failure: BaseException | None) -> None:
    """Leave the launch as its last attempt's decision says: 143 for a requeue, the signal that
    stopped the launch, nothing after completion, else the failure (exit 1)."""
    if decision == "requeue":
        raise SystemExit(PREEMPTED_EXIT)
    if signaled is not None:
        raise signaled
    if decision == "done":
        return
    raise failure if failure is not None else SystemExit(1)


def main(argv: Sequence[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record
    from torch.distributed.run import parse_args

    @record  # as torchrun's own main: its error file, if torchrun runs under another elastic agent
    def launch() -> None:
        args = parse_args(list(sys.argv[1:] if argv is None else argv))
        run_dir = os.environ.get(RUN_DIR_ENV)
        if run_dir:
            run_with_policy(args, run_dir)
        else:
            _run_once(args)

    launch()


def _run_once(args) -> None:
    """torchrun exactly (its own --max-restarts), plus the failure report."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        run(args)
    except ChildFailedError as error:
        write_failure_report(failure_report(error.failures))
        raise


if __name__ == "__main__":
    main()
