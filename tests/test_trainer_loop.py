"""Tests of the training loop (trainer/loop.py) in one process (world size 1): determinism,
gradient accumulation, non-finite steps, bf16 numerics, resume through app_state (bucketed data
too), hooks, cancellation (SIGTERM) and the failure record; and the wiring (trainer/wiring.py) of
the DCP checkpointer: another run's checkpoint resumed (restore drills), a parent's weights
(init_from), and the committed checkpoint a run reports.

Every run is the tiny_cpu preset: a 0.15M-parameter model, a fraction of a second per run.
Run: python -m pytest tests/test_trainer_loop.py -q
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from ops.publish.paths import REPO_ROOT
from ops.loading.sampling import World
from ops.checkpoints import store as store
from trainer.checkpointing.checkpointer import Checkpointer as DcpCheckpointer, LoadReport
from trainer.launch.config import ExperimentConfig, load_config
from trainer.data import SyntheticClips
from trainer.observe.hooks import Checkpointer
from trainer.loop import Trainer
from trainer.observe.metrics import compare_runs
from trainer.state import RunResult
from trainer.train import EXIT_CODES
from trainer.wiring import ResumeFrom, attach_plugins, committed_step


def make_config(run_dir: Path, *overrides: str) -> ExperimentConfig:
    return load_config(None, ["preset=tiny_cpu", f"train.run_dir={run_dir}", *overrides])


def run(config: ExperimentConfig, **kwargs: Any) -> dict[str, Any]:
    trainer = Trainer(config, **kwargs)
    try:
        trainer.train()
    finally:
        trainer.close()
    return json.loads((Path(config.train.run_dir) / "final.json").read_text())


def final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_params.pt")


class MemoryCheckpointer:
    """The Checkpointer protocol over deep copies in memory; ``events`` is the order of calls."""

    def __init__(self, saved: dict[int, dict[str, Any]] | None = None, *, load_step: int | None = None):
        self.saved = saved if saved is not None else {}
        self.load_step = load_step
        self.closed = False
        self.events: list[str] = []
        self.last_record: dict[str, Any] | None = None
        self.last_load: LoadReport | None = None

    def save(self, step: int, app_state: Mapping[str, Any]) -> None:
        self.saved[step] = {name: copy.deepcopy(obj.state_dict()) for name, obj in app_state.items()}
        self.last_record = {"step": step}
        self.events.append(f"save {step}")

    def wait(self) -> None:
        self.events.append("wait")

    def close(self) -> None:
        self.closed = True

    def load(self, app_state: Mapping[str, Any]) -> int | None:
        if self.load_step is None:
            return None
        for name, obj in app_state.items():
            obj.load_state_dict(copy.deepcopy(self.saved[self.load_step][name]))
        self.last_load = LoadReport(checkpoint_dir=None, step=self.load_step, notes=[])
        return self.load_step


class RecordingHook:
    def __init__(self, on_step=None) -> None:
        self.steps: list[tuple[int, dict[str, float]]] = []
        self.results: list[RunResult] = []
        self.on_step = on_step

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        self.steps.append((step, dict(metrics)))
        if self.on_step:
            self.on_step(step)

    def on_train_end(self, result: RunResult) -> None:
        self.results.append(result)


def test_fixed_seed_gives_bit_identical_losses_and_weights(tmp_path: Path) -> None:
    first = run(make_config(tmp_path / "a", "train.dump_final_params=true"))
    second = run(make_config(tmp_path / "b", "train.dump_final_params=true"))
    other_seed = run(make_config(tmp_path / "c", "train.seed=1"))
    assert first["status"] == "completed" and first["final_step"] == 8
    assert first["losses"] == second["losses"] and first["grad_norms"] == second["grad_norms"]
    for name, value in final_params(tmp_path / "a").items():
        assert torch.equal(value, final_params(tmp_path / "b")[name]), name
    assert other_seed["losses"] != first["losses"]


def test_grad_accum_2_equals_one_micro_batch_within_fp32_rounding(tmp_path: Path) -> None:
    """Same global batch of 8, split 2 x 4 instead of 1 x 8: the per-sample losses and the noise
    are identical, only the fp32 summation order differs. Tolerance rtol 1e-5 (measured ~1e-7)."""
    whole = run(make_config(tmp_path / "whole", "train.dump_final_params=true"))
    split = run(make_config(tmp_path / "split", "train.grad_accum=2", "train.dump_final_params=true"))
    torch.testing.assert_close(split["losses"], whole["losses"], rtol=1e-5, atol=0)
    torch.testing.assert_close(final_params(tmp_path / "split"), final_params(tmp_path / "whole"),
                               rtol=1e-5, atol=1e-6)


def test_non_finite_steps_are_skipped_counted_and_end_as_diverged(tmp_path: Path) -> None:
    hook = RecordingHook()
    final = run(make_config(tmp_path / "nan", "faults.nan_loss_at_steps=[2, 4, 5, 6, 7]",
                            "train.max_consecutive_nonfinite=3"), hooks=[hook])
    assert final["status"] == "diverged" and final["final_step"] == 6
    assert final["num_skipped_steps"] == 4
    assert [loss is None for loss in final["losses"]] == [False, True, False, True, True, True]
    assert [metrics["skipped"] for _, metrics in hook.steps] == [0, 1, 0, 1, 1, 1]
    assert hook.results[0].status == "diverged"


def test_a_step_is_finite_only_when_its_loss_and_its_gradient_norm_both_are() -> None:
    """A NaN or infinite gradient under a finite loss (an overflow in backward) is skipped like a NaN loss."""
    from trainer.precision import NonFiniteGuard

    assert NonFiniteGuard.is_finite(1.0, 0.5)
    for loss, grad_norm in ((1.0, float("nan")), (1.0, float("inf")), (float("nan"), 0.5), (float("nan"), float("nan"))):
        assert not NonFiniteGuard.is_finite(loss, grad_norm), (loss, grad_norm)


def test_a_skipped_step_leaves_the_weights_untouched(tmp_path: Path) -> None:
    trainer = Trainer(make_config(tmp_path / "skip", "faults.nan_loss_at_steps=[2]"))
    try:
        trainer.train_step()
        before = copy.deepcopy(trainer.model.state_dict())
        assert trainer.train_step()["skipped"] == 1.0
        assert all(torch.equal(before[name], value) for name, value in trainer.model.state_dict().items())
        assert trainer.train_step()["skipped"] == 0.0
        assert trainer.guard.num_skipped_steps == 1 and trainer.guard.num_consecutive == 0
        assert not all(torch.equal(before[name], value) for name, value in trainer.model.state_dict().items())
    finally:
        trainer.close()


def test_bf16_numerics_report_against_fp32(tmp_path: Path) -> None:
    """40 steps at lr 3e-3, bf16 autocast vs fp32. Tolerances: per-step loss within 2e-3
    relative and grad-norm ratio within 1 +- 1e-2. bf16 rounds each matmul to ~2^-9 relative,
    but norms, loss and weights are fp32 and the loss averages ~10^4 elements, so measured
    deviations are ~2e-4 (loss) and ~1e-3 (grad norm). The runs must also differ at all:
    identical numbers would mean autocast never engaged."""
    overrides = ("train.steps=40", "optim.lr=3e-3")
    fp32 = run(make_config(tmp_path / "fp32", *overrides))
    bf16 = run(make_config(tmp_path / "bf16", *overrides, "train.precision=bf16"))
    report = compare_runs(fp32, bf16)
    (tmp_path / "numerics_report.json").write_text(json.dumps(report, indent=2))
    assert bf16["precision"]["compute_dtype"] == "bfloat16" and bf16["precision"]["norm_dtype"] == "float32"
    assert report["num_steps"] == 40
    assert report["max_loss_rel_delta"] < 2e-3, report["loss_rel_delta"]
    assert report["max_grad_norm_ratio_deviation"] < 1e-2, report["grad_norm_ratio"]
    assert report["max_loss_rel_delta"] > 0


def test_fp16_uses_a_grad_scaler_and_stays_close_to_fp32(tmp_path: Path) -> None:
    """fp16 autocast + GradScaler over 8 steps; same tolerance and reasoning as bf16 (fp16 has
    more mantissa bits, measured ~1e-5). The scaler's state is part of app_state."""
    fp32 = run(make_config(tmp_path / "fp32"))
    hook, checkpointer = RecordingHook(), MemoryCheckpointer()
    fp16 = run(make_config(tmp_path / "fp16", "train.precision=fp16"), hooks=[hook],
               checkpointer=checkpointer)
    assert fp16["precision"]["grad_scaler"] and fp16["precision"]["compute_dtype"] == "float16"
    assert hook.steps[0][1]["loss_scale"] == 2.0**16
    assert checkpointer.saved[8]["grad_scaler"]["scale"] > 0
    report = compare_runs(fp32, fp16)
    assert 0 < report["max_loss_rel_delta"] < 2e-3


