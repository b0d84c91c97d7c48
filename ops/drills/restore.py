"""Restore drills: does a run restored from a checkpoint reproduce what the original run did?

The truth is the original run itself. A drill restores an earlier committed checkpoint of it
(step ``from_step``) in fresh processes, trains to a later step that the original also reached
and committed (``to_step``), and compares that continuation with what the original recorded:

- losses of steps from_step+1 .. to_step: the original's ``final.json`` (its loss history
  survives its own resumes, since the train state carries it);
- parameters at to_step: the original's own committed checkpoint of that step, read with DCP
  after its files were re-hashed against its record;
- the global sample order of those steps: the original's ``samples/rank_*.json`` where its
  last process trained them (a retry that resumed later logs none), else the order of a
  continuation that was itself proven bit-identical to the original.

Which rule judges a continuation (``comparison_rule``, recorded in the drill's metadata):

- ``bit_identical``: the same world size, and the original ran with deterministic kernels (the
  default on CPU; ``train.deterministic=true`` on CUDA): nothing is tolerated.
- ``reassociation``: another world size, deterministic kernels: the same gradients summed in
  another order (float32 reassociation, measured ~1e-7 relative per step on CPU): losses within
  ``LOSS_RTOL`` relative, parameters within ``PARAM_ATOL``.
- ``nondeterministic_kernels``: the original ran without deterministic kernels (the default on
  CUDA: flash attention's backward accumulates with atomics), at any world size: losses within
  ``GPU_LOSS_RTOL`` and parameters within ``GPU_PARAM_ATOL``. These are stated, not yet measured
  on a GPU (docs/status.md lists the GPU drill as a check to run); a drill that must catch small
  restore bugs on GPU runs the original with train.deterministic=true.

The rule is read from the restored checkpoint's signed record (``content["numerics"]``), never
from the run's final.json, which nothing signs.

Two continuations of one checkpoint are no proof: a restore that drops the optimizer state
makes both wrong in the same way, so nothing here compares continuations with each other.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ops.checkpoints import store
from ops.checkpoints.dcp_metadata import DCP_METADATA_NAME, MetadataRefused, RecordedMetadataReader

# Different world sizes reassociate float32 sums; 1e-4 relative on losses after tens of steps
# leaves two orders of magnitude over what was measured, while a real divergence moves losses
# by more (a restore that dropped the optimizer state: ~1e-3 after 3 steps of the tiny test
# model; wrong data or RNG: 1e-2 or more). At the saved world size nothing is tolerated.
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4
# Nondeterministic GPU kernels (atomics in attention backward, split-K matmuls) change the last
# bits of every step's gradients, which training amplifies; bf16 rounding (8-bit mantissa)
# makes each difference larger. Stated for drills of tens of steps; not yet measured.
GPU_LOSS_RTOL = 1e-2
GPU_PARAM_ATOL = 1e-2
_MODEL_PREFIX = "model."  # the checkpoint's model part, flattened by DCP (trainer/checkpointing/checkpointer.py)


class DrillError(ValueError):
    """A drill cannot be run or judged: too few checkpoints, a run that recorded nothing, ..."""


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """What one run did over the drilled steps: the original (the truth) or a continuation."""

    name: str
    """For messages: 'original', 'same_world', 'other_world'."""
    losses: dict[int, float | None]
    """1-based step -> global mean loss (None: non-finite, as final.json writes it)."""
    params: dict[str, torch.Tensor]
    """Full (unsharded) model state after ``params_step``."""
    params_step: int
    """The step the parameters were taken at."""
    order: dict[int, list[str]] | None = None
    """Step -> sample keys in global position order; None when the run did not record them."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ComparisonRule:
    """How a continuation is judged (module docstring)."""

    name: str
    """'bit_identical', 'reassociation' or 'nondeterministic_kernels'."""
    loss_rtol: float
    """Largest relative loss difference tolerated (0: none)."""
    param_atol: float
    """Largest absolute parameter difference tolerated (0: none)."""
    why: str
    """The reason this rule applies, for the drill's metadata."""


def comparison_rule(numerics: Mapping, *, same_world: bool) -> ComparisonRule:
    """The rule for a continuation of a run whose checkpoint record holds ``numerics`` (module docstring).

    ``numerics`` is the signed commit record's ``content["numerics"]`` (trainer/checkpointing/checkpointer.py):
    device type, precision, deterministic kernels. It comes from the record, not from final.json,
    so an edited run file cannot loosen the rule; a record without it (written before it was
    recorded, always on CPU) is judged as deterministic, the strictest rule.
    """
    device_type = numerics.get("device_type", "cpu")
    deterministic = bool(numerics.get("deterministic", True))
    where = f"the original ran on {device_type} with {'deterministic' if deterministic else 'nondeterministic'} kernels"
    if not deterministic:
        return ComparisonRule(name="nondeterministic_kernels", loss_rtol=GPU_LOSS_RTOL, param_atol=GPU_PARAM_ATOL,
                              why=f"{where}: no two runs are bit-identical")
    if same_world:
        return ComparisonRule(name="bit_identical", loss_rtol=0.0, param_atol=0.0, why=f"{where}, same world size")
    return ComparisonRule(name="reassociation", loss_rtol=LOSS_RTOL, param_atol=PARAM_ATOL,
                          why=f"{where}, another world size: sums reassociate")


