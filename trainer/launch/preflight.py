"""Launch preflight: everything that can be refused before torchrun starts.

    config = load_config("exp.yaml", ["train.steps=20"])
    plan = preflight(config, world_size=8)   # raises before any process starts

``preflight`` checks what depends on the world size (batch divisibility, fault ranks), the shard
index (clip shapes, audio, manifest, encoding), the device and precision of this machine, and
the per-rank memory budget (trainer/launch/memory.py). Importing it imports no torch; the device,
precision and parameter-count probes import torch when they run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.launch.memory import MemoryEstimate, check_memory_budget
from trainer.launch.config_sections import check_matches_index
from trainer.launch.refusal import Refusal

if TYPE_CHECKING:
    from trainer.launch.config import ExperimentConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    world_size: int
    """Ranks the job will run."""
    local_batch_size: int
    """Samples per rank per step."""
    micro_batch_size: int
    """Samples per forward/backward."""
    device_type: str
    """'cpu' or 'cuda', as resolved on this machine."""
    precision: str
    """The precision policy that runs (train.precision 'auto' resolved for device_type)."""
    memory: MemoryEstimate | None
    """Per-rank memory estimate; None where preflight was asked not to make one (ranks other than 0)."""
    memory_budget_bytes: int | None
    """What the estimate was checked against: train.max_memory_bytes, else a CUDA device's memory; None: unchecked."""
    memory_estimate_s: float = 0.0
    """Seconds the estimate took (the start-up breakdown's memory_estimate; not part of as_dict)."""

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "local_batch_size": self.local_batch_size,
                "micro_batch_size": self.micro_batch_size, "device_type": self.device_type,
                "precision": self.precision, "memory": None if self.memory is None else self.memory.as_dict(),
                "memory_budget_bytes": self.memory_budget_bytes}


def preflight(config: ExperimentConfig, *, world_size: int, estimate_memory: bool = True) -> LaunchPlan:
    """Refuse a config that cannot run on world_size ranks here; else the plan it will run.

    estimate_memory=False skips the memory estimate and its budget check: the trainer's ranks other
    than 0 pass it, since the estimate measures a block on CPU (a second and half a GB for the 1b
    preset) and every rank would get the same answer; rank 0's check refuses the run for all.
    """
    train, data = config.train, config.data
    _check_world(config, world_size)
    per_step = world_size * train.grad_accum
    if config.stage.checkpoint and config.stage.checkpoint_io == "store":
        from ops.publish import paths  # no store named: refused here, before any rank starts

        if paths.checkpoint_store_root() is None:
            # config, not credentials: what is missing is where the store is; its keys are a separate matter
            raise Refusal("config", f"stage.checkpoint_io=store writes checkpoints to the object store, but neither "
                                    f"{paths.CHECKPOINT_ROOT_VARIABLE} nor a data root URL (TRAINYARD_DATA_ROOT) names one",
                          f"export {paths.CHECKPOINT_ROOT_VARIABLE}=s3://BUCKET/checkpoints (the store's location, "
                          f"a deployment setting), or set stage.checkpoint_io=local to keep them in the run folder",
                          key="stage.checkpoint_io")
    if data.source == "shards":  # clip shapes, audio, manifest and encoding against the index, before launch
        check_matches_index(data, read_index_for_launch(data.shard_index))
    # Whether this machine has the device and the precision is probed with torch: imported here,
    # so that importing this module (and checking a config's shape) stays torch-free. A CPU run in fp32
    # needs no probe: with the memory estimate cached, the Dagster process's preflight imports no torch
    # (a second of every launch's start-up; benchmarks/first_step.py).
    if config.model.factory:  # imports and builds it on the meta device: a bad path or module is named here
        from trainer.models.protocol import check_factory

        check_factory(config)  # ModelProtocolError: a config Refusal naming model.factory
    try:
        device_type = "cpu" if train.device == "cpu" else _resolve_device_type(train.device)
    except ValueError as error:
        raise Refusal("cluster", f"train.device={train.device}: {error}",
                      "run where the device is (a GPU node), or set train.device=cpu", key="train.device") from None
    if train.precision == "fp32" or (train.precision == "auto" and device_type == "cpu"):
        precision = "fp32"  # what resolve_precision answers; fp32 runs everywhere (check_supported passes it)
    else:
        from trainer.precision import resolve_precision

        precision = resolve_precision(train.precision, device_type)
    try:
        _check_supported(precision, device_type)
    except Refusal:
        raise
    except ValueError as error:
        raise Refusal("config", f"train.precision={train.precision}: {error}",
                      "set train.precision=fp32 (or another precision this device supports)",
                      key="train.precision") from None
    device_memory = _cuda_memory_bytes() if device_type == "cuda" else None
    started = time.perf_counter()
    memory = (check_memory_budget(config, world_size, device_type=device_type, device_memory_bytes=device_memory)
              if estimate_memory else None)
    memory_estimate_s = time.perf_counter() - started
    return LaunchPlan(world_size=world_size, local_batch_size=data.batch_size // world_size,
                      micro_batch_size=data.batch_size // per_step, device_type=device_type,
                      precision=precision, memory=memory, memory_estimate_s=round(memory_estimate_s, 4),
                      memory_budget_bytes=train.max_memory_bytes if train.max_memory_bytes is not None else device_memory)


