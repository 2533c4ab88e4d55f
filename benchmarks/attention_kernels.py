"""The CPU paged-attention kernel alone, on a decoder's attention shapes: a decode step's reads
of the cache and a prefill's arithmetic, each against what this machine allows and the
prefill against PyTorch's `scaled_dot_product_attention` (its CPU flash kernel).

Why: `benchmarks/step_breakdown.py` shows attention as the largest part of a step that is not
a matrix product. Decode is bound by reading the cache (so it is measured with every layer's
cache in DRAM, as in a run, and with one layer's cache hot in the CPU's caches), prefill by its
arithmetic; on a CPU with AMX, PyTorch's flash kernel runs its products on tiles, and this
comparison, taken there, says whether prefill should use it. Keys lie in blocks scattered
through the cache, as in a long run, and every cache dtype the kernel reads can be compared.

The defaults are the embedded model's attention (30 layers, 9 query heads over 3 KV heads of
64 dimensions) at workload (b)'s decode: 32 sequences of 300-600 keys.

    .venv/bin/python benchmarks/attention_kernels.py
    .venv/bin/python benchmarks/attention_kernels.py --kv-cache-dtypes bfloat16,int8 --block-size 16
"""

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import roofline as rl  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.kernels import kv_cache_quant  # noqa: E402
from engine.kernels.cpu_attention import paged_attention  # noqa: E402


@dataclass(frozen=True)
class AttentionShape:
    """A decoder's attention and the paged cache's block size."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int


@dataclass
class PagedCache:
    """Keys and values of `lengths` sequences in one layer's paged cache ([kv_heads, slots,
    head_dim], the CPU backend's layout), with their scales for a scaled dtype (else None)."""

    keys: torch.Tensor
    values: torch.Tensor
    key_scales: torch.Tensor | None
    value_scales: torch.Tensor | None

    def attend(self, q: torch.Tensor, tables: torch.Tensor, row_seq: torch.Tensor, row_keys: torch.Tensor,
               block_size: int) -> torch.Tensor:
        return paged_attention(q, self.keys, self.values, tables, row_seq, row_keys, block_size,
                               q.shape[-1] ** -0.5, k_scale=self.key_scales, v_scale=self.value_scales)


