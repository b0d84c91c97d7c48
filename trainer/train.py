"""The training program: parse the config, build, train, close.

    torchrun --nproc-per-node=2 -m trainer.train --config exp.yaml --set train.parallelism=ddp
    python -m trainer.train --config exp.yaml                   # one rank, no torchrun
    python -m trainer.train --config exp.yaml --preflight 8     # check for 8 ranks, print the plan

Rank 0 writes run_dir/final.json however the run ends: status (completed / failed / diverged /
canceled / pruned), final step, per-step losses and gradient norms (null marks a non-finite value),
skipped steps, precision policy, launch plan, performance summary, the redacted config, and the
data source's resolved batching (policy, global batch, clip shapes and samples per bucket).
With bucketed data the clip shape changes from step to step: noise, throughput and FLOPs follow
each batch's own shape.
SIGTERM (a cancelled Dagster run, a preempted job) stops every rank at the same step boundary:
the stop flag rides on the per-step loss all-reduce, so no rank is left waiting in a collective.

Exit status: 0 completed or pruned (a sweep's rule), 1 failed, 2 config refused, 3 diverged, 143 preempted (stopped by a
preemption signal at a step boundary, checkpoint committed: requeue-able; trainer/endings.py).

This module parses and runs; the Trainer and its loop live in trainer/loop.py, the checkpointer,
resume, init-from, MLflow and Pipes wiring in trainer/wiring.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from ops.loading.sampling import World
from trainer.launch.config import ExperimentConfig, load_config, read_overrides_file
from trainer.supervisor.failure_report import record_rank_error
from trainer.endings import CONFIG_ERROR_EXIT, PREEMPTED_EXIT, classify, write_rank_end
from trainer.observe.hooks import ConsoleHook
from trainer.observe.startup import JOB_STARTED_ENV, StartupClock, process_start_time
from ops.publish.durable import write_json_atomic
from trainer.loop import Trainer
from trainer.launch.preflight import check_rights, preflight
from trainer.launch.refusal import Refusal, one_line
from trainer.launch.redact import Redactor, RedactingFilter, redacted_dict
from trainer.wiring import Warmup, attach_plugins

log = logging.getLogger("trainer")

EXIT_CODES = {"completed": 0, "pruned": 0, "failed": 1, "diverged": 3, "canceled": PREEMPTED_EXIT}


def _setup_logging(rank: int) -> RedactingFilter:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(asctime)s %(levelname)s %(message)s"))
    redacting = RedactingFilter(Redactor.for_config(None))
    handler.addFilter(redacting)
    log.handlers[:] = [handler]
    log.propagate = False
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    return redacting


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="experiment YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=C",
                        help="override one field (repeatable)")
    parser.add_argument("--overrides-file", metavar="PATH",
                        help="JSON list of overrides, applied before --set (launchers use it: a file only its "
                             "owner reads, instead of a command line every user sees)")
    parser.add_argument("--preflight", type=int, metavar="WORLD_SIZE",
                        help="only check the config for WORLD_SIZE ranks and print the plan")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    startup = _startup_clock()
    args = _parse_args(argv)
    world = World.from_env()  # ValueError names a RANK / WORLD_SIZE / LOCAL_RANK that is not a rank
    redacting = _setup_logging(world.rank)
    try:
        overrides = [*(read_overrides_file(args.overrides_file) if args.overrides_file else []), *args.overrides]
        config = load_config(args.config, overrides)
        redacting.redactor = Redactor.for_config(config)
        if args.preflight is not None:
            plan = preflight(config, world_size=args.preflight)
            print(json.dumps(plan.as_dict()))
            return 0
    except (ValueError, OSError, yaml.YAMLError) as error:
        log.error("config refused: %s", one_line(error))  # a Refusal: "<category>: <found>; fix: <fix>"
        return CONFIG_ERROR_EXIT
    if world.is_main:
        log.info("config %s", json.dumps(redacted_dict(config), sort_keys=True))
    try:
        check_rights(config)  # the check every stage makes before launch, also for a run by hand
    except Refusal as error:
        log.error("refused before training: %s", error)
        return _record_early_failure(config, error, redacting.redactor, world=world)
    # Rank 0's lineage and MLflow connection, in a thread while this one builds (trainer/wiring.py).
    warmup = Warmup(config) if world.is_main else None
    return _train(config, redacting.redactor, world=world, startup=startup, warmup=warmup)


def _startup_clock() -> StartupClock:
    """The start-up so far: this process's creation, the imports just done, and the SLURM job's start
    (the batch script records it, resources/sbatch_script.py)."""
    clock = StartupClock()
    started = process_start_time()
    if started is not None:
        clock.mark("process_started", started)
    clock.mark("imports")
    try:
        clock.mark("job_started", float(os.environ[JOB_STARTED_ENV]))
    except (KeyError, ValueError):
        pass  # not a SLURM batch job (or a script that did not record it)
    return clock


def _train(config: ExperimentConfig, redactor: Redactor, *, world: World, startup: StartupClock,
           warmup: Warmup | None = None) -> int:
    """Build, attach the plugins, train, and close on every path; the exit status."""
    hold_ranks_lock(config.train.run_dir)
    try:
        trainer = Trainer(config, hooks=[ConsoleHook(log_every=config.train.log_every,
                                                     total_steps=config.train.steps)], startup=startup)
    except Exception as error:
        log.exception("could not build the trainer")
        return _record_early_failure(config, error, redactor, world=world)
    with contextlib.ExitStack() as plugins:
        try:
            attach_plugins(trainer, config, plugins, warmup=warmup)
        except Exception as error:  # e.g. a parent checkpoint that fails verification
            log.exception("could not attach the checkpointer or tracking")
            trainer.close()
            return _record_early_failure(config, error, redactor, world=world)
        startup.mark("plugins")
        try:
            result = trainer.train()
        except Exception as error:
            log.exception("run failed")  # final.json already records a failure inside train()
            record_rank_error(error, redactor.text)  # for torchrun: this rank was alive to see it
            return EXIT_CODES["failed"]
        finally:
            trainer.close()
    return EXIT_CODES[result.status]


_RANKS_LOCK: list = []  # this process's open handle: the shared lock lives as long as the process


def hold_ranks_lock(run_dir: str | Path) -> None:
    """A shared flock on ``run_dir``/launch/ranks.lock for this rank's whole life (the kernel drops it when the
    process ends, however it ends): a launcher asks for it exclusively (``ranks_running``) to know that no rank
    of an earlier launch still trains in the folder, whatever became of the process that started it
    (torchrun puts each rank in a session of its own: killing the launcher's group leaves them running)."""
    import fcntl

    if not run_dir:
        return
    path = Path(run_dir) / "launch" / "ranks.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
        fcntl.flock(handle, fcntl.LOCK_SH)
    except OSError as error:  # a folder that refuses locks (some network filesystems): the run goes on
        log.warning("no ranks lock at %s (%s): a relaunch cannot tell that this rank still runs", path, error)
        return
    _RANKS_LOCK.append(handle)


def _record_early_failure(config: ExperimentConfig, error: BaseException, redactor: Redactor, *, world: World) -> int:
    """final.json for a run that failed before its first step (rank 0 writes it), and this rank's
    record. A ValueError there is a config the trainer cannot run (a batch that does not divide, a
    checkpoint that does not fit the model): ``config_error``, exit 2, never retried."""
    record_rank_error(error, redactor.text)
    failure_class = classify("failed", error)
    if failure_class == "error" and isinstance(error, ValueError):
        failure_class = "config_error"
    write_rank_end(config.train.run_dir, rank=world.rank, world_size=world.world_size, status="failed",
                   step=0, error=error, redact=redactor.text, failure_class=failure_class)
    if world.is_main:
        write_json_atomic(Path(config.train.run_dir) / "final.json", {
            "status": "failed", "final_step": 0, "error": redactor.text(f"{type(error).__name__}: {error}"),
            "failure_class": failure_class, "config": redacted_dict(config)})
    return CONFIG_ERROR_EXIT if failure_class == "config_error" else EXIT_CODES["failed"]


if __name__ == "__main__":
    sys.exit(main())
