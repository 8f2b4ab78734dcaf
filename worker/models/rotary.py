"""Rotary position embeddings (RoPE), default and Llama 3.1 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from worker.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """The ``head_dim / 2`` rotation frequencies, float32, on the CPU even under a meta device."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    if config.rope_type == "llama3":
        inv_freq = _llama3_scaled(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: slow down low frequencies by ``factor``, blend the middle band smoothly."""
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's two halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin for arbitrary token positions and rotates queries and keys.

    The frequencies are a plain float32 tensor, not a buffer, so casting the model to bfloat16
    never rounds them; they follow the positions to their device on first use.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq = inverse_frequencies(config)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """cos and sin for ``positions`` (num_tokens,), each (num_tokens, 1, head_dim)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq  # (num_tokens, head_dim / 2)
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (num_tokens, 1, head_dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` (num_tokens, num_heads, head_dim) by the angles in ``cos``/``sin``."""
        return x * cos + rotate_half(x) * sin
