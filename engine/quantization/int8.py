"""int8 weights on a CPU (`quantization="int8"`, the default on CPUs with VNNI or AMX that
compute in bfloat16, and of pooling models on AVX2 CPUs without VNNI): a 16- or 32-bit
checkpoint's projections and experts quantized at load, multiplied in int8.

Weights: symmetric, one scale per output feature (max |w| / 127), stored [in, out] as the
int8 product reads them. Activations: each row (token) quantized the same way on the fly,
so a row's result never depends on the rest of the batch. A projection whose input ranges
were measured at load (`engine.worker.calibration`) is smoothed first, as SmoothQuant
does: each input channel j is divided by s_j = range_j^0.5 / max|w_j|^0.5 and its weight
column multiplied by it (the same product, with the activations' outlier channels tamed so
that one row scale suits them all), and its `OUTLIER_CHANNELS` widest channels after that
skip the int8 product and are summed in float32 instead. On the embedded model this takes
greedy agreement with bfloat16 from 16 to 30 of 64 prompts (benchmarks/RESULTS.md). The
product sums in int32, exactly, on oneDNN's int8 kernels (VNNI or AMX where the CPU has
them: twice the bfloat16 rate on a Zen 4) or, on other AVX2 CPUs, as int16 pairs in the
compiled kernel (`engine/kernels/cpu_int8_product.cpp`: 1.7x float32 on a Zen 3), then
out = sum * row scale * feature scale (+ bias) (+ the outliers' sum), rounded once to the
compute dtype. The compiled kernel (`engine/kernels/cpu_int8.cpp`) fuses the passes around
the product; PyTorch's operations compute the same where it cannot be built (the outliers'
sum to float32 rounding).
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.hardware import onednn_sums_int8_exactly
from engine.kernels import cpu_build
from engine.quantization.at_load import QuantizedAtLoadMethod

if TYPE_CHECKING:
    from engine.layers.fused_moe import ExpertFn, FusedMoE
    from engine.layers.linear import Linear

LEVELS = 127
SMOOTHING_ALPHA = 0.5
OUTLIER_CHANNELS = 16


@dataclass(frozen=True)
class Int8Smoothing:
    """How a calibrated projection is smoothed: `input_scale` [in] float32 multiplies each
    input channel before the row is quantized (1 / s_j; 0 for the outlier channels, which
    leaves them out of the int8 sums), and the outlier channels (`outlier_index` [k] int64)
    meet their weight columns (`outlier_weight` [k, out] float32) in float32. A bfloat16
    model's also come as `outlier_pairs` [k // 2, out] int32, channels 2j and 2j + 1 as two
    bfloat16 in one word (2j in the low half): the compiled kernel multiplies its bfloat16
    rows by them in bfloat16 dot products, two channels an instruction."""

    input_scale: torch.Tensor
    outlier_index: torch.Tensor
    outlier_weight: torch.Tensor
    outlier_pairs: torch.Tensor | None = None

    @classmethod
    def plan(cls, weight: torch.Tensor, input_range: torch.Tensor) -> "Int8Smoothing":
        """The smoothing of a projection (weight [out, in], in the model's dtype) whose inputs
        reached |x_j| <= input_range[j] on the calibration text."""
        columns = weight
        weight = weight.float()
        factor = input_range.float().clamp(min=1e-5) ** SMOOTHING_ALPHA
        factor /= weight.abs().amax(0).clamp(min=1e-5) ** (1 - SMOOTHING_ALPHA)
        input_scale = 1 / factor.clamp(min=torch.finfo(torch.float32).tiny)
        count = min(OUTLIER_CHANNELS, weight.shape[1] // 8)
        index = (input_range.float() * input_scale).topk(count).indices.sort().values
        input_scale[index] = 0
        pairs = bfloat16_pairs(columns[:, index].t()) if columns.dtype == torch.bfloat16 else None
        return cls(input_scale.contiguous(), index, weight[:, index].t().contiguous(), pairs)

    def smoothed(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [out, in] with each input column divided by its input scale (the outlier
        columns zeroed): what the int8 product multiplies the scaled input by."""
        weight = weight.float()
        return torch.where(self.input_scale > 0, weight / self.input_scale.clamp(min=1e-30), 0)


def bfloat16_pairs(rows: torch.Tensor) -> torch.Tensor:
    """rows [k, out] bfloat16 -> [k // 2, out] int32: rows 2j and 2j + 1 as one word per
    column, row 2j in the low half (a trailing odd row is left out)."""
    pairs = rows[: rows.shape[0] // 2 * 2].reshape(-1, 2, rows.shape[1]).transpose(1, 2).contiguous()
    return pairs.view(torch.int32).squeeze(-1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (q [rows, in] int8, scale [rows, 1] float32), one scale per row."""
    rows = x.float()
    scale = rows.abs().amax(dim=1, keepdim=True) / LEVELS
    q = torch.round(rows * (1 / torch.where(scale > 0, scale, 1))).clamp_(-LEVELS, LEVELS)
    return q.to(torch.int8), scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [in, out] int8, scale [out] float32), one scale per output
    feature: its rows quantized as activation rows are, stored transposed for the product."""
    q, scale = quantize_rows(weight.detach())
    return q.t().contiguous(), scale[:, 0]


def int8_sums(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The exact int32 sums of int8 rows [n, in] times q [in, out]: oneDNN's int8 product
    where it sums int8 pairs in hardware (VNNI, AMX); elsewhere its kernels saturate, and a
    float64 product (exact below 2^53) stands in."""
    if onednn_sums_int8_exactly():
        return torch._int_mm(rows, q)
    return (rows.double() @ q.double()).to(torch.int32)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                smoothing: Int8Smoothing | None = None) -> torch.Tensor:
    """x [..., in] times the quantized weight (q [in, out], scale [out]) (+ bias), in x's
    dtype; with `smoothing`, x scaled per channel first and its outlier channels' product
    added in float32. PyTorch's operations stand in where the kernel cannot be built, with
    the same bits except for the outliers' sum, which the kernel takes in fused steps."""
    kernels = cpu_build.load()
    if kernels is not None:
        return kernels.int8_linear(x, q, scale, bias, *_kernel_smoothing(smoothing))
    flat = x.reshape(-1, x.shape[-1])
    rows, x_scale = quantize_rows(flat if smoothing is None else flat.float() * smoothing.input_scale)
    out = int8_sums(rows, q).float().mul_(x_scale).mul_(scale)
    if bias is not None:
        out += bias.float()
    if smoothing is not None:
        out += flat[:, smoothing.outlier_index].float() @ smoothing.outlier_weight
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[1])


def _kernel_smoothing(smoothing: Int8Smoothing | None) -> list[torch.Tensor | None]:
    """A smoothing as the compiled kernels take it (Nones for none)."""
    if smoothing is None:
        return [None] * 4
    return [smoothing.input_scale, smoothing.outlier_index, smoothing.outlier_weight, smoothing.outlier_pairs]


def kernel_weight(layer: "Linear") -> list[torch.Tensor | None]:
    """A quantized projection as the compiled MLP takes it: q, scale, bias and its smoothing."""
    return [layer.qweight, layer.weight_scale, layer.bias, *_kernel_smoothing(layer.__dict__.get("smoothing"))]


def quantized_without_adapter(layer: "Linear") -> bool:
    """Whether a compiled kernel can multiply by `layer` through its int8 weight alone: quantized
    already (`qweight`), with no LoRA adapter whose deltas Python adds."""
    return isinstance(layer.quant_method, Int8LinearMethod) and hasattr(layer, "qweight") and layer.lora is None


def int8_gated_mlp(x: torch.Tensor, gate_up: "Linear", down: "Linear", activation: str) -> torch.Tensor | None:
    """The gated MLP down(act(gate) * up) of two int8 projections in one compiled call, the
    same bits as `int8_linear`, the activation kernel and `int8_linear` in turn; None where
    it cannot run it (no compiled kernels, weights not yet quantized, an adapter on either
    projection, or a down projection summed over tensor-parallel ranks), and the caller
    takes those three steps itself."""
    kernels = cpu_build.load()
    fusable = all(map(quantized_without_adapter, (gate_up, down)))
    if kernels is None or not fusable or getattr(down, "group", None) is not None and down.group.size > 1:
        return None
    return kernels.int8_gated_mlp(x, kernel_weight(gate_up), kernel_weight(down), activation == "gelu_tanh")


class Int8LinearMethod(QuantizedAtLoadMethod):
    """A `Linear`'s weight as int8 (`qweight` [in, out], `weight_scale` [out]), smoothed
    (`Int8Smoothing`, buffers `input_scale`, `outlier_index`, `outlier_weight`) when the
    calibration left the layer an `input_range` before the weights were quantized."""

    quantize = staticmethod(quantize_weight)
    wants_input_range = True

    def weight_to_quantize(self, layer: "Linear") -> torch.Tensor:
        """The weight, smoothed if the layer was calibrated (the smoothing kept as buffers)."""
        input_range = layer.__dict__.pop("input_range", None)
        if input_range is None:
            return layer.weight.detach()
        smoothing = Int8Smoothing.plan(layer.weight.detach(), input_range)
        for name, value in vars(smoothing).items():
            layer.register_buffer(name, value)
        layer.smoothing = smoothing
        return smoothing.smoothed(layer.weight.detach())

    def apply(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int8_linear(x, layer.qweight, layer.weight_scale, bias, layer.__dict__.get("smoothing"))


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
        """Plain SwiGLU experts in one C++ call where it is built; experts with biases or
        the clamped SwiGLU (gpt-oss) one int8 product pair per expert that received rows."""
        kernels = cpu_build.load()
        if kernels is not None and layer.plain:
            return kernels.fused_moe_int8(x, topk_weights, topk_ids, layer.w13_qweight, layer.w13_scale,
                                          layer.w2_qweight, layer.w2_scale)
        return layer.grouped(x, topk_weights, topk_ids, self._expert(layer))

    @staticmethod
    def _expert(layer: "FusedMoE") -> "ExpertFn":
        bias13, bias2 = layer.w13_bias, layer.down_bias()

        def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = int8_linear(rows, layer.w13_qweight[e], layer.w13_scale[e],
                                   None if bias13 is None else bias13[e]).chunk(2, dim=-1)
            hidden = F.silu(gate).mul_(up) if layer.activation is None else layer.activation(gate, up)
            return int8_linear(hidden, layer.w2_qweight[e], layer.w2_scale[e], None if bias2 is None else bias2[e])
        return expert
