"""Attention over the paged KV cache, and the seam between the models and its backends.

The model runner builds one `AttentionMetadata` per step, in a flattened variable-length
layout; each layer's `Attention` hands its queries, keys and values to the step's
`AttentionBackend`, which owns the cache's layout, writes the new keys and values into it
and attends. A backend is one module: `attention_torch` (PyTorch's batched products),
`attention_cpu` (the compiled CPU kernel), `attention_triton` (Triton kernels, for GPUs);
`attention_selector` picks one.

Layers differ in what they see: each `Attention` carries its own scale, sliding window
(a query at position p sees keys p - W < k <= p), attention chunk (Llama 4's local layers:
keys k <= p of p's own chunk of C, k // C == p // C), attention-logit soft-cap
(C * tanh(score / C), Gemma 2) and attention sinks (gpt-oss: a learned logit per query head
that joins the softmax's denominator without a value), so one model can mix windowed, local
and global layers; every backend reads them from the layer in `forward`, while `prepare`
runs once per step.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class KeyRange:
    """Which keys a query at position p sees besides the causal k <= p: with a
    `sliding_window` W only p - W < k, with a `chunk_size` C only its own chunk,
    k // C == p // C; both where both are set. A contiguous range of keys ending at p,
    from `first_key(p)`."""

    sliding_window: int | None = None
    chunk_size: int | None = None

    @property
    def limited(self) -> bool:
        """Whether some query sees less than its whole causal context."""
        return bool(self.sliding_window or self.chunk_size)

    def first_key(self, position: int) -> int:
        """The first key a query at `position` sees."""
        first = 0
        if self.sliding_window:
            first = max(first, position - self.sliding_window + 1)
        if self.chunk_size:
            first = max(first, position // self.chunk_size * self.chunk_size)
        return first

    def visible(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """Whether queries at `query_pos` see keys at `key_pos` (broadcast together)."""
        seen = key_pos <= query_pos
        if self.sliding_window:
            seen = seen & (key_pos > query_pos - self.sliding_window)
        if self.chunk_size:
            seen = seen & (key_pos // self.chunk_size == query_pos // self.chunk_size)
        return seen


@dataclass
class AttentionMetadata:
    """Who attends to what in one step, for every layer.

    Sequence i's new tokens are rows `query_start_loc[i]:query_start_loc[i + 1]` of the
    step, and they see the first `seq_lens[i]` keys of the sequence (its cached context,
    then themselves, causally); its cache blocks are row i of `block_tables` (int32,
    padded with block 0). `slot_mapping` [tokens] is where each new token's key and value
    go (block * block_size + offset) and `positions` [tokens] their positions. The host
    lists repeat the lengths for backends that plan on the CPU, without reading the
    tensors back. `backend_data` is what the step's backend derived in `prepare`;
    `layer_plans` what a kind of layer derives once per step for all its layers (latent
    attention's split of the rows, `engine.attention.mla`), by kind.
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
    layer_plans: dict[str, Any] = field(default_factory=dict)

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


class Rotation(Protocol):
    """What rotates a layer's queries and keys by their positions: rotation(positions, x
    [tokens, heads, head_dim]) -> the same shape. A rotation by one position per token from
    float32 tables (`engine.layers.rotary.RotaryEmbedding`) also has `tables`, its cos and
    (signed) sin [positions, rotary_dim], which a backend's fused pass may read instead
    (`AttentionBackend.rotate_and_attend`); any other has none."""

    def __call__(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


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

    def rotate_and_attend(self, layer: "Attention", qkv: torch.Tensor, positions: torch.Tensor,
                          rotation: Rotation, meta: AttentionMetadata) -> torch.Tensor:
        """The attention block between a decoder layer's two products: `qkv` [tokens, (heads +
        2 kv_heads) * head_dim] (a fused projection's queries, keys and values side by side),
        its queries and keys rotated by `rotation`, its keys and values written, and the
        queries' attention, [tokens, heads * head_dim]. Here those steps one after the other;
        a backend with a kernel for the whole of it overrides this (the same bits)."""
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
        q, k = rotation(positions, qk.view(-1, heads + kv_heads, dim)).split([heads, kv_heads], dim=1)
        self.write_kv(layer, k, v.view(-1, kv_heads, dim), meta)
        return self.forward(layer, q, meta).view(-1, heads * dim)

    def forward_latent(self, layer: "Attention", q: torch.Tensor, meta: AttentionMetadata,
                       latent: int) -> torch.Tensor:
        """Attention of q [tokens, heads, head_dim] over a latent layer's one cache
        (`values_in_keys`), whose values are the keys' first `latent` values: [tokens,
        heads, latent]. Here `forward`'s, over the cache as keys and values; a backend with
        a kernel of its own for latent caches overrides it."""
        return self.forward(layer, q, meta)[..., :latent]


class Attention(nn.Module):
    """One layer's attention: writes the step's keys and values into this layer's paged
    cache, then attends over it, through `backend`. The model runner assigns the backend
    and the caches once it knows how many blocks fit: `k_cache`, `v_cache`, and for a
    scaled cache dtype (`engine.kernels.kv_cache_quant`) their scales `k_scale`, `v_scale`
    (else empty).

    Scores are (q . k) * `scale` (default head_dim**-0.5), then soft-capped to
    `logit_softcap` * tanh(score / `logit_softcap`) when it is set. With `sliding_window`
    W a query at position p sees the W keys p - W < k <= p (transformers' semantics); with
    `attention_chunk_size` C only the keys of its own chunk, p // C * C <= k <= p (Llama 4's
    local layers); with both, the keys both allow; with neither its whole causal context.

    `sinks` (gpt-oss): True gives the layer a float32 parameter `sinks` [num_heads], zeros
    until the checkpoint's values are copied in (`layer.sinks.data.copy_(tensor)`); a tensor
    gives it those values. Head h's softmax then takes exp(sinks[h] - m) into its
    denominator, m the largest of its scores and the sink, with no value: out = sum_k
    exp(s_k - m) v_k / (exp(sinks[h] - m) + sum_k exp(s_k - m)). The sink is neither
    scaled nor soft-capped. Without sinks `sinks` is None.

    `values_in_keys` (latent attention, `engine.attention.mla`): the layer's values are the
    first values of its keys, so its cache is one tensor, `v_cache` the same as `k_cache`.
    """

    values_in_keys = False

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float | None = None,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 sinks: bool | torch.Tensor = False, attention_chunk_size: int | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 key, got {sliding_window}")
        if attention_chunk_size is not None and attention_chunk_size < 1:
            raise ValueError(f"attention_chunk_size must be at least 1 key, got {attention_chunk_size}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be positive, got {logit_softcap}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.attention_chunk_size = attention_chunk_size
        self.logit_softcap = logit_softcap
        self.sinks: nn.Parameter | None = _sinks_parameter(sinks, num_heads)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = torch.empty(0)
        self.v_scale = torch.empty(0)
        self.backend: AttentionBackend | None = None

    @property
    def key_range(self) -> KeyRange:
        """The keys each query sees (its sliding window and attention chunk)."""
        return KeyRange(self.sliding_window, self.attention_chunk_size)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> "Attention":
        """As `nn.Module._apply` (`to`, `to_empty`, `cuda`), except that the sinks stay
        float32 when the model is cast to another dtype: the kernels read them as float32.
        (The engine casts before it loads the checkpoint, so no loaded value is rounded.)"""
        super()._apply(fn, recurse)
        if self.sinks is not None and self.sinks.dtype != torch.float32:
            self.sinks = nn.Parameter(self.sinks.detach().float(), requires_grad=False)
        return self

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """`q` [tokens, heads, head_dim], `k`/`v` [tokens, kv_heads, head_dim]."""
        self.backend.write_kv(self, k, v, meta)
        return self.backend.forward(self, q, meta)

    def rotate_and_attend(self, qkv: torch.Tensor, positions: torch.Tensor, rotation: Rotation,
                          meta: AttentionMetadata) -> torch.Tensor:
        """`qkv` [tokens, (heads + 2 kv_heads) * head_dim], a fused projection's output: the
        queries and keys rotated, the keys and values cached, the queries' attention [tokens,
        heads * head_dim] (`AttentionBackend.rotate_and_attend`)."""
        return self.backend.rotate_and_attend(self, qkv, positions, rotation, meta)


@dataclass
class CrossInputs:
    """A step's cross-attention inputs (an encoder-decoder model's: Whisper's decoder over its
    clip's encoder rows). In `meta` each decoder row of the step is a sequence of its own:
    one query over all its sequence's encoder rows, read from the sequence's cross blocks, so
    that every backend attends over them unchanged (the causal rule sees every key, the query
    standing at the last one). `states` [rows, width] are the encoder outputs whose keys and
    values the step writes (those of the sequences whose decoder prompt it starts), to the
    slots of `writes` (its `slot_mapping`); None when it writes none."""

    meta: AttentionMetadata
    states: torch.Tensor | None = None
    writes: AttentionMetadata | None = None


def cross_attention_metadata(row_keys: list[int], block_tables: torch.Tensor, block_size: int) -> AttentionMetadata:
    """The metadata in which row i of a step is a sequence of its own: one query over the first
    `row_keys[i]` keys of the cross blocks in `block_tables[i]`, standing at the last key (so
    that a causal backend sees them all). It writes nothing (`CrossInputs.writes` does)."""
    device = block_tables.device
    count = len(row_keys)
    keys = torch.tensor(row_keys, dtype=torch.int32).to(device)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long, device=device),
        query_start_loc=torch.arange(count + 1, dtype=torch.int32, device=device),
        seq_lens=keys, block_tables=block_tables, positions=keys.long() - 1,
        query_lens=[1] * count, context_lens=list(row_keys), block_size=block_size)


class CrossAttention(Attention):
    """A decoder layer's attention over its encoder's outputs (Whisper's `encoder_attn`): its
    keys and values are written once per sequence, from the encoder rows, into the sequence's
    cross blocks, then read at every step.

    It has no cache tensors of its own: it shares those of its layer's self-attention
    (`paired_with`, same heads and head size), and a block of the one pool holds either a
    sequence's decoder keys and values or its cross ones, so the KV-cache budget counts one
    layer's bytes per token (`engine.worker.kv_cache.KVCache`)."""

    def __init__(self, paired_with: Attention) -> None:
        super().__init__(paired_with.num_heads, paired_with.head_dim, paired_with.num_kv_heads)
        self.paired_with = [paired_with]  # a list, so that the pair is not registered twice as a module

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                cross: CrossInputs) -> torch.Tensor:
        """`q` [tokens, heads, head_dim]; `k`/`v` [encoder rows, kv_heads, head_dim] of
        `cross.states`, or None in a step that writes none."""
        if k is not None:
            self.backend.write_kv(self, k, v, cross.writes)
        return self.backend.forward(self, q, cross.meta)


def _sinks_parameter(sinks: bool | torch.Tensor, num_heads: int) -> nn.Parameter | None:
    """The float32 sinks parameter [num_heads] that `Attention(sinks=...)` asks for, or None."""
    if isinstance(sinks, torch.Tensor):
        if tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must hold one logit per query head, shape ({num_heads},); got "
                             f"{tuple(sinks.shape)}")
        return nn.Parameter(sinks.detach().float().clone(), requires_grad=False)
    if sinks:
        return nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
    return None
