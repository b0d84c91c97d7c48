"""Multi-process tests of the trainer under real torchrun (2 ranks, gloo, CPU, tiny preset):
DDP determinism, equivalence of DDP / FSDP2 / gradient accumulation (bucketed data too), a rank
that dies, and secrets that must not leak into logs or final.json.

Each torchrun job takes ~5 s (two fresh Python processes importing torch).
Run: python -m pytest tests/test_trainer_distributed.py -q
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from ops.publish.paths import REPO_ROOT
from trainer.launch.config import load_config
from trainer.faults import INJECTED_EXIT_CODE
from trainer.loop import Trainer

ENV_SECRET_NAME = "TRAINYARD_TEST_SECRET_TOKEN"
ENV_SECRET = "s3cr3t-xyz"
FIELD_SECRET = "tok-field-abc123"
# Losses and weights of runs that see the same global batches but sum them in another order
# (ranks vs micro-batches, all-reduce vs reduce-scatter, 1 vs 2 OpenMP threads): fp32
# rounding only, measured ~1e-7 relative after 8 AdamW steps; 1e-5 leaves two decades of margin
# and still catches any real difference (a wrong sample, a missing average: >= 1e-3).
RTOL, PARAM_ATOL = 1e-5, 1e-6
# Below every step's gradient norm in these runs (0.22 to 0.37, so the default clip of 1.0 never
# engages): clipping scales every step, so FSDP's clip by the global norm over shards is checked
# against DDP's clip_grad_norm_ (a clip by one rank's shard norm moves the weights by ~3e-4,
# measured, against PARAM_ATOL 1e-6; AdamW's normalization hides most of a scale, not all).
CLIP = "optim.grad_clip_norm=0.05"


@dataclass
class Job:
    returncode: int
    output: str
    elapsed_s: float
    run_dir: Path

    @property
    def final(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "final.json").read_text())

    @property
    def params(self) -> dict[str, torch.Tensor]:
        return torch.load(self.run_dir / "final_params.pt")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(run_dir: Path, *overrides: str, extra_yaml: dict | None = None,
             timeout_s: float = 120) -> Job:
    """Run the trainer on 2 local ranks; the YAML holds what must not be on the command line."""
    run_dir.mkdir(parents=True)
    config_path = run_dir / "exp.yaml"
    config_path.write_text(yaml.safe_dump({"preset": "tiny_cpu", **(extra_yaml or {})}))
    env = os.environ | {ENV_SECRET_NAME: ENV_SECRET}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
               "--master-port", str(free_port()), "-m", "trainer.train", "--config", str(config_path),
               "--set", f"train.run_dir={run_dir}", "--set", "train.dump_final_params=true", *(
                   arg for override in overrides for arg in ("--set", override))]
    start = time.monotonic()
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=timeout_s)
    return Job(result.returncode, result.stdout + result.stderr, time.monotonic() - start, run_dir)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory) -> tuple[Job, Job]:
    """Two identical DDP jobs; their YAML plants a secret field and the env secret in the name."""
    secrets = {"name": f"exp-{ENV_SECRET}", "data": {"storage_token": FIELD_SECRET}}
    root = tmp_path_factory.mktemp("ddp")
    jobs = tuple(torchrun(root / name, "train.parallelism=ddp", CLIP, extra_yaml=secrets) for name in "ab")
    for job in jobs:
        assert job.returncode == 0, job.output
    assert min(jobs[0].final["grad_norms"]) > 0.05  # clipping engaged on every step
    return jobs


def test_ddp_two_ranks_is_bit_identical_across_runs(ddp_runs) -> None:
    first, second = ddp_runs
    assert first.final["status"] == "completed" and first.final["world_size"] == 2
    assert first.final["losses"] == second.final["losses"]
    assert first.final["grad_norms"] == second.final["grad_norms"]
    for name, value in first.params.items():
        assert torch.equal(value, second.params[name]), name


def test_ddp_records_communication_in_the_performance_model(ddp_runs) -> None:
    performance = ddp_runs[0].final["performance"]
    assert performance["reduced_over_ranks"] and performance["comm_s"] > 0
    assert performance["verdict"] in ("compute-bound", "input-bound", "communication-bound")


def test_one_rank_with_grad_accum_2_matches_two_ddp_ranks(ddp_runs, tmp_path: Path) -> None:
    """Global batch 8 as 1 rank x 2 micro-batches of 4 vs 2 ranks x 1 micro-batch of 4: the same
    samples (interleaved sampling) and the same per-sample noise; tolerance RTOL (module top)."""
    config = load_config(None, ["preset=tiny_cpu", f"train.run_dir={tmp_path}", "train.grad_accum=2",
                                "train.dump_final_params=true", CLIP])
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    single = json.loads((tmp_path / "final.json").read_text())
    ddp = ddp_runs[0]
    torch.testing.assert_close(single["losses"], ddp.final["losses"], rtol=RTOL, atol=0)
    torch.testing.assert_close(single["grad_norms"], ddp.final["grad_norms"], rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.load(tmp_path / "final_params.pt"), ddp.params,
                               rtol=RTOL, atol=PARAM_ATOL)


def test_bucketed_one_rank_with_grad_accum_2_matches_two_ddp_ranks(tmp_path: Path) -> None:
    """Bucketed data (three clip shapes, one per global step): the same equivalence as above,
    tolerance RTOL. Each global step is one bucket on both ranks, and the noise follows each
    batch's shape."""
    buckets = "data.buckets=[[4,16,16],[8,16,16],[4,16,24]]"
    ddp = torchrun(tmp_path / "ddp", "train.parallelism=ddp", buckets)
    assert ddp.returncode == 0, ddp.output
    config = load_config(None, ["preset=tiny_cpu", f"train.run_dir={tmp_path / 'single'}", buckets,
                                "train.grad_accum=2", "train.dump_final_params=true"])
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    single = json.loads((tmp_path / "single" / "final.json").read_text())
    assert ddp.final["data"]["batching"] == single["data"]["batching"] == "bucketed"
    assert len(ddp.final["performance"]["clip_shapes"]) > 1  # the steady steps crossed shapes
    torch.testing.assert_close(single["losses"], ddp.final["losses"], rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.load(tmp_path / "single" / "final_params.pt"), ddp.params,
                               rtol=RTOL, atol=PARAM_ATOL)


