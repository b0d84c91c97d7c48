"""The restore drill's procedure: which checkpoints it restores, where the original's records are,
the continuations it judges, and the pin it leaves when they pass.

A drill restores the second-newest committed checkpoint of a run and trains on to the newest,
at the saved and at another world size; ops/drills/restore.py judges each continuation against
what the original run recorded. This module does the rest, with plain values in and records out:

    start = start_drill(run_dir, run_id, drills_root=data / "drills", drill_name="ab12cd34")
    if not start.problems:
        records = original_records(run_dir, run_url, start.drill_root)
        outcome = start.outcome | run_drill(start, run_id=run_id, original_dir=records,
                                            original_config=config, other_world_size=1,
                                            continue_run=launch_one)   # (world, run_dir) -> run_dir
    if outcome["passed"]:
        pin_known_good(run_dir, start.mirror, start.restored.step, evidence)

Where the deployment mirrors checkpoints (TRAINYARD_CHECKPOINT_ROOT), the drill restores from
the store: what a new machine would have after this one is lost, not the run folder's copy. A
drill that cannot start raises ``DrillRefused``; a drill that ran and failed returns
``passed: False`` and its reason. Torch is imported only by ``run_drill`` (the comparison reads
DCP checkpoints), so the Definitions import this module without it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ops.checkpoints import store
from ops.checkpoints.mirror import CheckpointMirror
from ops.publish import objstore, store_root

ContinueRun = Callable[[int, Path], Path]
"""Runs one continuation of the restored checkpoint to the target step on ``world`` ranks in
``run_dir`` (a fresh stage run on the original's data and config) and returns that folder."""


class DrillRefused(RuntimeError):
    """The drill cannot start: too few committed checkpoints, a store that fails, no original records."""


@dataclass(kw_only=True, slots=True)
class DrillStart:
    """What a drill starts from: the checkpoint it restores, the one it trains to, and whether both verify."""

    mirror: CheckpointMirror | None
    """The checkpoint store the drill restored from; None: the run folder."""
    restored: store.CheckpointInfo
    """The second-newest committed checkpoint (a local copy where it came from the store)."""
    target: store.CheckpointInfo
    """The newest committed checkpoint: what the original run reached."""
    drill_root: Path
    """The drill's own folder: fetched copies, the original's records, the continuations."""
    outcome: dict[str, Any]
    """The drill's metadata so far: where the checkpoints came from, their steps."""
    problems: str = ""
    """Why the checkpoints failed verification; empty when both verify."""


def start_drill(run_dir: Path, run_id: str, *, drills_root: Path, drill_name: str) -> DrillStart:
    """The checkpoints of run ``run_id`` to drill, fetched from the store where one is configured
    and verified, under ``drills_root / <run_id>-step<restored step>-<drill_name>``."""
    mirror = CheckpointMirror.for_run(run_dir.name, keep_last_k=1, keep_every_m=0)
    source = mirror.url if mirror is not None else str(run_dir)
    try:
        committed = (mirror.committed() if mirror is not None else
                     [info for info in store.list_checkpoints(run_dir) if info.status == "committed"])
    except objstore.ObjectStoreError as error:
        raise DrillRefused(f"restore drill: the checkpoint store {source} failed: {error}") from error
    if len(committed) < 2:
        raise DrillRefused(
            f"{source} has {len(committed)} committed checkpoint(s); the drill restores the second-newest and "
            f"compares with the original run at the newest, so it needs two: set train.checkpoint_every below "
            f"train.steps and keep stage.keep_last_k >= 2")
    restored, target = committed[-2], committed[-1]
    drill_root = drills_root / f"{run_id}-step{restored.step:06d}-{drill_name}"
    outcome: dict[str, Any] = {"checkpoint_source": source, "checkpoint_step": restored.step, "target_step": target.step,
                               "checkpoint": str(restored.path), "target_checkpoint": str(target.path)}
    problems = ""
    if mirror is not None:
        outcome |= {"checkpoint": mirror.source_of(restored.name), "target_checkpoint": mirror.source_of(target.name)}
        try:  # each copy re-hashed against its commit record in the store, then verified as any checkpoint
            restored, target = [mirror.fetch(info.name, drill_root / "from_store") for info in (restored, target)]
        except objstore.VersionRefused as refused:
            problems = f"the store's copy was refused: {refused}"
        except objstore.ObjectStoreError as error:
            raise DrillRefused(f"restore drill: the checkpoint store {source} failed: {error}") from error
        outcome["fetched_to"] = str(restored.path.parent)
    return DrillStart(mirror=mirror, restored=restored, target=target, drill_root=drill_root, outcome=outcome,
                      problems=problems or _verification_problems(run_id, restored, target))


def _verification_problems(run_id: str, *checkpoints: store.CheckpointInfo) -> str:
    key = store.configured_key()
    reports = [store.verify(info.path, key, expected_run_id=run_id) for info in checkpoints]
    return "; ".join(f"{report.checkpoint_dir.name}/{file}: {problem}"
                     for report in reports for file, problem in report.problems)


def original_records(run_dir: Path, run_url: str | None, drill_root: Path) -> Path:
    """The folder holding the original run's records (launch.json, final.json, sample order): its run
    folder on this machine, or, where that is gone and the data root is an object store, the newest
    records the run published there, fetched and re-hashed (ops.publish.store_root)."""
    if (run_dir / "launch.json").is_file():
        return run_dir
    if not run_url or run_url == "none":
        raise DrillRefused(f"restore drill: {run_dir / 'launch.json'} is missing, and the run published no records "
                           "to a data store (its data root was a folder): nothing says what the original run did")
    try:
        fetched = store_root.fetch_run_records(run_url, drill_root / "original_records")
    except objstore.ObjectStoreError as error:  # VersionRefused too: the store's copy is not the run's record
        raise DrillRefused(f"restore drill: the original run's records could not be read from the data store: "
                           f"{error}") from error
    if fetched is None:
        raise DrillRefused(f"restore drill: {run_dir / 'launch.json'} is missing and {run_url} holds no committed "
                           "records of that run: nothing says what the original run did")
    return fetched


def run_drill(start: DrillStart, *, run_id: str, original_dir: Path, original_config: Mapping,
              other_world_size: int, continue_run: ContinueRun) -> dict[str, Any]:
    """Continue ``start.restored`` to ``start.target``'s step at the saved and the other world size; judge
    each against the original run's losses, its parameters in ``start.target`` and its sample order."""
    from ops.drills import restore  # torch (DCP): imported by the run that drills, not by the Definitions

    restored, target = start.restored, start.target
    saved_world = int(store.read_record(restored.path)["world_size"])
    from_step, to_step = restored.step, target.step
    summary = {"records_source": str(original_dir), "saved_world_size": saved_world,
               "other_world_size": other_world_size,
               "loss_rtol": restore.LOSS_RTOL, "param_atol": restore.PARAM_ATOL, "drill_dir": str(start.drill_root)}
    try:
        configured_steps = int(original_config["train"]["steps"])
        if to_step != configured_steps:  # the cosine schedule depends on train.steps: train to the same end
            raise restore.DrillError(f"the original's newest committed checkpoint is at step {to_step}, but it was "
                                     f"configured for {configured_steps} steps; drill a run that completed")
        truth = restore.RunRecord(
            name="original", losses=restore.recorded_losses(original_dir, require_completed=False),
            params=restore.checkpoint_params(target.path, hmac_key=store.configured_key(), expected_run_id=run_id),
            params_step=to_step, order=restore.recorded_order(original_dir, range(from_step + 1, to_step + 1)))
        worlds = {"same_world": saved_world, "other_world": other_world_size}
        if other_world_size == saved_world:
            del worlds["other_world"]
        runs = {name: continue_run(world, start.drill_root / name) for name, world in worlds.items()}
        records = {name: restore.continuation_record(path, name=name) for name, path in runs.items()}
    except restore.DrillError as error:
        return {**summary, "passed": False, "reason": str(error)}
    summary["order_reference"] = "original run" if truth.order is not None else "same_world continuation"
    numerics = store.read_record(restored.path)["content"].get("numerics", {})  # signed
    rules = {name: restore.comparison_rule(numerics, same_world=name == "same_world") for name in records}
    summary |= {f"{name}/rule_why": rule.why for name, rule in rules.items()}
    comparisons = {"same_world": restore.compare(truth, records["same_world"], from_step=from_step, to_step=to_step,
                                                 same_world=True, rule=rules["same_world"])}
    if truth.order is None and comparisons["same_world"].passed:
        # The original's last process resumed after these steps and logged none of them; the
        # continuation just proven bit-identical to it stands in for its order.
        truth.order = records["same_world"].order
    if "other_world" in records:
        comparisons["other_world"] = restore.compare(truth, records["other_world"], from_step=from_step,
                                                     to_step=to_step, same_world=False, rule=rules["other_world"])
    reasons = [f"{name}: {reason}" for name, result in comparisons.items() for reason in result.reasons]
    startup = json.loads((runs[list(runs)[-1]] / "samples" / "rank_0.json").read_text())["startup"]
    metadata = {key: value for name, result in comparisons.items() for key, value in
                result.as_metadata(f"{name}/").items()}
    return {**summary, **metadata, "passed": all(result.passed for result in comparisons.values()),
            "reason": "; ".join(reasons) or "both continuations reproduce the original run",
            "num_steps_compared": to_step - from_step,
            "restore_s": startup.get("restore_s"), "time_to_first_step_s": startup.get("time_to_first_step_s")}


def pin_known_good(run_dir: Path, mirror: CheckpointMirror | None, step: int, evidence: dict) -> str | None:
    """Pin the proven step where it lives: the run folder (when it still has that checkpoint) and the
    store. Returns where the store's pin was written; None without a store."""
    local = store.checkpoints_dir(run_dir) / store.step_dir_name(step)
    if mirror is None or (local / store.RECORD_NAME).exists():
        store.pin_known_good(run_dir, step, evidence)
    return mirror.pin_known_good(step, evidence) if mirror is not None else None
