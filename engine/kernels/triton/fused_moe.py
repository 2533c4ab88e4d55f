"""The experts of a mixture-of-experts layer in two grouped launches for all experts at once.

A step's T * top_k slots (slot t * top_k + j: token t's j-th expert) are sorted by expert
and each expert's run is padded to a multiple of BLOCK_M (the "align" step, as vLLM's
moe_align_block_size), so that every block of BLOCK_M sorted slots belongs to one expert
and experts without a slot get no block. One launch computes silu(gate) * up for every
block, gathering x's rows by the slots' tokens; a second the down product, scaled by each
slot's routing weight, into a [T, top_k, H] float32 buffer whose top_k rows per token
are then summed: a fixed order, the same bits from run to run (no atomics).

gpt-oss's experts add a bias to each product and clamp their SwiGLU (`clamped_swiglu`):
compile-time switches of the same two launches. Their MXFP4 checkpoints' matrices are read
as stored (`Mxfp4Weights`: a quarter of bfloat16's bytes): each tile of 32 input features
of a row is its 16 bytes of E2M1 codes and its one E8M0 scale, turned into the
activations' dtype in registers, exactly as `engine.quantization.mxfp4.dequantize_mxfp4`
rounds them, before the product.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.triton.activation import silu_mul

_BLOCK_K = 32  # also MXFP4's block: one scale per row of a tile


@dataclass(frozen=True)
class Mxfp4Weights:
    """The experts' matrices in MXFP4: w13 [E, 2I, H / 2] and w2 [E, H, I / 2] uint8 (two
    E2M1 codes a byte, the low nibble first, rows as `fused_moe`'s dense w13 and w2), and
    their scales w13_scales [E, 2I, H / 32], w2_scales [E, H, I / 32] uint8 (E8M0)."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


@triton.jit
def _fp4_values(codes):
    """E2M1 codes (uint8 tile, 0-15) as float32: bit 3 the sign, bits 1-2 the exponent,
    bit 0 the mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    codes = codes.to(tl.int32)
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).to(tl.float32)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + 0.5 * mantissa))
    return tl.where(codes >= 8, -magnitude, magnitude)


@triton.jit
def _mxfp4_tile(blocks_ptr, scales_ptr, w_rows, w_row_ok, k0, K: tl.constexpr, BLOCK_N: tl.constexpr,
                dtype: tl.constexpr):
    """Rows `w_rows` of an MXFP4 matrix [*, K], features k0..k0 + 32, as a [32, BLOCK_N] tile
    of `dtype` (transposed, as `_expert_product` multiplies it)."""
    bytes_ = tl.load(blocks_ptr + w_rows[None, :] * (K // 2) + (k0 // 2 + tl.arange(0, 16))[:, None],
                     mask=w_row_ok[None, :], other=0)
    codes = tl.reshape(tl.permute(tl.join(bytes_ & 0x0F, bytes_ >> 4), (0, 2, 1)), (32, BLOCK_N))
    exponents = tl.load(scales_ptr + w_rows * (K // 32) + k0 // 32, mask=w_row_ok, other=127).to(tl.float32)
    return (_fp4_values(codes) * tl.exp2(exponents - 127.0)[None, :]).to(dtype)


@triton.jit
def _expert_product(a_ptr, a_rows, row_ok, a_stride, w_ptr, w_scales_ptr, w_rows, w_row_ok, K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    MXFP4: tl.constexpr):
    """a[a_rows] [BLOCK_M, K] times w[w_rows].T [K, BLOCK_N] in float32, w row-major [*, K]
    (MXFP4: its blocks [*, K / 2] and scales [*, K / 32], K a multiple of 32)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * a_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if MXFP4:
            w = _mxfp4_tile(w_ptr, w_scales_ptr, w_rows, w_row_ok, k0, K, BLOCK_N, a.dtype)
        else:
            w = tl.load(w_ptr + w_rows[None, :] * K + ks[:, None], mask=k_ok[:, None] & w_row_ok[None, :],
                        other=0.0)
        acc += tl.dot(a, w, input_precision=PRECISION)
    return acc


