"""The CPU attention backend: the compiled paged-attention kernel of
`engine.kernels.cpu_attention`, reading keys and values straight from the cache through
the block table, one (row tile, KV head) task at a time; a row's result does not depend on
the rest of the step. A decoder layer's rotation, cache writes and attention run as one call
where its rotation is a table's (`rotate_and_attend`). The layer's sliding window, attention chunk, soft-cap and sinks go to
the kernel, which reads only the keys a row sees; it reads float32, bfloat16, float16 and
int8 caches (with their scales) as they are stored."""

from dataclasses import dataclass

import torch

from engine.attention.backends.torch_attn import TorchAttentionBackend
from engine.attention.layer import Attention, AttentionMetadata, Rotation
from engine.kernels import cpu_attention


@dataclass
class PagedRows:
    """Row i of the step sees the first `row_keys[i]` keys of sequence `row_seq[i]`,
    whose blocks are row `row_seq[i]` of `block_tables` (int64, as the kernel takes them)."""

    block_tables: torch.Tensor
    row_seq: torch.Tensor
    row_keys: torch.Tensor


class CpuAttentionBackend(TorchAttentionBackend):
    """The compiled kernel; the cache layout is the PyTorch backend's, the writes (and an
    int8 cache's quantization) one compiled pass per layer."""

    name = "cpu"

    def write_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        for new, cache, scale in ((k, layer.k_cache, layer.k_scale), (v, layer.v_cache, layer.v_scale)):
            cpu_attention.store_kv(new, cache, scale, meta.slot_mapping)

    def prepare(self, meta: AttentionMetadata) -> None:
        num_seqs, num_rows = len(meta.query_lens), len(meta.positions)
        row_seq = torch.arange(num_seqs, device=meta.positions.device)
        if num_rows != num_seqs:
            row_seq = row_seq.repeat_interleave(meta.query_start_loc.diff(), output_size=num_rows)
        meta.backend_data = PagedRows(meta.block_tables.long(), row_seq, meta.positions + 1)

    def forward(self, layer: Attention, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        rows = meta.backend_data
        return cpu_attention.paged_attention(q, layer.k_cache, layer.v_cache, rows.block_tables, rows.row_seq,
                                             rows.row_keys, meta.block_size, layer.scale, layer.sliding_window,
                                             layer.logit_softcap, layer.k_scale, layer.v_scale, layer.sinks,
                                             layer.attention_chunk_size)

    def rotate_and_attend(self, layer: Attention, qkv: torch.Tensor, positions: torch.Tensor, rotation: Rotation,
                          meta: AttentionMetadata) -> torch.Tensor:
        """One compiled call (`cpu_attention.rotary_cache_attention`) where `rotation` has
        tables; else the steps one after the other."""
        tables = getattr(rotation, "tables", None)
        if tables is None:
            return super().rotate_and_attend(layer, qkv, positions, rotation, meta)
        rows = meta.backend_data
        return cpu_attention.rotary_cache_attention(
            qkv, layer.num_heads, layer.num_kv_heads, positions, *tables, layer.k_cache, layer.v_cache,
            meta.slot_mapping, rows.block_tables, rows.row_seq, rows.row_keys, meta.block_size, layer.scale,
            layer.sliding_window, layer.logit_softcap, layer.k_scale, layer.v_scale, layer.sinks,
            layer.attention_chunk_size)
