"""Rotary position embeddings, with the "linear" and "llama3" frequency scalings."""

import math
from collections.abc import Callable

import torch
from torch import nn


def _inverse_frequencies(head_dim: int, rope: dict) -> torch.Tensor:
    base = rope.get("rope_theta", 10000.0)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope["factor"]
    if rope_type == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by their positions, from a cos/sin table built once.

    The table's sine carries the sign of the rotation (-sin on the first half), so a
    rotation is x * cos + roll(x, half) * signed_sin. `kernel`, when set (see
    `engine.layers.triton_routing`), does it in one launch: kernel(positions, x, cos, sin).
    """

    kernel: Callable | None = None

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(head_dim, rope_parameters)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat((freqs, freqs), dim=-1).cos(), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotates `x` [tokens, heads, head_dim]; pass queries and keys together."""
        if self.kernel is not None:
            return self.kernel(positions, x, self.cos, self.sin)
        return self.torch_forward(positions, x)

    def torch_forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
