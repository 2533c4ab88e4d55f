"""Paged attention on PyTorch: keys and values live in blocks, found through slot indices."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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

    The cache tensors are [num_blocks, block_size, kv_heads, head_dim], assigned by the
    ModelRunner once it knows how many blocks fit; a slot is block * block_size + offset.
    Decode steps (one query per sequence) and prefill chunks go in separate groups so
    that short queries are not padded to a long chunk's length.
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
        k_slots = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_slots = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_slots.index_copy_(0, meta.slot_mapping, k)
        v_slots.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        for group in meta.groups:
            attended = F.scaled_dot_product_attention(
                q[group.query_index].transpose(1, 2),
                k_slots[group.key_slots].transpose(1, 2),
                v_slots[group.key_slots].transpose(1, 2),
                attn_mask=group.mask,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[group.out_rows] = attended.transpose(1, 2)[group.valid]
        return out
