"""Paged attention over the block table, for a flattened batch of variable-length queries.

`prefill_attention` serves any step: each sequence's new tokens attend causally among
themselves and fully over the sequence's cached context (a prefix hit, an earlier chunk),
reading keys and values through the block table. `decode_attention` serves steps where
every sequence has one new token: the context is split into partitions that run in
parallel (split-K), and a second kernel merges their softmax statistics; each program
takes all the query heads of one KV head, so a key block is read once per group.

Both take a layer's SLIDING_WINDOW (a query at position p sees keys p - W < k <= p),
CHUNK (attention chunks, Llama 4: only keys of p's own chunk, p // C * C <= k <= p) and
SOFTCAP (scores become SOFTCAP * tanh(score / SOFTCAP) before the mask) as compile-time
constants, 0 for none. With a window or chunks, key loops start at the earliest key a
query sees (tiles wholly before it are never read), and decode's partitions split only
the keys seen rather than the whole context. Attention sinks (gpt-oss), one float32 logit
per query head, are a tensor argument (HAS_SINKS, a compile-time constant, says whether
to read it): each head's sink joins its softmax's denominator once, after prefill's key
loop and in decode's merge of the partitions, so a CUDA graph replays with the layer's
own sinks.

The caches are [num_blocks, block_size, kv_heads, head_dim], in the queries' dtype, a
narrower float one, or fp8 with float32 scales [num_blocks, block_size, kv_heads] (SCALED):
keys and values are converted to the queries' dtype as they are loaded, a key's score and a
value's weight multiplied by its scale. Products accumulate in float32; float32 inputs use
IEEE products (no TF32), so they match PyTorch's float32.
"""

import torch
import triton
import triton.language as tl

from engine.kernels.kv_cache_quant import is_scaled

# Keys per split of a decode sequence's context (a multiple of KEY_TILE).
DECODE_PARTITION = 512
# Keys per loop iteration, gathered through the block table whatever the block size.
KEY_TILE = 64


