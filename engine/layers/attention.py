"""Paged attention on PyTorch: keys and values live in blocks, found through slot indices."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_attention


# Queries attend in chunks of at most this many rows per sequence, and sequences in
# sub-batches whose scores fit in this many elements (16 MiB in float32): memory stays
# bounded for long prompts, and each chunk reads only the keys its queries can see.
_QUERY_CHUNK = 256
_MAX_SCORES = 4 << 20

# MKL's float32 products round a row differently when it is one of fewer than 4 rows,
# when the key count is not a multiple of 16, and when the reduction is long enough to
# be split (measured on AVX2: a sum over 448 keys differs once zeros pad it to 512). So
# float32 attention runs at least 4 query rows, keys in chunks of this many, and adds
# the chunks' value sums left to right: padding keys add exact zeros, and a row's bits
# depend on nothing but its own keys.
KEY_CHUNK = 64
_MIN_QUERY_ROWS = 4


def padded_context(length: int) -> int:
    """`length` keys rounded up to whole key chunks."""
    return -(-length // KEY_CHUNK) * KEY_CHUNK


@dataclass
class AttentionGroup:
    """Sequences attended together as one padded batch.

    `query_index` [seqs, max_query] picks each sequence's query rows out of the step's
    flat token rows (padding points at row 0); `key_slots` [seqs, max_context] are the
    cache slots of each sequence's whole context; `mask` [seqs, 1, max_query,
    max_context] is causal within that context and hides padding; `valid` [seqs,
    max_query] marks the real queries. `num_computed` and `num_new` give, per sequence,
    the tokens already in the cache before this step and the step's new ones.
    """

    query_index: torch.Tensor
    key_slots: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    num_computed: list[int]
    num_new: list[int]

    def context_needed(self, first: int, last: int, query_end: int) -> int:
        """Keys that queries before `query_end` of sequences [first, last) can see."""
        return max(c + min(query_end, n) for c, n in zip(self.num_computed[first:last], self.num_new[first:last]))


@dataclass
class PagedRows:
    """Who attends to what, row by row, for the compiled CPU kernel: row i of the step
    sees the first `row_keys[i]` keys of sequence `row_seq[i]`, whose blocks are row
    `row_seq[i]` of `block_tables` [seqs, max_blocks]."""

    block_tables: torch.Tensor
    row_seq: torch.Tensor
    row_keys: torch.Tensor
    block_size: int


@dataclass
class AttentionMetadata:
    """Where this step's new keys and values go, and who attends to what: padded
    `groups` for PyTorch's products, or `rows` for the compiled CPU kernel."""

    slot_mapping: torch.Tensor
    groups: list[AttentionGroup]
    rows: PagedRows | None = None


class Attention(nn.Module):
    """Writes the step's keys and values into the paged cache, then attends over it.

    The cache tensors are [kv_heads, slots, head_dim], assigned by the ModelRunner once
    it knows how many blocks fit; a slot is block * block_size + offset. Head-major, so
    that one gather yields [kv_heads, seqs, context, head_dim], which batched matrix
    products take without another copy. The gather indexes the cache as rows of
    head_dim (head * slots + slot), which copies whole rows: measured 2-9x faster than
    indexing the slot dimension of the 3-d tensor. Decode steps (one query per sequence) and
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
        if meta.rows is not None:
            rows = meta.rows
            return cpu_attention.paged_attention(q, self.k_cache, self.v_cache, rows.block_tables, rows.row_seq,
                                                 rows.row_keys, rows.block_size, self.scale)
        out = torch.empty_like(q)
        for group in meta.groups:
            seqs, max_query = group.query_index.shape
            for query_start in range(0, max_query, _QUERY_CHUNK):
                query_end = min(query_start + _QUERY_CHUNK, max_query)
                per_seq = self.num_heads * (query_end - query_start) * group.context_needed(0, seqs, query_end)
                step = max(1, _MAX_SCORES // per_seq)
                for first in range(0, seqs, step):
                    last = min(first + step, seqs)
                    context = min(padded_context(group.context_needed(first, last, query_end)),
                                  group.key_slots.shape[1])
                    queries = slice(first, last), slice(query_start, query_end)
                    slots = group.key_slots[first:last, :context]
                    keys, values = self._gather(self.k_cache, slots), self._gather(self.v_cache, slots)
                    rows = group.query_index[queries]
                    attended = self._matmul_attention(
                        q[rows], keys, values, group.mask[first:last, :, query_start:query_end, :context]
                    )
                    valid = group.valid[queries]
                    out[rows[valid]] = attended[valid]
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """[kv_heads, seqs, context, head_dim] from `cache` at `slots` [seqs, context]."""
        kv_heads, num_slots, head_dim = cache.shape
        rows = torch.arange(kv_heads, device=slots.device).unsqueeze(1) * num_slots + slots.flatten()
        return cache.view(-1, head_dim).index_select(0, rows.flatten()).view(kv_heads, *slots.shape, head_dim)

    def _matmul_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention as batched matrix products per KV head and its query group.

        `q` [seqs, queries, heads, dim]; `k`, `v` [kv_heads, seqs, context, dim]; `mask`
        [seqs, 1, queries, context]. At decode and short-prefill shapes this is several
        times faster than PyTorch's fused CPU kernel, which pays per (sequence, head)
        overhead. It is also the only attention used, at every shape: a query row's result
        here does not depend on the other rows, sequences or padding in the batch (the
        fused kernel's blocking does), so a token's output is the same whether it runs in
        a decode step, a prefill chunk or a recompute after preemption. In float32 the
        keys go in `KEY_CHUNK`s (see there); other dtypes take the whole context at once.
        """
        seqs, queries = q.shape[0], q.shape[1]
        kv_heads, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        rows = group * queries
        q = q.view(seqs, queries, kv_heads, group, dim).permute(2, 0, 3, 1, 4).reshape(kv_heads, seqs, rows, dim)
        if rows < _MIN_QUERY_ROWS:
            q = F.pad(q, (0, 0, 0, _MIN_QUERY_ROWS - rows))
        chunk = k.shape[2]
        if v.dtype == torch.float32:
            chunk = KEY_CHUNK
            if k.shape[2] % chunk:
                extra = padded_context(k.shape[2]) - k.shape[2]
                k, v, mask = F.pad(k, (0, 0, 0, extra)), F.pad(v, (0, 0, 0, extra)), F.pad(mask, (0, extra))
        scores = torch.cat([torch.matmul(q, part.transpose(2, 3)) for part in k.split(chunk, dim=2)], dim=3)
        scores = scores[:, :, :rows].float() * self.scale
        scores = scores.view(kv_heads, seqs, group, queries, -1).masked_fill_(~mask.unsqueeze(0), float("-inf"))
        probs = scores.softmax(dim=-1).to(v.dtype).view(kv_heads, seqs, rows, -1)
        if rows < _MIN_QUERY_ROWS:
            probs = F.pad(probs, (0, 0, 0, _MIN_QUERY_ROWS - rows))
        out = None
        for p, part in zip(probs.split(chunk, dim=3), v.split(chunk, dim=2)):
            out = torch.matmul(p, part) if out is None else out.add_(torch.matmul(p, part))
        out = out[:, :, :rows].reshape(kv_heads, seqs, group, queries, dim)
        return out.permute(1, 3, 0, 2, 4).reshape(seqs, queries, self.num_heads, dim)
