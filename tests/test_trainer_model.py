"""Tests of trainer/models/video.py: sizes (1b counted on the meta device), patching, deterministic init,
per-sample loss independence (what makes gradient accumulation exact), audio masking, FLOPs, and
clip shapes other than the reference one (bucketed data).

Run: python -m pytest tests/test_trainer_model.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from trainer.launch.config_sections import MODEL_PRESETS, one_b, tiny
from trainer.models.video import (VideoFlowModel, count_params, flops_per_step, flops_per_token, num_params, patchify,
                                  per_token_matmul_params, sample_noise_and_time, sincos_3d, unpatchify)

TINY_SHAPE = (4, 16, 16)
CPU = torch.device("cpu")


def tiny_model(seed: int = 0) -> VideoFlowModel:
    model = VideoFlowModel(tiny(), video_shape=TINY_SHAPE)
    model.init_weights(seed=seed)
    return model


def tiny_inputs(batch: int, *, step: int = 1):
    generator = torch.Generator().manual_seed(123)
    video = torch.randint(0, 256, (batch, *TINY_SHAPE, 3), dtype=torch.uint8, generator=generator)
    audio = torch.randn(batch, 256, generator=generator)
    has_audio = torch.arange(batch) % 2 == 0
    keys = [f"clip-{index}" for index in range(batch)]
    noise, t = sample_noise_and_time(keys, seed=0, step=step, video_shape=TINY_SHAPE, device=CPU)
    return video, audio, has_audio, noise, t


def test_tiny_preset_is_small_enough_for_cpu_tests() -> None:
    assert 50_000 < num_params(tiny_model()) < 2_000_000


def test_1b_preset_has_about_a_billion_parameters_counted_without_memory() -> None:
    count = count_params(one_b(), video_shape=(16, 256, 256))
    assert abs(count - 1e9) <= 0.15e9, count


@pytest.mark.parametrize("pos_embed", ["sincos", "learned"])
def test_the_meta_device_count_is_the_built_models_count_and_its_table_has_the_real_shape(pos_embed: str) -> None:
    config = tiny()
    config.pos_embed = pos_embed
    assert count_params(config, video_shape=TINY_SHAPE) == num_params(VideoFlowModel(config, video_shape=TINY_SHAPE))
    with torch.device("meta"):
        meta = VideoFlowModel(config, video_shape=TINY_SHAPE)
    real = VideoFlowModel(config, video_shape=TINY_SHAPE)
    assert {name: (tuple(b.shape), b.dtype) for name, b in meta.named_buffers()} == \
        {name: (tuple(b.shape), b.dtype) for name, b in real.named_buffers()}
    assert all(b.device.type == "meta" for b in meta.buffers())  # no table computed for a count


def test_learned_position_embedding_adds_one_vector_per_token() -> None:
    config = tiny()
    config.pos_embed = "learned"
    learned = VideoFlowModel(config, video_shape=TINY_SHAPE)
    learned.init_weights(seed=0)
    assert num_params(learned) - num_params(tiny_model()) == learned.tokens_per_sample * config.dim
    video, audio, has_audio, noise, t = tiny_inputs(2)
    learned(video, audio, has_audio, noise, t).mean().backward()
    assert learned.pos_embed.grad is not None


def test_every_preset_builds_on_meta_and_flops_grow_with_size() -> None:
    flops = [flops_per_step(MODEL_PRESETS[name](), (8, 16, 256, 256))
             for name in ("small", "base", "1b")]
    assert flops == sorted(flops) and flops[0] > 0
    for preset in MODEL_PRESETS.values():
        assert count_params(preset(), video_shape=(16, 256, 256)) > 0


def test_flops_per_token_is_6n_plus_attention() -> None:
    config = one_b()
    tokens = 8 * 32 * 32  # (16/2) x (256/8) x (256/8)
    attention = 12 * config.num_layers * config.dim * tokens
    assert flops_per_token(config, tokens_per_sample=tokens) == 6 * per_token_matmul_params(config) + attention
    assert flops_per_step(config, (4, 16, 256, 256)) == 4 * tokens * flops_per_token(config, tokens_per_sample=tokens)


def test_patchify_round_trips() -> None:
    video = torch.randn(2, *TINY_SHAPE, 3)
    tokens = patchify(video, (2, 4, 4))
    assert tokens.shape == (2, 2 * 4 * 4, 2 * 4 * 4 * 3)
    assert torch.equal(unpatchify(tokens, TINY_SHAPE, (2, 4, 4)), video)


def test_init_is_deterministic_per_seed() -> None:
    first, again, other = tiny_model(seed=7), tiny_model(seed=7), tiny_model(seed=8)
    for (name, a), (_, b), (_, _c) in zip(first.state_dict().items(), again.state_dict().items(),
                                         other.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))


def test_noise_depends_on_sample_key_and_step_not_on_batch_position() -> None:
    noise_ab, t_ab = sample_noise_and_time(["a", "b"], seed=0, step=3, video_shape=TINY_SHAPE, device=CPU)
    noise_b, t_b = sample_noise_and_time(["b"], seed=0, step=3, video_shape=TINY_SHAPE, device=CPU)
    noise_next, _ = sample_noise_and_time(["b"], seed=0, step=4, video_shape=TINY_SHAPE, device=CPU)
    assert torch.equal(noise_ab[1], noise_b[0]) and torch.equal(t_ab[1], t_b[0])
    assert not torch.equal(noise_b, noise_next)
    assert bool(((t_ab > 0) & (t_ab < 1)).all())


def test_per_sample_loss_does_not_depend_on_batch_split() -> None:
    """Splitting a batch in halves gives the same per-sample losses (up to fp32 kernel order)."""
    model = tiny_model()
    with torch.no_grad():
        torch.nn.init.normal_(model.final.linear.weight, std=0.05)  # non-trivial output
    video, audio, has_audio, noise, t = tiny_inputs(4)
    whole = model(video, audio, has_audio, noise, t)
    halves = torch.cat([model(video[i:i + 2], audio[i:i + 2], has_audio[i:i + 2], noise[i:i + 2],
                              t[i:i + 2]) for i in (0, 2)])
    assert whole.dtype == torch.float32 and whole.shape == (4,)
    torch.testing.assert_close(whole, halves, rtol=1e-5, atol=1e-6)


def test_silent_clips_ignore_their_audio_tensor() -> None:
    model = tiny_model()
    with torch.no_grad():
        torch.nn.init.normal_(model.final.linear.weight, std=0.05)
    video, audio, has_audio, noise, t = tiny_inputs(4)
    changed = audio + 5.0
    base, moved = model(video, audio, has_audio, noise, t), model(video, changed, has_audio, noise, t)
    assert torch.equal(base[~has_audio], moved[~has_audio])
    assert not torch.equal(base[has_audio], moved[has_audio])


class _NormInputDtypes(TorchFunctionMode):
    """Records the input dtype of every layer_norm / rms_norm call."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (F.layer_norm, F.rms_norm):
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_norms_compute_in_fp32_under_bf16_autocast() -> None:
    model = tiny_model()
    seen = {}
    model.blocks[0].attn.qkv.register_forward_hook(lambda mod, inputs, out: seen.update(qkv=out.dtype))
    video, audio, has_audio, noise, t = tiny_inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16), _NormInputDtypes() as norms:
        loss = model(video, audio, has_audio, noise, t)
    assert seen["qkv"] == torch.bfloat16  # autocast is on for the matmuls
    assert loss.dtype == torch.float32
    # 2 layer norms per block + final, 2 qk rms norms per block: all fed fp32.
    assert len(norms.dtypes) == 4 * len(model.blocks) + 1
    assert set(norms.dtypes) == {torch.float32}