@triton.jit
def _block_tile(sorted_slots_ptr, num_slots, width, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's block of sorted slots and tile of output columns (of `width`), with
    which of each are real."""
    slots = tl.load(sorted_slots_ptr + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return slots, slots < num_slots, cols, cols < width


@triton.jit
def _with_bias(acc, bias_ptr, cols, col_ok, dtype: tl.constexpr):
    """A float32 product tile rounded to `dtype`, plus bias[cols] rounded again, as PyTorch
    computes `x @ w + b` (transformers' gpt-oss experts), back in float32."""
    bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    return (acc.to(dtype).to(tl.float32) + bias).to(dtype).to(tl.float32)


@triton.jit
def clamped_swiglu(gate, up, ALPHA: tl.constexpr, LIMIT: tl.constexpr, dtype: tl.constexpr):
    """gpt-oss's (up + 1) * gate * sigmoid(ALPHA * gate), gate clamped above and up on both
    sides at LIMIT, of float32 tiles, each step rounded to `dtype` as PyTorch rounds it."""
    gate = tl.minimum(gate.to(dtype).to(tl.float32), LIMIT)
    up = tl.minimum(tl.maximum(up.to(dtype).to(tl.float32), -LIMIT), LIMIT)
    scaled = (gate * ALPHA).to(dtype).to(tl.float32)
    sigmoid = (1.0 / (1.0 + tl.exp(-scaled))).to(dtype).to(tl.float32)
    glu = (gate * sigmoid).to(dtype).to(tl.float32)
    return ((up + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)


@triton.jit
def _gate_up_kernel(x_ptr, w13_ptr, w13_scales_ptr, b13_ptr, act_ptr, sorted_slots_ptr, block_experts_ptr,
                    num_slots, x_stride, TOP_K: tl.constexpr, NUM_EXPERTS: tl.constexpr, INTER: tl.constexpr,
                    HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, ALPHA: tl.constexpr,
                    LIMIT: tl.constexpr, MXFP4: tl.constexpr):
    """act[slot, cols] = silu(gate) * up (CLAMPED: `clamped_swiglu`) of x[slot // TOP_K]
    through the block's expert, with its gate and up biases where HAS_BIAS."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < NUM_EXPERTS:
        slots, slot_ok, cols, col_ok = _block_tile(sorted_slots_ptr, num_slots, INTER, BLOCK_M, BLOCK_N)
        if MXFP4:
            w = w13_ptr + expert.to(tl.int64) * (INTER * HIDDEN)
            w_scales = w13_scales_ptr + expert.to(tl.int64) * (2 * INTER * (HIDDEN // 32))
        else:
            w = w13_ptr + expert.to(tl.int64) * (2 * INTER * HIDDEN)
            w_scales = w13_scales_ptr
        tokens = slots // TOP_K
        gate = _expert_product(x_ptr, tokens, slot_ok, x_stride, w, w_scales, cols, col_ok, HIDDEN, BLOCK_M, BLOCK_N,
                               BLOCK_K, PRECISION, MXFP4)
        up = _expert_product(x_ptr, tokens, slot_ok, x_stride, w, w_scales, INTER + cols, col_ok, HIDDEN, BLOCK_M,
                             BLOCK_N, BLOCK_K, PRECISION, MXFP4)
        dtype = act_ptr.dtype.element_ty
        if HAS_BIAS:
            bias = b13_ptr + expert.to(tl.int64) * (2 * INTER)
            gate = _with_bias(gate, bias, cols, col_ok, dtype)
            up = _with_bias(up, bias, INTER + cols, col_ok, dtype)
        if CLAMPED:
            act = clamped_swiglu(gate, up, ALPHA, LIMIT, dtype)
        else:
            act = silu_mul(gate, up, dtype)
        tl.store(act_ptr + slots[:, None] * INTER + cols[None, :], act, mask=slot_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w2_ptr, w2_scales_ptr, b2_ptr, weights_ptr, out_ptr, sorted_slots_ptr, block_experts_ptr,
                 num_slots, NUM_EXPERTS: tl.constexpr, INTER: tl.constexpr, HIDDEN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr):
    """out[slot, cols] = weight[slot] * (act[slot] through the block's expert's down matrix,
    plus its bias where HAS_BIAS), the product rounded to act's dtype first as PyTorch's
    would be."""
    expert = tl.load(block_experts_ptr + tl.program_id(0))
    if expert < NUM_EXPERTS:
        slots, slot_ok, cols, col_ok = _block_tile(sorted_slots_ptr, num_slots, HIDDEN, BLOCK_M, BLOCK_N)
        if MXFP4:
            w = w2_ptr + expert.to(tl.int64) * (HIDDEN * (INTER // 2))
            w_scales = w2_scales_ptr + expert.to(tl.int64) * (HIDDEN * (INTER // 32))
        else:
            w = w2_ptr + expert.to(tl.int64) * (HIDDEN * INTER)
            w_scales = w2_scales_ptr
        acc = _expert_product(act_ptr, slots, slot_ok, INTER, w, w_scales, cols, col_ok, INTER, BLOCK_M, BLOCK_N,
                              BLOCK_K, PRECISION, MXFP4)
        scale = tl.load(weights_ptr + slots, mask=slot_ok, other=0.0)
        if HAS_BIAS:
            acc = _with_bias(acc, b2_ptr + expert.to(tl.int64) * HIDDEN, cols, col_ok, act_ptr.dtype.element_ty)
        acc = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * scale[:, None]
        tl.store(out_ptr + slots[:, None] * HIDDEN + cols[None, :], acc, mask=slot_ok[:, None] & col_ok[None, :])


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots sorted by expert, each expert's run padded to a multiple of `block_m`
    with the invalid slot T * top_k: sorted_slots [blocks * block_m] int32; and each
    block's expert, block_experts [blocks] int32, `num_experts` for blocks past the last.

    No host sync (a CUDA graph can hold it): `blocks` is the bound slots // block_m +
    min(experts, slots) rather than the count, and the surplus blocks' programs exit."""
    flat = topk_ids.reshape(-1).long()
    slots = flat.numel()
    blocks = slots // block_m + min(num_experts, slots)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    place_in_run = torch.arange(slots, device=flat.device) - (counts.cumsum(0) - counts)[expert_of]
    sorted_slots = torch.full((blocks * block_m,), slots, dtype=torch.int32, device=flat.device)
    sorted_slots[(padded_ends - padded)[expert_of] + place_in_run] = order.to(torch.int32)
    block_starts = torch.arange(blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).to(torch.int32)
    return sorted_slots, block_experts


def _tile(width: int) -> int:
    return min(64, max(16, triton.next_power_of_2(width)))


def fused_moe(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int | None = None, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, limit: float | None = None, alpha: float = 1.0,
              mxfp4: Mxfp4Weights | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = topk_ids[t, j],
    for x [T, H], w13 [E, 2 * I, H] (each expert's gate rows, then its up rows) and
    w2 [E, H, I], or their `mxfp4` form (then w13 and w2 are None; H and I multiples of 32).
    Returns [T, H] in x's dtype. `block_m` (slots per block, a power of two of at least 16)
    defaults to one for the step's average slots per expert.

    gpt-oss's experts: w13_bias [E, 2 * I] (gate, then up) and w2_bias [E, H] are added to
    the products; a `limit` replaces silu(gate) * up by `clamped_swiglu` with `alpha`."""
    tokens, hidden = x.shape
    if mxfp4 is not None:
        w13, w2 = mxfp4.w13, mxfp4.w2
        w13_scales, w2_scales = mxfp4.w13_scales.contiguous(), mxfp4.w2_scales.contiguous()
        num_experts, inter = w2.shape[0], 2 * w2.shape[2]
    else:
        w13_scales = w2_scales = w13
        num_experts, inter = w2.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    slots = tokens * top_k
    if slots == 0:
        return torch.zeros_like(x)
    block_m = block_m or _tile(slots // num_experts)
    sorted_slots, block_experts = align(topk_ids, num_experts, block_m)
    blocks = block_experts.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    block_n = _tile(inter)
    w13 = w13.contiguous()
    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        x, w13, w13_scales, w13 if w13_bias is None else w13_bias.contiguous(), act, sorted_slots, block_experts,
        slots, x.stride(0), TOP_K=top_k, NUM_EXPERTS=num_experts, INTER=inter, HIDDEN=hidden, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=_BLOCK_K, PRECISION=precision, HAS_BIAS=w13_bias is not None,
        CLAMPED=limit is not None, ALPHA=float(alpha), LIMIT=float(limit or 0.0), MXFP4=mxfp4 is not None)
    out = torch.empty(slots, hidden, dtype=torch.float32, device=x.device)
    block_n = _tile(hidden)
    w2 = w2.contiguous()
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        act, w2, w2_scales, w2 if w2_bias is None else w2_bias.contiguous(), topk_weights.float().contiguous(), out,
        sorted_slots, block_experts, slots, NUM_EXPERTS=num_experts, INTER=inter, HIDDEN=hidden, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=_BLOCK_K, PRECISION=precision, HAS_BIAS=w2_bias is not None,
        MXFP4=mxfp4 is not None)
    return out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
