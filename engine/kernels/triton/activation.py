"""The gated activations of the MLPs, act(gate) times the up projection, from the fused
gate/up output in one pass: SiLU (SwiGLU: Llama, Qwen, Mistral, Phi-3, the experts of the
mixtures) and tanh-approximated GELU (GeGLU: Gemma)."""

import torch
import triton
import triton.language as tl

ACTIVATIONS = ("silu", "gelu_tanh")


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of float32 tiles, rounded as PyTorch computes it in `dtype`: the
    gate and up products, then silu's result, each rounded to `dtype` before the product.
    Shared with kernels that compute gate and up themselves (`fused_moe`)."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _gelu_tanh_mul(gate, up, dtype: tl.constexpr):
    """gelu_tanh(gate) * up, rounded like `silu_mul`: 0.5 g (1 + tanh(u)) = g sigmoid(2u),
    u = sqrt(2 / pi) (g + 0.044715 g^3)."""
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
    gelu = (gate / (1.0 + tl.exp(-2.0 * inner))).to(dtype).to(tl.float32)
    return (gelu * up).to(dtype)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, x_stride, WIDTH: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
    if GELU:
        out = _gelu_tanh_mul(gate, up, out_ptr.dtype.element_ty)
    else:
        out = silu_mul(gate, up, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * WIDTH + cols, out, mask=ok)


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for x [rows, 2 * width] = [gate | up], act one of `ACTIVATIONS`.
    Returns [rows, width]."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _act_and_mul_kernel[(rows, triton.cdiv(width, block))](x, out, x.stride(0), WIDTH=width, BLOCK=block,
                                                               GELU=activation == "gelu_tanh")
    return out