def _resolve_device_type(device: str) -> str:
    from trainer.devices import resolve_device_type

    return resolve_device_type(device)


def _check_supported(precision: str, device_type: str) -> None:
    if precision == "fp32":
        return
    from trainer.precision import check_supported

    check_supported(precision, device_type)


def _check_world(config: ExperimentConfig, world_size: int) -> None:
    """What the world size must agree with: parallelism, the global batch, the faults' ranks."""
    train, batch = config.train, config.data.batch_size
    if world_size < 1:
        raise Refusal("config", f"world_size must be >= 1, got {world_size}", "pass --world-size 1 or more",
                      key="world_size")
    if train.parallelism == "none" and world_size > 1:
        raise Refusal("config", f"train.parallelism 'none' with world_size {world_size} would train "
                                f"{world_size} unrelated copies",
                      "set train.parallelism=ddp (or fsdp), or --world-size 1", key="train.parallelism")
    per_step = world_size * train.grad_accum
    if batch % per_step:
        divisors = [n for n in range(1, batch + 1) if batch % (n * train.grad_accum) == 0]
        raise Refusal("config", f"global batch data.batch_size={batch} is not divisible by "
                                f"world_size {world_size} x train.grad_accum {train.grad_accum} = {per_step}",
                      f"set data.batch_size to a multiple of {per_step}, or the world size (--world-size) to one of "
                      f"{', '.join(map(str, divisors[-6:]))}", key="data.batch_size")
    faults = config.faults
    if faults.max_rank >= world_size:
        ranks = {"exit_rank": faults.exit_rank, "stall_rank": faults.stall_rank, "nan_loss_rank": faults.nan_loss_rank,
                 "sigterm_rank": faults.sigterm_rank if faults.sigterm_at_step else -1}
        key = "faults." + next(name for name, rank in ranks.items() if rank == faults.max_rank)
        raise Refusal("config", f"{key}: faults name rank {faults.max_rank}, but world_size is {world_size}",
                      f"set {key} below {world_size}, or run with --world-size {faults.max_rank + 1} or more",
                      key=key)


def read_index_for_launch(location: str):
    """The shard index's facts (index.json, verified) at data.shard_index, or a data Refusal naming it."""
    from ops.clips.shard_cache import read_any_index_info  # a folder, or a set in an object store
    from ops.publish.errors import PublishedFileError

    try:
        return read_any_index_info(location)
    except PublishedFileError:
        # A published file that fails its digest or signature keeps its type: every reader of a published
        # version refuses it alike (tests/test_published.py); the command line prints it as a data refusal.
        raise
    except (OSError, ValueError) as error:  # absent or unreadable
        raise Refusal("data", f"data.shard_index {location} cannot be read as a shard index: {error}",
                      "materialize the shard_index asset (make demo runs it) and set data.shard_index to its folder "
                      "(<data root>/shards/<plan version>)", key="data.shard_index") from None


