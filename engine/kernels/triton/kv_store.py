"""Writes a step's new keys and values into the paged cache at their slots, as the cache's
dtype: cast, or for an fp8 cache divided by a scale per (token, KV head) that is stored
beside it (`engine.kernels.kv_cache_quant`)."""

import torch
import triton
import triton.language as tl

from engine.kernels.kv_cache_quant import scaled_max


@triton.jit
def _round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, as float32.

    The conversion to fp8 that follows then only re-encodes: Triton's interpreter (which
    CI runs) drops the carry when a value rounds up to the next power of two (124.7 -> 64)."""
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    # Three mantissa bits: the grid's step is 2^(exponent - 3); subnormals (below 2^-6) step 2^-9.
    step = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    steps = tl.abs(x) / step
    below = tl.floor(steps)
    rest = steps - below
    up = (rest > 0.5) | ((rest == 0.5) & (below % 2 == 1))
    rounded = (below + tl.where(up, 1.0, 0.0)) * step
    return tl.where(x < 0, -rounded, rounded)


@triton.jit
def _store_heads(src_ptr, dst_ptr, scale_ptr, ok, head_ok, LARGEST: tl.constexpr):
    """One token's heads [heads, dims] from `src_ptr` into `dst_ptr`; with LARGEST (an fp8
    cache), each head divided by its largest magnitude / LARGEST, which goes to `scale_ptr`
    [heads]."""
    x = tl.load(src_ptr, mask=ok, other=0.0)
    if LARGEST != 0.0:
        x = x.to(tl.float32)
        scale = tl.max(tl.abs(x), 1) / LARGEST
        scale = tl.where(scale > 0, scale, 1.0)
        x = _round_to_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -LARGEST), LARGEST))
        tl.store(scale_ptr, scale, mask=head_ok)
    tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, k_stride, v_stride,
                     KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     LARGEST: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # a negative slot is a padding row (CUDA-graph batches)
        heads = tl.arange(0, BLOCK_H)
        head_ok = heads < KV_HEADS
        dims = tl.arange(0, BLOCK_D)
        ok = head_ok[:, None] & (dims < HEAD_DIM)[None, :]
        cols = heads[:, None] * HEAD_DIM + dims[None, :]
        cached = slot * KV_HEADS * HEAD_DIM + cols
        scales = slot * KV_HEADS + heads
        _store_heads(k_ptr + token * k_stride + cols, k_cache_ptr + cached, k_scale_ptr + scales, ok, head_ok, LARGEST)
        _store_heads(v_ptr + token * v_stride + cols, v_cache_ptr + cached, v_scale_ptr + scales, ok, head_ok, LARGEST)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             k_scale: torch.Tensor, v_scale: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] (each token's heads contiguous) into the caches
    [num_blocks, block_size, kv_heads, head_dim] at `slot_mapping` [tokens] (block *
    block_size + offset; negative: skip); for an fp8 cache with their scales into `k_scale`,
    `v_scale` [num_blocks, block_size, kv_heads] (else empty)."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    k, v = k.reshape(tokens, kv_heads * head_dim), v.reshape(tokens, kv_heads * head_dim)
    _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, k.stride(0), v.stride(0),
                                KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads),
                                BLOCK_D=triton.next_power_of_2(head_dim), LARGEST=scaled_max(k_cache.dtype))