def test_fsdp2_matches_ddp_on_two_ranks(ddp_runs, tmp_path: Path) -> None:
    """FSDP2 (per-block units) reduce-scatters what DDP all-reduces: same math, tolerance RTOL,
    with clipping engaged on every step (CLIP)."""
    fsdp = torchrun(tmp_path / "fsdp", "train.parallelism=fsdp", CLIP)
    assert fsdp.returncode == 0, fsdp.output
    ddp = ddp_runs[0]
    assert fsdp.final["launch_plan"]["memory"]["params_bytes"] * 2 == ddp.final["launch_plan"]["memory"]["params_bytes"]
    torch.testing.assert_close(fsdp.final["losses"], ddp.final["losses"], rtol=RTOL, atol=0)
    # FSDP's norm is the square of every rank's shards summed in the step's one all-reduce
    # (trainer/parallel.py:clip_and_reduce); DDP's is torch's clip_grad_norm_ of full gradients.
    torch.testing.assert_close(fsdp.final["grad_norms"], ddp.final["grad_norms"], rtol=RTOL, atol=0)
    torch.testing.assert_close(fsdp.params, ddp.params, rtol=RTOL, atol=PARAM_ATOL)


def test_fsdp2_in_bf16_gathers_bf16_parameters_and_tracks_ddp_in_bf16(tmp_path: Path) -> None:
    """MixedPrecisionPolicy(bf16 params, fp32 reduce) under FSDP2; DDP's autocast computes the same
    per-op dtypes, so the two differ by the rounding of bf16 all-gathered weights only."""
    fsdp = torchrun(tmp_path / "fsdp", "train.parallelism=fsdp", "train.precision=bf16", "train.steps=4")
    ddp = torchrun(tmp_path / "ddp", "train.parallelism=ddp", "train.precision=bf16", "train.steps=4")
    assert fsdp.returncode == 0, fsdp.output
    assert ddp.returncode == 0, ddp.output
    assert fsdp.final["precision"]["policy"] == "bf16" and fsdp.final["kernels"]["residual_dtype"] == "bfloat16"
    torch.testing.assert_close(fsdp.final["losses"], ddp.final["losses"], rtol=2e-2, atol=0)


