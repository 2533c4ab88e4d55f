"""Attention over the paged KV cache, and the seam between the models and its backends.

The model runner builds one `AttentionMetadata` per step, in a flattened variable-length
layout; each layer's `Attention` hands its queries, keys and values to the step's
`AttentionBackend`, which owns the cache's layout, writes the new keys and values into it
and attends. A backend is one module: `attention_torch` (PyTorch's batched products),
`attention_cpu` (the compiled CPU kernel), `attention_triton` (Triton kernels, for GPUs);
`attention_selector` picks one.

Layers differ in what they see: each `Attention` carries its own scale, sliding window
(a query at position p sees keys p - W < k <= p) and attention-logit soft-cap
(C * tanh(score / C), Gemma 2), so one model can mix windowed and global layers; every
backend reads them from the layer in `forward`, while `prepare` runs once per step.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class AttentionMetadata:
    """Who attends to what in one step, for every layer.

    Sequence i's new tokens are rows `query_start_loc[i]:query_start_loc[i + 1]` of the
    step, and they see the first `seq_lens[i]` keys of the sequence (its cached context,
    then themselves, causally); its cache blocks are row i of `block_tables` (int32,
    padded with block 0). `slot_mapping` [tokens] is where each new token's key and value
    go (block * block_size + offset) and `positions` [tokens] their positions. The host
    lists repeat the lengths for backends that plan on the CPU, without reading the
    tensors back. `backend_data` is what the step's backend derived in `prepare`.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    block_size: int
    backend_data: Any = None

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def is_decode(self) -> bool:
        """Whether every sequence computes one token (what a CUDA graph replays)."""
        return self.max_query_len == 1

    @property
    def max_seq_len(self) -> int:
        return max(self.context_lens, default=0)

    @property
    def num_computed(self) -> list[int]:
        """Tokens of each sequence already in the cache before this step."""
        return [c - q for c, q in zip(self.context_lens, self.query_lens)]


class AttentionBackend:
    """How attention runs: the cache layout, writing new keys and values, attending."""

    name = ""

    def cache_shape(self, num_slots: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's key (and value) cache of `num_slots` slots."""
        raise NotImplementedError

    def slot_major(self, cache: torch.Tensor) -> torch.Tensor:
        """A view of `cache` indexed by slot first: [slots, ...]."""
        raise NotImplementedError

    def prepare(self, meta: AttentionMetadata) -> None:
        """Derives, once per step, what `forward` needs beyond `meta` (into backend_data)."""

    def write_kv(self, layer: "Attention", k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """Stores the step's k, v [tokens, kv_heads, head_dim] in `layer`'s caches at
        `meta.slot_mapping`, as the caches' dtype (quantized, with their scales, for int8
        and fp8 caches)."""
        raise NotImplementedError

    def forward(self, layer: "Attention", q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q [tokens, heads, head_dim] over `layer`'s caches."""
        raise NotImplementedError


class Attention(nn.Module):
    """One layer's attention: writes the step's keys and values into this layer's paged
    cache, then attends over it, through `backend`. The model runner assigns the backend
    and the caches once it knows how many blocks fit: `k_cache`, `v_cache`, and for a
    scaled cache dtype (`engine.kv_cache_dtype`) their scales `k_scale`, `v_scale` (else
    empty).

    Scores are (q . k) * `scale` (default head_dim**-0.5), then soft-capped to
    `logit_softcap` * tanh(score / `logit_softcap`) when it is set. With `sliding_window`
    W a query at position p sees the W keys p - W < k <= p (transformers' semantics);
    None sees its whole causal context.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None = None,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 key, got {sliding_window}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = torch.empty(0)
        self.v_scale = torch.empty(0)
        self.backend: AttentionBackend | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`q` [tokens, heads, head_dim], `k`/`v` [tokens, kv_heads, head_dim]."""
        self.backend.write_kv(self, k, v, meta)
        return self.backend.forward(self, q, meta)
