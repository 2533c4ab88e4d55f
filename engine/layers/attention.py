"""Paged attention on PyTorch: keys and values live in blocks, found through slot indices."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


# Above this many attention scores in a group (64 MiB in float32), use the fused kernel,
# which never materializes them.
_MATMUL_ATTENTION_MAX_SCORES = 16 << 20


@dataclass
class AttentionGroup:
    """Sequences attended together as one padded batch.

    `query_index` [seqs, max_query] picks each sequence's query rows out of the step's
    flat token rows; `key_slots` [seqs, max_context] are the cache slots of each
    sequence's whole context; `mask` [seqs, 1, max_query, max_context] is causal within
    that context and hides padding; `out_rows` are the flat rows of the real queries,
    in the order `valid` [seqs, max_query] selects them from the padded output.
    """

    query_index: torch.Tensor
    key_slots: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    out_rows: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where this step's new keys and values go, and who attends to what."""

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]


class Attention(nn.Module):
    """Writes the step's keys and values into the paged cache, then attends over it.

    The cache tensors are [kv_heads, slots, head_dim], assigned by the ModelRunner once
    it knows how many blocks fit; a slot is block * block_size + offset. Head-major, so
    that one gather yields [kv_heads, seqs, context, head_dim], which batched matrix
    products take without another copy. Decode steps (one query per sequence) and
    prefill chunks go in separate groups so that short queries are not padded to a long
    chunk's length.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """`q` [tokens, heads, head_dim], `k`/`v` [tokens, kv_heads, head_dim]."""
        self.k_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        self.v_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty_like(q)
        for group in meta.groups:
            queries = q[group.query_index]  # [seqs, max_query, heads, head_dim]
            # [kv_heads, seqs, max_context, head_dim]; index_select is several times
            # faster than advanced indexing for this gather.
            keys = self.k_cache.index_select(1, group.key_slots.flatten()).unflatten(1, group.key_slots.shape)
            values = self.v_cache.index_select(1, group.key_slots.flatten()).unflatten(1, group.key_slots.shape)
            seqs, max_query = group.query_index.shape
            if seqs * max_query * keys.shape[2] * self.num_heads <= _MATMUL_ATTENTION_MAX_SCORES:
                attended = self._matmul_attention(queries, keys, values, group.mask)
            else:
                attended = F.scaled_dot_product_attention(
                    queries.transpose(1, 2), keys.transpose(0, 1), values.transpose(0, 1),
                    attn_mask=group.mask, scale=self.scale,
                    enable_gqa=self.num_heads != self.num_kv_heads,
                ).transpose(1, 2)
            out[group.out_rows] = attended[group.valid]
        return out

    def _matmul_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention as two batched matrix products per KV head and its query group.

        `q` [seqs, queries, heads, dim]; `k`, `v` [kv_heads, seqs, context, dim]; `mask`
        [seqs, 1, queries, context]. At decode and short-prefill shapes this is several
        times faster than the fused CPU kernel, which pays per (sequence, head) overhead.
        """
        seqs, queries = q.shape[0], q.shape[1]
        kv_heads, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q = q.view(seqs, queries, kv_heads, group, dim).permute(2, 0, 3, 1, 4).reshape(kv_heads, seqs, group * queries, dim)
        scores = torch.matmul(q, k.transpose(2, 3)).float() * self.scale
        scores = scores.view(kv_heads, seqs, group, queries, -1).masked_fill_(~mask.unsqueeze(0), float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype).view(kv_heads, seqs, group * queries, -1)
        out = torch.matmul(probs, v).view(kv_heads, seqs, group, queries, dim)
        return out.permute(1, 3, 0, 2, 4).reshape(seqs, queries, self.num_heads, dim)