@dataclass(kw_only=True, slots=True)
class DrillComparison:
    passed: bool
    same_world: bool
    rule: str = "bit_identical"
    loss_rtol: float = 0.0
    param_atol: float = 0.0
    reasons: list[str] = field(default_factory=list)
    max_loss_rel_diff: float = 0.0
    max_param_abs_diff: float = 0.0
    losses_identical: bool = False
    params_identical: bool = False
    order_compared: bool = False
    order_identical: bool = False
    num_steps_compared: int = 0

    def as_metadata(self, prefix: str = "") -> dict:
        record = asdict(self)
        record["reasons"] = "; ".join(self.reasons) or "none"
        return {f"{prefix}{key}": value for key, value in record.items()}


# ---------------------------------------------------------------------------------------------
# Reading runs


def recorded_losses(run_dir: str | Path, *, require_completed: bool) -> dict[int, float | None]:
    """Step -> loss from a run's final.json; a continuation must have completed, an original
    need not (a cancelled run's losses up to its last checkpoint are still the truth)."""
    path = Path(run_dir) / "final.json"
    if not path.is_file():
        raise DrillError(f"{path} is missing: the run recorded no result")
    final = json.loads(path.read_text())
    if require_completed and final.get("status") != "completed":
        raise DrillError(f"{run_dir} ended {final.get('status')!r}: {final.get('error')}")
    return {step: loss for step, loss in enumerate(final["losses"], start=1)}


def global_order(run_dir: str | Path) -> dict[int, list[str]]:
    """Step -> sample keys in global position order (ranks interleaved element-wise, j-major)."""
    records = [json.loads(path.read_text()) for path in (Path(run_dir) / "samples").glob("rank_*.json")]
    if not records:
        raise DrillError(f"{run_dir}/samples has no rank_*.json: the run recorded no sample order")
    records.sort(key=lambda record: record["rank"])  # numerically: rank_10 after rank_2
    per_rank = [{step: keys for step, keys in record["steps"]} for record in records]
    order: dict[int, list[str]] = {}
    for step in sorted(set().union(*per_rank)):
        columns = [record.get(step, []) for record in per_rank]
        order[step] = [column[j] for j in range(max(map(len, columns))) for column in columns if j < len(column)]
    return order


def recorded_order(run_dir: str | Path, steps: range) -> dict[int, list[str]] | None:
    """The run's global order of ``steps``, or None when its sample log does not cover them all
    (its last process resumed after them, or it logged nothing)."""
    try:
        order = global_order(run_dir)
    except DrillError:
        return None
    if not all(step in order for step in steps):
        return None
    return {step: order[step] for step in steps}


def final_params(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """The full model state a run dumped at its end (train.dump_final_params)."""
    path = Path(run_dir) / "final_params.pt"
    if not path.is_file():
        raise DrillError(f"{path} is missing: run the continuation with train.dump_final_params=true")
    return torch.load(path, weights_only=True)


def checkpoint_params(checkpoint_dir: str | Path, *, hmac_key: bytes | str | None = None,
                      expected_run_id: str | None = None) -> dict[str, torch.Tensor]:
    """Full model parameters from a committed DCP checkpoint, read in this one process.

    Files are re-hashed against the checkpoint's record first: DCP's ``.metadata`` is a pickle.
    Only tensor entries of the model part are read; every shard (any world size, DDP or FSDP)
    lands in one full tensor.
    """
    report = store.verify(checkpoint_dir, hmac_key, expected_run_id)
    if not report.ok:
        raise DrillError(f"checkpoint failed verification: {report.summary()}")
    reader = RecordedMetadataReader(checkpoint_dir, report.record["files"])
    try:
        entries = reader.read_metadata().state_dict_metadata
    except MetadataRefused as refused:
        raise DrillError(f"{checkpoint_dir}/{DCP_METADATA_NAME} refused: {refused}") from refused
    template = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in entries.items()
                if key.startswith(_MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)}
    if not template:
        raise DrillError(f"{checkpoint_dir} holds no model tensors")
    dcp.load(template, storage_reader=reader, no_dist=True)
    return {key.removeprefix(_MODEL_PREFIX): tensor for key, tensor in template.items()}


