"""Evaluation (trainer/heldout.py, trainer/evaluate.py) and the model protocol (trainer/models/protocol.py):
a validation loss that depends on the weights alone (the same bits twice, on 1 and 2 ranks, under
DDP and FSDP), training that evaluation never changes, samples that decode, non-finite samples that
are never encoded, checkpoints that fail verification refused, and factories that cannot serve named
before launch. The Dagster side (the evaluation assets, the example model through the stages) is in
tests/test_training_assets.py.
Run: python -m pytest tests/test_evaluation.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from helpers import train_wired
from PIL import Image

from ops.publish.paths import REPO_ROOT
from trainer.launch.config import load_config
from trainer.heldout import contact_sheet, write_samples
from trainer.loop import Trainer
from trainer.models.protocol import ModelProtocolError, check_model
from trainer.launch.preflight import preflight
from trainer.launch.config_sections import EvalConfig

TINY = ["preset=tiny_cpu", "train.steps=6"]


def _config(run_dir: Path, *overrides: str):
    return load_config(None, [*TINY, f"train.run_dir={run_dir}", *overrides])


def _train(config) -> tuple[dict, dict[str, torch.Tensor]]:
    trainer = Trainer(config)
    try:
        trainer.train()
        params = {name: value.detach().clone() for name, value in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    return json.loads((Path(config.train.run_dir) / "final.json").read_text()), params


def _python(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    # One intra-op thread in every process, as torchrun gives each rank: the same bits on 1 and 2 ranks
    # hold at the same thread count per process. On Intel CPUs the matmul kernels block by thread
    # count, so a lone process on both cores differs from a rank in the last bits (measured: 1.29219125608
    # against 1.29219125509 on a Xeon; an AMD EPYC happened to agree).
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"OMP_NUM_THREADS": "1"})


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    return _python("-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *args)


# ---------------------------------------------------------------------------------------------
# Evaluation never changes training


def test_evaluation_leaves_training_losses_params_and_order_bit_identical(tmp_path: Path) -> None:
    plain, plain_params = _train(_config(tmp_path / "plain"))
    evaluated, evaluated_params = _train(_config(tmp_path / "evaluated", "train.eval_every=2"))
    assert evaluated["losses"] == plain["losses"] and evaluated["grad_norms"] == plain["grad_norms"]
    assert all(torch.equal(evaluated_params[name], plain_params[name]) for name in plain_params)
    order = [json.loads((tmp_path / name / "samples" / "rank_0.json").read_text())["steps"]
             for name in ("plain", "evaluated")]
    assert order[0] == order[1]
    assert plain["evaluations"] == [] and plain["generated"] is None
    results = evaluated["evaluations"]
    assert [result["step"] for result in results] == [2, 4, 6]
    for result in results:
        assert result["status"] == "ok" and result["split"] == "val" and result["num_samples"] == 16
        assert list(result["loss_t"]) == [f"{(i + 0.5) / 8:.4f}" for i in range(8)]
        assert result["loss"] == pytest.approx(sum(result["loss_t"].values()) / 8, rel=1e-12)
    # Trained weights move the figure: evaluation measures the model, not a constant.
    assert results[0]["loss"] != results[-1]["loss"]


def test_a_resumed_run_with_evaluation_matches_the_uninterrupted_one(tmp_path: Path) -> None:
    """Evaluation inside a run that is stopped and resumed changes neither side of the resume."""

    def run(run_dir: Path, *faults: str) -> dict:
        config = _config(run_dir, "train.eval_every=2", "stage.checkpoint=true", "train.checkpoint_every=2",
                         "stage.mirror=false", *faults)
        train_wired(config)
        return json.loads((run_dir / "final.json").read_text())

    whole = run(tmp_path / "whole")
    stopped = run(tmp_path / "resumed", "faults.sigterm_at_step=4")  # preempted: checkpoint at step 4, then stop
    assert stopped["status"] == "canceled" and stopped["final_step"] == 4 and stopped["generated"] is None
    resumed = run(tmp_path / "resumed")
    assert resumed["losses"] == whole["losses"] and resumed["grad_norms"] == whole["grad_norms"]
    # The stop at step 4 skipped that evaluation; the resume made it up and kept the earlier attempt's.
    assert [r["step"] for r in stopped["evaluations"]] == [2]
    assert [(r["step"], r["loss"]) for r in resumed["evaluations"]] == [(r["step"], r["loss"]) for r in whole["evaluations"]]
    assert [r["step"] for r in whole["evaluations"]] == [2, 4, 6]


# ---------------------------------------------------------------------------------------------
# One checkpoint, one figure: twice, on 1 and 2 ranks, DDP and FSDP


@pytest.fixture(scope="module", autouse=True)
def signing_key():
    """One checkpoint signing key for the module (the default key lives under TRAINYARD_HOME, which
    conftest moves per test): the deployment way, the environment variable."""
    from ops.checkpoints import store

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(store.HMAC_KEY_ENV, "evaluation-module-key")
        yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny run with checkpoints, evaluation every 3 steps and samples at the end (one process)."""
    run_dir = tmp_path_factory.mktemp("evaluation") / "run"
    done = _python("-m", "trainer.train", "--config", "configs/test_tiny.yaml", "--set", f"train.run_dir={run_dir}",
                   "--set", "data.source=synthetic", "--set", "stage.mlflow=false", "--set", "stage.mirror=false",
                   "--set", "train.parallelism=none", "--set", "train.eval_every=3", "--set", "eval.samples=3",
                   # 15 held-out clips: 8 on one rank, 7 on the other, so FSDP's padding forwards are exercised
                   "--set", "eval.synthetic_samples=15")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def _evaluate(trained: Path, out: Path, *overrides: str, ranks: int = 1, checkpoint: str = "step_000006",
              run_id: str = "run") -> subprocess.CompletedProcess:
    args = ["-m", "trainer.evaluate", "--config", "configs/test_tiny.yaml", "--checkpoint",
            str(trained / "checkpoints" / checkpoint), "--run-id", run_id, "--out", str(out),
            *(item for override in ("data.source=synthetic", "stage.mlflow=false", "eval.synthetic_samples=15", *overrides)
              for item in ("--set", override))]
    return _torchrun(*args) if ranks == 2 else _python(*args)


