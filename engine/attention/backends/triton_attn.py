"""The Triton attention backend, for GPUs (and CPUs under Triton's interpreter, in tests).

The caches are [num_blocks, block_size, kv_heads, head_dim]: a token's heads side by
side, so that one block of keys for one KV head is a strided [block_size, head_dim] tile.
Steps where every sequence has one new token run the split-K decode kernel; others run the
variable-length prefill kernel, which also serves the decode rows among them. Both take the
layer's sliding window, attention chunk and soft-cap as compile-time constants (a kernel
per kind of layer), and its sinks as a tensor argument: the layer's own parameter, the
same tensor at every step, as a CUDA graph's replay needs.
"""

import torch

from engine.attention.layer import Attention, AttentionBackend, AttentionMetadata
from engine.kernels.triton.kv_store import store_kv
from engine.kernels.triton.mla_decode import mla_decode_attention
from engine.kernels.triton.paged_attention import decode_attention, decode_splits, prefill_attention


class TritonAttentionBackend(AttentionBackend):
    """`backend_data` is the decode kernel's context split count: from the step's longest
    context here, fixed for every step where CUDA graphs replay (see `engine.worker.cuda_graphs`)."""

    name = "triton"

    def cache_shape(self, num_slots: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_slots // block_size, block_size, num_kv_heads, head_dim)

    def slot_major(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, *cache.shape[2:])

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_data = decode_splits(meta.max_seq_len)

    def write_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        store_kv(k, v, layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale, meta.slot_mapping)

    def forward_latent(self, layer: Attention, q: torch.Tensor, meta: AttentionMetadata, latent: int) -> torch.Tensor:
        """Decode steps through the latent cache's own kernel (`mla_decode_attention`), which
        reads each key once and tiles the latent and rotary parts apart; others through
        the prefill kernel."""
        if meta.max_query_len == 1:
            return mla_decode_attention(q, layer.k_cache, meta.seq_lens, meta.block_tables, meta.backend_data,
                                        layer.scale, latent, layer.k_scale)
        return super().forward_latent(layer, q, meta, latent)

    def forward(self, layer: Attention, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        options = {"sliding_window": layer.sliding_window, "softcap": layer.logit_softcap, "k_scale": layer.k_scale,
                   "v_scale": layer.v_scale, "sinks": layer.sinks, "chunk_size": layer.attention_chunk_size}
        if meta.max_query_len == 1:
            return decode_attention(q, layer.k_cache, layer.v_cache, meta.seq_lens, meta.block_tables,
                                    meta.backend_data, layer.scale, **options)
        return prefill_attention(q, layer.k_cache, layer.v_cache, meta.query_start_loc, meta.seq_lens,
                                 meta.block_tables, meta.max_query_len, layer.scale, **options)
