"""FP8 products on a GPU with FP8 units (`quantization="fp8"`, or an FP8 checkpoint).

Weights: e4m3, one scale per output feature (max |w| / 448), quantized once the weights
are in. A 16-bit checkpoint is quantized so at load, as vLLM's `quantization="fp8"` does;
an FP8 checkpoint arrives dequantized (`engine.quantization.checkpoint`) and quantizes
back to its own values where it was stored per output feature (the scale comes back within
bfloat16's rounding), and to finer scales where it was stored per tensor. Activations:
each row (token) quantized the same way on the fly, so a row's result never depends on the
rest of the batch; on a GPU in one Triton launch (`engine.kernels.triton.fp8_quant`, the same
bits as `quantize_fp8_rows`). The product is `torch._scaled_mm` with both scales (row-wise
scaling, Hopper's FP8 tensor cores); elsewhere (the tests, on a CPU) the same arithmetic in float32.
"""

import functools
from collections.abc import Callable

import torch

from engine.kernels import triton as triton_kernels
from engine.quantization.at_load import QuantizedAtLoadMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
RowQuantizer = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fp8_products_available(device: torch.device) -> bool:
    """Whether `device` multiplies in FP8: a CUDA GPU of compute capability 8.9 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (q [rows, in] e4m3, scale [rows, 1] float32), one scale per row.

    The scale is the row's largest magnitude times float32's 1 / 448: PyTorch divides by a
    Python number on a GPU as that product (on a CPU it divides, which differs in the last bit
    for about half the rows), so written as the product its bits are the same on both, and the
    fused kernel's."""
    rows = x.float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) * (1 / FP8_MAX)
    return (rows / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def row_quantizer(device: torch.device) -> RowQuantizer:
    """What quantizes the activation rows of the products on `device`: on a GPU, with Triton
    installed, the fused kernel (one launch in place of PyTorch's seven), elsewhere
    `quantize_fp8_rows`; both give the same bits."""
    if device.type == "cuda" and triton_kernels.installed():
        from engine.kernels.triton.fp8_quant import quantize_fp8_rows as fused  # Triton's modules load where they run

        return fused
    return quantize_fp8_rows


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               quantize_rows: RowQuantizer = quantize_fp8_rows) -> torch.Tensor:
    """x [..., in] times the FP8 weight (q [out, in], scale [1, out]) (+ bias), in x's dtype,
    x's rows quantized by `quantize_rows`. On a GPU `torch._scaled_mm` rounds to bfloat16 (its
    only output type with row-wise scales on every PyTorch and CUDA release): for a bfloat16 x
    and bias, the casts around it do nothing."""
    rows, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    if x.is_cuda:
        out = torch._scaled_mm(rows, q.t(), scale_a=x_scale, scale_b=scale, out_dtype=torch.bfloat16,
                               bias=None if bias is None else bias.to(torch.bfloat16))
    else:
        out = (rows.float() * x_scale) @ (q.float() * scale.t()).t()
        if bias is not None:
            out += bias.float()
    return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])


def quantize_fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (q [out, in] e4m3, scale [1, out] float32), as `torch._scaled_mm`
    takes them."""
    q, scale = quantize_fp8_rows(weight)
    return q, scale.t().contiguous()


class Fp8LinearMethod(QuantizedAtLoadMethod):
    """A `Linear`'s weight as FP8 (`qweight` [out, in] e4m3, `weight_scale` [1, out]), its
    products' activation rows quantized by what `row_quantizer` picks for `device`."""

    quantize = staticmethod(quantize_fp8_weight)

    def __init__(self, device: torch.device) -> None:
        self.product = functools.partial(fp8_linear, quantize_rows=row_quantizer(device))