def test_the_validation_loss_is_the_same_bits_twice_and_on_one_and_two_ranks(trained: Path, tmp_path: Path) -> None:
    # Three separate processes (one rank, two under DDP, two under FSDP) must agree bit for bit, so the
    # figure is also the same bits twice: a run of the one-rank case again would add nothing.
    figures = {}
    for name, ranks, overrides in (("once", 1, ["train.parallelism=none"]), ("ddp", 2, ["train.parallelism=ddp"]),
                                   ("fsdp", 2, ["train.parallelism=fsdp"])):
        done = _evaluate(trained, tmp_path / name, *overrides, ranks=ranks)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        record = json.loads((tmp_path / name / "evaluation.json").read_text())
        assert record["checkpoint_step"] == 6 and record["world_size"] == ranks
        figures[name] = record["loss"]
    assert figures["once"]["status"] == "ok" and figures["once"]["num_samples"] == 15
    assert figures["once"] == figures["ddp"] == figures["fsdp"]
    # ... and the same figure the run itself measured at that step.
    final = json.loads((trained / "final.json").read_text())
    assert final["evaluations"][-1]["step"] == 6
    assert final["evaluations"][-1]["loss_t"] == figures["once"]["loss_t"]
    # Another checkpoint, another figure.
    done = _evaluate(trained, tmp_path / "step3", "train.parallelism=none", checkpoint="step_000003")
    assert done.returncode == 0, done.stderr[-3000:]
    earlier = json.loads((tmp_path / "step3" / "evaluation.json").read_text())["loss"]
    assert earlier["loss"] != figures["once"]["loss"]
    assert earlier["loss"] == final["evaluations"][0]["loss"]


def test_samples_decode_with_pyav_to_the_clip_shape_with_their_audio(trained: Path) -> None:
    generated = json.loads((trained / "final.json").read_text())["generated"]
    assert generated["status"] == "ok" and generated["step"] == 6 and len(generated["samples"]) == 3
    keys = [sample["key"] for sample in generated["samples"]]
    assert keys == sorted(keys)  # the held-out clips with the smallest keys
    for sample in generated["samples"]:
        path = Path(generated["dir"]) / sample["path"]
        with av.open(str(path)) as container:
            frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
        assert len(frames) == 8 and frames[0].shape == (64, 64, 3)
        with av.open(str(path)) as container:
            audio_streams = list(container.streams.audio)
            if sample["has_audio"]:
                assert audio_streams and audio_streams[0].codec_context.name == "aac"
                samples = sum(frame.samples for frame in container.decode(audio=0))
                assert samples >= 16_000  # 1 s of conditioning audio (AAC pads to whole frames)
            else:
                assert not audio_streams
        assert Fraction(sample["fps"]) == 8  # 8 frames over 1 s of audio, or eval.fps without audio
    sheet = Image.open(Path(generated["dir"]) / generated["contact_sheet"])
    assert sheet.format == "PNG" and sheet.size == (8 * 66 + 2, 3 * 66 + 2)


