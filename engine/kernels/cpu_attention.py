"""The CPU paged-attention kernel and its cache writes (C++, `cpu_paged_attention.cpp`, built
by `cpu_build`).

PyTorch's batched products need each sequence's keys gathered into a padded copy first,
and run decode's tiny products (a few query rows per sequence) at a fraction of the
machine's speed. The kernel reads keys and values straight from the paged cache through
the block table, one (row, KV head) task at a time in a fixed order, so a row's result
does not depend on the rest of the step. A sliding window limits a row to its last keys,
an attention chunk to those of its own chunk (only those are read); a soft-cap bounds the
scores before the softmax; attention sinks join each head's softmax denominator.
"""

import torch

from engine.kernels import cpu_build


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    row_seq: torch.Tensor, row_keys: torch.Tensor, block_size: int, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """Each row of `q` [rows, heads, dim] attends over the first `row_keys[row]` keys of
    sequence `row_seq[row]` (only the last `sliding_window` of them, and only those of
    its own chunk of `chunk_size` keys, where given), whose cache slots `block_tables`
    [seqs, max_blocks] gives; scores are scale * (q . k), soft-capped to softcap *
    tanh(score / softcap) where given; `sinks` [heads] (float32, where given) join each
    head's softmax denominator. The caches are [kv_heads, slots, dim], in q's dtype, a
    narrower float one, or int8 with float32 scales `k_scale`, `v_scale` [kv_heads, slots]
    (a key's or value's stored vector times its scale). Returns [rows, heads, dim]."""
    none = torch.empty(0)
    return cpu_build.load().paged_attention(q.contiguous(), k_cache, v_cache,
                                            none if k_scale is None else k_scale,
                                            none if v_scale is None else v_scale, block_tables, row_seq, row_keys,
                                            none if sinks is None else sinks, block_size, scale,
                                            sliding_window or 0, chunk_size or 0, softcap or 0.0)


def store_kv(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes keys or values `x` [tokens, kv_heads, dim] into `cache` [kv_heads, slots, dim]
    at `slots` [tokens] (int64) in one pass: cast to the cache's dtype, or for an int8 cache
    quantized per (token, KV head) with the scales into `scale` [kv_heads, slots], the same
    bits as `engine.kernels.kv_cache_quant.quantize`."""
    cpu_build.load().store_kv(x if x.stride(2) == 1 else x.contiguous(), cache, scale, slots)


def rotary_cache_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, positions: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slots: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor,
                           row_keys: torch.Tensor, block_size: int, scale: float,
                           sliding_window: int | None = None, softcap: float | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """The attention block between a decoder layer's two products in one call: `qkv` [tokens,
    (num_heads + 2 num_kv_heads) * head_dim] (a fused projection's queries, keys and values
    side by side), the queries and keys rotated by rows `positions` of the cos/sin tables (as
    `engine.kernels.cpu_rotary.rotary`), the keys and values written at `slots` (as `store_kv`),
    then `paged_attention` of the queries (its arguments). Returns [tokens, num_heads * head_dim]:
    the same bits as those calls one after the other, without their three returns to Python
    and the views between them."""
    none = torch.empty(0)
    return cpu_build.load().rotary_cache_attention(
        qkv if qkv.stride(-1) == 1 else qkv.contiguous(), num_heads, num_kv_heads, positions, cos, sin, k_cache,
        v_cache, none if k_scale is None else k_scale, none if v_scale is None else v_scale, slots, block_tables,
        row_seq, row_keys, none if sinks is None else sinks, block_size, scale, sliding_window or 0, chunk_size or 0,
        softcap or 0.0)
