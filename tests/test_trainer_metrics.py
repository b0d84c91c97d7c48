"""Tests of trainer/observe/metrics.py and trainer/optim.py: warm-up steps are left out of the summary,
throughput counts each step at its own clip shape, the bound verdict follows its documented rule,
the numerics report, and the LR schedule.

Run: python -m pytest tests/test_trainer_metrics.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer.observe.metrics import StepTimer, bound_verdict, compare_runs, reduce_max, reduce_mean, reduce_sum, summarize
from trainer.launch.config_sections import tiny
from trainer.models.video import VideoFlowModel
from trainer.optim import OptimConfig, build_optimizer, lr_factor
from ops.loading.sampling import World
from trainer.parallel import Distributed

CPU_WORLD = Distributed(world=World(rank=0, world_size=1), device=torch.device("cpu"), backend=None)


def test_step_timer_keeps_only_steps_after_warmup() -> None:
    timer = StepTimer(device=torch.device("cpu"), warmup_steps=2)
    for _ in range(5):
        timer.start_step()
        with timer.phase("forward"):
            pass
        with timer.phase("forward"):  # a second micro-batch adds to the same phase
            pass
        record = timer.end_step()
        assert record["step_time_s"] >= record["time_forward_s"] >= 0
    assert len(timer.steady) == 3
    assert set(timer.medians()) >= {"step_time_s", "time_forward_s", "time_checkpoint_s"}


def test_throughput_counts_each_step_at_its_clip_shape_median_time() -> None:
    """Two clip shapes: 3 steps of 8 x 32 tokens at 1 s, 1 s and 5 s (an outlier; median 1 s) and
    2 steps of 8 x 64 tokens at 2 s each. Robust time 3 x 1 + 2 x 2 = 7 s for 1792 tokens, 40
    samples, 224 frames; the FLOPs are the global batch's."""
    timer = StepTimer(device=torch.device("cpu"), warmup_steps=0)
    for step_s, shape in ((1.0, (4, 16, 16)), (2.0, (8, 16, 16)), (5.0, (4, 16, 16)), (2.0, (8, 16, 16)),
                          (1.0, (4, 16, 16))):
        timer.start_step()
        tokens = 32 if shape[0] == 4 else 64
        timer.record_work(clip_shape=shape, samples=8, frames=8 * shape[0], tokens=8 * tokens, flops=1000 * tokens)
        timer.end_step()
        timer.steady[-1]["step_time_s"] = step_s  # a known time instead of the measured one
    summary = summarize(timer, distributed=CPU_WORLD, comm_s=0.0, collective=False)
    assert summary["tokens_per_s"] == pytest.approx(1792 / 7)
    assert summary["samples_per_s"] == pytest.approx(40 / 7) and summary["frames_per_s"] == pytest.approx(224 / 7)
    assert summary["achieved_flops_per_s"] == pytest.approx(1000 * 224 / 7)
    assert summary["flops_per_step"] == 1000 * 224 / 5 and summary["clip_shapes"] == ["4x16x16", "8x16x16"]
    assert summary["step_time_s"] == 2.0  # the plain median over all steps is still reported


@pytest.mark.parametrize(("input_s", "compute_s", "comm_s", "verdict"), [
    (0.5, 0.2, 0.1, "input-bound"),
    (0.1, 0.5, 0.2, "compute-bound"),
    (0.1, 0.2, 0.5, "communication-bound"),
    (0.3, 0.3, 0.0, "compute-bound"),  # ties go to compute
])
def test_bound_verdict_is_the_largest_component(input_s, compute_s, comm_s, verdict) -> None:
    assert bound_verdict(input_s=input_s, compute_s=compute_s, comm_s=comm_s) == verdict


def test_reductions_on_one_rank_are_identity() -> None:
    assert reduce_mean([2.0, 4.0], CPU_WORLD) == [2.0, 4.0]
    assert reduce_max([1.0], CPU_WORLD) == reduce_sum([1.0], CPU_WORLD) == [1.0]


def test_compare_runs_reports_per_step_deltas_and_ratios() -> None:
    report = compare_runs({"losses": [1.0, 2.0], "grad_norms": [1.0, 4.0]},
                          {"losses": [1.1, 2.0], "grad_norms": [1.0, 2.0]})
    assert report["loss_rel_delta"] == pytest.approx([0.1, 0.0])
    assert report["grad_norm_ratio"] == [1.0, 0.5]
    assert report["max_grad_norm_ratio_deviation"] == 0.5
    with pytest.raises(ValueError, match="differ in length"):
        compare_runs({"losses": [1.0], "grad_norms": [1.0]}, {"losses": [], "grad_norms": []})


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor() -> None:
    config = OptimConfig(lr=1.0, warmup_steps=3, min_lr_ratio=0.1)
    factors = [lr_factor(step, config=config, total_steps=10) for step in range(10)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(factors[3:], factors[4:]))
    assert factors[-1] == pytest.approx(0.1)
    assert factors[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    constant = OptimConfig(lr=1.0, decay="constant")
    assert lr_factor(50, config=constant, total_steps=10) == 1.0


def test_weight_decay_skips_vectors_and_tables() -> None:
    config = tiny()
    config.pos_embed = "learned"
    model = VideoFlowModel(config, video_shape=(4, 16, 16))
    decayed, plain = build_optimizer(model, OptimConfig(weight_decay=0.1)).param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    names = {id(param): name for name, param in model.named_parameters()}
    decayed_names = {names[id(param)] for param in decayed["params"]}
    assert all(name.endswith(".weight") and "norm" not in name for name in decayed_names)
    assert "blocks.0.attn.qkv.weight" in decayed_names
    assert {"pos_embed", "blocks.0.scale_shift_table", "final.scale_shift_table"} <= {
        names[id(param)] for param in plain["params"]}
    assert len(decayed["params"]) + len(plain["params"]) == len(names)