def test_resume_from_app_state_is_bit_identical(tmp_path: Path) -> None:
    straight = run(make_config(tmp_path / "straight", "train.steps=6", "train.dump_final_params=true"))
    first_half = MemoryCheckpointer()
    run(make_config(tmp_path / "first", "train.steps=6", "train.checkpoint_every=3"),
        checkpointer=first_half)
    assert sorted(first_half.saved) == [3, 6] and first_half.closed
    assert first_half.events == ["save 3", "save 6", "wait"]  # the run ends with its last save committed
    assert set(first_half.saved[3]) == {"model", "optimizer", "lr_scheduler", "grad_scaler",
                                        "nonfinite", "data", "train_state"}
    resumed = run(make_config(tmp_path / "resumed", "train.steps=6", "train.dump_final_params=true"),
                  checkpointer=MemoryCheckpointer(first_half.saved, load_step=3))
    assert resumed["losses"] == straight["losses"]  # the first 3 come from the restored train_state
    assert resumed["performance"]["num_steady_steps"] == 1  # only 3 steps ran, 2 were warm-up
    for name, value in final_params(tmp_path / "straight").items():
        assert torch.equal(value, final_params(tmp_path / "resumed")[name]), name


def test_the_train_state_follows_the_data_sources_epoch(tmp_path: Path) -> None:
    # 16 samples, 8 a step: two steps an epoch, so step 5 is the first step of epoch 2.
    checkpointer = MemoryCheckpointer()
    run(make_config(tmp_path / "epochs", "data.num_samples=16", "train.steps=5"), checkpointer=checkpointer)
    assert checkpointer.saved[5]["train_state"]["epoch"] == 2
    assert checkpointer.saved[5]["train_state"]["consumed_samples"] == 40
