"""Reproduction from lineage: what a checkpoint's signed record must hold to be rebuilt, and the checks
that judge a rebuild (docs/lineage.md, "Reproducing a checkpoint").

Every committed checkpoint's record (trainer/checkpointing/checkpointer.py) carries, beside the lineage
fields, a ``content["reproduction"]`` block written by the run that trained it (`reproduction_block`):

- ``config``: the redacted config that ran, which must hash to the lineage's ``config_hash``;
- ``environment``: the interpreter and every installed distribution, the exact list ``env_digest``
  hashes (ops.lineage.environment_pins), so a rebuilt environment is checked and a different one is
  described package by package;
- ``shard_set``: the shard index the run read (its location, index, plan, validated and manifest
  versions, the plan's shard config and code version, and every shard's sha256), so the data is found by
  version, or rebuilt from the validated manifest and checked byte for byte;
- ``parent``: the checkpoint the stage started from (its run, step, and the digest of its data files),
  None for a run from scratch;
- ``sampler_at_start``: the data order's state before the first step.

This module is plain Python over records and files: `recorded_inputs` reads the block (and, for a
record written before it existed, what the run folder still holds that the signed hashes vouch for),
`package_differences`, `shard_set_problems`, `revoked_in_data` and `compare_checkpoints` judge. The
procedure (worktree, environment, rebuild, re-run) is ops/drills/replay.py.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops.checkpoints import store
from ops.publish.hashing import digest_json, sha256_file

BLOCK_FORMAT = 1
BLOCK_FIELDS = ("config", "environment", "shard_set", "parent", "sampler_at_start")
# Files of a DCP checkpoint that are not its data: the commit record, and DCP's pickled index, which
# names the storage layout and differs between two byte-identical saves (it is checked against the
# record's own hash when the checkpoint is verified).
_NOT_DATA = {store.RECORD_NAME, ".metadata"}
_MODEL, _OPTIMIZER = "model.", "optimizer."


class ReproductionError(RuntimeError):
    """A reproduction that cannot be run, or not claimed: ``kind`` says which step refused it."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# ---------------------------------------------------------------------------------------------
# Recording (the trainer, rank 0, once per run)


def shard_set_record(location: str | Path, index: Any = None) -> dict[str, Any]:
    """What a reproduction needs to find or rebuild the shard set at ``location`` (a folder or a store URL);
    ``index``: the ops.clips.shards.ShardIndex already read from there (the trainer's loader has it)."""
    from ops.clips import plan as clip_plan
    from ops.clips.shard_cache import read_any_index

    index = index if index is not None else read_any_index(location)
    plan = clip_plan.read_plan(index.directory)
    shas = dict(zip(index.table.column("shard").to_pylist(), index.table.column("shard_sha256").to_pylist()))
    return {"location": str(location), "index_version": index.version, "plan_version": plan.version,
            "validated_version": plan.validated_version, "manifest_version": plan.manifest_version,
            "config": plan.config.as_dict(), "code_version": plan.code_version, "erased": plan.erased,
            "shards": dict(sorted(shas.items()))}


def data_files_digest(files: Mapping[str, Any]) -> str:
    """The digest of a checkpoint's data files (name -> sha256, from its record's ``files``): equal for two
    saves of bit-identical state, whatever run, time or storage layout wrote them."""
    return digest_json({name: entry["sha256"] for name, entry in files.items() if name not in _NOT_DATA})


def parent_record(checkpoint_dir: str | Path, run_id: str) -> dict[str, Any]:
    """The parent a stage starts from (a folder or a store URL), as its checkpoint records it."""
    from ops.publish import objstore

    if objstore.is_remote(checkpoint_dir):
        data = objstore.read_object(objstore.join(str(checkpoint_dir), store.RECORD_NAME))
        if data is None:
            raise ValueError(f"{checkpoint_dir} holds no {store.RECORD_NAME}")
        record = json.loads(data)
    else:
        record = store.read_record(checkpoint_dir)
    return {"path": str(checkpoint_dir), "run_id": run_id, "step": record["step"],
            "world_size": record["world_size"], "data_digest": data_files_digest(record["files"])}


