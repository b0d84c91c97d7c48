"""What makes the trainer fast and honest on its first GPU, held on CPU (issue 18):

- precision 'auto' and deterministic 'auto' resolve per device (bf16 / off on CUDA, fp32 / on
  on CPU) and the run records what applied; TF32 and the determinism flags are set and restored;
- the residual stream stays in the compute dtype under autocast (an fp32 position table would
  promote it), or in fp32 when asked, and both are the same arithmetic under fp32;
- a named attention backend is probed before the first step: one the device cannot run is a
  clear error, one it can is used and recorded;
- torch.compile of the blocks has no graph break across clip shapes and batch sizes (the empty
  micro-batch included), and a compiled run trains to the eager run's losses;
- one collective per step carries the loss, the stop flag and (FSDP) the gradient norm, and
  gives the norm torch's clip_grad_norm_ gives;
- device 'cuda' on a CPU-only torch is an error that says what to install, not a CPU run.

GPU-only behaviour (bf16 autocast by default, fused AdamW, pinned batches, NCCL) is what
benchmarks/gpu_check.py measures on a lent machine.
Run: python -m pytest tests/test_gpu_readiness.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_trainer_loop import make_config, run

from ops.loading.sampling import World
from trainer.loop import Trainer
from trainer.models.video import DiTBlock, VideoFlowModel, sample_noise_and_time
from trainer.parallel import (
    Distributed, clip_and_reduce, resolve_deterministic, resolve_device_type, restore_determinism, seed_everything,
)
from trainer.precision import (
    Precision, UnsupportedAttentionBackend, probe_attention, resolve_precision, restore_tf32, set_tf32,
)
from trainer.launch.preflight import preflight
from trainer.launch.config_sections import tiny

BUCKETS = "data.buckets=[[4,16,16],[8,16,16],[4,16,24]]"


def test_precision_auto_is_fp32_on_cpu_and_a_named_policy_is_kept() -> None:
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16" and resolve_precision("fp32", "cuda") == "fp32"
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("fp8", "cpu")
    precision = Precision("auto", device_type="cpu")
    assert precision.describe()["policy"] == "fp32" and precision.describe()["requested_policy"] == "auto"


def test_precision_auto_is_bf16_where_cuda_has_it(monkeypatch) -> None:
    """The CUDA branch of the rule, with the probe answering as an H200 would."""
    import trainer.precision as precision

    monkeypatch.setattr(precision, "autocast_supported", lambda device_type, dtype: device_type == "cuda")
    assert precision.resolve_precision("auto", "cuda") == "bf16"
    monkeypatch.setattr(precision, "autocast_supported", lambda device_type, dtype: False)
    assert precision.resolve_precision("auto", "cuda") == "fp32"  # a GPU without bf16


def test_deterministic_auto_is_what_the_device_can_honour() -> None:
    assert resolve_deterministic(None, "cpu") is True
    assert resolve_deterministic(None, "cuda") is False
    assert resolve_deterministic(True, "cuda") is True and resolve_deterministic(False, "cpu") is False


def test_deterministic_mode_is_strict_and_restored() -> None:
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    snapshot = seed_everything(0, 0, deterministic=True, device_type="cpu")
    try:
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # a warning would hide nondeterminism
    finally:
        restore_determinism(snapshot)
    assert (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) == before


def test_tf32_flags_are_set_and_restored() -> None:
    previous = set_tf32(True)
    try:
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        restore_tf32(previous)
    assert torch.backends.cuda.matmul.allow_tf32 == previous.matmul


def test_a_cpu_run_records_the_numerics_that_applied(tmp_path: Path) -> None:
    final = run(make_config(tmp_path))
    assert final["precision"]["policy"] == "fp32" and final["precision"]["requested_policy"] == "auto"
    assert final["launch_plan"]["precision"] == "fp32"
    kernels = final["kernels"]
    assert kernels["deterministic"] is True and kernels["deterministic_requested"] is None
    assert kernels == kernels | {"tf32": False, "fused_adamw": False, "pin_memory": False, "attention_backend": "auto",
                                 "residual_dtype": "float32", "sync_phases": False}


def _stream_dtypes(model: VideoFlowModel, *, dtype: torch.dtype | None) -> set[torch.dtype]:
    """The dtype of the residual stream entering each block, for one forward under autocast (or none)."""
    seen: set[torch.dtype] = set()
    hooks = [block.register_forward_pre_hook(lambda module, args: seen.add(args[0].dtype)) for block in model.blocks]
    video = torch.randint(0, 255, (2, 4, 16, 16, 3), dtype=torch.uint8)
    noise, t = sample_noise_and_time(["a", "b"], seed=0, step=1, video_shape=(4, 16, 16), device=torch.device("cpu"))
    audio = torch.zeros(2, 64)
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = model(video, audio, torch.ones(2, dtype=torch.bool), noise, t)
    for hook in hooks:
        hook.remove()
    return seen | {loss.dtype}


def test_the_residual_stream_stays_in_the_compute_dtype_unless_asked() -> None:
    torch.manual_seed(0)
    compute = VideoFlowModel(tiny(), video_shape=(4, 16, 16))
    compute.init_weights(seed=0)
    assert _stream_dtypes(compute, dtype=torch.bfloat16) == {torch.bfloat16, torch.float32}  # stream bf16, loss fp32
    wide = VideoFlowModel(tiny(), video_shape=(4, 16, 16), residual_fp32=True)
    wide.load_state_dict(compute.state_dict())  # no weight depends on it: the same checkpoint loads
    assert _stream_dtypes(wide, dtype=torch.bfloat16) == {torch.float32}
    # Under fp32 the two are the same arithmetic, bit for bit.
    video = torch.randint(0, 255, (2, 4, 16, 16, 3), dtype=torch.uint8)
    noise, t = sample_noise_and_time(["a", "b"], seed=0, step=1, video_shape=(4, 16, 16), device=torch.device("cpu"))
    args = (video, torch.zeros(2, 64), torch.ones(2, dtype=torch.bool), noise, t)
    assert torch.equal(compute(*args), wide(*args))


def test_the_residual_dtype_is_recorded_and_trains(tmp_path: Path) -> None:
    bf16 = run(make_config(tmp_path / "bf16", "train.precision=bf16", "train.steps=3"))
    wide = run(make_config(tmp_path / "wide", "train.precision=bf16", "train.residual_dtype=fp32", "train.steps=3"))
    assert bf16["kernels"]["residual_dtype"] == "bfloat16" and wide["kernels"]["residual_dtype"] == "float32"
    assert bf16["status"] == wide["status"] == "completed"
    assert bf16["losses"] != wide["losses"]  # the choice changes the arithmetic under bf16
    torch.testing.assert_close(bf16["losses"], wide["losses"], rtol=2e-2, atol=0)  # and only by rounding


def test_an_attention_backend_the_device_cannot_run_is_refused_before_the_first_step(tmp_path: Path) -> None:
    probe_attention("math", device=torch.device("cpu"), dtype=torch.float32, head_dim=16)
    with pytest.raises(UnsupportedAttentionBackend, match="'efficient' cannot run on cpu with float32 and head_dim 16"):
        probe_attention("efficient", device=torch.device("cpu"), dtype=torch.float32, head_dim=16)
    with pytest.raises(UnsupportedAttentionBackend, match="'cudnn' cannot run"):
        run(make_config(tmp_path / "refused", "train.attention_backend=cudnn"))
    assert not (tmp_path / "refused" / "final.json").exists() or json.loads(
        (tmp_path / "refused" / "final.json").read_text())["final_step"] == 0


def _attention_ops(config) -> set[str]:
    """The aten attention kernels one training step of config runs (forward and backward)."""
    trainer = Trainer(config)
    try:
        with torch.profiler.profile() as profiler:
            trainer.train_step()
    finally:
        trainer.close()
    return {event.key for event in profiler.key_averages() if event.key.startswith("aten::_scaled_dot_product")}


@pytest.mark.parametrize(("backend", "kernel"), [("auto", "flash_attention_for_cpu"), ("flash", "flash_attention_for_cpu"),
                                                 ("math", "attention_math")])
def test_the_named_attention_backend_is_the_kernel_that_runs(backend: str, kernel: str, tmp_path: Path) -> None:
    ops = _attention_ops(make_config(tmp_path, f"train.attention_backend={backend}"))
    assert ops and all(kernel in op for op in ops), ops


def test_a_named_attention_backend_is_recorded(tmp_path: Path) -> None:
    final = run(make_config(tmp_path, "train.steps=2", "train.attention_backend=math"))
    assert final["kernels"]["attention_backend"] == "math" and final["status"] == "completed"


@pytest.mark.parametrize(("batch", "tokens"), [(2, 32), (2, 64), (3, 48), (1, 32), (0, 32)])
def test_a_compiled_block_has_no_graph_break(batch: int, tokens: int) -> None:
    """Every clip shape (token count) and batch size a run meets, the empty micro-batch included."""
    torch._dynamo.reset()
    block = DiTBlock(tiny())
    x, modulation = torch.randn(batch, tokens, 64), torch.randn(batch, 6, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        explanation = torch._dynamo.explain(block)(x, modulation)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.slow
def test_a_compiled_run_trains_across_buckets_to_the_eager_losses(tmp_path: Path) -> None:
    """train.compile=true (fullgraph: a graph break would raise) over three clip shapes."""
    torch._dynamo.reset()
    eager = run(make_config(tmp_path / "eager", BUCKETS, "train.steps=3"))
    compiled = run(make_config(tmp_path / "compiled", BUCKETS, "train.steps=3", "train.compile=true"))
    assert compiled["status"] == "completed" and compiled["kernels"]["compile"] is True
    assert len(compiled["data"]["clip_shapes_trained"]) >= 2  # recompiled for another shape, no graph break
    torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0)


def test_one_collective_gives_torchs_norm_and_the_summed_totals() -> None:
    """No process group: clip_and_reduce must equal clip_grad_norm_ and return the totals as floats."""
    torch.manual_seed(0)
    reference, model = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    model.load_state_dict(reference.state_dict())
    reference(torch.randn(4, 8)).pow(2).sum().backward()
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        param.grad = ref.grad.clone()
    expected = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1))
    distributed = Distributed(world=World(rank=0, world_size=1), device=torch.device("cpu"), backend=None)
    norm, (loss_sum, stop) = clip_and_reduce(model, 0.1, [torch.tensor(2.5), 1.0], distributed=distributed)
    assert norm == expected and (loss_sum, stop) == (2.5, 1.0)
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(param.grad, ref.grad)  # clipped alike


def test_cuda_on_a_cpu_only_torch_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if torch.version.cuda is None:
        with pytest.raises(ValueError, match=r"CPU-only build; install the CUDA build: make install TORCH_INDEX="):
            resolve_device_type("cuda")
    else:
        with pytest.raises(ValueError, match="sees no CUDA device"):
            resolve_device_type("cuda")
    with pytest.raises(ValueError, match="device 'cuda' requested"):
        preflight(make_config(Path("unused"), "train.device=cuda"), world_size=1)


def test_ddp_is_built_with_the_keyword_the_installed_torch_takes(monkeypatch) -> None:
    """torch 2.13 renamed broadcast_buffers to forward_sync_buffers; a lent GPU machine's 2.11 knows only the old one."""
    import trainer.parallel as parallel

    assert parallel._no_forward_buffer_sync() == {"forward_sync_buffers": False}  # this torch (2.13)

    def old_init(self, module, device_ids=None, broadcast_buffers=True, gradient_as_bucket_view=False) -> None: ...

    monkeypatch.setattr(parallel.DistributedDataParallel, "__init__", old_init)
    assert parallel._no_forward_buffer_sync() == {"broadcast_buffers": False}