def test_secrets_never_appear_in_logs_or_final_json(ddp_runs) -> None:
    for job in ddp_runs:
        record = (job.run_dir / "final.json").read_text()
        for secret in (ENV_SECRET, FIELD_SECRET):
            assert secret not in job.output
            assert secret not in record
        assert job.final["config"]["data"]["storage_token"] == "***"
        assert job.final["config"]["name"] == "exp-***"
        assert "exp-***" in job.output  # the config was logged, redacted


def test_a_rank_that_exits_early_ends_the_job_with_an_error_not_a_hang(tmp_path: Path) -> None:
    job = torchrun(tmp_path / "exit", "train.parallelism=ddp", "train.steps=50",
                   "train.collective_timeout_s=30", "faults.exit_rank=1", "faults.exit_at_step=3",
                   timeout_s=90)
    assert job.returncode != 0, job.output
    assert job.elapsed_s < 90
    assert f"exitcode  : {INJECTED_EXIT_CODE}" in job.output  # torchrun names the root cause
    final = job.final  # rank 0 recorded its side: failed in the collective of step 3
    assert final["status"] == "failed" and final["final_step"] == 2


def test_a_stalled_rank_0_leaves_a_classified_record_from_the_survivor(tmp_path: Path) -> None:
    """Rank 0 is the one that hangs, so it writes no final.json in time: rank 1's own record must
    say what happened (a collective timeout in step 3, after step 2 completed)."""
    job = torchrun(tmp_path / "stall0", "train.parallelism=ddp", "train.collective_timeout_s=4",
                   "faults.stall_rank=0", "faults.stall_at_step=3", "faults.stall_s=8", timeout_s=90)
    assert job.returncode != 0, job.output
    survivor = json.loads((job.run_dir / "ranks" / "rank_1.json").read_text())
    assert survivor["status"] == "failed" and survivor["failure_class"] == "collective_timeout", survivor
    assert survivor["step"] == 2 and survivor["rank"] == 1 and survivor["host"]


def test_rank_0s_slow_end_of_run_work_keeps_no_peer_waiting(tmp_path: Path) -> None:
    """Rank 0 spends longer than the collective timeout on its end-of-run work (final.json,
    hooks: a slow MLflow server); the ranks met at the final barrier before it, so no rank is
    left in a collective that times out, and the job completes."""
    job = torchrun(tmp_path / "slow_end", "train.parallelism=ddp", "train.collective_timeout_s=5",
                   "faults.end_stall_s=8", "train.steps=3", timeout_s=90)
    assert job.returncode == 0, job.output
    assert job.final["status"] == "completed" and job.final["failure_class"] == "completed"
    for rank in (0, 1):
        assert json.loads((job.run_dir / "ranks" / f"rank_{rank}.json").read_text())["failure_class"] == "completed"


def test_a_stalled_rank_makes_the_others_fail_at_the_collective_timeout(tmp_path: Path) -> None:
    """Rank 1 stops responding for 12 s; with a 4 s collective timeout rank 0 must fail with a
    timeout error after ~4 s instead of waiting, and the job must end non-zero."""
    job = torchrun(tmp_path / "stall", "train.parallelism=ddp", "train.collective_timeout_s=4",
                   "faults.stall_rank=1", "faults.stall_at_step=3", "faults.stall_s=12",
                   timeout_s=90)
    assert job.returncode != 0, job.output
    final = job.final
    assert final["status"] == "failed" and final["final_step"] == 2
    assert "Timed out" in final["error"] or "timeout" in final["error"].lower()
    assert final["failure_class"] == "collective_timeout"
    started, ended = (datetime.fromisoformat(final[key]) for key in ("started_at", "ended_at"))
    assert (ended - started).total_seconds() < 12  # rank 0 gave up before the stall ended