def reproduction_block(*, config: Mapping[str, Any], pins: Sequence[str], shard_set: Mapping[str, Any] | None,
                       parent: Mapping[str, Any] | None, sampler_at_start: Any) -> dict[str, Any]:
    """``content["reproduction"]`` of every checkpoint a run commits (module docstring)."""
    return {"format": BLOCK_FORMAT, "config": dict(config),
            "environment": {"interpreter": pins[0], "packages": list(pins[1:])},
            "shard_set": dict(shard_set) if shard_set is not None else None,
            "parent": dict(parent) if parent is not None else None, "sampler_at_start": sampler_at_start}


# ---------------------------------------------------------------------------------------------
# Reading a record


@dataclass(kw_only=True, slots=True)
class Recorded:
    """What a verified record says a reproduction must rebuild."""

    checkpoint_dir: Path
    record: dict[str, Any]
    lineage: dict[str, Any]
    step: int
    world_size: int
    config: dict[str, Any] | None = None
    pins: list[str] | None = None
    """Interpreter first, then the packages; None: the record predates the list (digest only)."""
    shard_set: dict[str, Any] | None = None
    parent: dict[str, Any] | None = None
    has_parent: bool = False
    sampler_at_start: Any = None
    notes: list[str] = field(default_factory=list)
    """Where something came from other than the signed block (a record written before it existed)."""
    missing: list[str] = field(default_factory=list)
    """Fields a reproduction needs that neither the record nor anything it vouches for provides."""

    @property
    def run_id(self) -> str:
        return str(self.lineage.get("run_id", ""))


def recorded_inputs(checkpoint_dir: str | Path, record: Mapping[str, Any], *, data_root: Path | None) -> Recorded:
    """The reproduction inputs of a verified ``record``: its signed block, or for a record written before
    the block existed, the run folder's launch.json where its config hashes to the signed ``config_hash``
    (the run folder beside the checkpoint); whatever cannot be had is named in ``missing``."""
    checkpoint_dir = Path(checkpoint_dir)
    lineage = dict(record.get("lineage", {}))
    content = record.get("content", {})
    found = Recorded(checkpoint_dir=checkpoint_dir, record=dict(record), lineage=lineage, step=int(record["step"]),
                     world_size=int(record["world_size"]))
    block = content.get("reproduction")
    if isinstance(block, Mapping):
        if block.get("format") != BLOCK_FORMAT:
            found.missing.append(f"a reproduction block this version reads (format {block.get('format')!r}, this "
                                 f"one reads {BLOCK_FORMAT})")
            return found
        absent = [name for name in BLOCK_FIELDS if name not in block]
        environment = block.get("environment")
        if not isinstance(environment, Mapping) or not {"interpreter", "packages"} <= set(environment):
            absent.append("environment.interpreter/packages")
        if not isinstance(block.get("config"), Mapping):
            absent.append("config")
        if absent:
            found.missing.append("reproduction." + ", reproduction.".join(dict.fromkeys(absent)))
            return found
        if isinstance(block["parent"], Mapping) and block["parent"].get("unreadable"):
            found.missing.append(f"parent (its record could not be read when the run started: "
                                 f"{block['parent']['unreadable']})")
            return found
        found.config = dict(block["config"])
        found.pins = [environment["interpreter"], *environment["packages"]]
        found.shard_set, found.parent = block["shard_set"], block["parent"]
        found.has_parent = block["parent"] is not None
        found.sampler_at_start = block["sampler_at_start"]
    else:
        found.notes.append("the record predates reproduction records (no content.reproduction)")
        _from_run_folder(found)
        if found.config is not None and found.config["data"].get("source") == "shards":
            found.shard_set = _shard_set_by_version(content.get("data") or {}, data_root)
            if found.shard_set is None:
                found.missing.append("shard_set (the shard set's plan and shard digests, to rebuild the data; no "
                                     f"shard set of index version {(content.get('data') or {}).get('shard_index_version')}"
                                     " is left under the data root)")
    if found.config is not None and digest_json(found.config) != lineage.get("config_hash"):
        found.missing.append(f"config (the recorded config does not hash to the signed config_hash "
                             f"{str(lineage.get('config_hash'))[:12]})")
        found.config = None
    return found


