"""Rotary position embeddings: the "default", "linear", "llama3", "longrope" (Phi-3) and
"yarn" (gpt-oss, DeepSeek-V3) frequencies, partial rotation (`partial_rotary_factor`), per-layer-type parameters
(Gemma 3's local and global layers) and Qwen2-VL's multimodal positions (`MRotaryEmbedding`)."""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.layers.linear import ShardSlice, StoredTensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")


@dataclass(frozen=True)
class RotaryPairs:
    """Where a projection's output rows hold rotary features in interleaved pairs (x0, x1),
    (x2, x3)... (Llama 4's q/k, DeepSeek's rotary parts), which `RotaryEmbedding` turns as
    halves [x0, x2, ..., x1, x3, ...]: in every run of `period` rows (a head), the
    `rotary_dim` rows from `start`. Reordering the rows at load (`to_halves`), and an
    adapter's B alike, makes the half rotation compute the interleaved one: a query and key
    reordered the same way give the same scores."""

    period: int
    start: int
    rotary_dim: int

    def to_halves(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` [whole periods, ...] (a tensor-parallel slice holds whole heads), reordered."""
        pairs = torch.arange(self.start, self.start + self.rotary_dim).view(-1, 2)
        order = torch.cat((torch.arange(self.start), pairs[:, 0], pairs[:, 1],
                           torch.arange(self.start + self.rotary_dim, self.period)))
        return rows.unflatten(0, (-1, self.period))[:, order.to(rows.device)].flatten(0, 1)


@dataclass(frozen=True)
class RotaryPairsToHalves:
    """A checkpoint tensor (a projection's weight or bias) read with its rows reordered by
    `pairs` (`RotaryPairs.to_halves`); a `StoredTensor`."""

    tensor: StoredTensor
    pairs: RotaryPairs

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        return self.pairs.to_halves(self.tensor.read(piece))


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
    if rope_type == "yarn":
        return _yarn(exponents, base, rope)
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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 * mscale *
    ln(factor) + 1 (1 where nothing is stretched). DeepSeek-V3's attention also scales its
    softmax by yarn_mscale(factor, mscale_all_dim) ** 2."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(exponents: torch.Tensor, base: float, rope: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023), as transformers computes it: the frequencies that turn
    fewer than `beta_slow` times over the pretraining length (`original_max_position_embeddings`)
    are divided by `factor` (interpolated), those that turn more than `beta_fast` times kept
    (extrapolated), a linear ramp between the two in the rotary dimension (its ends rounded
    outward unless `truncate` is false); the cos and sin are scaled by `attention_factor`,
    by default yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) where both
    are given (DeepSeek), else yarn_mscale(factor)."""
    rotary_dim = 2 * exponents.numel()
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or rope["max_position_embeddings"] / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))

    def dimension_turning(rotations: float) -> float:
        """The (fractional) rotary dimension whose frequency turns `rotations` times over `original`."""
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(rope.get("beta_fast") or 32), dimension_turning(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    positional = base**exponents
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # each frequency's share kept as it is
    # 1 - extrapolated, as transformers writes it, is not always ramp's bits.
    inv_freq = 1.0 / (factor * positional) * (1 - extrapolated) + 1.0 / positional * extrapolated
    return inv_freq, attention_factor


def _cos_sin_tables(rotary_dim: int, max_position: int, rope: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The [max_position, rotary_dim] cos and signed sin tables (-sin on the first half), the
    frequencies repeated for both halves of the rotated features.

    Under the loader's meta device they are placeholders of that shape, built for real by the
    model's `build_buffers` on its device: computed on meta, PyTorch runs its Python reference
    kernels, whose first use imports torch._dynamo (1.2 s of every engine process's start)."""
    if torch.get_default_device().type == "meta":
        placeholder = torch.empty(max_position, rotary_dim)
        return placeholder, placeholder
    inv_freq, attention_factor = _inverse_frequencies(rotary_dim, rope, max_position)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
    return torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x [tokens, heads, head_dim] turned by cos and signed sin [tokens, 1, rotary_dim]; the
    features past `rotary_dim` pass through."""
    if rotary_dim < x.shape[-1]:
        rotated, passed = x.split([rotary_dim, x.shape[-1] - rotary_dim], dim=-1)
        return torch.cat((rotated * cos + rotated.roll(rotary_dim // 2, dims=-1) * sin, passed), dim=-1)
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


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
        cos, sin = _cos_sin_tables(self.rotary_dim, max_position, rope_parameters)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @property
    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 cos and signed sin tables [positions, rotary_dim], for an attention
        backend that rotates in a fused pass of its own (`AttentionBackend.rotate_and_attend`),
        rounding as `forward` does."""
        return self.cos, self.sin

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotates `x` [tokens, heads, head_dim]; pass queries and keys together."""
        if self.kernel is not None:
            return self.kernel(positions, x, self.cos, self.sin)
        return self.torch_forward(positions, x)

    def torch_forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return _rotate(x, cos, sin, self.rotary_dim)


class MRotaryEmbedding(nn.Module):
    """Qwen2-VL's multimodal rotary positions (M-RoPE): each token has a temporal, a height
    and a width position (positions [3, tokens]), and the rotary frequencies are cut into
    three runs (`mrope_section`, in frequencies, summing to rotary_dim / 2) that turn by
    the temporal, height and width position respectively. A text token's three positions
    are equal, which is plain RoPE; 1-D positions are taken as such.

    Deliberately not a `RotaryEmbedding`: the fused kernels that `kernel_routing` sets on
    those take one position per token, so this rotation always runs in PyTorch.
    """

    def __init__(self, head_dim: int, max_position: int, rope_parameters: dict) -> None:
        super().__init__()
        self.rotary_dim = int(head_dim * rope_parameters.get("partial_rotary_factor", 1.0))
        sections = rope_parameters.get("mrope_section")
        if not sections or len(sections) != 3 or sum(sections) != self.rotary_dim // 2:
            raise ValueError(f"rope_parameters' mrope_section {sections} must be three sizes summing to "
                             f"{self.rotary_dim // 2} (half the rotary dimension): fix config.json's "
                             "rope_scaling / rope_parameters")
        self.sections = list(sections) * 2  # the tables hold the frequencies twice, once per half
        cos, sin = _cos_sin_tables(self.rotary_dim, max_position, rope_parameters)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotates `x` [tokens, heads, head_dim] by positions [3, tokens] (or [tokens])."""
        if positions.dim() == 1:
            positions = positions.expand(3, -1)
        cos = self._by_section(self.cos[positions]).unsqueeze(1).to(x.dtype)
        sin = self._by_section(self.sin[positions]).unsqueeze(1).to(x.dtype)
        return _rotate(x, cos, sin, self.rotary_dim)

    def _by_section(self, table: torch.Tensor) -> torch.Tensor:
        """[tokens, rotary_dim] from [3, tokens, rotary_dim]: each section's columns from
        the row of its position (temporal, height, width, then again for the second half)."""
        parts = table.split(self.sections, dim=-1)
        return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
