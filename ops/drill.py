"""Restore drills: is a run resumed from a checkpoint the same run it was?

A drill resumes the newest committed checkpoint twice in fresh processes, once at the world
size it was saved with (the reference continuation) and once at another world size, trains N
more steps in each, and compares:

- losses and final parameters: bit-identical where the arithmetic is deterministic (same
  world size on CPU), within ``rtol`` / ``atol`` otherwise (a different world size sums the
  same gradients in another order: float32 reassociation, measured ~1e-7 relative per step);
- the global sample order: exactly equal in both cases (ops.sampling's contract).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

# Different world sizes reassociate float32 sums; 1e-4 relative on losses after tens of steps
# leaves two orders of magnitude over what was measured, while any real divergence (wrong
# data, lost optimizer state, wrong RNG) moves losses by 1e-2 or more.
LOSS_RTOL = 1e-4
PARAM_ATOL = 1e-4


@dataclass(kw_only=True, slots=True)
class DrillComparison:
    passed: bool
    same_world: bool
    reasons: list[str] = field(default_factory=list)
    max_loss_rel_diff: float = 0.0
    max_param_abs_diff: float = 0.0
    losses_identical: bool = False
    params_identical: bool = False
    order_identical: bool = False
    num_steps_compared: int = 0

    def as_metadata(self) -> dict:
        record = asdict(self)
        record["reasons"] = "; ".join(self.reasons) or "none"
        return record


def global_order(run_dir: Path) -> dict[int, list[str]]:
    """Step -> sample keys in global position order (ranks interleaved element-wise, j-major)."""
    records = [json.loads(path.read_text()) for path in (run_dir / "samples").glob("rank_*.json")]
    if not records:
        raise FileNotFoundError(f"{run_dir}/samples has no rank_*.json: the run recorded no sample order")
    records.sort(key=lambda record: record["rank"])  # numerically: rank_10 after rank_2
    per_rank = [{step: keys for step, keys in record["steps"]} for record in records]
    order: dict[int, list[str]] = {}
    for step in sorted(set().union(*per_rank)):
        columns = [record.get(step, []) for record in per_rank]
        order[step] = [column[j] for j in range(max(map(len, columns))) for column in columns if j < len(column)]
    return order


def _losses(run_dir: Path, first_step: int) -> list[float]:
    final = json.loads((run_dir / "final.json").read_text())
    if final.get("status") != "completed":
        raise RuntimeError(f"{run_dir} ended {final.get('status')!r}: {final.get('error')}")
    return final["losses"][first_step:]


def compare(reference: Path, candidate: Path, *, from_step: int, same_world: bool) -> DrillComparison:
    """Compare two continuations of one checkpoint taken at ``from_step``."""
    result = DrillComparison(passed=False, same_world=same_world)
    ref_losses, cand_losses = _losses(reference, from_step), _losses(candidate, from_step)
    result.num_steps_compared = min(len(ref_losses), len(cand_losses))
    if len(ref_losses) != len(cand_losses) or not ref_losses:
        result.reasons.append(f"step counts differ or are empty: {len(ref_losses)} vs {len(cand_losses)}")
    result.losses_identical = ref_losses == cand_losses
    if any(loss is None for loss in ref_losses + cand_losses):  # final.json writes non-finite losses as null
        result.reasons.append("a continuation has non-finite losses")
        ref_losses = [float("nan") if loss is None else loss for loss in ref_losses]
        cand_losses = [float("nan") if loss is None else loss for loss in cand_losses]
    result.max_loss_rel_diff = max((abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref_losses, cand_losses)),
                                   default=0.0)
    ref_params = torch.load(reference / "final_params.pt", weights_only=True)
    cand_params = torch.load(candidate / "final_params.pt", weights_only=True)
    if ref_params.keys() != cand_params.keys():
        result.reasons.append(f"parameter names differ: {sorted(set(ref_params) ^ set(cand_params))[:5]}")
    shared = sorted(set(ref_params) & set(cand_params))
    result.params_identical = all(torch.equal(ref_params[name], cand_params[name]) for name in shared)
    result.max_param_abs_diff = max((float((ref_params[n] - cand_params[n]).abs().max()) for n in shared), default=0.0)
    ref_order = {step: keys for step, keys in global_order(reference).items() if step > from_step}
    cand_order = {step: keys for step, keys in global_order(candidate).items() if step > from_step}
    result.order_identical = ref_order == cand_order
    if not result.order_identical:
        result.reasons.append("global sample order differs from the reference continuation")
    if same_world and not (result.losses_identical and result.params_identical):
        result.reasons.append("same world size on CPU must be bit-identical, and is not")
    if not same_world and result.max_loss_rel_diff > LOSS_RTOL:
        result.reasons.append(f"losses differ by {result.max_loss_rel_diff:.2e} relative > {LOSS_RTOL}")
    if not same_world and result.max_param_abs_diff > PARAM_ATOL:
        result.reasons.append(f"parameters differ by {result.max_param_abs_diff:.2e} > {PARAM_ATOL}")
    result.passed = not result.reasons
    return result