@triton.jit
def _kv_heads(table_ptr, key_positions, key_ok, kv_head, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Indices [keys] of one KV head's keys at `key_positions` among the cache's (slot, KV
    head) vectors, through a block table row: where their scales are."""
    blocks = tl.load(table_ptr + key_positions // BLOCK_SIZE, mask=key_ok, other=0)
    slots = blocks * BLOCK_SIZE + key_positions % BLOCK_SIZE
    return slots * NUM_KV_HEADS + kv_head


@triton.jit
def _tanh(x):
    """tanh(x) as (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1], with the sign of x (Triton
    has no tanh): no overflow at any x, and within about 1e-7 of torch.tanh."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, key_positions, key_ok, visible,
                 kv_head, dims, dim_ok, scale, top, total, acc, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, SCALED: tl.constexpr):
    """One tile of keys folded into the queries' running softmax (online softmax): returns
    the new running maximum, sum of weights and weighted value sum. `visible` [queries,
    keys] masks the scores; a query that has seen no key yet keeps a maximum of -inf and
    adds nothing."""
    vectors = _kv_heads(table_ptr, key_positions, key_ok, kv_head, NUM_KV_HEADS, BLOCK_SIZE)
    kv_offsets = vectors[:, None] * HEAD_DIM + dims[None, :]
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if SCALED:
        scores = scores * tl.load(k_scale_ptr + vectors, mask=key_ok, other=0.0)[None, :]
    if SOFTCAP != 0.0:
        scores = SOFTCAP * _tanh(scores / SOFTCAP)
    scores = tl.where(visible, scores, float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, 1))
    shift = tl.where(new_top == float("-inf"), 0.0, new_top)  # exp(-inf - -inf) would be NaN
    p = tl.exp(scores - shift[:, None])
    alpha = tl.exp(top - shift)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
    weights = p
    if SCALED:
        weights = p * tl.load(v_scale_ptr + vectors, mask=key_ok, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(weights.to(q.dtype), v, input_precision=PRECISION)
    return new_top, total * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_keys(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr, key_start, key_end, positions,
                 kv_head, dims, dim_ok, scale, ROWS: tl.constexpr, CAUSAL: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                 HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr,
                 SLIDING_WINDOW: tl.constexpr, CHUNK: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                 SCALED: tl.constexpr):
    """The ROWS queries `q` over keys [key_start, key_end) of one KV head, a tile of
    TILE_N keys at a time (`_attend_tile`): returns the running maximum, sum of weights
    and weighted value sum. CAUSAL: query i sees only keys at or before `positions[i]`,
    after `positions[i] - SLIDING_WINDOW` where that is set, and in the CHUNK of
    `positions[i]` where that is set."""
    top = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    offsets = tl.arange(0, TILE_N)
    for tile_start in range(key_start, key_end, TILE_N):
        key_positions = tile_start + offsets
        key_ok = key_positions < key_end
        if CAUSAL:
            visible = (key_positions[None, :] <= positions[:, None]) & key_ok[None, :]
            if SLIDING_WINDOW:
                visible = visible & (key_positions[None, :] > positions[:, None] - SLIDING_WINDOW)
            if CHUNK:
                visible = visible & (key_positions[None, :] >= (positions // CHUNK * CHUNK)[:, None])
        else:
            visible = key_ok[None, :]
        top, total, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table_ptr,
                                       key_positions, key_ok, visible, kv_head, dims, dim_ok, scale, top, total, acc,
                                       NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, SOFTCAP, PRECISION, SCALED)
    return top, total, acc


@triton.jit
def _first_key(position, SLIDING_WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    """The first key a query at `position` (>= -1; -1: a decode padding row) sees."""
    first = 0
    if SLIDING_WINDOW:
        first = tl.maximum(0, position - SLIDING_WINDOW + 1)
    if CHUNK:  # on a GPU integer division truncates: never divide a negative position
        first = tl.maximum(first, tl.maximum(position, 0) // CHUNK * CHUNK)
    return first


@triton.jit
def _join_sink(top, total, acc, sink):
    """The running softmax statistics (`_attend_tile`) with `sink` joined to the denominator:
    the sum of weights and the weighted value sum, rescaled to max(top, sink)."""
    new_top = tl.maximum(top, sink)
    alpha = tl.exp(top - new_top)
    return total * alpha + tl.exp(sink - new_top), acc * alpha[:, None]


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, out_ptr, query_start_ptr,
                    seq_lens_ptr, block_tables_ptr, scale, table_stride, NUM_HEADS: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    SLIDING_WINDOW: tl.constexpr, CHUNK: tl.constexpr, SOFTCAP: tl.constexpr,
                    PRECISION: tl.constexpr, SCALED: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_block * BLOCK_M < q_len:
        context = tl.load(seq_lens_ptr + seq)
        computed = context - q_len
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < q_len
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q_offsets = ((q_start + rows)[:, None] * NUM_HEADS + head) * HEAD_DIM + dims[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        key_end = tl.minimum(context, computed + (m_block + 1) * BLOCK_M)
        # The block's first row sees the earliest key.
        key_start = _first_key(computed + m_block * BLOCK_M, SLIDING_WINDOW, CHUNK)
        top, total, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                       block_tables_ptr + seq * table_stride, key_start, key_end, computed + rows,
                                       kv_head, dims, dim_ok, scale, BLOCK_M, True, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                       BLOCK_D, TILE_N, SLIDING_WINDOW, CHUNK, SOFTCAP, PRECISION, SCALED)
        if HAS_SINKS:
            total, acc = _join_sink(top, total, acc, tl.load(sinks_ptr + head))
        out = acc / tl.where(total > 0, total, 1.0)[:, None]  # padding rows may see no key in their window
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_partition_kernel(q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, part_acc_ptr, part_top_ptr,
                             part_total_ptr, seq_lens_ptr, block_tables_ptr, scale, table_stride, num_splits,
                             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                             PARTITION: tl.constexpr, TILE_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                             CHUNK: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                             SCALED: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(seq_lens_ptr + seq)
    # Split 0 starts at the first key the query (the context's last key) sees.
    start = _first_key(context - 1, SLIDING_WINDOW, CHUNK) + split * PARTITION
    if start < context:
        group = NUM_HEADS // NUM_KV_HEADS
        members = tl.arange(0, GROUP_PAD)
        member_ok = members < group
        heads = kv_head * group + members
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + (seq * NUM_HEADS + heads)[:, None] * HEAD_DIM + dims[None, :],
                    mask=member_ok[:, None] & dim_ok[None, :], other=0.0)
        end = tl.minimum(context, start + PARTITION)
        top, total, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                                       block_tables_ptr + seq * table_stride, start, end, members, kv_head, dims,
                                       dim_ok, scale, GROUP_PAD, False, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_D,
                                       TILE_N, SLIDING_WINDOW, CHUNK, SOFTCAP, PRECISION, SCALED)
        stat = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(part_top_ptr + stat, top, mask=member_ok)
        tl.store(part_total_ptr + stat, total, mask=member_ok)
        tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM + dims[None, :], acc, mask=member_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_top_ptr, part_total_ptr, sinks_ptr, out_ptr, seq_lens_ptr, num_splits,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, PARTITION: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
                         CHUNK: tl.constexpr, HAS_SINKS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    context = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(context - _first_key(context - 1, SLIDING_WINDOW, CHUNK), PARTITION)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < used
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    stat = (seq * NUM_HEADS + head) * num_splits + splits
    top = tl.load(part_top_ptr + stat, mask=split_ok, other=float("-inf"))
    best = tl.max(top, 0)
    if HAS_SINKS:  # the sink joins the denominator once, here, not in every partition
        sink = tl.load(sinks_ptr + head)
        best = tl.maximum(best, sink)
        total = tl.exp(sink - best)
    else:
        total = 0.0
    weight = tl.where(split_ok, tl.exp(top - best), 0.0)
    total += tl.sum(weight * tl.load(part_total_ptr + stat, mask=split_ok, other=0.0), 0)
    acc = tl.load(part_acc_ptr + stat[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(used > 0, total, 1.0)
    tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _optional(tensors: tuple[torch.Tensor | None, ...], q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The optional tensor arguments (an fp8 cache's scales, the sinks): as given, or empty
    tensors (never read) where None."""
    none = q.new_empty(0, dtype=torch.float32)
    return tuple(none if tensor is None else tensor for tensor in tensors)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int, scale: float,
                      sliding_window: int | None = None, softcap: float | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None, chunk_size: int | None = None) -> torch.Tensor:
    """Attention of q [tokens, heads, head_dim], the new tokens of each sequence back to
    back (sequence i's rows are query_start_loc[i]:query_start_loc[i + 1]), over each
    sequence's first seq_lens[i] keys (its cached context, then its new tokens) through
    block_tables [seqs, max_blocks] (int32), causally, each query over only its last
    `sliding_window` keys and only the keys of its own chunk of `chunk_size` where given,
    scores soft-capped at `softcap` where given, each head's float32 logit `sinks` [heads]
    joined to its softmax's denominator where given; an fp8 cache comes with its scales
    `k_scale`, `v_scale`. Returns [tokens, heads, head_dim]."""
    q = q.contiguous()
    out = torch.empty_like(q)
    _, block_size, kv_heads, head_dim = k_cache.shape
    seqs, heads = seq_lens.shape[0], q.shape[1]
    block_m = 16 if max_query_len <= 16 else 32 if q.dtype == torch.float32 else 64
    grid = (seqs, triton.cdiv(max_query_len, block_m), heads)
    _prefill_kernel[grid](q, k_cache, v_cache, *_optional((k_scale, v_scale, sinks), q), out, query_start_loc,
                          seq_lens, block_tables, scale, block_tables.stride(0), NUM_HEADS=heads,
                          NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
                          TILE_N=KEY_TILE, BLOCK_D=triton.next_power_of_2(head_dim),
                          SLIDING_WINDOW=sliding_window or 0, CHUNK=chunk_size or 0, SOFTCAP=float(softcap or 0),
                          PRECISION=_precision(q.dtype), SCALED=is_scaled(k_cache.dtype), HAS_SINKS=sinks is not None)
    return out


def decode_splits(max_seq_len: int) -> int:
    """Partitions of a context of `max_seq_len` keys."""
    return max(1, triton.cdiv(max_seq_len, DECODE_PARTITION))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, num_splits: int, scale: float, sliding_window: int | None = None,
                     softcap: float | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
                     chunk_size: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence, q [seqs, heads, head_dim], over each
    sequence's first seq_lens[i] keys (0: a padding row, whose output is zeros), or only
    their last `sliding_window` and only those of the last key's chunk of `chunk_size`
    where given, scores soft-capped at `softcap` where given, each head's float32 logit
    `sinks` [heads] joined to its softmax's denominator where given. The keys seen are
    split `num_splits` ways (at least `decode_splits(max(seq_lens))`; a fixed number keeps
    the launch the same for CUDA graphs; splits past the keys seen do nothing). An fp8
    cache comes with its scales `k_scale`, `v_scale`. Returns [seqs, heads, head_dim]."""
    q = q.contiguous()
    _, block_size, kv_heads, head_dim = k_cache.shape
    seqs, heads = q.shape[0], q.shape[1]
    part_acc = torch.empty(seqs, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_top = torch.empty(seqs, heads, num_splits, dtype=torch.float32, device=q.device)
    part_total = torch.empty_like(part_top)
    block_d = triton.next_power_of_2(head_dim)
    _decode_partition_kernel[(seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, *_optional((k_scale, v_scale), q), part_acc, part_top, part_total, seq_lens,
        block_tables, scale, block_tables.stride(0), num_splits, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, GROUP_PAD=max(16, triton.next_power_of_2(heads // kv_heads)),
        BLOCK_D=block_d, PARTITION=DECODE_PARTITION, TILE_N=KEY_TILE, SLIDING_WINDOW=sliding_window or 0,
        CHUNK=chunk_size or 0, SOFTCAP=float(softcap or 0), PRECISION=_precision(q.dtype),
        SCALED=is_scaled(k_cache.dtype))
    out = torch.empty_like(q)
    _decode_merge_kernel[(seqs, heads)](part_acc, part_top, part_total, *_optional((sinks,), q), out, seq_lens,
                                        num_splits, NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
                                        SPLITS_PAD=triton.next_power_of_2(num_splits), PARTITION=DECODE_PARTITION,
                                        SLIDING_WINDOW=sliding_window or 0, CHUNK=chunk_size or 0,
                                        HAS_SINKS=sinks is not None)
    return out
