"""Rotary position embedding of queries and keys in one launch, from the cos/sin table."""

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, out_ptr, x_stride, HEADS: tl.constexpr,
                   HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    ok = (heads[:, None] < HEADS) & (dims[None, :] < HEAD_DIM)
    rotates = dims < ROTARY_DIM
    partner = tl.where(rotates, (dims + ROTARY_DIM // 2) % ROTARY_DIM, dims)
    base = x_ptr + token * x_stride + heads[:, None] * HEAD_DIM
    x = tl.load(base + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    rolled = tl.load(base + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + position * ROTARY_DIM + dims, mask=rotates, other=1.0)
    sin = tl.load(sin_ptr + position * ROTARY_DIM + dims, mask=rotates, other=0.0)
    out = x * cos[None, :] + rolled * sin[None, :]
    tl.store(out_ptr + (token * HEADS + heads[:, None]) * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok)


def rotary(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [tokens, heads, head_dim] (each token's heads contiguous) by `positions`:
    the first rotary_dim features as x * cos + roll(x, rotary_dim / 2) * sin with the
    float32 tables cos, sin [max_position, rotary_dim] (sin signed: -sin on the first
    half), the rest unchanged. Returns a new contiguous tensor."""
    tokens, heads, head_dim = x.shape
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens:
        _rotary_kernel[(tokens,)](x, positions, cos, sin, out, x.stride(0), HEADS=heads, HEAD_DIM=head_dim,
                                  ROTARY_DIM=cos.shape[1], BLOCK_H=triton.next_power_of_2(heads),
                                  BLOCK_D=triton.next_power_of_2(head_dim))
    return out