def test_non_finite_samples_are_reported_and_not_encoded(tmp_path: Path) -> None:
    out = tmp_path / "samples"
    shape = (4, 16, 16)
    good = torch.zeros(1, *shape, 3)
    bad = good.clone()
    bad[0, 1, 2, 3, 0] = float("nan")
    conditions = [("a", shape, np.zeros(256, np.float32), False, 8.0, 16_000),
                  ("b", shape, np.zeros(256, np.float32), False, 8.0, 16_000)]
    record = write_samples(out, conditions, [bad, good], eval_config=EvalConfig(),
                           to_video=lambda x: ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8))
    assert [sample["status"] for sample in record["samples"]] == ["non_finite", "ok"]
    assert record["samples"][0]["num_non_finite"] == 1 and "path" not in record["samples"][0]
    assert record["status"] == "partial" and record["num_non_finite"] == 1
    assert sorted(path.name for path in out.iterdir()) == ["contact_sheet.png", "sample_01.mp4"]
    everything_bad = write_samples(tmp_path / "all", conditions[:1], [bad], eval_config=EvalConfig(),
                                   to_video=lambda x: x.to(torch.uint8))
    assert everything_bad["status"] == "non_finite" and everything_bad["contact_sheet"] is None


def test_contact_sheet_puts_samples_in_rows_and_time_in_columns() -> None:
    frames = np.stack([np.full((4, 6, 3), value, np.uint8) for value in (10, 20, 30)])
    sheet = np.asarray(Image.open(__import__("io").BytesIO(contact_sheet([frames, frames[:1]]))))
    assert sheet.shape == (2 * 6 + 2, 3 * 8 + 2, 3)
    assert sheet[2, 2, 0] == 10 and sheet[2, 2 + 8, 0] == 20 and sheet[2, 2 + 16, 0] == 30
    assert sheet[8, 2, 0] == 10 and sheet[8, 2 + 8, 0] == 255  # a one-frame sample fills one cell