def test_hooks_get_reduced_metrics_every_step_and_the_result(tmp_path: Path) -> None:
    hook = RecordingHook()
    final = run(make_config(tmp_path / "hooks", "train.steps=3"), hooks=[hook])
    assert [step for step, _ in hook.steps] == [1, 2, 3]
    step, metrics = hook.steps[-1]
    for key in ("loss", "grad_norm", "lr", "skipped", "num_skipped_steps", "step_time_s",
                "samples_per_s", "tokens_per_s", "time_forward_s", "time_data_wait_s"):
        assert key in metrics
    assert metrics["loss"] == final["losses"][-1] and metrics["consumed_samples"] == 24
    assert hook.results[0].status == "completed" and hook.results[0].final_step == 3


def test_sigterm_stops_at_a_step_boundary_saves_and_records_canceled(tmp_path: Path) -> None:
    def send_sigterm(step: int) -> None:
        if step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    checkpointer = MemoryCheckpointer()
    handler_before = signal.getsignal(signal.SIGTERM)
    final = run(make_config(tmp_path / "cancel", "train.steps=50"),
                hooks=[RecordingHook(send_sigterm)], checkpointer=checkpointer)
    # Noticed in step 4's all-reduce, so every rank would stop after the same step.
    assert final["status"] == "canceled" and final["final_step"] == 4
    assert sorted(checkpointer.saved) == [4]
    assert signal.getsignal(signal.SIGTERM) is handler_before  # the trainer's handler is gone


def test_sigterm_on_the_command_line_run_exits_143_with_canceled_record(tmp_path: Path) -> None:
    run_dir = tmp_path / "cli"
    config_path = tmp_path / "exp.yaml"
    config_path.write_text(f"preset: tiny_cpu\ntrain:\n  run_dir: {run_dir}\n  steps: 100000\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer.train", "--config", str(config_path)],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in process.stdout:
            if "step 3/" in line:
                process.send_signal(signal.SIGTERM)
                break
        output = process.communicate(timeout=60)[0]
    finally:
        process.kill()
    final = json.loads((run_dir / "final.json").read_text())
    assert process.returncode == EXIT_CODES["canceled"], output
    assert final["status"] == "canceled" and 3 <= final["final_step"] < 100000


def test_a_failing_step_is_recorded_as_failed_and_reraised(tmp_path: Path) -> None:
    def explode(step: int) -> None:
        if step == 2:
            raise RuntimeError("hook broke")

    with pytest.raises(RuntimeError, match="hook broke"):
        run(make_config(tmp_path / "fail"), hooks=[RecordingHook(explode)])
    final = json.loads((tmp_path / "fail" / "final.json").read_text())
    assert final["status"] == "failed" and final["final_step"] == 2
    assert final["error"] == "RuntimeError: hook broke"


