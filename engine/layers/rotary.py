"""Rotary position embeddings: the "default", "linear", "llama3" and "longrope" (Phi-3)
frequencies, partial rotation (`partial_rotary_factor`) and per-layer-type parameters
(Gemma 3's local and global layers)."""

import math
from collections.abc import Callable

import torch
from torch import nn
from transformers import PretrainedConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


def rope_parameters(config: PretrainedConfig, layer_type: str | None = None) -> dict:
    """The rotary parameters of `layer_type`'s layers ("sliding_attention",
    "full_attention") where config.json gives them per type (Gemma 3), else the model's;
    with the config's own `partial_rotary_factor` and `max_position_embeddings` where the
    dict lacks them (LongRoPE derives its scaling from the latter)."""
    rope = dict(config.rope_parameters or {})
    if layer_type in rope and isinstance(rope[layer_type], dict):
        rope = dict(rope[layer_type])
    rope.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0)
    rope.setdefault("max_position_embeddings", getattr(config, "max_position_embeddings", None))
    return rope


def _inverse_frequencies(rotary_dim: int, rope: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """The rotation's inverse frequencies and the factor its cos and sin are scaled by."""
    base = rope.get("rope_theta", 10000.0)
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / rope["factor"], 1.0
    if rope_type == "llama3":
        factor = rope["factor"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled), 1.0
    if rope_type == "longrope":
        return _longrope(exponents, base, rope, max_position)
    raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def _longrope(exponents: torch.Tensor, base: float, rope: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE: the short factors where every position of the engine's context
    (`max_position`, its max_model_len) is within the pretraining length, else the long
    ones, for every position. transformers switches a sequence to the long factors when it
    grows past that length and recomputes its cache; here one set serves each engine, so
    a sequence's keys never mix the two (outputs equal transformers' for sequences that
    stay on one side)."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or rope["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = rope["long_factor"] if max_position > original else rope["short_factor"]
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * base**exponents), attention_factor


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by their positions, from a cos/sin table built once.

    The first `rotary_dim` features of each head rotate (all of them unless the config's
    `partial_rotary_factor` says fewer); the rest pass through. The table's sine carries
    the sign of the rotation (-sin on the first half), so a rotation is x * cos +
    roll(x, rotary_dim / 2) * signed_sin. `kernel`, when set (see
    `engine.model_loader.kernel_routing`), does it in one launch: kernel(positions, x, cos, sin).
    """

    kernel: Callable | None = None

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
        inv_freq, attention_factor = _inverse_frequencies(self.rotary_dim, rope_parameters, max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotates `x` [tokens, heads, head_dim]; pass queries and keys together."""
        if self.kernel is not None:
            return self.kernel(positions, x, self.cos, self.sin)
        return self.torch_forward(positions, x)

    def torch_forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        if self.rotary_dim < x.shape[-1]:
            rotated, passed = x.split([self.rotary_dim, x.shape[-1] - self.rotary_dim], dim=-1)
            return torch.cat((rotated * cos + rotated.roll(self.rotary_dim // 2, dims=-1) * sin, passed), dim=-1)
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
