"""A small generative video model: a DiT-style transformer over spatio-temporal patches,
trained with rectified flow (flow matching).

    video uint8 [B,T,H,W,3] -> x0 in [-1, 1] -> tubelets (pt x ph x pw x 3) -> tokens [B,N,P]
    x_t = (1 - t) x0 + t noise,   target velocity v = noise - x0,   loss = mean (v_pred - v)^2

The conditioning vector c is a timestep embedding plus, for clips with audio, a pooled
embedding of framed mono PCM. c drives adaLN-single modulation (PixArt-alpha): one shared
projection c -> 6 x dim and a learned per-block table, instead of DiT's per-block
dim -> 6 x dim projection, which would add a third to the parameters at the same width.

Norms run in fp32 whatever the autocast dtype (precision policy, trainer/precision.py). Noise
and timestep are functions of (seed, step, sample key) (`sample_noise_and_time`), so a global
batch gives the same loss however it is split over ranks and micro-batches.

Clip shapes: the model is built for a reference shape (T, H, W), but with the 'sincos' position
embedding it takes any clip shape its patch size divides, so bucketed data (several durations
and aspect ratios, one shape per batch) trains one model. Every weight is per token or per
sample; only the position table depends on the token grid, and it is a function of the grid.
'learned' embeddings exist for the reference grid alone, so that model refuses other shapes.

Residual stream: under autocast every matmul returns the compute dtype (bf16/fp16), and the
stream between blocks stays in it: the position table is cast to the patch embedding's dtype
before the add, since an fp32 table would silently promote the whole stream to fp32 and every
norm input, modulation, gate and residual add would move twice the bytes. Norms still compute
in fp32 internally and return the stream's dtype. `residual_fp32=True` (train.residual_dtype
'fp32') keeps an fp32 stream on purpose. Under the fp32 policy both are the same arithmetic.

No distributed code here: trainer/parallel.py wraps `VideoFlowModel.blocks`.
Presets: `tiny`, `small`, `base`, `one_b` (in `MODEL_PRESETS` as "1b").
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trainer.launch.config_sections import (ModelConfig, grid_shape, num_tokens)

_TIME_SCALE = 1000.0  # timesteps in [0, 1] are embedded like DiT's integer steps in [0, 1000]


# ---------------------------------------------------------------------------------------------
# Video <-> tokens


def normalize_video(video: Tensor) -> Tensor:
    """uint8 pixels -> float32 in [-1, 1]."""
    return video.float() / 127.5 - 1.0


def patchify(video: Tensor, patch_size: Sequence[int]) -> Tensor:
    """[B, T, H, W, C] -> [B, N, pt*ph*pw*C], tokens in (t, h, w) raster order."""
    b, t, h, w, c = video.shape
    pt, ph, pw = patch_size
    x = video.reshape(b, t // pt, pt, h // ph, ph, w // pw, pw, c)
    x = x.permute(0, 1, 3, 5, 2, 4, 6, 7)
    return x.reshape(b, (t // pt) * (h // ph) * (w // pw), pt * ph * pw * c)


def unpatchify(tokens: Tensor, video_shape: Sequence[int], patch_size: Sequence[int]) -> Tensor:
    """Inverse of `patchify`: [B, N, P] -> [B, T, H, W, C]."""
    t, h, w = video_shape
    pt, ph, pw = patch_size
    b = tokens.shape[0]
    x = tokens.reshape(b, t // pt, h // ph, w // pw, pt, ph, pw, -1)
    return x.permute(0, 1, 4, 2, 5, 3, 6, 7).reshape(b, t, h, w, -1)


def sincos_1d(dim: int, positions: Tensor) -> Tensor:
    """[len(positions), dim] sine-cosine features (dim even)."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()