def test_profile_writes_a_trace_and_environment_record(tmp_path: Path, monkeypatch) -> None:
    import ops.lineage

    monkeypatch.setattr(ops.lineage, "git_state", lambda: ("0" * 40, False))  # no git in tests
    final = run(make_config(tmp_path / "prof", "train.steps=5", "train.profile=true",
                            "train.profile_active_steps=1"))
    environment = json.loads((tmp_path / "prof" / "profile" / "environment.json").read_text())
    trace = json.loads((tmp_path / "prof" / "profile" / "trace_rank0.json").read_text())
    assert final["status"] == "completed"
    assert environment["git_commit"] == "0" * 40 and environment["batch_shape"] == [8, 4, 16, 16]
    assert environment["parallelism"] == "none" and environment["torch"] == torch.__version__
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert "aten::scaled_dot_product_attention" in names
    assert sum(name.startswith("ProfilerStep#") for name in names) == 1  # one active step


def test_performance_summary_has_throughput_memory_and_a_verdict(tmp_path: Path) -> None:
    final = run(make_config(tmp_path / "perf", "train.steps=6"))
    performance = final["performance"]
    assert performance["num_steady_steps"] == 4
    assert performance["samples_per_s"] > 0
    assert performance["frames_per_s"] == pytest.approx(performance["samples_per_s"] * 4)
    assert performance["tokens_per_s"] == pytest.approx(performance["samples_per_s"] * 32)
    assert performance["peak_memory_bytes"] > 10 * 2**20
    assert performance["comm_s"] == 0 and performance["verdict"] in ("compute-bound", "input-bound")
    assert set(performance["phase_medians_s"]) == {"data_wait", "host_to_device", "forward",
                                                   "backward", "optimizer", "logging", "checkpoint"}


BUCKETS = "data.buckets=[[4,16,16],[8,16,16],[4,16,24]]"  # 32, 64 and 48 tokens a clip


def step_buckets(config: ExperimentConfig, num_steps: int) -> list[str]:
    """The bucket of each of the run's first steps, read from a replica of its data source."""
    source = SyntheticClips(config.data, world=World(rank=0, world_size=1), local_batch_size=config.data.batch_size)
    return [source.next_batch()["bucket"] for _ in range(num_steps)]


def test_bucketed_run_resumed_mid_epoch_is_bit_identical(tmp_path: Path) -> None:
    config = make_config(tmp_path / "straight", BUCKETS, "train.steps=6", "train.dump_final_params=true")
    assert len(set(step_buckets(config, 6))) == 3  # the run crosses every clip shape
    hook = RecordingHook()
    straight = run(config, hooks=[hook])
    first_half = MemoryCheckpointer()
    run(make_config(tmp_path / "first", BUCKETS, "train.steps=6", "train.checkpoint_every=3"),
        checkpointer=first_half)
    assert first_half.saved[3]["data"]["batching"] == {"policy": "bucketed", "global_batch": 8, "shuffle": True,
                                                       "drop_last": True}
    resumed = run(make_config(tmp_path / "resumed", BUCKETS, "train.steps=6", "train.dump_final_params=true"),
                  checkpointer=MemoryCheckpointer(first_half.saved, load_step=3))
    assert resumed["losses"] == straight["losses"]
    for name, value in final_params(tmp_path / "straight").items():
        assert torch.equal(value, final_params(tmp_path / "resumed")[name]), name
    tokens = {"4x16x16": 32, "8x16x16": 64, "4x16x24": 48}
    for (_, metrics), bucket in zip(hook.steps, step_buckets(config, 6), strict=True):
        assert metrics["tokens_per_s"] == pytest.approx(metrics["samples_per_s"] * tokens[bucket])
    assert straight["data"]["batching"] == "bucketed" and straight["data"]["bucket_counts"] == {
        "4x16x16": 86, "8x16x16": 85, "4x16x24": 85}
    assert straight["performance"]["clip_shapes"] == sorted(set(step_buckets(config, 6)[2:]))


# ---------------------------------------------------------------------------------------------
# The wiring: the DCP checkpointer, what a run starts from, the checkpoint it reports


CHECKPOINTED = ("train.steps=6", "stage.checkpoint=true", "train.checkpoint_every=3")


