"""Writes a step's new keys and values into the paged cache at their slots."""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_stride, v_stride,
                     WIDTH: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:  # a negative slot is a padding row (CUDA-graph batches)
        cols = tl.arange(0, BLOCK)
        ok = cols < WIDTH
        tl.store(k_cache_ptr + slot * WIDTH + cols, tl.load(k_ptr + token * k_stride + cols, mask=ok), mask=ok)
        tl.store(v_cache_ptr + slot * WIDTH + cols, tl.load(v_ptr + token * v_stride + cols, mask=ok), mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, head_dim] (each token's heads contiguous) into the caches
    [num_blocks, block_size, kv_heads, head_dim] at `slot_mapping` [tokens] (block *
    block_size + offset; negative: skip)."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    width = k.shape[1] * k.shape[2]
    k, v = k.reshape(tokens, width), v.reshape(tokens, width)
    _store_kv_kernel[(tokens,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                WIDTH=width, BLOCK=triton.next_power_of_2(width))
