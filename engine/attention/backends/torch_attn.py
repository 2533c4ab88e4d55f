"""The PyTorch attention backend: each sequence's keys gathered from the paged cache into a
padded batch, then batched matrix products. Runs on any device; the reference for the others.

A layer with a sliding window or an attention chunk reads, per sequence, only the key
chunks that hold the keys its queries see, and masks the others; a soft-capped layer caps
the scaled scores before masking and the softmax; a layer with sinks adds each head's sink
to the softmax's denominator."""

import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.layer import Attention, AttentionBackend, AttentionMetadata, KeyRange
from engine.hardware import detect_cpu
from engine.kernels.kv_cache_quant import dequantize, is_scaled, quantize


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


def product_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype attention's products run in: float32 for bfloat16 on a CPU without native
    bfloat16. Emulated bfloat16 products split long sums as MKL's float32 ones do
    (measured with oneDNN capped at AVX-512 without BF16: a value sum over 320 keys
    differed once zeros padded it to 512), so they take the key-chunked float32 path;
    emulation computes in float32 anyway."""
    if dtype == torch.bfloat16 and device.type == "cpu" and not detect_cpu().native_bf16:
        return torch.float32
    return dtype


def padded_context(length: int) -> int:
    """`length` keys rounded up to whole key chunks."""
    return -(-length // KEY_CHUNK) * KEY_CHUNK


@dataclass(frozen=True)
class _GroupEntry:
    """A sequence of the step, as a group takes it: its index in the step, its first row
    among the step's rows, its new tokens and the tokens already in the cache."""

    index: int
    first_row: int
    num_new: int
    num_computed: int


