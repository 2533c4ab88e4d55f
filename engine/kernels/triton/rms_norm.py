"""RMSNorm with the residual add fused in: one pass over each row instead of four."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, eps,
                     HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < HIDDEN
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        # The sum rounded to the residual stream's dtype.
        x = (x.to(tl.float32) + tl.load(residual_ptr + row * HIDDEN + cols, mask=ok, other=0.0).to(tl.float32))
        x = x.to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * HIDDEN + cols, x, mask=ok)
    x = x.to(tl.float32)
    normed = x * tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    out = weight * normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rms_norm(x) for x [rows, hidden], computed in float32, in x's dtype; given
    `residual`, of x + residual, and that sum is returned too, in residual's dtype (the
    next residual)."""
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(residual) if residual is not None else out
    if rows:
        _rms_norm_kernel[(rows,)](x, residual.contiguous() if residual is not None else x, weight, out, residual_out,
                                  x.stride(0), eps, HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden),
                                  HAS_RESIDUAL=residual is not None)
    return out if residual is None else (out, residual_out)
