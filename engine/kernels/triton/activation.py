"""SiLU of the gate times the up projection, from the fused gate/up output in one pass."""

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < WIDTH
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + WIDTH + cols, mask=ok, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * WIDTH + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x [rows, 2 * width] = [gate | up]. Returns [rows, width]."""
    rows, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(width))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(width, block))](x, out, x.stride(0), WIDTH=width, BLOCK=block)
    return out