def _from_run_folder(found: Recorded) -> None:
    launch = found.checkpoint_dir.parent.parent / "launch.json"
    try:
        config = json.loads(launch.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        found.missing.append(f"config (not in the record, and {launch} is gone or unreadable)")
        return
    if digest_json(config) != found.lineage.get("config_hash"):
        found.missing.append(f"config (not in the record, and {launch}'s config does not hash to the signed "
                             "config_hash)")
        return
    found.config = config
    found.notes.append(f"config from {launch} (it hashes to the signed config_hash)")
    stage = config.get("stage", {})
    parent_dir = stage.get("init_from") or stage.get("resume_from")
    if parent_dir:
        found.has_parent = True
        run_id = stage.get("init_from_run_id") or stage.get("resume_run_id") or ""
        try:
            found.parent = parent_record(parent_dir, run_id) | {"data_digest": None}
            found.notes.append("parent's data digest not recorded: the parent is checked by its own signed record only")
        except (OSError, store.CheckpointRecordCorrupt, KeyError, ValueError):
            found.missing.append(f"parent (the record names no digest of it, and {parent_dir} is gone)")


def _shard_set_by_version(data: Mapping[str, Any], data_root: Path | None) -> dict[str, Any] | None:
    """A pre-block record names only the index version: a set of that version still under the data root."""
    version = data.get("shard_index_version")
    if not version or data_root is None:
        return None
    for index_json in sorted((data_root / "shards").glob("*/index.json")):
        try:
            if json.loads(index_json.read_text()).get("version") == version:
                return shard_set_record(index_json.parent) | {"rebuildable": False}
        except (OSError, ValueError):
            continue
    return None


# ---------------------------------------------------------------------------------------------
# The environment


def package_differences(recorded: Sequence[str], here: Sequence[str]) -> list[str]:
    """One line per interpreter or distribution that differs: ``torch: recorded 2.13.0+cpu, here 2.12.0``."""
    def split(pins: Sequence[str]) -> dict[str, str]:
        return dict(pin.split("==", 1) if "==" in pin else (pin, "?") for pin in pins)

    was, now = split(recorded), split(here)
    lines = []
    for name in sorted(set(was) | set(now)):
        if was.get(name) == now.get(name):
            continue
        if name not in now:
            lines.append(f"{name}: recorded {was[name]}, not installed here")
        elif name not in was:
            lines.append(f"{name}: not recorded, {now[name]} installed here")
        else:
            lines.append(f"{name}: recorded {was[name]}, here {now[name]}")
    return lines


# ---------------------------------------------------------------------------------------------
# The data


def shard_set_problems(directory: Path, recorded: Mapping[str, Any]) -> list[str]:
    """Why the shard set in ``directory`` is not the recorded one: its index version, or each shard whose
    sha256 is not the recorded one (named); empty when every byte matches."""
    from ops.clips import shards

    problems = []
    try:
        index = shards.read_index(directory)
    except (OSError, ValueError, shards.ShardIntegrityError) as error:  # PublishedFileError is a ValueError
        return [f"{directory}: the index cannot be read: {error}"]
    if index.version != recorded["index_version"]:
        problems.append(f"{directory}: index version {index.version}, recorded {recorded['index_version']}")
    for shard, expected in recorded["shards"].items():
        path = directory / f"{shard}.tar"
        actual = sha256_file(path) if path.is_file() else None
        if actual != expected:
            problems.append(f"shard {shard}: " + ("missing" if actual is None else
                                                 f"sha256 {actual[:12]}, recorded {expected[:12]}"))
    return problems


def revoked_in_data(revoked: Mapping[str, Mapping], assets: Sequence[str]) -> dict[str, Mapping]:
    """The assets of the recorded data that the rights ledger revokes now."""
    return {asset: revoked[asset] for asset in sorted(set(assets) & set(revoked))}


# ---------------------------------------------------------------------------------------------
# Comparing the rebuilt checkpoint with the recorded one


def read_state(checkpoint_dir: str | Path, hmac_key: bytes | str | None) -> dict[str, Any]:
    """Every entry of a committed DCP checkpoint (tensors full-size, other values as saved), read in this
    one process after its files were re-hashed against its signed record."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ops.checkpoints.dcp_metadata import MetadataRefused, RecordedMetadataReader

    report = store.verify(checkpoint_dir, hmac_key)
    if not report.ok:
        raise ReproductionError("record", f"{checkpoint_dir} failed verification: {report.summary()}")
    reader = RecordedMetadataReader(checkpoint_dir, report.record["files"])
    try:
        entries = reader.read_metadata().state_dict_metadata
    except MetadataRefused as refused:
        raise ReproductionError("record", f"{checkpoint_dir}: DCP metadata refused: {refused}") from refused
    state: dict[str, Any] = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
                             if isinstance(meta, TensorStorageMetadata) else None for key, meta in entries.items()}
    with warnings.catch_warnings():  # one process reads on purpose: DCP warns that no process group exists
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """How a rebuilt checkpoint is judged: ops/drills/restore.py's ComparisonRule, read from the signed record."""

    name: str
    loss_rtol: float
    param_atol: float
    why: str


def _same_bits(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))
    if isinstance(a, float) and isinstance(b, float):
        return a.hex() == b.hex() if not (math.isnan(a) and math.isnan(b)) else True
    return a == b


