"""Paged attention over the block table, for a flattened batch of variable-length queries.

`prefill_attention` serves any step: each sequence's new tokens attend causally among
themselves and fully over the sequence's cached context (a prefix hit, an earlier chunk),
reading keys and values through the block table. `decode_attention` serves steps where
every sequence has one new token: the context is split into partitions that run in
parallel (split-K), and a second kernel merges their softmax statistics; each program
takes all the query heads of one KV head, so a key block is read once per group.

The caches are [num_blocks, block_size, kv_heads, head_dim]. Products accumulate in
float32; float32 inputs use IEEE products (no TF32), so they match PyTorch's float32.
"""

import torch
import triton
import triton.language as tl

# Keys per split of a decode sequence's context (a multiple of KEY_TILE).
DECODE_PARTITION = 512
# Keys per loop iteration, gathered through the block table whatever the block size.
KEY_TILE = 64


@triton.jit
def _kv_offsets(table_ptr, key_positions, key_ok, kv_head, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_SIZE: tl.constexpr, dims):
    """Offsets [keys, dims] of one KV head's keys at `key_positions`, through a block table row."""
    blocks = tl.load(table_ptr + key_positions // BLOCK_SIZE, mask=key_ok, other=0)
    slots = blocks * BLOCK_SIZE + key_positions % BLOCK_SIZE
    return (slots[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + dims[None, :]


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, table_ptr, key_positions, key_ok, visible, kv_head, dims, dim_ok,
                 scale, top, total, acc, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys folded into the queries' running softmax (online softmax): returns
    the new running maximum, sum of weights and weighted value sum. `visible` [queries,
    keys] masks the scores."""
    kv_offsets = _kv_offsets(table_ptr, key_positions, key_ok, kv_head, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dims)
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    scores = tl.where(visible, scores, float("-inf"))
    new_top = tl.maximum(top, tl.max(scores, 1))
    p = tl.exp(scores - new_top[:, None])
    alpha = tl.exp(top - new_top)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return new_top, total * alpha + tl.sum(p, 1), acc


@triton.jit
def _attend_keys(q, k_cache_ptr, v_cache_ptr, table_ptr, key_start, key_end, positions, kv_head, dims, dim_ok, scale,
                 ROWS: tl.constexpr, CAUSAL: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr):
    """The ROWS queries `q` over keys [key_start, key_end) of one KV head, a tile of
    TILE_N keys at a time (`_attend_tile`): returns the running maximum, sum of weights
    and weighted value sum. CAUSAL: query i sees only keys at or before `positions[i]`."""
    top = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    offsets = tl.arange(0, TILE_N)
    for tile_start in range(key_start, key_end, TILE_N):
        key_positions = tile_start + offsets
        key_ok = key_positions < key_end
        if CAUSAL:
            visible = (key_positions[None, :] <= positions[:, None]) & key_ok[None, :]
        else:
            visible = key_ok[None, :]
        top, total, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table_ptr, key_positions, key_ok, visible,
                                       kv_head, dims, dim_ok, scale, top, total, acc, NUM_KV_HEADS, HEAD_DIM,
                                       BLOCK_SIZE, PRECISION)
    return top, total, acc


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
                    scale, table_stride, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    TILE_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
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
        top, total, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * table_stride, 0, key_end,
                                       computed + rows, kv_head, dims, dim_ok, scale, BLOCK_M, True, NUM_KV_HEADS,
                                       HEAD_DIM, BLOCK_SIZE, BLOCK_D, TILE_N, PRECISION)
        out = acc / total[:, None]
        tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_partition_kernel(q_ptr, k_cache_ptr, v_cache_ptr, part_acc_ptr, part_top_ptr, part_total_ptr,
                             seq_lens_ptr, block_tables_ptr, scale, table_stride, num_splits,
                             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
                             PARTITION: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(seq_lens_ptr + seq)
    start = split * PARTITION
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
        top, total, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * table_stride, start, end,
                                       members, kv_head, dims, dim_ok, scale, GROUP_PAD, False, NUM_KV_HEADS,
                                       HEAD_DIM, BLOCK_SIZE, BLOCK_D, TILE_N, PRECISION)
        stat = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(part_top_ptr + stat, top, mask=member_ok)
        tl.store(part_total_ptr + stat, total, mask=member_ok)
        tl.store(part_acc_ptr + stat[:, None] * HEAD_DIM + dims[None, :], acc, mask=member_ok[:, None] & dim_ok[None, :])


@triton.jit
def _decode_merge_kernel(part_acc_ptr, part_top_ptr, part_total_ptr, out_ptr, seq_lens_ptr, num_splits,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, PARTITION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < used
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    stat = (seq * NUM_HEADS + head) * num_splits + splits
    top = tl.load(part_top_ptr + stat, mask=split_ok, other=float("-inf"))
    best = tl.max(top, 0)
    weight = tl.where(split_ok, tl.exp(top - best), 0.0)
    total = tl.sum(weight * tl.load(part_total_ptr + stat, mask=split_ok, other=0.0), 0)
    acc = tl.load(part_acc_ptr + stat[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(used > 0, total, 1.0)
    tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, max_query_len: int,
                      scale: float) -> torch.Tensor:
    """Attention of q [tokens, heads, head_dim], the new tokens of each sequence back to
    back (sequence i's rows are query_start_loc[i]:query_start_loc[i + 1]), over each
    sequence's first seq_lens[i] keys (its cached context, then its new tokens) through
    block_tables [seqs, max_blocks] (int32). Returns [tokens, heads, head_dim]."""
    q = q.contiguous()
    out = torch.empty_like(q)
    _, block_size, kv_heads, head_dim = k_cache.shape
    seqs, heads = seq_lens.shape[0], q.shape[1]
    block_m = 16 if max_query_len <= 16 else 32 if q.dtype == torch.float32 else 64
    grid = (seqs, triton.cdiv(max_query_len, block_m), heads)
    _prefill_kernel[grid](q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                          block_tables.stride(0), NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim,
                          BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE_N=KEY_TILE,
                          BLOCK_D=triton.next_power_of_2(head_dim), PRECISION=_precision(q.dtype))
    return out


def decode_splits(max_seq_len: int) -> int:
    """Partitions of a context of `max_seq_len` keys."""
    return max(1, triton.cdiv(max_seq_len, DECODE_PARTITION))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                     block_tables: torch.Tensor, num_splits: int, scale: float) -> torch.Tensor:
    """Attention of one new token per sequence, q [seqs, heads, head_dim], over each
    sequence's first seq_lens[i] keys (0: a padding row, whose output is zeros), the
    context split `num_splits` ways (at least `decode_splits(max(seq_lens))`; a fixed
    number keeps the launch the same for CUDA graphs). Returns [seqs, heads, head_dim]."""
    q = q.contiguous()
    _, block_size, kv_heads, head_dim = k_cache.shape
    seqs, heads = q.shape[0], q.shape[1]
    part_acc = torch.empty(seqs, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_top = torch.empty(seqs, heads, num_splits, dtype=torch.float32, device=q.device)
    part_total = torch.empty_like(part_top)
    block_d = triton.next_power_of_2(head_dim)
    _decode_partition_kernel[(seqs, kv_heads, num_splits)](
        q, k_cache, v_cache, part_acc, part_top, part_total, seq_lens, block_tables, scale, block_tables.stride(0),
        num_splits, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        GROUP_PAD=max(16, triton.next_power_of_2(heads // kv_heads)), BLOCK_D=block_d, PARTITION=DECODE_PARTITION,
        TILE_N=KEY_TILE, PRECISION=_precision(q.dtype))
    out = torch.empty_like(q)
    _decode_merge_kernel[(seqs, heads)](part_acc, part_top, part_total, out, seq_lens, num_splits, NUM_HEADS=heads,
                                        HEAD_DIM=head_dim, BLOCK_D=block_d,
                                        SPLITS_PAD=triton.next_power_of_2(num_splits), PARTITION=DECODE_PARTITION)
    return out