def check_parent(config: ExperimentConfig, data_root: str | Path | None = None) -> dict | None:
    """Refuse a tainted parent checkpoint (stage.init_from or resume_from: a run trained on an asset the
    rights ledger revokes or an erasure deleted, ops.curation.erasure.run_taint) unless the config says
    rights.accept_tainted (reason and approver); the taint (accepted) or None. ``data_root``: the ledger's
    (default: the one of the run folder the parent lies in, ``ROOT/runs/NAME``, else the configured one)."""
    parent = config.stage.init_from or config.stage.resume_from
    if not parent:
        return None
    from ops.curation import erasure
    from ops.curation.rights import RightsLedgerError
    from ops.publish import paths

    if "://" in parent:  # <checkpoint root>/<run name>/step_N: the run's records are in the data root's runs/
        data_root = Path(data_root) if data_root is not None else paths.data_root()
        run_dir = data_root / "runs" / parent.rstrip("/").rsplit("/", 2)[-2]
    else:
        run_dir = Path(parent).parent.parent  # <run>/checkpoints/step_N
    if data_root is None:
        data_root = run_dir.parent.parent if run_dir.parent.name in ("runs", "drills") else paths.data_root()
    if not (run_dir / "launch.json").exists():
        return None  # a checkpoint from outside any run folder here (an import): no record to judge it by
    key = "stage.init_from" if config.stage.init_from else "stage.resume_from"
    try:
        taint = erasure.run_taint(data_root, run_dir)
    except RightsLedgerError as error:
        raise Refusal("rights", f"{key}: the rights ledger cannot be trusted, so parent {parent} cannot be "
                      f"checked: {error}", "restore the rights ledger from a backup (docs/rights.md)", key=key) from None
    if taint is None or taint["state"] != "tainted":
        return None
    if not config.rights.accept_tainted.given:
        raise Refusal("rights", f"{key}: parent checkpoint {parent} is tainted: {taint['how']} "
                      f"({', '.join(asset[:12] for asset in taint['assets'][:5])})",
                      "train the parent again without the asset, or start from it deliberately with "
                      "rights.accept_tainted.reason and rights.accept_tainted.approver (recorded in the run's "
                      "config and lineage)", key="rights.accept_tainted")
    return {**taint, "accepted": {"reason": config.rights.accept_tainted.reason,
                                  "approver": config.rights.accept_tainted.approver}}


def check_rights(config: ExperimentConfig) -> None:
    """The rights check every stage makes before launch (assets/stage_runs.py), for a run or a dry run by
    hand: a shard index holding an asset the rights ledger revokes (or a ledger that cannot be trusted)
    is a rights Refusal, and so is a tainted parent checkpoint without rights.accept_tainted (check_parent).
    Reads the ledger, and the index's plan only when something is revoked."""
    check_parent(config)
    if config.data.source != "shards":
        return
    from ops.curation.rights import IndexNotTrainable, refuse_revoked_index

    try:
        refuse_revoked_index(config.data.shard_index)
    except IndexNotTrainable as error:
        found = "data.shard_index: " + str(error).split("; validate, plan and shard again")[0]
        if "cannot be trusted" in found:
            fix = "restore the rights ledger from a backup (docs/rights.md); no run trains on data it cannot check"
        elif "cannot be read" in found:
            fix = "rebuild the shard index (its plan must be readable to check it against the ledger)"
        else:
            fix = ("materialize validated_manifest, clip_plan, clip_shards and shard_index again (the retrain sensor "
                   "does) so a new index leaves the revoked assets out, and set data.shard_index to it")
        raise Refusal("rights", found, fix, key="data.shard_index") from error


def _cuda_memory_bytes() -> int:
    """Total memory of the CUDA device this process would use (every rank of a node has the same kind)."""
    import torch

    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
