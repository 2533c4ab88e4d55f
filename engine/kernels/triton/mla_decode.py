"""Decode attention over a latent KV cache (multi-head latent attention's absorbed form, see
`engine.attention.mla`): one new token per sequence, every query head over one cache vector
per key, [latent c, rotary key k_pe], whose first LATENT values are also the value.

Against the general decode kernel (`paged_attention.decode_attention`) run on the same cache,
this one reads each key's vector once for both products (the score and the weighted value
sum), keeps the latent and rotary parts in tiles of their own widths (512 and 64 for
DeepSeek: the general kernel pads 576 to 1,024), and gives each program a tile of BLOCK_H
heads rather than a KV head's whole group (128 heads for DeepSeek-V3 would not fit one
program's registers). The context is split into partitions (split-K) whose softmax
statistics the general kernel's merge kernel combines.

The cache is [num_blocks, block_size, 1, latent + rope] in the queries' dtype, a narrower
float one, or fp8 with float32 scales [num_blocks, block_size, 1] (SCALED): a key's score
and its value's weight are multiplied by its scale. Products accumulate in float32, IEEE
for float32 inputs.
"""

import torch
import triton
import triton.language as tl

from engine.kernels.kv_cache_quant import is_scaled
from engine.kernels.triton.paged_attention import DECODE_PARTITION, _decode_merge_kernel, _optional, _precision

# Keys per loop iteration, and query heads per program.
KEY_TILE = 32
BLOCK_H = 16


@triton.jit
def _mla_partition_kernel(q_ptr, cache_ptr, scale_ptr, part_acc_ptr, part_top_ptr, part_total_ptr, seq_lens_ptr,
                          block_tables_ptr, scale, table_stride, num_splits, NUM_HEADS: tl.constexpr,
                          LATENT: tl.constexpr, ROPE: tl.constexpr, LATENT_PAD: tl.constexpr,
                          ROPE_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
                          PARTITION: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
                          SCALED: tl.constexpr):
    seq = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(seq_lens_ptr + seq)
    start = split * PARTITION
    if start < context:
        width = LATENT + ROPE
        heads = head_tile * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
        head_ok = heads < NUM_HEADS
        latent = tl.arange(0, LATENT_PAD)
        latent_ok = latent < LATENT
        rope = tl.arange(0, ROPE_PAD)
        rope_ok = rope < ROPE
        q_rows = (seq * NUM_HEADS + heads)[:, None] * width
        q_latent = tl.load(q_ptr + q_rows + latent[None, :], mask=head_ok[:, None] & latent_ok[None, :], other=0.0)
        q_rope = tl.load(q_ptr + q_rows + LATENT + rope[None, :], mask=head_ok[:, None] & rope_ok[None, :],
                         other=0.0)
        top = tl.full([HEADS_PER_PROGRAM], float("-inf"), tl.float32)
        total = tl.zeros([HEADS_PER_PROGRAM], tl.float32)
        acc = tl.zeros([HEADS_PER_PROGRAM, LATENT_PAD], tl.float32)
        end = tl.minimum(context, start + PARTITION)
        table = block_tables_ptr + seq * table_stride
        for tile_start in range(start, end, TILE_N):
            positions = tile_start + tl.arange(0, TILE_N)
            key_ok = positions < end
            blocks = tl.load(table + positions // BLOCK_SIZE, mask=key_ok, other=0)
            slots = blocks * BLOCK_SIZE + positions % BLOCK_SIZE
            c = tl.load(cache_ptr + slots[:, None] * width + latent[None, :],
                        mask=key_ok[:, None] & latent_ok[None, :], other=0.0).to(q_latent.dtype)
            k_pe = tl.load(cache_ptr + slots[:, None] * width + LATENT + rope[None, :],
                           mask=key_ok[:, None] & rope_ok[None, :], other=0.0).to(q_latent.dtype)
            scores = tl.dot(q_latent, tl.trans(c), input_precision=PRECISION)
            scores = (scores + tl.dot(q_rope, tl.trans(k_pe), input_precision=PRECISION)) * scale
            if SCALED:
                key_scale = tl.load(scale_ptr + slots, mask=key_ok, other=0.0)
                scores = scores * key_scale[None, :]
            scores = tl.where(key_ok[None, :], scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, 1))
            p = tl.exp(scores - new_top[:, None])
            alpha = tl.exp(top - new_top)
            weights = p
            if SCALED:
                weights = p * key_scale[None, :]
            acc = acc * alpha[:, None] + tl.dot(weights.to(q_latent.dtype), c, input_precision=PRECISION)
            total = total * alpha + tl.sum(p, 1)
            top = new_top
        stat = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(part_top_ptr + stat, top, mask=head_ok)
        tl.store(part_total_ptr + stat, total, mask=head_ok)
        tl.store(part_acc_ptr + stat[:, None] * LATENT + latent[None, :], acc,
                 mask=head_ok[:, None] & latent_ok[None, :])


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                         num_splits: int, scale: float, latent: int,
                         cache_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence, q [seqs, heads, latent + rope] (absorbed
    queries), over each sequence's first seq_lens[i] keys (0: a padding row, whose output is
    zeros) in `cache` [num_blocks, block_size, 1, latent + rope] through block_tables [seqs,
    max_blocks] (int32): scores are scale * (q . key), values the keys' first `latent`
    values. The keys are split `num_splits` ways (as `decode_attention`'s). An fp8 cache
    comes with its scales `cache_scale`. Returns [seqs, heads, latent]."""
    q = q.contiguous()
    _, block_size, kv_heads, width = cache.shape
    if kv_heads != 1:
        raise ValueError(f"a latent cache has one vector per slot; this one has {kv_heads} heads")
    seqs, heads = q.shape[0], q.shape[1]
    rope = width - latent
    part_acc = torch.empty(seqs, heads, num_splits, latent, dtype=torch.float32, device=q.device)
    part_top = torch.empty(seqs, heads, num_splits, dtype=torch.float32, device=q.device)
    part_total = torch.empty_like(part_top)
    (scales,) = _optional((cache_scale,), q)
    _mla_partition_kernel[(seqs, triton.cdiv(heads, BLOCK_H), num_splits)](
        q, cache, scales, part_acc, part_top, part_total, seq_lens, block_tables, scale, block_tables.stride(0),
        num_splits, NUM_HEADS=heads, LATENT=latent, ROPE=rope, LATENT_PAD=max(16, triton.next_power_of_2(latent)),
        ROPE_PAD=max(16, triton.next_power_of_2(rope)), BLOCK_SIZE=block_size, HEADS_PER_PROGRAM=BLOCK_H,
        PARTITION=DECODE_PARTITION, TILE_N=KEY_TILE, PRECISION=_precision(q.dtype),
        SCALED=is_scaled(cache.dtype))
    out = q.new_empty(seqs, heads, latent)
    _decode_merge_kernel[(seqs, heads)](part_acc, part_top, part_total, *_optional((None,), q), out, seq_lens,
                                        num_splits, NUM_HEADS=heads, HEAD_DIM=latent,
                                        BLOCK_D=triton.next_power_of_2(latent),
                                        SPLITS_PAD=triton.next_power_of_2(num_splits), PARTITION=DECODE_PARTITION,
                                        SLIDING_WINDOW=0, CHUNK=0, HAS_SINKS=False)
    return out
