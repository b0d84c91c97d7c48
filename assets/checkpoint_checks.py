"""The blocking checks of a training stage on the checkpoint it reported: ``checkpoint_committed``
(the commit record and ``latest`` are in place) and ``checkpoint_integrity`` (every file re-hashes
to the signed record, under the stage's run id), in a run folder or in the store.

A module of its own, Dagster and the checkpoint store only: the training assets' code version counts
everything they import (ops.lineage).
"""

from pathlib import Path

import dagster as dg

from ops.checkpoints import store
from ops.publish import objstore

CHECKPOINT_CHECKS = ("checkpoint_committed", "checkpoint_integrity")


def _metadata_value(metadata: dict, key: str):
    value = metadata.get(key)
    return getattr(value, "value", value)


def checkpoint_checks(asset: str, metadata: dict):
    """The two blocking checks of a training stage, on the checkpoint it reported."""
    checkpoint = _metadata_value(metadata, "checkpoint")
    run_dir, run_id = _metadata_value(metadata, "run_dir"), _metadata_value(metadata, "run_id")
    if not checkpoint:
        for name in CHECKPOINT_CHECKS:
            yield dg.AssetCheckResult(asset_key=asset, check_name=name, passed=False,
                                      metadata={"reason": "the run reported no committed checkpoint"})
        return
    if objstore.is_remote(checkpoint):  # stage.checkpoint_io=store: committed means the store's records
        yield _store_committed_check(asset, checkpoint)
    else:
        infos = {info.path.name: info for info in store.list_checkpoints(run_dir)}
        info = infos.get(Path(checkpoint).name)
        latest = store.read_latest(run_dir)
        committed = info is not None and info.status == "committed"
        yield dg.AssetCheckResult(
            asset_key=asset, check_name="checkpoint_committed", passed=committed and latest is not None,
            metadata={"checkpoint": checkpoint, "status": info.status if info else "missing", "latest": latest or "none",
                      "num_incomplete": sum(i.status == "incomplete" for i in infos.values())})
    report = verify_checkpoint(checkpoint, expected_run_id=run_id)
    yield dg.AssetCheckResult(
        asset_key=asset, check_name="checkpoint_integrity", passed=report.ok,
        metadata={"checkpoint": checkpoint, "num_files": len((report.record or {}).get("files", {})),
                  "problems": "; ".join(f"{file}: {problem}" for file, problem in report.problems) or "none"})


def verify_checkpoint(checkpoint: str, *, expected_run_id: str | None) -> store.VerifyReport:
    """Every file re-hashed against the signed record, in a run folder or in the store (stage.checkpoint_io=store)."""
    if objstore.is_remote(checkpoint):
        from trainer.checkpointing import object_store  # torch: only where a checkpoint is in the store

        return object_store.check_version(checkpoint, store.configured_key(), expected_run_id,
                                              rehash=True)
    return store.verify(checkpoint, store.configured_key(), expected_run_id=expected_run_id)


def _store_committed_check(asset: str, checkpoint: str) -> dg.AssetCheckResult:
    run_url, name = checkpoint.rstrip("/").rsplit("/", 1)
    try:
        listing = objstore.list_versions(run_url, accept=lambda entry: store.checkpoint_step(entry) is not None)
    except objstore.ObjectStoreError as error:
        return dg.AssetCheckResult(asset_key=asset, check_name="checkpoint_committed", passed=False,
                                   metadata={"checkpoint": checkpoint, "reason": str(error)})
    return dg.AssetCheckResult(
        asset_key=asset, check_name="checkpoint_committed", passed=name in listing.committed,
        metadata={"checkpoint": checkpoint, "status": "committed" if name in listing.committed else "missing",
                  "latest": listing.latest or "none", "num_incomplete": len(listing.ignored)})
