"""Tests of trainer/launch/config.py and trainer/launch/memory.py: typed loading, unknown keys, contradictions
(bucketed clip shapes included) and the memory budget are refused in this process, before any
training process starts.

Run: python -m pytest tests/test_trainer_config.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ops.publish.paths import REPO_ROOT
from trainer.launch.config import DataConfig, ExperimentConfig, load_config, tiny_cpu
from trainer.launch.memory import MemoryBudgetExceeded, estimate_memory_bytes
from trainer.launch.preflight import preflight
from trainer.launch.memory import estimate_memory
from trainer.launch.config_sections import one_b
from trainer.models.video import count_params
from trainer.precision import UnsupportedPrecision, autocast_supported, check_supported
from trainer.train import CONFIG_ERROR_EXIT, main


def tiny(*overrides: str, run_dir: Path | str = "unused") -> ExperimentConfig:
    return load_config(None, ["preset=tiny_cpu", f"train.run_dir={run_dir}", *overrides])


def write_yaml(path: Path, content: dict) -> Path:
    path.write_text(yaml.safe_dump(content))
    return path


def test_yaml_with_preset_and_overrides_builds_typed_config(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "exp.yaml", {
        "preset": "tiny_cpu", "name": "exp",
        "train": {"steps": 3, "run_dir": str(tmp_path / "run")},
        "optim": {"lr": "1e-3", "betas": [0.8, 0.9]},  # YAML 1.1 reads 1e-3 as a string
    })
    config = load_config(path, ["train.grad_accum=2", "name=123", "train.max_memory_bytes=2e9",
                                "faults.nan_loss_at_steps=[2, 3]"])
    assert config.train.steps == 3 and config.train.grad_accum == 2
    assert config.optim.lr == 1e-3 and config.optim.betas == (0.8, 0.9)
    assert config.name == "123"  # a str field keeps the override text as is
    assert config.train.max_memory_bytes == 2_000_000_000
    assert config.faults.nan_loss_at_steps == [2, 3]
    assert config.model == tiny_cpu().model


def test_unknown_keys_are_rejected_by_dotted_name(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "exp.yaml", {"preset": "tiny_cpu", "train": {"stepz": 3},
                                             "model": {"dimm": 8}, "extra": 1})
    with pytest.raises(ValueError) as error:
        load_config(path, ["optim.lrr=0.1"])
    message = str(error.value)
    for key in ("train.stepz", "model.dimm", "extra", "optim.lrr"):
        assert key in message
    assert "train takes: steps" in message


@pytest.mark.parametrize(("override", "needle"), [
    ("train.precision=fp8", "precision must be one of"),
    ("train.parallelism=tp", "parallelism must be one of"),
    ("train.steps=abc", "train.steps must be int"),
    ("train.steps=0", "steps must be >= 1"),
    ("train.deterministic=1", "train.deterministic must be bool"),
    ("data.height=18", "not divisible by patch size"),
    ("data.audio_samples=100", "multiple of model.audio_frame_samples"),
    ("train.grad_accum=3", "not divisible by train.grad_accum 3"),
    ("model.num_heads=5", "not divisible by num_heads"),
    ("faults.exit_rank=1", "set exit_rank and exit_at_step together"),
    ("data.buckets=[[4,16,16],[4,16,18]]", r"data.buckets: clip shape \(4, 16, 18\) is not divisible by patch size"),
    ("data.buckets=[[4,16,16],[4,16,16]]", "buckets must be distinct"),
    ("data.buckets=[[4,16]]", r"each of buckets must be \[frames, height, width\]"),
    ("data.batching=padded", "batching must be one of"),
])
def test_bad_values_are_refused_with_a_plain_message(override: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        tiny(override)


BUCKETS = "data.buckets=[[4,16,16],[8,16,16],[4,16,24]]"


@pytest.mark.parametrize(("overrides", "needle"), [
    (("model.pos_embed=learned",), r"pos_embed 'learned' has one embedding per token of the reference clip "
                                   r"\(4, 16, 16\) only"),
    (("data.batching=fixed_shape",), "'fixed_shape' would mix the clip shapes"),
    (("data.audio_samples=320", "data.buckets=[[4,16,16],[2,16,16]]"),
     r"clips \[2, 16, 16\] carry 160 audio samples .* not a multiple of model.audio_frame_samples 64"),
    (("data.num_samples=20",), "at most 7 samples a bucket, fewer than one global batch"),
])
def test_bucketed_data_the_model_or_the_sampler_cannot_serve_is_refused(overrides, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        tiny(BUCKETS, *overrides)


def test_bucket_audio_that_is_not_whole_samples_is_refused() -> None:
    with pytest.raises(ValueError, match=r"bucket \[1, 16, 16\]: audio_samples 250 x 1 / clip_frames 4"):
        DataConfig(batch_size=8, clip_frames=4, height=16, width=16, audio_samples=250, buckets=[[1, 16, 16]])


def test_memory_estimate_uses_the_bucket_with_the_most_tokens() -> None:
    bucketed = estimate_memory(tiny(BUCKETS), 1)  # 4x16x16: 32 tokens, 8x16x16: 64, 4x16x24: 48
    longest = estimate_memory(tiny("data.clip_frames=8", "data.audio_samples=512"), 1)
    assert bucketed.activations_bytes == longest.activations_bytes
    assert bucketed.activations_bytes > estimate_memory(tiny(), 1).activations_bytes
    assert bucketed.num_params == longest.num_params  # sincos: no weight depends on the clip shape


def test_missing_required_keys_are_named(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "exp.yaml", {"name": "x", "train": {"steps": 1}})
    with pytest.raises(ValueError, match="missing required config keys: model, data, train.run_dir"):
        load_config(path)


def test_fp16_with_fsdp_is_refused() -> None:
    with pytest.raises(ValueError, match="'fp16' with parallelism 'fsdp'"):
        tiny("train.precision=fp16", "train.parallelism=fsdp")


def test_secret_env_reference_must_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINYARD_TEST_STORE_TOKEN", "from-env-value")
    assert tiny("data.storage_token=${env:TRAINYARD_TEST_STORE_TOKEN}").data.storage_token == "from-env-value"
    monkeypatch.delenv("TRAINYARD_TEST_STORE_TOKEN")
    with pytest.raises(ValueError, match="TRAINYARD_TEST_STORE_TOKEN, which is not set"):
        tiny("data.storage_token=${env:TRAINYARD_TEST_STORE_TOKEN}")


def test_type_errors_never_echo_a_secret_value(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "exp.yaml", {"preset": "tiny_cpu", "train": {"run_dir": "x"},
                                              "data": {"storage_token": ["hunter2-secret"]}})
    with pytest.raises(ValueError) as error:
        load_config(path)
    assert "hunter2-secret" not in str(error.value) and "data.storage_token" in str(error.value)


def test_preflight_refuses_a_batch_that_does_not_split_over_ranks() -> None:
    config = tiny("train.parallelism=ddp", "train.grad_accum=2")
    assert preflight(config, world_size=2).micro_batch_size == 2
    with pytest.raises(ValueError, match=r"data.batch_size=8 is not divisible by world_size 3 x "
                                         r"train.grad_accum 2 = 6"):
        preflight(config, world_size=3)


def test_preflight_refuses_single_process_parallelism_on_many_ranks_but_allows_fsdp_on_one() -> None:
    with pytest.raises(ValueError, match="parallelism 'none' with world_size 2"):
        preflight(tiny(), world_size=2)
    assert preflight(tiny("train.parallelism=fsdp"), world_size=1).world_size == 1


def test_preflight_refuses_fault_on_a_rank_that_does_not_exist() -> None:
    config = tiny("train.parallelism=ddp", "faults.exit_rank=3", "faults.exit_at_step=1")
    with pytest.raises(ValueError, match="faults name rank 3, but world_size is 2"):
        preflight(config, world_size=2)


def test_precision_support_is_probed_not_assumed() -> None:
    with pytest.raises(ValueError, match="precision must be one of"):
        check_supported("fp8", "cpu")
    for policy, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        supported = autocast_supported("cpu", dtype)
        if supported:
            check_supported(policy, "cpu")
        else:
            with pytest.raises(UnsupportedPrecision, match=f"precision '{policy}'"):
                check_supported(policy, "cpu")


def test_precision_the_device_cannot_run_is_refused_at_preflight(monkeypatch: pytest.MonkeyPatch) -> None:
    import trainer.precision

    monkeypatch.setattr(trainer.precision, "autocast_supported", lambda device_type, dtype: False)
    with pytest.raises(UnsupportedPrecision, match="precision 'fp16' needs autocast to torch.float16 "
                                                   "on 'cpu'.*use 'fp32' or 'bf16'"):
        preflight(tiny("train.precision=fp16"), world_size=1)
    assert preflight(tiny("train.precision=fp32"), world_size=1).device_type == "cpu"


def test_memory_over_budget_is_refused_with_the_numbers() -> None:
    config = tiny("train.max_memory_bytes=1000000")
    estimate = estimate_memory_bytes(config, 1)
    assert estimate > 1_000_000
    with pytest.raises(MemoryBudgetExceeded, match=r"exceeds train.max_memory_bytes 976.56 KiB"):
        preflight(config, world_size=1)
    assert preflight(tiny(f"train.max_memory_bytes={estimate}"), world_size=1).memory.total_bytes == estimate


def test_memory_estimate_scales_with_sharding_batch_and_checkpointing() -> None:
    config = tiny("model.dim=128", "train.parallelism=fsdp", "data.batch_size=16")
    alone, sharded = estimate_memory(config, 1), estimate_memory(config, 4)
    assert sharded.params_bytes * 4 == alone.params_bytes
    assert sharded.optimizer_bytes * 4 == alone.optimizer_bytes
    assert sharded.activations_bytes * 4 == alone.activations_bytes  # micro-batch 16 -> 4
    checkpointed = estimate_memory(tiny("model.dim=128", "data.batch_size=16",
                                        "train.activation_checkpointing=true"), 1)
    assert checkpointed.activations_bytes < estimate_memory(tiny("model.dim=128", "data.batch_size=16"), 1).activations_bytes


def test_memory_estimate_of_1b_counts_16_bytes_per_parameter() -> None:
    config = tiny()
    config.model = one_b()
    config.data.height = config.data.width = 64
    config.data.clip_frames = 8
    config.data.audio_samples = 640
    estimate = estimate_memory(config, 1)
    assert estimate.num_params == count_params(one_b(), video_shape=(8, 64, 64))
    assert estimate.params_bytes + estimate.grads_bytes + estimate.optimizer_bytes == 16 * estimate.num_params


def test_cli_preflight_refuses_before_anything_starts(tmp_path: Path, capsys) -> None:
    path = write_yaml(tmp_path / "exp.yaml", {"preset": "tiny_cpu",
                                              "train": {"run_dir": str(tmp_path / "run"),
                                                        "parallelism": "ddp"}})
    assert main(["--config", str(path), "--preflight", "3"]) == CONFIG_ERROR_EXIT
    assert "not divisible by world_size 3" in capsys.readouterr().out
    assert main(["--config", str(path), "--preflight", "2"]) == 0
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert plan["local_batch_size"] == 4
    assert not (tmp_path / "run").exists()  # nothing was built or written


def test_cli_unknown_key_exits_with_config_error_and_no_run_dir(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "exp.yaml", {"preset": "tiny_cpu",
                                              "train": {"run_dir": str(tmp_path / "run"), "bogus": 1}})
    result = subprocess.run([sys.executable, "-m", "trainer.train", "--config", str(path)],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == CONFIG_ERROR_EXIT
    assert "unknown config keys: train.bogus" in result.stdout
    assert not (tmp_path / "run").exists()


def test_preflight_refuses_checkpoints_in_the_store_without_a_store(monkeypatch) -> None:
    monkeypatch.delenv("TRAINYARD_CHECKPOINT_ROOT", raising=False)  # conftest's data root is a folder
    config = tiny("stage.checkpoint=true", "stage.checkpoint_io=store")
    with pytest.raises(ValueError, match="TRAINYARD_CHECKPOINT_ROOT nor a data root URL"):
        preflight(config, world_size=1)
    monkeypatch.setenv("TRAINYARD_CHECKPOINT_ROOT", "s3://trainyard/checkpoints")
    assert preflight(config, world_size=1).world_size == 1