def block_tables(lengths: list[int], block_size: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Each sequence's blocks, drawn in a random order from a pool just large enough (a long
    run's cache: a sequence's blocks lie apart), and the pool's slot count."""
    counts = [-(-n // block_size) for n in lengths]
    order = torch.randperm(sum(counts), generator=generator)
    tables = torch.zeros(len(lengths), max(counts), dtype=torch.long)
    start = 0
    for seq, count in enumerate(counts):
        tables[seq, :count] = order[start:start + count]
        start += count
    return tables, sum(counts) * block_size


def paged_cache(keys: torch.Tensor, values: torch.Tensor, dtype: str) -> PagedCache:
    """A cache of `dtype` ("bfloat16", "float16", "float32" or "int8") holding `keys` and
    `values` [kv_heads, slots, head_dim]: cast, or quantized per (token, KV head) as the
    engine's cache writes quantize them."""
    torch_dtype = kv_cache_quant.cache_torch_dtype(dtype)
    if not kv_cache_quant.is_scaled(torch_dtype):
        return PagedCache(keys.to(torch_dtype), values.to(torch_dtype), None, None)
    (k, k_scale), (v, v_scale) = (kv_cache_quant.quantize(x, torch_dtype) for x in (keys, values))
    return PagedCache(k, v, k_scale, v_scale)


def cache_bytes(cache: PagedCache, tokens: int) -> int:
    """Bytes read for `tokens` keys and values of every KV head, scales included."""
    per_token = 2 * cache.keys.shape[0] * cache.keys.shape[2] * cache.keys.element_size()
    if cache.key_scales is not None:
        per_token += 2 * cache.keys.shape[0] * cache.key_scales.element_size()
    return per_token * tokens


@dataclass
class DecodeResult:
    dtype: str
    dram_s: float  # a step over every layer's own cache (beyond the CPU's caches, as in a run)
    hot_s: float  # the same step over one layer's cache, read again by each layer
    bytes: int  # the cache a step reads


def measure_decode(shape: AttentionShape, lengths: list[int], dtype: str, rounds: int, seed: int = 0) -> DecodeResult:
    """One decode step (a query row a sequence) through every layer, timed with every layer's
    cache in DRAM and with a single layer's cache hot."""
    generator = torch.Generator().manual_seed(seed)
    tables, slots = block_tables(lengths, shape.block_size, generator)
    caches = [paged_cache(torch.randn(shape.kv_heads, slots, shape.head_dim, generator=generator),
                          torch.randn(shape.kv_heads, slots, shape.head_dim, generator=generator), dtype)
              for _ in range(shape.layers)]
    q = torch.randn(len(lengths), shape.heads, shape.head_dim, generator=generator).to(torch.bfloat16)
    row_seq, row_keys = torch.arange(len(lengths)), torch.tensor(lengths)

    def step(layer_caches: list[PagedCache]) -> None:
        for cache in layer_caches:
            cache.attend(q, tables, row_seq, row_keys, shape.block_size)

    dram = rl.best_time(lambda: step(caches), rounds)
    hot = rl.best_time(lambda: step(caches[:1] * shape.layers), rounds)
    return DecodeResult(dtype, dram, hot, shape.layers * cache_bytes(caches[0], sum(lengths)))


@dataclass
class PrefillResult:
    dtype: str
    ours_s: float
    sdpa_s: float  # PyTorch's scaled_dot_product_attention, causal, a call per sequence
    flops: int  # the causal products' (2 per multiply-add, scores and value sums)
    largest_difference: float  # between the two outputs


def measure_prefill(shape: AttentionShape, lengths: list[int], dtype: str, rounds: int,
                    seed: int = 0) -> PrefillResult:
    """One layer's causal attention over whole prompts of `lengths`, in bfloat16: ours reading
    the keys from a paged cache of `dtype`, PyTorch's from dense bfloat16 tensors."""
    generator = torch.Generator().manual_seed(seed)
    tables, slots = block_tables(lengths, shape.block_size, generator)
    keys = torch.randn(shape.kv_heads, slots, shape.head_dim, generator=generator)
    values = torch.randn(shape.kv_heads, slots, shape.head_dim, generator=generator)
    cache = paged_cache(keys, values, dtype)
    q = torch.randn(sum(lengths), shape.heads, shape.head_dim, generator=generator).to(torch.bfloat16)
    row_seq = torch.cat([torch.full((n,), seq) for seq, n in enumerate(lengths)])
    row_keys = torch.cat([torch.arange(1, n + 1) for n in lengths])
    positions = [torch.arange(n) for n in lengths]
    slot_of = [tables[seq, p // shape.block_size] * shape.block_size + p % shape.block_size
               for seq, p in enumerate(positions)]
    dense = [tuple(x.to(torch.bfloat16).unsqueeze(0) for x in (q[row_seq == seq].transpose(0, 1),
                                                              keys[:, slot_of[seq]], values[:, slot_of[seq]]))
             for seq in range(len(lengths))]

    def ours() -> torch.Tensor:
        return cache.attend(q, tables, row_seq, row_keys, shape.block_size)

    def sdpa() -> torch.Tensor:
        outputs = [F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True) for qs, ks, vs in dense]
        return torch.cat([o.squeeze(0).transpose(0, 1) for o in outputs])

    difference = (ours().float() - sdpa().float()).abs().max().item()
    flops = sum(4 * shape.heads * shape.head_dim * n * (n + 1) // 2 for n in lengths)
    return PrefillResult(dtype, rl.best_time(ours, rounds), rl.best_time(sdpa, rounds), flops, difference)


def report_decode(result: DecodeResult, shape: AttentionShape, rates: rl.MachineRates) -> None:
    per_layer_us = result.dram_s / shape.layers * 1e6
    print(f"decode, {result.dtype} cache: {result.dram_s * 1e3:.2f} ms a step in DRAM ({per_layer_us:.0f} us a layer, "
          f"{result.bytes / result.dram_s / 1e9:.1f} GB/s of {result.bytes / 1e6:.0f} MB, "
          f"{result.bytes / result.dram_s / rates.bandwidth:.0%} of the copy bandwidth), "
          f"{result.hot_s * 1e3:.2f} ms hot")


def report_prefill(result: PrefillResult) -> None:
    ours, sdpa = result.flops / result.ours_s / 1e9, result.flops / result.sdpa_s / 1e9
    print(f"prefill, {result.dtype} cache: ours {result.ours_s * 1e3:.2f} ms ({ours:.0f} GFLOP/s), PyTorch SDPA "
          f"{result.sdpa_s * 1e3:.2f} ms ({sdpa:.0f} GFLOP/s): ours {result.sdpa_s / result.ours_s:.2f}x; "
          f"outputs within {result.largest_difference:.3f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16, help="the engine's default")
    parser.add_argument("--seqs", type=int, default=32, help="decode: sequences in the step")
    parser.add_argument("--keys", default="300-600", help="decode: each sequence's keys, drawn from this range")
    parser.add_argument("--prefill-lengths", default="300,340,384", help="prefill: the prompts' lengths")
    parser.add_argument("--kv-cache-dtypes", default="bfloat16,int8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = AttentionShape(args.layers, args.heads, args.kv_heads, args.head_dim, args.block_size)
    low, high = (int(k) for k in args.keys.split("-"))
    lengths = torch.randint(low, high + 1, (args.seqs,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    prefill_lengths = [int(n) for n in args.prefill_lengths.split(",")]
    rates = rl.measure_rates(detect_cpu().native_bf16)
    print(f"CPU: {detect_cpu().describe()} | threads: {args.threads}\n{rates.describe()}\n{shape}, "
          f"bfloat16 queries; decode: {args.seqs} sequences of {args.keys} keys; prefill: {prefill_lengths}")
    for dtype in args.kv_cache_dtypes.split(","):
        report_decode(measure_decode(shape, lengths, dtype, args.rounds, args.seed), shape, rates)
        report_prefill(measure_prefill(shape, prefill_lengths, dtype, args.rounds, args.seed))


if __name__ == "__main__":
    main()