class CommitProbe:
    """A hook that records, when the run ends, the checkpoint step the run reports (as Pipes does)
    and whether that checkpoint is committed in the run's own folder at that moment."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.reported: list[tuple[int | None, bool]] = []

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def on_train_end(self, result: RunResult) -> None:
        step = committed_step(self.trainer.checkpointer, final_step=result.final_step,
                              run_dir=self.trainer.config.train.run_dir)
        committed = step is not None and (
            store.checkpoints_dir(self.trainer.run_dir) / store.step_dir_name(step) / store.RECORD_NAME).is_file()
        self.reported.append((step, committed))


def wired_run(config: ExperimentConfig) -> tuple[dict[str, Any], Checkpointer, CommitProbe]:
    """What `python -m trainer.train` does, keeping the checkpointer for the test to inspect."""
    trainer = Trainer(config)
    probe = CommitProbe(trainer)
    trainer.hooks.append(probe)
    try:
        with contextlib.ExitStack() as plugins:
            attach_plugins(trainer, config, plugins)
            checkpointer = trainer.checkpointer
            trainer.train()
    finally:
        trainer.close()
    return json.loads((Path(config.train.run_dir) / "final.json").read_text()), checkpointer, probe


def test_the_checkpointer_protocol_is_implemented_in_full() -> None:
    members = {name for name in vars(Checkpointer) if not name.startswith("_")}
    assert members == {"load", "save", "wait", "close", "last_record", "last_load"}
    for implementation in (DcpCheckpointer, ResumeFrom, MemoryCheckpointer):
        instance_only = {"last_record", "last_load"} if implementation is not ResumeFrom else set()
        missing = {name for name in members - instance_only if not hasattr(implementation, name)}
        assert not missing, f"{implementation.__name__} lacks {missing}"


def test_a_drill_resumes_another_runs_checkpoint_bit_identically_and_reports_its_own(tmp_path: Path) -> None:
    source, _, _ = wired_run(make_config(tmp_path / "source", *CHECKPOINTED))
    parent = store.checkpoints_dir(tmp_path / "source") / store.step_dir_name(3)
    drill, checkpointer, probe = wired_run(make_config(
        tmp_path / "drill", *CHECKPOINTED, "stage.async_checkpoint=true", f"stage.resume_from={parent}",
        "stage.resume_run_id=source"))
    assert isinstance(checkpointer, ResumeFrom)
    assert drill["losses"] == source["losses"]
    assert checkpointer.last_load.step == 3 and checkpointer.last_load.checkpoint_dir == parent
    assert checkpointer.last_record["step"] == 6
    assert probe.reported == [(6, True)]  # the async save of step 6 was committed before the run reported it
    # A retry of the drill resumes its own checkpoint, not the other run's again.
    _, checkpointer, probe = wired_run(make_config(
        tmp_path / "drill", *CHECKPOINTED, f"stage.resume_from={parent}", "stage.resume_run_id=source"))
    assert isinstance(checkpointer, DcpCheckpointer) and checkpointer.last_load.step == 6
    assert checkpointer.last_load.checkpoint_dir.parent == store.checkpoints_dir(tmp_path / "drill")


def test_a_run_reports_only_its_own_committed_checkpoint(tmp_path: Path) -> None:
    wired_run(make_config(tmp_path / "source", *CHECKPOINTED))
    # A retry that resumes at its last step saves nothing: the checkpoint it loaded is its own.
    retry, checkpointer, probe = wired_run(make_config(tmp_path / "source", *CHECKPOINTED))
    assert retry["final_step"] == 6 and checkpointer.last_record is None and probe.reported == [(6, True)]
    # A drill resumed at the last step holds only the other run's checkpoint: nothing to report.
    parent = store.checkpoints_dir(tmp_path / "source") / store.step_dir_name(6)
    drill, checkpointer, probe = wired_run(make_config(
        tmp_path / "drill", *CHECKPOINTED, f"stage.resume_from={parent}", "stage.resume_run_id=source"))
    assert drill["final_step"] == 6 and checkpointer.last_load.step == 6 and probe.reported == [(None, False)]
    # Without a checkpointer there is none.
    assert committed_step(None, final_step=6, run_dir=tmp_path / "source") is None


def test_init_from_starts_a_fresh_run_from_the_parents_weights(tmp_path: Path) -> None:
    wired_run(make_config(tmp_path / "parent", *CHECKPOINTED, "train.dump_final_params=true"))
    parent = store.checkpoints_dir(tmp_path / "parent") / store.step_dir_name(6)
    config = make_config(tmp_path / "child", *CHECKPOINTED, f"stage.init_from={parent}",
                         "stage.init_from_run_id=parent")
    trainer = Trainer(config)
    try:
        with contextlib.ExitStack() as plugins:
            attach_plugins(trainer, config, plugins)
            weights = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
            assert isinstance(trainer.checkpointer, DcpCheckpointer) and trainer.train_state.step == 0
            result = trainer.train()
    finally:
        trainer.close()
    for name, value in final_params(tmp_path / "parent").items():
        assert torch.equal(weights[name], value), name
    assert result.status == "completed" and result.final_step == 6  # a fresh run: six steps of its own
