"""MXFP4 expert weights, as gpt-oss checkpoints store them.

A matrix [rows, K] is kept as `*_blocks` [rows, K / 32, 16] uint8 and `*_scales`
[rows, K / 32] uint8: each block of 32 consecutive values of a row is 16 bytes of 4-bit
E2M1 codes (two per byte, the low nibble first) sharing one power-of-two scale, an E8M0
exponent with bias 127. A code's bit 3 is the sign and bits 0-2 index the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6 (the OCP Microscaling format). The rows are the matrix's output
features, as in a `Linear`: gpt-oss's `gate_up_proj_blocks` [E, 2I, H / 32, 16] is each
expert's gate/up matrix [2I, H] (gate and up rows alternating), `down_proj_blocks`
[E, H, I / 32, 16] its down matrix [H, I].

Where the experts run through the Triton kernels (a GPU, with the Triton backend) they stay
as stored (`Mxfp4MoEMethod`), a quarter of bfloat16's bytes, and the fused MoE kernel reads
them (`engine.kernels.triton.fused_moe`). Elsewhere they are dequantized to the model's
dtype as they load (`dequantize_mxfp4`, one expert's tensor at a time), on a GPU with the
warning `MXFP4_DEQUANTIZED_WARNING`. `quantize_mxfp4` writes such tensors, for tests that
build MXFP4 checkpoints.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.layers.fused_moe import FusedMoE

BLOCK_SIZE = 32  # values per block, sharing one scale
SCALE_BIAS = 127  # an E8M0 scale s stands for 2 ** (s - 127)
# The magnitudes of codes 0-7; codes 8-15 are their negatives.
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = FP4_MAGNITUDES[-1]
# Round to nearest, ties to the even code (mantissa bit 0): the midpoints between neighbouring
# magnitudes, those whose tie goes up (to an even code) and those whose tie goes down.
_TIES_UP = (0.75, 1.75, 3.5)
_TIES_DOWN = (0.25, 1.25, 2.5, 5.0)
# float32's bits of 2 ** -127, the one E8M0 scale that float32 holds as a subnormal.
_SCALE_ZERO_BITS = 0x00400000

MXFP4_DEQUANTIZED_WARNING = ("MXFP4 expert weights are dequantized to the model's dtype as they load: the experts take "
                             "4 times their checkpoint's memory (bfloat16) and run at the dtype's speed; the MXFP4 "
                             "kernel runs with attention_backend='triton'")


@dataclass(frozen=True)
class Mxfp4Tensor:
    """A matrix in the checkpoint's MXFP4 layout: blocks [..., K / 32, 16] uint8 and
    scales [..., K / 32] uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor


