"""``trainyard sweep``: a declared sweep's trials, before anything runs (trainer/launch/sweep.py).

    trainyard sweep plan FILE [--json] [--shard-index PATH_OR_URL]

Prints the sweep (space, objective, budget, concurrency, sampler, pruning rule) and each trial: its
id, its parameters and, given the data, its run identity (the run folder its stage launch would
train in: the same name a Dagster launch gives it). The data is ``--shard-index``, else the
shard_index asset's latest materialization in this Dagster home; without either the run names are
left out, said so. A bad sweep file is refused before anything runs: ``trainyard: refused (config)``
with the key, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys

EXIT_OK = 0
EXIT_REFUSED = 2


def _data(location: str | None):
    """The shard index the trials would read: the given one, or shard_index's latest; None when neither."""
    from ops.clips import shard_cache
    from ops.clips.shard_ref import ShardIndexRef

    if location:
        info = shard_cache.read_any_index_info(location)
        return ShardIndexRef(path=str(location), version=info.version, manifest_version=info.manifest_version)
    try:
        import dagster as dg

        from pipelines.instance import ensure_dagster_home

        ensure_dagster_home()
        with dg.DagsterInstance.get() as instance:
            event = instance.get_latest_materialization_event(dg.AssetKey("shard_index"))
    except Exception:  # noqa: BLE001 (no Dagster home or instance here: the plan goes on without run names)
        return None
    if event is None:
        return None
    metadata = event.asset_materialization.metadata
    path = metadata.get("published_to") or metadata.get("data_path")
    return ShardIndexRef(path=str(getattr(path, "value", path)), version=str(metadata["shard_index_version"].value),
                         manifest_version=event.asset_materialization.tags.get("manifest_version", "")
                         or _manifest_of(str(getattr(path, "value", path))))


def _manifest_of(location: str) -> str:
    from ops.clips import shard_cache

    return shard_cache.read_any_index_info(location).manifest_version


def run_names(spec, trials, data) -> dict[str, str]:
    """trial id -> the run folder's name its stage launch gets (trainer.launch.run_identity)."""
    from assets.stage_runs import index_buckets
    from assets.training import PRETRAIN_DEFAULTS
    from trainer.launch.config import load_config
    from trainer.launch.run_identity import run_name
    from trainer.launch.stage_launch import StageLaunch

    from trainer.launch.sweep import trial_overrides

    buckets = index_buckets(data)
    names = {}
    for trial in trials:  # the storage and the MLflow parent are not part of a run's identity
        launch = StageLaunch(stage=spec.stage, config_path=spec.base, data=data, buckets=buckets, steps=spec.steps,
                             world_size=spec.world_size or 1, defaults=PRETRAIN_DEFAULTS,
                             user_overrides=tuple(trial_overrides(spec, trial, storage_url="")))
        names[trial.trial_id] = run_name(spec.stage, load_config(spec.base, launch.overrides()))
    return names


def _plan(args: argparse.Namespace) -> int:
    from trainer.launch.sweep import load_sweep, plan_trials

    spec = load_sweep(args.file)
    trials = plan_trials(spec)
    data = _data(args.shard_index)
    names = run_names(spec, trials, data) if data is not None else {}
    if args.json:
        print(json.dumps({"name": spec.name, "digest": spec.digest, "stage": spec.stage, "steps": spec.steps,
                          "budget": spec.budget, "concurrency": spec.concurrency, "sampler": spec.sampler,
                          "seed": spec.seed, "objective": vars_of(spec.objective), "pruner": vars_of(spec.pruner),
                          "shard_index": data.version if data else None,
                          "trials": [{"trial_id": t.trial_id, "params": t.params, "planned": t.planned,
                                      "run_name": names.get(t.trial_id)} for t in trials]}, indent=2))
        return EXIT_OK
    print(f"sweep {spec.name} ({spec.path}): {spec.stage} of {spec.base}, {spec.steps} steps, "
          f"{spec.world_size or 'default'} rank(s) a trial")
    for dim in spec.space:
        print(f"  space       {dim.key}: {dim.describe()}")
    print(f"  objective   {spec.objective.direction} {spec.objective.metric} at step {spec.objective.step}")
    print(f"  budget      {spec.budget} trial(s), at most {spec.concurrency} at once; sampler {spec.sampler} "
          f"(seed {spec.seed})" + (f" over a grid of {spec.grid_size}" if spec.grid_size else ""))
    print(f"  pruning     {spec.pruner.kind}" + (f" (warm-up {spec.pruner.warmup_steps} steps, after "
                                                 f"{spec.pruner.min_trials} trials)" if spec.pruner.kind == "median"
                                                 else ""))
    where = (f"shard index {data.version} ({data.path})" if data else
             "no shard index (materialize shard_index, or --shard-index): run names left out")
    print(f"  data        {where}")
    for trial in trials:
        params = ", ".join(f"{key}={value}" for key, value in trial.params.items())
        later = "" if trial.planned else "  (drawn as results come in: this is the sampler's prior draw)"
        print(f"  {trial.trial_id}  {params}  {names.get(trial.trial_id, '')}{later}")
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    from assets.sweeps import LockHeld
    from pipelines.sweeps import run_sweep

    try:
        summary = run_sweep(args.file, retries=args.retries, register_only=args.register_only)
    except LockHeld as held:
        print(f"trainyard: refused (sweep) {held}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    return EXIT_OK


def _promote(args: argparse.Namespace) -> int:
    from pipelines.sweeps import PromotionRefused, promote

    try:
        promoted = promote(args.sweep, args.trial)
    except PromotionRefused as refused:
        print(f"trainyard: refused (sweep) {refused}", file=sys.stderr)
        return EXIT_REFUSED
    if args.json:
        print(json.dumps(promoted, indent=2))
    return EXIT_OK


def vars_of(value) -> dict:
    return {name: getattr(value, name) for name in value.__dataclass_fields__}


def register(subparsers: argparse._SubParsersAction) -> None:
    commands = subparsers.add_parser("sweep", help="declared sweeps: plan, run and promote their trials").add_subparsers(
        dest="sweep_command", required=True)
    plan = commands.add_parser("plan", help="print a sweep's trials and their run identities without running them")
    plan.add_argument("file", help="a sweep YAML (configs/sweeps/)")
    plan.add_argument("--json", action="store_true")
    plan.add_argument("--shard-index", default=None, metavar="PATH_OR_URL",
                      help="the data the trials would read (default: shard_index's latest materialization)")
    plan.set_defaults(handler=_plan)
    run = commands.add_parser("run", help="register a sweep and run its trials as Dagster runs, at most its "
                              "concurrency at once (pipelines/sweeps.py)")
    run.add_argument("file", help="a sweep YAML (configs/sweeps/)")
    run.add_argument("--retries", type=int, default=1, help="extra rounds for a trial whose failure is retryable")
    run.add_argument("--register-only", action="store_true",
                     help="register the study, partitions and pool limit only (then backfill sweep_trial_job in the UI)")
    run.add_argument("--json", action="store_true")
    run.set_defaults(handler=_run)
    promote = commands.add_parser("promote", help="make a trial's checkpoint the parent of finetune (the best "
                                  "completed trial by default)")
    promote.add_argument("sweep", help="the sweep's name")
    promote.add_argument("trial", nargs="?", default=None, help="a trial id such as demo_lr-003 (default: the best)")
    promote.add_argument("--json", action="store_true")
    promote.set_defaults(handler=_promote)
