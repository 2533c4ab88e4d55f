"""int8 weights on a CPU (`quantization="int8"`): a 16- or 32-bit checkpoint's projections
and experts quantized at load, multiplied in int8.

Weights: symmetric, one scale per output feature (max |w| / 127), stored [in, out] as the
int8 product reads them. Activations: each row (token) quantized the same way on the fly,
so a row's result never depends on the rest of the batch. The product sums in int32,
exactly, on oneDNN's int8 kernels (VNNI or AMX where the CPU has them: twice the
bfloat16 rate on a Zen 4), then out = sum * row scale * feature scale (+ bias), rounded
once to the compute dtype. The compiled kernel (`engine/kernels/cpu_int8.cpp`) fuses the
passes around the product; PyTorch's operations compute the same where it cannot be built.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_build
from engine.quantization.at_load import QuantizedAtLoadMethod

if TYPE_CHECKING:
    from engine.layers.fused_moe import ExpertFn, FusedMoE

LEVELS = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (q [rows, in] int8, scale [rows, 1] float32), one scale per row."""
    rows = x.float()
    scale = rows.abs().amax(dim=1, keepdim=True) / LEVELS
    q = torch.round(rows / torch.where(scale > 0, scale, 1)).clamp_(-LEVELS, LEVELS)
    return q.to(torch.int8), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [in, out] int8, scale [out] float32), one scale per output
    feature: its rows quantized as activation rows are, stored transposed for the product."""
    q, scale = quantize_rows(weight.detach())
    return q.t().contiguous(), scale[:, 0]


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times the quantized weight (q [in, out], scale [out]) (+ bias), in x's dtype."""
    kernels = cpu_build.load()
    if kernels is not None:
        return kernels.int8_linear(x, q, scale, bias)
    rows, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = torch._int_mm(rows, q).float().mul_(x_scale).mul_(scale)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[1])


class Int8LinearMethod(QuantizedAtLoadMethod):
    """A `Linear`'s weight as int8 (`qweight` [in, out], `weight_scale` [out])."""

    quantize = staticmethod(quantize_weight)
    product = staticmethod(int8_linear)


class Int8MoEMethod:
    """A `FusedMoE`'s experts as int8: buffers w13_qweight [E, H, 2I], w13_scale [E, 2I],
    w2_qweight [E, I, H], w2_scale [E, H]."""

    def process_weights(self, layer: "FusedMoE") -> None:
        """Quantizes every expert's loaded matrices and drops them."""
        for name in ("w13", "w2"):
            weight = getattr(layer, name)
            pieces = [quantize_weight(matrix) for matrix in weight]
            layer.register_buffer(f"{name}_qweight", torch.stack([q for q, _ in pieces]))
            layer.register_buffer(f"{name}_scale", torch.stack([s for _, s in pieces]))
            setattr(layer, name, nn.Parameter(torch.empty(0, dtype=weight.dtype), requires_grad=False))

    def apply(self, layer: "FusedMoE", x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
        kernels = cpu_build.load()
        if kernels is not None:
            return kernels.fused_moe_int8(x, topk_weights, topk_ids, layer.w13_qweight, layer.w13_scale,
                                          layer.w2_qweight, layer.w2_scale)
        return layer.grouped(x, topk_weights, topk_ids, self._expert(layer))

    @staticmethod
    def _expert(layer: "FusedMoE") -> "ExpertFn":
        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = int8_linear(rows, layer.w13_qweight[e], layer.w13_scale[e]).chunk(2, dim=-1)
            return int8_linear(F.silu(gate).mul_(up), layer.w2_qweight[e], layer.w2_scale[e])
        return expert
