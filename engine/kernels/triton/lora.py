"""Batched LoRA products for a step whose rows use different adapters (SGMV, as in Punica):
one launch per product for every adapter in the step.

The step's rows come grouped by adapter slot; `segments` [3, groups] holds each group's first
row, row count and slot. `sgmv` multiplies each group's rows by its slot's matrix: the
shrink (x [rows, in] by A [slots, in, width]) and the expand (by B [slots, width, out], added
into the projection's output) are the same kernel.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _sgmv_kernel(x_ptr, w_ptr, out_ptr, segments_ptr, num_groups, x_stride, out_stride, w_slot_stride, K, N,
                 ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    group = tl.program_id(0)
    m_block = tl.program_id(1)
    n_block = tl.program_id(2)
    start = tl.load(segments_ptr + group)
    length = tl.load(segments_ptr + num_groups + group)
    slot = tl.load(segments_ptr + 2 * num_groups + group)
    if m_block * BLOCK_M < length:
        local = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = local < length
        rows = start + local
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + slot * w_slot_stride + ks[:, None] * N + cols[None, :],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(a, b, input_precision=PRECISION)
        ptrs = out_ptr + rows[:, None] * out_stride + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        if ADD:
            acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, weights: torch.Tensor, segments: torch.Tensor, max_rows: int,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """For each group g: rows [start, start + length) of x [rows, K] times weights[slot]
    [K, N]; into a new [rows, N] tensor (rows outside every group are zeros), or added into
    `out`. `segments` [3, groups] int (start, length, slot); `max_rows` bounds a group's length."""
    rows, k = x.shape
    n = weights.shape[2]
    add = out is not None
    if out is None:
        out = torch.zeros(rows, n, dtype=x.dtype, device=x.device)
    groups = segments.shape[1]
    if groups and rows:
        block_n = min(64, max(16, triton.next_power_of_2(n)))
        grid = (groups, triton.cdiv(max_rows, 16), triton.cdiv(n, block_n))
        _sgmv_kernel[grid](x, weights.contiguous(), out, segments, groups, x.stride(0), out.stride(0),
                           weights.stride(0), k, n, ADD=add, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32,
                           PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out