# ---------------------------------------------------------------------------------------------
# Clip shapes other than the reference (bucketed data)


def shape_inputs(video_shape: tuple[int, int, int], batch: int = 2, *, audio_samples: int = 256):
    generator = torch.Generator().manual_seed(7)
    video = torch.randint(0, 256, (batch, *video_shape, 3), dtype=torch.uint8, generator=generator)
    audio = torch.randn(batch, audio_samples, generator=generator)
    has_audio = torch.ones(batch, dtype=torch.bool)
    noise, t = sample_noise_and_time([f"clip-{i}" for i in range(batch)], seed=0, step=1,
                                     video_shape=video_shape, device=CPU)
    return video, audio, has_audio, noise, t


def test_sincos_model_takes_any_divisible_shape_as_if_built_for_it() -> None:
    """A model built for 4x16x16 clips gives, on 8x16x24 clips (and 512 audio samples), exactly
    the loss of the same weights built for 8x16x24: the position table is a function of the grid."""
    reference, other = tiny_model(), VideoFlowModel(tiny(), video_shape=(8, 16, 24))
    other.init_weights(seed=0)
    for model in (reference, other):
        with torch.no_grad():
            torch.nn.init.normal_(model.final.linear.weight, std=0.05, generator=torch.Generator().manual_seed(1))
    keys_before, loss_before = set(reference.state_dict()), reference(*tiny_inputs(2))
    inputs = shape_inputs((8, 16, 24), audio_samples=512)
    loss = reference(*inputs)
    assert loss.shape == (2,) and bool(torch.isfinite(loss).all())
    assert torch.equal(loss, other(*inputs))
    assert torch.equal(reference.position_table((4, 4, 6)), sincos_3d(64, (4, 4, 6))[None])
    assert set(reference.state_dict()) == keys_before  # no new buffer: checkpoints unchanged
    assert torch.equal(reference(*tiny_inputs(2)), loss_before)  # the reference shape is unaffected


def test_learned_position_embedding_refuses_another_shape() -> None:
    config = tiny()
    config.pos_embed = "learned"
    learned = VideoFlowModel(config, video_shape=TINY_SHAPE)
    with pytest.raises(ValueError, match="pos_embed 'learned'.*got clips \\(8, 16, 16\\)"):
        learned(*shape_inputs((8, 16, 16), audio_samples=512))


def test_a_shape_the_patch_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match="clip shape \\(4, 16, 18\\) is not divisible by patch size"):
        tiny_model()(*shape_inputs((4, 16, 18)))


def test_audio_that_is_not_whole_frames_is_refused_clearly() -> None:
    video, _, has_audio, noise, t = shape_inputs(TINY_SHAPE)
    with pytest.raises(ValueError, match="100 samples per clip is not a positive multiple of "
                                         "model.audio_frame_samples 64"):
        tiny_model()(video, torch.zeros(2, 100), has_audio, noise, t)
