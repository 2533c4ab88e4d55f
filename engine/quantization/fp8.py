"""FP8 products on a GPU with FP8 units (`quantization="fp8"`, or an FP8 checkpoint).

Weights: e4m3, one scale per output feature (max |w| / 448), quantized once the weights
are in. A 16-bit checkpoint is quantized so at load, as vLLM's `quantization="fp8"` does;
an FP8 checkpoint arrives dequantized (`engine.quantization.checkpoint`) and quantizes
back to its own values where it was stored per output feature (the scale comes back within
bfloat16's rounding), and to finer scales where it was stored per tensor. Activations:
each row (token) quantized the same way on the fly, so a row's result never depends on the
rest of the batch. The product is `torch._scaled_mm` with both scales (row-wise scaling,
Hopper's FP8 tensor cores); elsewhere (the tests, on a CPU) the same arithmetic in float32.
"""

import torch

from engine.quantization.at_load import QuantizedAtLoadMethod

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def fp8_products_available(device: torch.device) -> bool:
    """Whether `device` multiplies in FP8: a CUDA GPU of compute capability 8.9 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] -> (q [rows, in] e4m3, scale [rows, 1] float32), one scale per row."""
    rows = x.float()
    scale = rows.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12) / FP8_MAX
    return (rows / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] times the FP8 weight (q [out, in], scale [1, out]) (+ bias), in x's dtype."""
    rows, x_scale = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
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
    """A `Linear`'s weight as FP8 (`qweight` [out, in] e4m3, `weight_scale` [1, out])."""

    quantize = staticmethod(quantize_fp8_weight)
    product = staticmethod(fp8_linear)