@dataclass
class AttentionGroup:
    """Sequences attended together as one padded batch.

    `query_index` [seqs, max_query] picks each sequence's query rows out of the step's
    flat token rows (padding points at row 0); `key_slots` [seqs, max_context] are the
    cache slots of each sequence's whole context; `mask` [seqs, 1, max_query,
    max_context] is causal within that context and hides padding; `valid` [seqs,
    max_query] marks the real queries; `query_pos` [seqs, max_query] are their
    positions. `num_computed` and `num_new` give, per sequence, the tokens already in the
    cache before this step and the step's new ones. `windowed` holds the key slots and
    masks of layers whose queries see less than their causal context (a sliding window, an
    attention chunk), by (`KeyRange`, sequences, query chunk): built by the step's first
    layer with that range, reused by the others.
    """

    query_index: torch.Tensor
    key_slots: torch.Tensor
    mask: torch.Tensor
    valid: torch.Tensor
    query_pos: torch.Tensor
    num_computed: list[int]
    num_new: list[int]
    windowed: dict[tuple[KeyRange, int, int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def key_starts(self, first: int, last: int, query_start: int, window: int | None,
                   chunk: int | None = None) -> list[int]:
        """Per sequence of [first, last), the first key its queries from `query_start` on
        can see in a layer with sliding window `window` and attention chunk `chunk` (its
        last query's, where it has none there), rounded down to whole `KEY_CHUNK`s: a row's
        keys then fall in the same chunks in any batch. 0 with neither."""
        seen = KeyRange(window, chunk)
        if not seen.limited:
            return [0] * (last - first)
        return [seen.first_key(c + min(query_start, n - 1)) // KEY_CHUNK * KEY_CHUNK
                for c, n in zip(self.num_computed[first:last], self.num_new[first:last])]

    def keys_needed(self, first: int, last: int, query_start: int, query_end: int, window: int | None,
                    chunk: int | None = None) -> int:
        """Keys, from each sequence's `key_starts`, that queries [query_start, query_end)
        of sequences [first, last) can see: the longest such span."""
        starts = self.key_starts(first, last, query_start, window, chunk)
        return max(c + min(query_end, n) - start
                   for c, n, start in zip(self.num_computed[first:last], self.num_new[first:last], starts))

    def keys(self, first: int, last: int, query_start: int, query_end: int, window: int | None,
             chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Key slots [seqs, context] and mask [seqs, 1, queries, context] for queries
        [query_start, query_end) of sequences [first, last), for a layer with sliding
        window `window` and attention chunk `chunk`."""
        seen = KeyRange(window, chunk)
        context = padded_context(self.keys_needed(first, last, query_start, query_end, window, chunk))
        if not seen.limited:
            context = min(context, self.key_slots.shape[1])
            return self.key_slots[first:last, :context], self.mask[first:last, :, query_start:query_end, :context]
        cached = (seen, first, last, query_start)
        if cached not in self.windowed:
            starts = torch.tensor(self.key_starts(first, last, query_start, window, chunk),
                                  device=self.key_slots.device)
            key_pos = starts.unsqueeze(1) + torch.arange(context, device=starts.device)
            # Past the table's width every sequence has only null slots (its last column).
            slots = self.key_slots[first:last].gather(1, key_pos.clamp(max=self.key_slots.shape[1] - 1))
            query_pos = self.query_pos[first:last, query_start:query_end].unsqueeze(2)
            self.windowed[cached] = slots, seen.visible(query_pos, key_pos.unsqueeze(1)).unsqueeze(1)
        return self.windowed[cached]


class TorchAttentionBackend(AttentionBackend):
    """Attention as PyTorch's batched products over gathered keys.

    The caches are [kv_heads, slots, head_dim]: head-major, so that one gather yields
    [kv_heads, seqs, context, head_dim], which batched matrix products take without
    another copy. The gather indexes the cache as rows of head_dim (head * slots + slot),
    which copies whole rows: measured 2-9x faster than indexing the slot dimension of the
    3-d tensor. Decode steps (one query per sequence) and prefill chunks go in separate
    groups so that short queries are not padded to a long chunk's length.
    """

    name = "torch"

    def __init__(self, null_slot: int) -> None:
        self.null_slot = null_slot  # zeros that padded key positions point to

    def cache_shape(self, num_slots: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_slots, head_dim)

    def slot_major(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.transpose(0, 1)

    def write_kv(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        for new, cache, scale in ((k, layer.k_cache, layer.k_scale), (v, layer.v_cache, layer.v_scale)):
            if is_scaled(cache.dtype):
                new, scales = quantize(new, cache.dtype)
                scale.index_copy_(1, meta.slot_mapping, scales.transpose(0, 1))
            # PyTorch copies no float8 by index: one-byte types go as bytes.
            as_bytes = cache.element_size() == 1
            target, new = (cache.view(torch.uint8), new.view(torch.uint8)) if as_bytes else (cache, new)
            target.index_copy_(1, meta.slot_mapping, new.to(target.dtype).transpose(0, 1))

    def prepare(self, meta: AttentionMetadata) -> None:
        decode, prefill = [], []
        starts = itertools.accumulate(meta.query_lens, initial=0)
        for index, (start, new, context) in enumerate(zip(starts, meta.query_lens, meta.context_lens)):
            (decode if new == 1 else prefill).append(_GroupEntry(index, start, new, context - new))
        meta.backend_data = [self._group(g, meta) for g in (decode, prefill) if g]

    def _group(self, entries: list[_GroupEntry], meta: AttentionMetadata) -> AttentionGroup:
        """The entries' sequences as one padded batch."""
        device, block_size = meta.slot_mapping.device, meta.block_size
        rows = torch.tensor([e.first_row for e in entries], device=device)
        num_new = torch.tensor([e.num_new for e in entries], device=device)
        computed = torch.tensor([e.num_computed for e in entries], device=device)
        max_query = int(num_new.max())
        max_context = padded_context(int((computed + num_new).max()))
        max_blocks = -(-max_context // block_size)
        tables = meta.block_tables[torch.tensor([e.index for e in entries], device=device)].long()
        if tables.shape[1] < max_blocks:
            tables = torch.nn.functional.pad(tables, (0, max_blocks - tables.shape[1]))
        query = torch.arange(max_query, device=device)
        valid = query.unsqueeze(0) < num_new.unsqueeze(1)
        query_index = torch.where(valid, rows.unsqueeze(1) + query, 0)
        key_pos = torch.arange(max_context, device=device)
        key_slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size
        key_slots = torch.where(key_pos < (computed + num_new).unsqueeze(1), key_slots, self.null_slot)
        query_pos = computed.unsqueeze(1) + query  # [seqs, max_query]
        mask = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(2)
        return AttentionGroup(query_index, key_slots, mask.unsqueeze(1), valid, query_pos,
                              num_computed=[e.num_computed for e in entries], num_new=[e.num_new for e in entries])

    def forward(self, layer: Attention, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        out = torch.empty_like(q)
        limits = layer.sliding_window, layer.attention_chunk_size
        for group in meta.backend_data:
            seqs, max_query = group.query_index.shape
            for query_start in range(0, max_query, _QUERY_CHUNK):
                query_end = min(query_start + _QUERY_CHUNK, max_query)
                keys_needed = group.keys_needed(0, seqs, query_start, query_end, *limits)
                step = max(1, _MAX_SCORES // (layer.num_heads * (query_end - query_start) * keys_needed))
                for first in range(0, seqs, step):
                    last = min(first + step, seqs)
                    slots, mask = group.keys(first, last, query_start, query_end, *limits)
                    keys = read_cache(layer.k_cache, layer.k_scale, slots, q.dtype)
                    values = read_cache(layer.v_cache, layer.v_scale, slots, q.dtype)
                    queries = slice(first, last), slice(query_start, query_end)
                    rows = group.query_index[queries]
                    attended = matmul_attention(layer, q[rows], keys, values, mask)
                    valid = group.valid[queries]
                    out[rows[valid]] = attended[valid]
        return out


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[kv_heads, seqs, context, head_dim] from `cache` at `slots` [seqs, context]."""
    kv_heads, num_slots, head_dim = cache.shape
    rows = torch.arange(kv_heads, device=slots.device).unsqueeze(1) * num_slots + slots.flatten()
    return cache.view(-1, head_dim).index_select(0, rows.flatten()).view(kv_heads, *slots.shape, head_dim)


def read_cache(cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`gather`ed keys or values as `dtype`: dequantized with their scales [kv_heads,
    slots] from a scaled cache, widened from a narrower one."""
    gathered = gather(cache, slots)
    if is_scaled(cache.dtype):
        return dequantize(gathered, scale[:, slots], dtype)
    return gathered.to(dtype)


def matmul_attention(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """Attention as batched matrix products per KV head and its query group.

    `q` [seqs, queries, heads, dim]; `k`, `v` [kv_heads, seqs, context, dim]; `mask`
    [seqs, 1, queries, context]. At decode and short-prefill shapes this is several
    times faster than PyTorch's fused CPU kernel, which pays per (sequence, head)
    overhead. It is also the only attention used, at every shape: a query row's result
    here does not depend on the other rows, sequences or padding in the batch (the
    fused kernel's blocking does), so a token's output is the same whether it runs in
    a decode step, a prefill chunk or a recompute after preemption. In float32 the
    keys go in `KEY_CHUNK`s (see there); other dtypes take the whole context at once,
    except where they run in float32 (`product_dtype`). A soft-capped layer caps the
    scaled scores (`layer.logit_softcap`) before the mask; a layer with sinks takes each
    head's sink into its softmax (`softmax_with_sinks`).
    """
    compute = product_dtype(v.dtype, v.device)
    if compute != v.dtype:
        return matmul_attention(layer, q.to(compute), k.to(compute), v.to(compute), mask).to(v.dtype)
    seqs, queries = q.shape[0], q.shape[1]
    kv_heads, group, dim = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim
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
    scores = scores[:, :, :rows].float() * layer.scale
    if layer.logit_softcap is not None:
        scores = scores.div_(layer.logit_softcap).tanh_().mul_(layer.logit_softcap)
    scores = scores.view(kv_heads, seqs, group, queries, -1).masked_fill_(~mask.unsqueeze(0), float("-inf"))
    if layer.sinks is None:
        probs = scores.softmax(dim=-1)
    else:
        probs = softmax_with_sinks(scores, layer.sinks.view(kv_heads, 1, group, 1, 1))
    probs = probs.to(v.dtype).view(kv_heads, seqs, rows, -1)
    if rows < _MIN_QUERY_ROWS:
        probs = F.pad(probs, (0, 0, 0, _MIN_QUERY_ROWS - rows))
    out = None
    for p, part in zip(probs.split(chunk, dim=3), v.split(chunk, dim=2)):
        out = torch.matmul(p, part) if out is None else out.add_(torch.matmul(p, part))
    out = out[:, :, :rows].reshape(kv_heads, seqs, group, queries, dim)
    return out.permute(1, 3, 0, 2, 4).reshape(seqs, queries, layer.num_heads, dim)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The softmax of float32 `scores` over their last dimension with `sinks` (broadcast to
    them, one per row) joined to each row's denominator, without a column of their own:
    exp(s - m) / (exp(sink - m) + sum exp(s - m)), m the larger of the row's maximum and
    its sink. Masked scores (-inf) weigh 0."""
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), sinks)
    weights = (scores - top).exp_()
    return weights.div_(weights.sum(dim=-1, keepdim=True).add_((sinks - top).exp()))