def test_a_checkpoint_that_fails_verification_is_refused(trained: Path, tmp_path: Path) -> None:
    copy = tmp_path / "run"
    import shutil

    shutil.copytree(trained, copy)
    data_file = max((copy / "checkpoints" / "step_000006").glob("*.distcp"), key=lambda path: path.stat().st_size)
    blob = bytearray(data_file.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data_file.write_bytes(bytes(blob))
    done = _evaluate(copy, tmp_path / "out", "train.parallelism=none")
    assert done.returncode == 1
    assert "refused" in done.stdout and data_file.name in done.stdout
    assert not (tmp_path / "out" / "evaluation.json").exists()
    wrong_run = _evaluate(trained, tmp_path / "wrong", "train.parallelism=none", run_id="another-run")
    assert wrong_run.returncode == 1 and "expected run 'another-run'" in wrong_run.stdout


# ---------------------------------------------------------------------------------------------
# The model protocol and model.factory


def test_a_factory_path_that_does_not_import_is_named_before_launch(tmp_path: Path) -> None:
    with pytest.raises(ModelProtocolError, match="'no_such_package.models:build'.*does not import"):
        preflight(_config(tmp_path, "model.factory=no_such_package.models:build"), world_size=1)
    with pytest.raises(ModelProtocolError, match="has no 'nothing_here'"):
        preflight(_config(tmp_path, "model.factory=examples.image_model:nothing_here"), world_size=1)
    with pytest.raises(ValueError, match="must look like 'package.module:function'"):
        _config(tmp_path, "model.factory=examples/image_model.py")


def test_a_factory_that_returns_no_protocol_is_named_with_what_it_lacks(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "half_model.py").write_text(
        "import torch\n"
        "class Half(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])\n"
        "    def forward(self, video, audio, has_audio, noise, t):\n"
        "        return noise.mean()\n"
        "def build(config):\n"
        "    return Half()\n"
        "def not_a_module(config):\n"
        "    return 'a string'\n"
        "def broken(config):\n"
        "    raise RuntimeError('weights file missing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModelProtocolError) as refused:
        preflight(_config(tmp_path, "model.factory=half_model:build"), world_size=1)
    message = str(refused.value)
    for missing in ("init_weights", "noise_shape", "predict_velocity", "to_video", "flops_per_sample"):
        assert f"no `{missing}`" in message
    assert "no `forward`" not in message and "blocks" not in message
    with pytest.raises(ModelProtocolError, match="not a torch.nn.Module"):
        preflight(_config(tmp_path, "model.factory=half_model:not_a_module"), world_size=1)
    with pytest.raises(ModelProtocolError, match="raised while building the model: RuntimeError: weights file missing"):
        preflight(_config(tmp_path, "model.factory=half_model:broken"), world_size=1)
    # The trainer itself refuses it as a config error (exit 2), naming the factory, before a step.
    config = tmp_path / "exp.yaml"
    config.write_text("preset: tiny_cpu\nmodel:\n  factory: half_model:build\n")
    done = subprocess.run([sys.executable, "-m", "trainer.train", "--config", str(config), "--set",
                           f"train.run_dir={tmp_path / 'run'}"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "half_model:build" in done.stdout and "no `noise_shape`" in done.stdout


def test_the_builtin_and_example_models_meet_the_protocol(tmp_path: Path) -> None:
    from examples.image_model import build as build_image
    from trainer.models.video import build as build_video

    config = _config(tmp_path)
    assert check_model(build_video(config)) == [] and check_model(build_image(config)) == []
    assert check_model(torch.nn.Linear(2, 2)) == [
        "no `blocks` nn.ModuleList (the layers parallelize() wraps)", "no `init_weights` method",
        "no `noise_shape` method", "no `predict_velocity` method", "no `to_video` method",
        "no `flops_per_sample` method"]


def test_the_builtin_models_flops_are_the_performance_models(tmp_path: Path) -> None:
    from trainer.models.video import build, flops_per_step

    config = _config(tmp_path)
    model = build(config)
    for shape in ((4, 16, 16), (8, 16, 32)):
        assert 8 * model.flops_per_sample(shape) == flops_per_step(config.model, (8, *shape))


def test_the_example_model_trains_resumes_bit_identically_and_evaluates(tmp_path: Path) -> None:
    """examples/image_model.py through the trainer's own paths: no platform change, the same guarantees."""
    overrides = ["--set", "data.source=synthetic", "--set", "stage.mlflow=false", "--set", "stage.mirror=false",
                 "--set", "train.parallelism=none", "--set", "train.dump_final_params=true"]

    def train(run_dir: Path, *extra: str) -> dict:
        done = _python("-m", "trainer.train", "--config", "configs/example_image.yaml", "--set",
                       f"train.run_dir={run_dir}", *overrides, *extra)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return json.loads((run_dir / "final.json").read_text())

    whole = train(tmp_path / "whole", "--set", "train.eval_every=3")
    preempted = _python("-m", "trainer.train", "--config", "configs/example_image.yaml", "--set",
                        f"train.run_dir={tmp_path / 'resumed'}", *overrides, "--set", "faults.sigterm_at_step=4")
    assert preempted.returncode == 143, preempted.stdout[-3000:] + preempted.stderr[-3000:]
    resumed = train(tmp_path / "resumed", "--set", "train.eval_every=3")
    assert resumed["losses"] == whole["losses"] and whole["num_params"] > 0
    params = [torch.load(tmp_path / name / "final_params.pt") for name in ("whole", "resumed")]
    assert all(torch.equal(params[0][name], params[1][name]) for name in params[0])
    assert whole["evaluations"][-1]["status"] == "ok" and whole["evaluations"][-1]["loss_bucket"]
    sample = whole["generated"]["samples"][0]
    assert sample["status"] == "ok" and sample["frames"] == 1  # an image model: one-frame clips
    with av.open(str(Path(whole["generated"]["dir"]) / sample["path"])) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 1 and frames[0].shape == (64, 64, 3)
    assert whole["performance"]["flops_per_step"] > 0


# ---------------------------------------------------------------------------------------------
# What a hostile review found (each failed before its fix)


def test_rank_0_samples_after_the_final_barrier_so_no_peer_times_out_waiting(tmp_path: Path) -> None:
    """Under DDP rank 0 integrates the samples alone: with a 2 s collective timeout and sampling that
    takes longer, the other rank must not be left in a collective (it timed out in probe_comm_s)."""
    run_dir = tmp_path / "run"
    done = _torchrun("-m", "trainer.train", "--config", "configs/test_tiny.yaml", "--set", f"train.run_dir={run_dir}",
                     "--set", "data.source=synthetic", "--set", "stage.mlflow=false", "--set", "stage.mirror=false",
                     "--set", "stage.checkpoint=false", "--set", "train.parallelism=ddp", "--set", "train.steps=2",
                     "--set", "train.eval_every=2", "--set", "train.collective_timeout_s=2",
                     "--set", "eval.sample_steps=2000", "--set", "eval.samples=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    final = json.loads((run_dir / "final.json").read_text())
    assert final["status"] == "completed" and final["generated"]["status"] == "ok"
    assert final["generated"]["steps"] == 2000 and len(final["generated"]["samples"]) == 2


def test_a_split_name_that_would_break_metric_names_is_refused(tmp_path: Path) -> None:
    for split in ("a,b", "", "../x", "val loss"):
        with pytest.raises(ValueError, match="split must be a split name"):
            _config(tmp_path, f"eval.split={split}")
    assert _config(tmp_path, "eval.split=holdout-2").eval.split == "holdout-2"


def test_a_bucket_without_held_out_clips_on_a_rank_is_skipped_not_a_crash(tmp_path: Path) -> None:
    buckets = 'data.buckets=[[4, 16, 16], [4, 16, 32]]'
    config = _config(tmp_path / "run", buckets, "train.eval_every=3", "eval.max_samples=1", "eval.samples=1",
                     "train.steps=3")
    final, _ = _train(config)
    result = final["evaluations"][-1]
    assert result["status"] == "ok" and result["num_samples"] == 1 and list(result["loss_bucket"]) == ["4x16x16"]


def test_evaluation_leaves_the_running_statistics_of_a_norm_untouched(tmp_path: Path, monkeypatch) -> None:
    """A model with BatchNorm: evaluation runs it in eval mode and restores every buffer, so the
    checkpointed state is bit-identical with and without evaluation."""
    (tmp_path / "bn_model.py").write_text(
        "import torch\n"
        "from examples.image_model import StillFrameFlow\n"
        "class WithNorm(StillFrameFlow):\n"
        "    def __init__(self, **kwargs):\n"
        "        super().__init__(**kwargs)\n"
        "        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, self.channels, 3, padding=1),\n"
        "                                        torch.nn.BatchNorm2d(self.channels))\n"
        "def build(config):\n"
        "    return WithNorm(channels=config.model.dim, depth=config.model.num_layers)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = ["model.factory=bn_model:build", "model.dim=8", "model.num_layers=1", "train.steps=4"]
    plain, plain_state = _train(_config(tmp_path / "plain", *overrides))
    evaluated, evaluated_state = _train(_config(tmp_path / "evaluated", *overrides, "train.eval_every=2"))
    assert any("running_mean" in name for name in plain_state)
    assert evaluated["losses"] == plain["losses"]
    assert all(torch.equal(evaluated_state[name], plain_state[name]) for name in plain_state)


def test_a_hook_from_before_on_evaluation_does_not_end_the_run(tmp_path: Path) -> None:
    class OldHook:  # the Hook protocol as it was: no on_evaluation
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, step, metrics) -> None:
            self.steps.append(step)

        def on_train_end(self, result) -> None:
            pass

    hook = OldHook()
    config = _config(tmp_path / "run", "train.eval_every=3", "eval.samples=1")
    trainer = Trainer(config, hooks=[hook])
    try:
        result = trainer.train()
    finally:
        trainer.close()
    assert result.status == "completed" and hook.steps == list(range(1, 7))


def test_naming_the_builtin_factory_is_the_builtin_model(tmp_path: Path) -> None:
    from trainer.wiring import model_fingerprint

    named = _config(tmp_path, "model.factory=trainer.models.video:build")
    assert named.model.factory == "" and model_fingerprint(named) == model_fingerprint(_config(tmp_path))


def test_the_memory_estimate_of_a_factory_model_measures_its_activations(tmp_path: Path) -> None:
    from examples.image_model import build
    from trainer.launch.memory import estimate_memory

    config = load_config("configs/example_image.yaml", [f"train.run_dir={tmp_path}", "data.source=synthetic"])
    whole, half = estimate_memory(config, 1), estimate_memory(config, 2)  # micro-batch 4, then 2
    assert whole.num_params == sum(p.numel() for p in build(config).parameters())
    assert whole.params_bytes == 4 * whole.num_params
    # At least the stem's and blocks' feature maps: 16 channels x 64 x 64 in fp32 per conv, per sample.
    assert whole.activations_bytes >= 4 * (2 * 2 + 1) * 16 * 64 * 64 * 4
    assert whole.activations_bytes == pytest.approx(2 * half.activations_bytes, rel=1e-6)


def test_each_synthetic_split_is_its_own_set_of_clips(tmp_path: Path) -> None:
    losses = {}
    for split in ("val", "test"):
        final, _ = _train(_config(tmp_path / split, "train.steps=2", "train.eval_every=2", f"eval.split={split}",
                                  "eval.samples=0"))
        losses[split] = final["evaluations"][-1]["loss"]
    assert losses["val"] != losses["test"]  # the same weights (same seed), other clips
