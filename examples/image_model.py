"""An image model on Trainyard, written as a lab would write its own: no platform code changes.

It learns to generate one still frame (the middle one) of each clip with rectified flow, using a
small convolutional network: a stem, `model.num_layers` residual blocks modulated by the timestep
(FiLM), and a zero-initialized head. Convolutions take any frame size, so bucketed data with
several aspect ratios trains one model. The audio of a clip is not used: this is an unconditional
image model.

Use it from an experiment config (configs/example_image.yaml):

    model:
      factory: examples.image_model:build
      dim: 32          # channels
      num_layers: 2    # residual blocks

What Trainyard asks of it is the model protocol of trainer/models/protocol.py: ``blocks``,
``init_weights``, ``noise_shape``, ``forward`` (the per-sample loss), ``predict_velocity``,
``to_video`` and ``flops_per_sample``. Everything else (data, noise, parallelism, precision,
checkpoints, evaluation) is the platform's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _groups(channels: int) -> int:
    return math.gcd(8, channels)


class TimeEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, t: Tensor) -> Tensor:
        half = self.dim // 2
        freqs = torch.exp(-math.log(10000.0) / half * torch.arange(half, device=t.device, dtype=torch.float32))
        angles = (t.float() * 1000.0)[:, None] * freqs[None]
        features = torch.cat([angles.sin(), angles.cos()], dim=1)
        return self.fc2(F.silu(self.fc1(features)))


class ResBlock(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, FiLM by the time embedding, again, and the residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(_groups(channels), channels), nn.GroupNorm(_groups(channels), channels)
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.film = nn.Linear(channels, 2 * channels)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        scale, shift = self.film(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.norm2(h) * (1 + scale) + shift
        return x + self.conv2(F.silu(h))


class StillFrameFlow(nn.Module):
    """Velocity predictor over one RGB frame; ``forward`` returns the per-sample flow-matching loss."""

    def __init__(self, *, channels: int, depth: int) -> None:
        super().__init__()
        self.channels = channels
        self.time = TimeEmbedding(channels)
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ResBlock(channels) for _ in range(depth))
        self.head_norm = nn.GroupNorm(_groups(channels), channels)
        self.head = nn.Conv2d(channels, 3, 3, padding=1)

    @torch.no_grad()
    def init_weights(self, *, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for module in self.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_uniform_(module.weight, a=math.sqrt(5), generator=generator)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.GroupNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.zeros_(self.head.weight)  # the untrained model predicts zero velocity

    # What the platform calls --------------------------------------------------------------

    def noise_shape(self, clip_shape) -> tuple[int, ...]:
        _, height, width = clip_shape
        return (1, height, width, 3)  # one frame: to_video shows it as a one-frame clip

    def forward(self, video: Tensor, audio: Tensor, has_audio: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        x0 = video[:, video.shape[1] // 2 : video.shape[1] // 2 + 1].float() / 127.5 - 1.0
        t_ = t.float()[:, None, None, None, None]
        x_t = (1 - t_) * x0 + t_ * noise.float()
        v_pred = self.predict_velocity(x_t, t, audio, has_audio)
        return (v_pred.float() - (noise.float() - x0)).pow(2).mean(dim=(1, 2, 3, 4))

    def predict_velocity(self, x_t: Tensor, t: Tensor, audio: Tensor, has_audio: Tensor) -> Tensor:
        x = x_t[:, 0].permute(0, 3, 1, 2)  # [B, 1, H, W, 3] -> [B, 3, H, W]
        emb = self.time(t)
        h = self.stem(x)
        for block in self.blocks:
            h = block(h, emb)
        return self.head(F.silu(self.head_norm(h))).permute(0, 2, 3, 1)[:, None]

    def to_video(self, x: Tensor) -> Tensor:
        return ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)

    def flops_per_sample(self, clip_shape) -> int:
        """Forward + backward (3x the forward) of the convolutions, per pixel of the frame."""
        _, height, width = clip_shape
        c = self.channels
        per_pixel = 2 * 9 * (3 * c + len(self.blocks) * 2 * c * c + c * 3)
        return 3 * per_pixel * height * width


def build(config) -> StillFrameFlow:
    """The factory Trainyard calls with the experiment config: the model fields it reads are its own choice."""
    return StillFrameFlow(channels=config.model.dim, depth=config.model.num_layers)
