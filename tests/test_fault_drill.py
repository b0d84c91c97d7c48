"""The fault drill's judge (ops/drills/fault.py) on hand-written run records: a fault that must
leave the computation unchanged passes only when the recovered run's final parameters equal the
uninterrupted run's, bit for bit. The drill's real runs are in tests/test_training_assets.py.

Run: python -m pytest tests/test_fault_drill.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ops.drills.fault import FAULTS, judge

RANK_KILLED = next(fault for fault in FAULTS if fault.name == "rank_killed")


def _recovered_run(run_dir: Path, params: dict[str, torch.Tensor] | None) -> Path:
    """The records of a run whose rank died at step 4 and that resumed from step 4 and completed."""
    run_dir.mkdir(parents=True)
    attempts = [{"attempt": 0, "failure_class": "rank_crash", "decision": "restart", "step": 4,
                 "ended_at": "2026-01-01T00:00:10+00:00"},
                {"attempt": 1, "decision": "done", "restored_step": 4, "started_at": "2026-01-01T00:00:12+00:00",
                 "time_to_first_step_s": 1.5}]
    (run_dir / "attempts.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in attempts))
    (run_dir / "final.json").write_text(json.dumps({"status": "completed"}))
    if params is not None:
        torch.save(params, run_dir / "final_params.pt")
    return run_dir


@pytest.mark.parametrize(("candidate", "passed", "problem"), [
    ({"w": torch.tensor([1.0, 2.0])}, True, "none"),
    ({"w": torch.tensor([1.0, 2.0000002])}, False, "final parameters differ from the uninterrupted run's"),
    (None, False, "final parameters not comparable with the uninterrupted run's"),
], ids=["equal", "one_ulp_apart", "not_dumped"])
def test_a_recovery_that_must_be_bit_identical_passes_only_with_equal_final_parameters(
        tmp_path: Path, candidate, passed: bool, problem: str) -> None:
    reference = _recovered_run(tmp_path / "reference", {"w": torch.tensor([1.0, 2.0])})
    result = judge(RANK_KILLED, _recovered_run(tmp_path / "run", candidate), reference)
    assert result["outcome"] == "recovered" and result["steps_lost"] == 0 and result["time_to_recover_s"] == 3.5
    assert result["passed"] is passed and result["problems"] == problem