def _loss(value: Any) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


def compare_checkpoints(original: Mapping[str, Any], rebuilt: Mapping[str, Any], *, rule: Rule,
                        same_world: bool) -> dict[str, Any]:
    """Judge ``rebuilt`` against ``original`` (both from `read_state`) by ``rule``. The result names the
    first step whose loss differs and the tensor that differs most; bit_identical tolerates nothing."""
    import torch

    result: dict[str, Any] = {"rule": rule.name, "rule_why": rule.why, "loss_rtol": rule.loss_rtol,
                              "param_atol": rule.param_atol, "reasons": []}
    losses_a = list(original.get("train_state.losses") or [])
    losses_b = list(rebuilt.get("train_state.losses") or [])
    first, worst_loss = None, 0.0
    for step, (a, b) in enumerate(zip(losses_a, losses_b), start=1):
        fa, fb = _loss(a), _loss(b)
        identical = _same_bits(a, b) if isinstance(a, float) and isinstance(b, float) else a == b
        relative = (math.inf if (fa is None) != (fb is None) else
                    0.0 if fa is None else abs(fa - fb) / max(abs(fa), 1e-12))
        worst_loss = max(worst_loss, relative)
        if first is None and (not identical if rule.name == "bit_identical" else relative > rule.loss_rtol):
            first = {"step": step, "recorded": a, "reproduced": b}
    if len(losses_a) != len(losses_b):
        result["reasons"].append(f"loss history holds {len(losses_a)} steps in the record's checkpoint and "
                                 f"{len(losses_b)} in the reproduction")
    result["first_differing_step"] = first["step"] if first else None
    result["first_differing_loss"] = first
    result["max_loss_rel_diff"] = worst_loss
    result["steps_compared"] = min(len(losses_a), len(losses_b))
    if first:
        result["reasons"].append(f"loss differs first at step {first['step']}: recorded {first['recorded']!r}, "
                                 f"reproduced {first['reproduced']!r}")
    # Tensors: the model and the optimizer state always; at the saved world size, every tensor (RNG states too).
    keys = sorted(key for key in set(original) | set(rebuilt)
                  if isinstance(original.get(key, rebuilt.get(key)), torch.Tensor)
                  and (same_world or key.startswith((_MODEL, _OPTIMIZER))))
    missing = [key for key in keys if key not in original or key not in rebuilt]
    if missing:
        result["reasons"].append(f"tensors present in only one checkpoint: {missing[:5]}")
    worst_name, worst, differing = None, 0.0, 0
    for key in keys:
        if key in missing:
            continue
        a, b = original[key], rebuilt[key]
        if a.shape != b.shape or a.dtype != b.dtype:
            result["reasons"].append(f"tensor {key}: {tuple(a.shape)} {a.dtype} recorded, {tuple(b.shape)} {b.dtype} "
                                     "reproduced")
            differing += 1
            continue
        if _same_bits(a, b):
            continue
        differing += 1
        diff = float((a.double() - b.double()).abs().nan_to_num(nan=math.inf).max()) if a.numel() else 0.0
        if worst_name is None or diff > worst:
            worst_name, worst = key, diff
    result |= {"tensors_compared": len(keys) - len(missing), "tensors_differing": differing,
               "most_different_tensor": worst_name, "max_tensor_abs_diff": worst}
    if rule.name == "bit_identical":
        if differing:
            result["reasons"].append(f"{differing} tensor(s) are not bit-identical; the most different is "
                                     f"{worst_name} (max |diff| {worst:.3e})")
        others = [key for key in sorted(set(original) & set(rebuilt))
                  if key not in keys and not isinstance(original[key], torch.Tensor)
                  and not _same_bits(original[key], rebuilt[key])]
        if others:
            result["reasons"].append(f"saved values differ: {others[:5]}")
    elif worst > rule.param_atol:
        result["reasons"].append(f"tensor {worst_name} differs by {worst:.3e} > {rule.param_atol} ({rule.name})")
    result["passed"] = not result["reasons"]
    return result