# ---------------------------------------------------------------------------------------------
# Comparing


def _loss_diffs(truth: Mapping[int, float | None], candidate: Mapping[int, float | None], steps: range,
                result: DrillComparison) -> float:
    """Largest relative loss difference over ``steps``; inf when a loss is missing or non-finite."""
    missing = [step for step in steps if step not in truth or step not in candidate]
    if missing:
        result.reasons.append(f"steps {missing[:5]} missing from the original or the continuation")
    nonfinite = [step for step in steps if step not in missing
                 and not all(loss is not None and math.isfinite(loss) for loss in (truth[step], candidate[step]))]
    if nonfinite:
        result.reasons.append(f"non-finite losses at steps {nonfinite[:5]}")
    compared = [step for step in steps if step not in missing and step not in nonfinite]
    result.num_steps_compared = len(compared)
    result.losses_identical = not missing and not nonfinite and all(truth[s] == candidate[s] for s in compared)
    if missing or nonfinite:
        return math.inf
    return max((abs(truth[s] - candidate[s]) / max(abs(truth[s]), 1e-12) for s in compared), default=0.0)


def _param_diffs(truth: Mapping[str, torch.Tensor], candidate: Mapping[str, torch.Tensor],
                 result: DrillComparison) -> float:
    if truth.keys() != candidate.keys():
        result.reasons.append(f"parameter names differ: {sorted(set(truth) ^ set(candidate))[:5]}")
    shared = sorted(set(truth) & set(candidate))
    shapes = [name for name in shared if truth[name].shape != candidate[name].shape]
    if shapes:
        result.reasons.append(f"parameter shapes differ: {shapes[:5]}")
        return math.inf
    result.params_identical = truth.keys() == candidate.keys() and all(
        torch.equal(truth[name], candidate[name]) for name in shared)
    return max((float((truth[n].double() - candidate[n].double()).abs().max()) for n in shared), default=0.0)


def compare(truth: RunRecord, candidate: RunRecord, *, from_step: int, to_step: int,
            same_world: bool, rule: ComparisonRule | None = None) -> DrillComparison:
    """Judge a continuation restored at ``from_step`` against the original over steps up to ``to_step``
    by ``rule`` (default: the rule of a CPU run with deterministic kernels at this world size)."""
    if not 0 <= from_step < to_step:
        raise DrillError(f"need 0 <= from_step < to_step, got {from_step}, {to_step}")
    if rule is None:
        rule = comparison_rule({}, same_world=same_world)
    result = DrillComparison(passed=False, same_world=same_world, rule=rule.name, loss_rtol=rule.loss_rtol,
                             param_atol=rule.param_atol)
    steps = range(from_step + 1, to_step + 1)
    if truth.params_step != to_step or candidate.params_step != to_step:
        result.reasons.append(f"parameters taken at different steps: original {truth.params_step}, "
                              f"{candidate.name} {candidate.params_step}, compared step {to_step}")
    result.max_loss_rel_diff = _loss_diffs(truth.losses, candidate.losses, steps, result)
    result.max_param_abs_diff = _param_diffs(truth.params, candidate.params, result)
    if truth.order is not None:
        result.order_compared = True
        wanted = {step: truth.order.get(step) for step in steps}
        got = {step: (candidate.order or {}).get(step) for step in steps}
        result.order_identical = wanted == got
        if not result.order_identical:
            first = next(step for step in steps if wanted[step] != got[step])
            result.reasons.append(f"global sample order differs from the original's from step {first}")
    if rule.name == "bit_identical":
        if not (result.losses_identical and result.params_identical):
            result.reasons.append(f"same world size with deterministic kernels must be bit-identical to the original, "
                                  f"and is not (losses {result.max_loss_rel_diff:.2e} relative, parameters "
                                  f"{result.max_param_abs_diff:.2e})")
    else:
        if result.max_loss_rel_diff > rule.loss_rtol:
            result.reasons.append(f"losses differ from the original's by {result.max_loss_rel_diff:.2e} "
                                  f"relative > {rule.loss_rtol} ({rule.name})")
        if result.max_param_abs_diff > rule.param_atol:
            result.reasons.append(f"parameters differ from the original's checkpoint at step {to_step} by "
                                  f"{result.max_param_abs_diff:.2e} > {rule.param_atol} ({rule.name})")
    result.passed = not result.reasons
    return result


def continuation_record(run_dir: str | Path, *, name: str) -> RunRecord:
    """A drill continuation's losses, final parameters and sample order."""
    losses = recorded_losses(run_dir, require_completed=True)
    return RunRecord(name=name, losses=losses, params=final_params(run_dir), params_step=len(losses),
                     order=global_order(run_dir))