def _fp4_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The 16 codes' values, sign bit 3."""
    magnitudes = torch.tensor(FP4_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat((magnitudes, -magnitudes))


def _powers_of_two(scales: torch.Tensor) -> torch.Tensor:
    """2 ** (scales - 127) in float32, exactly, from the exponent bits (a product with one
    never rounds). Scale 255 (E8M0's NaN) gives infinity."""
    bits = scales.to(torch.int32) << 23
    return torch.where(scales == 0, _SCALE_ZERO_BITS, bits).view(torch.float32)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The matrix [..., K] in `dtype` from blocks [..., K / 32, 16] and scales [..., K / 32],
    equal to transformers' gpt-oss `convert_moe_packed_tensors` (which also swaps the
    first two dimensions of a stacked [E, rows, ...] tensor into its `x @ W` layout; this
    keeps the rows as the checkpoint has them). Each value is exact in float32 and rounded
    once to `dtype`. Call it per expert: its float32 intermediate is 8 bytes per value.

    Raises:
        ValueError: blocks and scales whose shapes do not fit, naming both.
    """
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK_SIZE // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not fit: blocks "
                         f"must be [..., groups, {BLOCK_SIZE // 2}] and scales [..., groups]; check the checkpoint's "
                         "*_blocks and *_scales tensors")
    blocks = blocks.to(torch.uint8)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).int()
    values = _fp4_values(torch.float32, blocks.device)[codes] * _powers_of_two(scales).unsqueeze(-1)
    return values.flatten(-2).to(dtype)


def quantize_mxfp4(weight: torch.Tensor) -> Mxfp4Tensor:
    """weight [..., K] (K a multiple of 32) in the checkpoint's MXFP4 layout. Each block's
    scale is the smallest power of two that brings its largest magnitude within 6 (so no
    value saturates), and each value divided by it rounds to the nearest FP4 value, ties to
    the even code. Values already on a block's grid come back exactly from
    `dequantize_mxfp4`; scales clamp to E8M0's finite range.

    Raises:
        ValueError: a last dimension that is not a multiple of 32, naming it.
    """
    if weight.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"MXFP4 quantizes rows of a multiple of {BLOCK_SIZE} values; this weight's rows have "
                         f"{weight.shape[-1]} (shape {tuple(weight.shape)})")
    grouped = weight.float().contiguous().unflatten(-1, (-1, BLOCK_SIZE))
    largest = grouped.abs().amax(dim=-1)
    # largest = m * 2 ** p with m in [0.5, 1): within 6 * 2 ** e for e = p - 3 when m <= 0.75, else p - 2.
    mantissa, power = torch.frexp(largest)
    exponent = (power - 2 - (mantissa <= 0.75).int()).clamp(-SCALE_BIAS, SCALE_BIAS)
    scales = (exponent + SCALE_BIAS).to(torch.uint8)
    scaled = grouped / _powers_of_two(scales).unsqueeze(-1)
    magnitude = scaled.abs()
    ties_up, ties_down = (torch.tensor(ties, device=weight.device) for ties in (_TIES_UP, _TIES_DOWN))
    # A magnitude's code counts the midpoints below it, and those it equals whose tie goes up.
    codes = torch.bucketize(magnitude, ties_up, right=True) + torch.bucketize(magnitude, ties_down)
    codes = (codes + 8 * (scaled < 0)).to(torch.uint8)
    return Mxfp4Tensor(blocks=codes[..., 0::2] | (codes[..., 1::2] << 4), scales=scales)


class Mxfp4MoEMethod:
    """A `FusedMoE`'s experts kept in MXFP4 as the checkpoint stores them, for the Triton
    kernel: buffers w13_blocks [E, 2I, H / 2] and w13_scales [E, 2I, H / 32] (gate rows, then
    up rows, as the dense w13), w2_blocks [E, H, I / 2] and w2_scales [E, H, I / 32], all
    uint8, filled by the family's loader (`engine.models.gpt_oss`); the dense w13 and w2 are
    never allocated. Biases and the clamped SwiGLU apply as on dense experts."""

    def create_weights(self, layer: "FusedMoE") -> None:
        """Replaces the layer's dense matrices (on the meta device, before it is placed) by
        the MXFP4 buffers.

        Raises:
            ValueError: features that are not whole blocks of 32 (a rank's share included).
        """
        experts, rows, hidden = layer.w13.shape
        inter = layer.w2.shape[2]
        if hidden % BLOCK_SIZE or inter % BLOCK_SIZE:
            raise ValueError(f"MXFP4 experts need hidden ({hidden}) and each rank's intermediate features ({inter}) "
                             f"in whole blocks of {BLOCK_SIZE}: use fewer tensor-parallel ranks")
        device = layer.w13.device
        shapes = {"w13_blocks": (rows, hidden // 2), "w13_scales": (rows, hidden // BLOCK_SIZE),
                  "w2_blocks": (hidden, inter // 2), "w2_scales": (hidden, inter // BLOCK_SIZE)}
        for name, shape in shapes.items():
            layer.register_buffer(name, torch.empty(experts, *shape, dtype=torch.uint8, device=device))
        for name in ("w13", "w2"):
            setattr(layer, name, nn.Parameter(torch.empty(0, device=device), requires_grad=False))

    def process_weights(self, layer: "FusedMoE") -> None:
        """Nothing: the loader wrote the blocks and scales as stored."""

    def apply(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        from engine.kernels.triton.fused_moe import Mxfp4Weights, fused_moe

        weights = Mxfp4Weights(layer.w13_blocks, layer.w13_scales, layer.w2_blocks, layer.w2_scales)
        clamped = layer.activation is not None
        return fused_moe(x, None, None, topk_weights, topk_ids, w13_bias=layer.w13_bias, w2_bias=layer.down_bias(),
                         limit=layer.activation.limit if clamped else None,
                         alpha=layer.activation.alpha if clamped else 1.0, mxfp4=weights)