def sincos_3d(dim: int, grid: Sequence[int]) -> Tensor:
    """[N, dim] table for a (t, h, w) token grid: a third of the width per axis, zero padded."""
    if torch.empty(0).is_meta:  # under torch.device("meta"); get_default_device is torch >= 2.3 only
        # A meta-device build (count_params, the memory estimate) needs the shape alone; computing the
        # table through meta kernels costs over a second of first-use set-up in every fresh process.
        return torch.empty(math.prod(grid), dim, dtype=torch.float32)
    axis_dim = (dim // 6) * 2
    axes = [sincos_1d(axis_dim, torch.arange(n)) for n in grid]
    t, h, w = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
    table = torch.cat([axes[0][t.flatten()], axes[1][h.flatten()], axes[2][w.flatten()]], dim=1)
    return F.pad(table, (0, dim - table.shape[1]))


# ---------------------------------------------------------------------------------------------
# Flow-matching inputs


def sample_seed(seed: int, step: int, key: str) -> int:
    """63-bit seed of one sample's noise at one step (sha256, so it is stable across processes)."""
    digest = hashlib.sha256(f"{seed}:{step}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def sample_noise_and_time(
    keys: Sequence[str], *, seed: int, step: int, device: torch.device, video_shape: Sequence[int] | None = None,
    noise_shape: Sequence[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """Noise [B, *noise_shape] and timesteps [B] for one batch, each a function of its sample.

    noise_shape is the model's (trainer/models/protocol.py); video_shape (T, H, W) alone means pixels, [T, H, W, 3].
    t is logit-normal (SD3): sigmoid of a standard normal, which favours mid-range noise levels.
    """
    shape = tuple(noise_shape) if noise_shape is not None else (*video_shape, 3)
    if not keys:  # an empty micro-batch (see Trainer._micro_batches)
        return torch.empty((0, *shape), device=device), torch.empty((0,), device=device)
    noises, times = [], []
    for key in keys:
        generator = torch.Generator(device=device).manual_seed(sample_seed(seed, step, key))
        noises.append(torch.randn(shape, generator=generator, device=device))
        times.append(torch.randn((), generator=generator, device=device).sigmoid())
    return torch.stack(noises), torch.stack(times)


# ---------------------------------------------------------------------------------------------
# Building blocks


class Fp32LayerNorm(nn.Module):
    """LayerNorm without affine that always computes in fp32 (precision policy), output in input dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.layer_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype)


class Fp32RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight, always computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int, *, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.q_norm = Fp32RMSNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = Fp32RMSNorm(self.head_dim) if qk_norm else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        b, n, dim = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        out = F.scaled_dot_product_attention(q, k, v)  # full (bidirectional) attention
        return self.proj(out.transpose(1, 2).reshape(b, n, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class DiTBlock(nn.Module):
    """Pre-norm attention + MLP, each modulated (shift, scale) and gated by the conditioning."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm1 = Fp32LayerNorm(config.dim)
        self.attn = Attention(config.dim, config.num_heads, qk_norm=config.qk_norm)
        self.norm2 = Fp32LayerNorm(config.dim)
        self.mlp = Mlp(config.dim, config.mlp_hidden)
        # adaLN-single: the shared projection gives [B, 6, dim]; this table makes it per block.
        self.scale_shift_table = nn.Parameter(torch.zeros(6, config.dim))

    def forward(self, x: Tensor, modulation: Tensor) -> Tensor:
        params = modulation + self.scale_shift_table[None].to(modulation.dtype)
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = params.unbind(dim=1)
        x = x + gate_a[:, None] * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        return x + gate_m[:, None] * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.fc1 = nn.Linear(freq_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, t: Tensor) -> Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) / half
                          * torch.arange(half, device=t.device, dtype=torch.float32))
        angles = (t.float() * _TIME_SCALE)[:, None] * freqs[None, :]
        features = torch.cat([angles.sin(), angles.cos()], dim=1)
        return self.fc2(F.silu(self.fc1(features)))


class AudioEncoder(nn.Module):
    """Framed mono PCM [B, A] -> linear per frame -> SiLU -> mean over frames -> linear: [B, dim].

    Clips without audio (has_audio False) contribute a zero vector, not an embedding of silence.
    """

    def __init__(self, dim: int, frame_samples: int) -> None:
        super().__init__()
        self.frame_samples = frame_samples
        self.frame_proj = nn.Linear(frame_samples, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, audio: Tensor, has_audio: Tensor) -> Tensor:
        b, num_samples = audio.shape
        # Buckets of different durations carry different audio lengths: any whole number of frames works.
        if num_samples == 0 or num_samples % self.frame_samples:
            raise ValueError(f"audio of {num_samples} samples per clip is not a positive multiple of "
                             f"model.audio_frame_samples {self.frame_samples}: every clip shape's audio "
                             "length must be one")
        frames = audio.reshape(b, num_samples // self.frame_samples, self.frame_samples)
        pooled = F.silu(self.frame_proj(frames)).mean(dim=1)
        return self.out(pooled) * has_audio.to(pooled.dtype)[:, None]


class FinalLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = Fp32LayerNorm(config.dim)
        self.scale_shift_table = nn.Parameter(torch.zeros(2, config.dim))
        self.linear = nn.Linear(config.dim, config.patch_dim)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        shift, scale = (self.scale_shift_table[None].to(cond.dtype) + cond[:, None]).unbind(dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))


# ---------------------------------------------------------------------------------------------
# The model


class VideoFlowModel(nn.Module):
    """Velocity predictor; `forward` returns the per-sample flow-matching loss.

    Built for clips of video_shape (the reference shape); with sincos position embeddings it
    also takes any other shape the patch size divides (module docstring).
    """

    def __init__(self, config: ModelConfig, *, video_shape: Sequence[int], residual_fp32: bool = False) -> None:
        super().__init__()
        self.config = config
        self.video_shape = tuple(video_shape)
        self.residual_fp32 = residual_fp32  # not a weight: the same checkpoint loads either way
        self.grid = grid_shape(self.video_shape, config.patch_size)
        self.patch_embed = nn.Linear(config.patch_dim, config.dim)
        if config.pos_embed == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(1, math.prod(self.grid), config.dim))
        else:  # a buffer, not saved: it is a function of the config
            self.register_buffer("pos_embed", sincos_3d(config.dim, self.grid)[None], persistent=False)
        # sincos tables of the other token grids, built on first use per (grid, device). A plain
        # dict, not a buffer: the state dict, checkpoints and FSDP/DDP wrapping stay the same
        # whatever clip shapes the data holds.
        self._pos_tables: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}
        self.t_embedder = TimestepEmbedder(config.dim, config.timestep_freq_dim)
        self.audio_encoder = (AudioEncoder(config.dim, config.audio_frame_samples)
                              if config.audio_frame_samples else None)
        self.t_block = nn.Linear(config.dim, 6 * config.dim)  # adaLN-single shared projection
        self.blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.num_layers))
        self.final = FinalLayer(config)

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        """Deterministic init from seed alone (one CPU generator, modules in definition order).

        Call on a CPU model before moving or sharding it; meta tensors cannot be initialized.
        Zero-initialized output layer (DiT): the untrained model predicts zero velocity.
        """
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight, generator=generator)
                nn.init.zeros_(module.bias)
            elif isinstance(module, Fp32RMSNorm):
                nn.init.ones_(module.weight)
        for linear in (self.t_embedder.fc1, self.t_embedder.fc2, self.t_block):
            nn.init.normal_(linear.weight, std=0.02, generator=generator)
        for block in self.blocks:
            block.scale_shift_table.copy_(
                torch.randn(block.scale_shift_table.shape, generator=generator) / self.config.dim**0.5)
        self.final.scale_shift_table.copy_(
            torch.randn(self.final.scale_shift_table.shape, generator=generator) / self.config.dim**0.5)
        if isinstance(self.pos_embed, nn.Parameter):
            nn.init.trunc_normal_(self.pos_embed, std=0.02, generator=generator)
        nn.init.zeros_(self.final.linear.weight)

    def grid_for(self, video_shape: Sequence[int]) -> tuple[int, int, int]:
        """Token grid of clips of video_shape; ValueError for a shape this model cannot take."""
        grid = grid_shape(video_shape, self.config.patch_size)
        if self.config.pos_embed == "learned" and grid != self.grid:
            raise ValueError(f"pos_embed 'learned' has one embedding per token of clips {self.video_shape} "
                             f"only, got clips {tuple(video_shape)}; use pos_embed 'sincos' for other shapes")
        return grid

    def position_table(self, grid: tuple[int, int, int]) -> Tensor:
        """[1, N, dim] position embedding of a token grid (`grid_for` checks that the model has one)."""
        if grid == self.grid:
            return self.pos_embed
        key = (grid, self.pos_embed.device)
        if key not in self._pos_tables:
            self._pos_tables[key] = sincos_3d(self.config.dim, grid)[None].to(self.pos_embed.device)
        return self._pos_tables[key]

    def velocity(self, x_t: Tensor, t: Tensor, audio: Tensor, has_audio: Tensor, *,
                 grid: tuple[int, int, int]) -> Tensor:
        """Predicted velocity tokens [B, N, P] for noisy tokens x_t of a token grid at timesteps t [B]."""
        cond = self.t_embedder(t)
        if self.audio_encoder is not None:
            cond = cond + self.audio_encoder(audio, has_audio)
        modulation = self.t_block(F.silu(cond)).unflatten(1, (6, self.config.dim))
        x = self.patch_embed(x_t)  # compute dtype under autocast (module docstring: residual stream)
        x = x.float() + self.position_table(grid) if self.residual_fp32 else x + self.position_table(grid).to(x.dtype)
        for block in self.blocks:
            x = block(x, modulation)
        return self.final(x, cond)

    def forward(self, video: Tensor, audio: Tensor, has_audio: Tensor, noise: Tensor,
                t: Tensor) -> Tensor:
        """Per-sample rectified-flow loss [B] in fp32 (the mean over tokens and channels)."""
        grid = self.grid_for(video.shape[1:4])
        x0 = patchify(normalize_video(video), self.config.patch_size)
        noise_tokens = patchify(noise.float(), self.config.patch_size)
        t_tokens = t.float()[:, None, None]
        x_t = (1 - t_tokens) * x0 + t_tokens * noise_tokens
        v_pred = self.velocity(x_t, t, audio, has_audio, grid=grid)
        return (v_pred.float() - (noise_tokens - x0)).pow(2).mean(dim=(1, 2))

    @property
    def tokens_per_sample(self) -> int:
        """Tokens of a clip of the reference shape (`num_tokens` for any other)."""
        return math.prod(self.grid)

    # The rest of the model protocol (trainer/models/protocol.py): forward above is its loss.

    def noise_shape(self, clip_shape: Sequence[int]) -> tuple[int, ...]:
        """The model generates pixels: one sample's noise is a clip, [T, H, W, 3]."""
        self.grid_for(clip_shape)  # refuses a shape the patch size does not divide
        return (*tuple(clip_shape), 3)

    def predict_velocity(self, x_t: Tensor, t: Tensor, audio: Tensor, has_audio: Tensor) -> Tensor:
        """Velocity [B, T, H, W, 3] at noisy clips x_t [B, T, H, W, 3] (the sampler's view of `velocity`)."""
        video_shape = tuple(x_t.shape[1:4])
        grid = self.grid_for(video_shape)
        tokens = patchify(x_t.float(), self.config.patch_size)
        v = self.velocity(tokens, t, audio, has_audio, grid=grid)
        return unpatchify(v.float(), video_shape, self.config.patch_size)

    def to_video(self, x: Tensor) -> Tensor:
        """Generated clips in [-1, 1] -> uint8 frames (the inverse of `normalize_video`, clamped)."""
        return ((x.float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)

    def flops_per_sample(self, clip_shape: Sequence[int]) -> int:
        """Training FLOPs of one clip of clip_shape (`flops_per_token` x its tokens)."""
        tokens = num_tokens(clip_shape, self.config.patch_size)
        return tokens * flops_per_token(self.config, tokens_per_sample=tokens)


def build(config) -> VideoFlowModel:
    """The built-in model factory (model.factory "" or "trainer.models.video:build"; trainer/models/protocol.py)."""
    return VideoFlowModel(config.model, video_shape=config.data.video_shape,
                          residual_fp32=config.train.residual_dtype == "fp32")


# ---------------------------------------------------------------------------------------------
# Sizes and FLOPs, without allocating


def num_params(model: nn.Module) -> int:
    """Parameters of a built model (meta tensors count too)."""
    return sum(p.numel() for p in model.parameters())


def count_params(config: ModelConfig, *, video_shape: Sequence[int]) -> int:
    """Parameters of the model for config, built on the meta device (no memory)."""
    with torch.device("meta"):
        return num_params(VideoFlowModel(config, video_shape=video_shape))


def per_token_matmul_params(config: ModelConfig) -> int:
    """Weights of the matmuls every token goes through: patch embed, qkv, proj, MLP, output."""
    per_block = 4 * config.dim**2 + 2 * config.dim * config.mlp_hidden
    return 2 * config.patch_dim * config.dim + config.num_layers * per_block


def flops_per_token(config: ModelConfig, *, tokens_per_sample: int) -> int:
    """Training FLOPs (forward + backward) per token.

    6 per per-token matmul weight, plus attention scores and values: 4 * S * dim per layer
    forward, times 3 for forward + backward (full attention over S = tokens_per_sample).
    Per-sample conditioning MLPs and elementwise work are left out (< 0.5% at every preset);
    activation-checkpointing recompute is not counted (model FLOPs, as for MFU).
    """
    attention = 12 * config.num_layers * config.dim * tokens_per_sample
    return 6 * per_token_matmul_params(config) + attention


def flops_per_step(config: ModelConfig, batch_shape: Sequence[int]) -> int:
    """Training FLOPs of one optimizer step over a global batch of shape (B, T, H, W)."""
    batch, *video_shape = batch_shape
    tokens = num_tokens(video_shape, config.patch_size)
    return batch * tokens * flops_per_token(config, tokens_per_sample=tokens)
