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

`--builds` compares kernels built from other checkouts with this one's, loaded side by side in
this process and timed in turn, round after round: on a noisy machine two runs of one build
differ more than two builds do, and interleaving in one process is what tells them apart.

    .venv/bin/python benchmarks/attention_kernels.py --kv-cache-dtypes bfloat16 \
        --builds before=~/.cache/torch_extensions/py311_cpu/engine_cpu_kernels_<hash>/engine_cpu_kernels_<hash>.so,after=this
"""

import argparse
import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import roofline as rl  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.kernels import cpu_build, kv_cache_quant  # noqa: E402
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


@dataclass
class DecodeStep:
    """One decode step's inputs: a query row a sequence of `lengths`, every layer's own cache."""

    caches: list[PagedCache]
    q: torch.Tensor
    tables: torch.Tensor
    lengths: list[int]
    block_size: int

    def run(self, caches: list[PagedCache] | None = None) -> None:
        """The step through every layer's cache (beyond the CPU's caches, as in a run), or `caches`."""
        row_seq, row_keys = torch.arange(len(self.lengths)), torch.tensor(self.lengths)
        for cache in self.caches if caches is None else caches:
            cache.attend(self.q, self.tables, row_seq, row_keys, self.block_size)


def decode_step(shape: AttentionShape, lengths: list[int], dtype: str, seed: int = 0) -> DecodeStep:
    """A step over caches of `dtype` whose sequences' blocks lie apart, as in a long run."""
    generator = torch.Generator().manual_seed(seed)
    tables, slots = block_tables(lengths, shape.block_size, generator)
    caches = [paged_cache(torch.randn(shape.kv_heads, slots, shape.head_dim, generator=generator),
                          torch.randn(shape.kv_heads, slots, shape.head_dim, generator=generator), dtype)
              for _ in range(shape.layers)]
    q = torch.randn(len(lengths), shape.heads, shape.head_dim, generator=generator).to(torch.bfloat16)
    return DecodeStep(caches, q, tables, lengths, shape.block_size)


def measure_decode(shape: AttentionShape, lengths: list[int], dtype: str, rounds: int, seed: int = 0) -> DecodeResult:
    """One decode step (a query row a sequence) through every layer, timed with every layer's
    cache in DRAM and with a single layer's cache hot."""
    step = decode_step(shape, lengths, dtype, seed)
    dram = rl.best_time(step.run, rounds)
    hot = rl.best_time(lambda: step.run(step.caches[:1] * shape.layers), rounds)
    return DecodeResult(dtype, dram, hot, shape.layers * cache_bytes(step.caches[0], sum(lengths)))


@dataclass
class PrefillResult:
    dtype: str
    ours_s: float
    sdpa_s: float  # PyTorch's scaled_dot_product_attention, causal, a call per sequence
    flops: int  # the causal products' (2 per multiply-add, scores and value sums)
    largest_difference: float  # between the two outputs


@dataclass
class PrefillCase:
    """One layer's causal attention over whole prompts, in bfloat16: `ours` reading the keys from
    a paged cache, `sdpa` PyTorch's from dense tensors; `flops` the causal products' (2 per
    multiply-add, scores and value sums)."""

    ours: Callable[[], torch.Tensor]
    sdpa: Callable[[], torch.Tensor]
    flops: int


def prefill_case(shape: AttentionShape, lengths: list[int], dtype: str, seed: int = 0) -> PrefillCase:
    """Prompts of `lengths`, ours over a paged cache of `dtype`, PyTorch's over dense bfloat16."""
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

    flops = sum(4 * shape.heads * shape.head_dim * n * (n + 1) // 2 for n in lengths)
    return PrefillCase(ours, sdpa, flops)


def measure_prefill(shape: AttentionShape, lengths: list[int], dtype: str, rounds: int,
                    seed: int = 0) -> PrefillResult:
    """One layer's causal attention over whole prompts of `lengths`, in bfloat16: ours reading
    the keys from a paged cache of `dtype`, PyTorch's from dense bfloat16 tensors."""
    case = prefill_case(shape, lengths, dtype, seed)
    difference = (case.ours().float() - case.sdpa().float()).abs().max().item()
    return PrefillResult(dtype, rl.best_time(case.ours, rounds), rl.best_time(case.sdpa, rounds), case.flops,
                         difference)


def load_build(spec: str) -> ModuleType:
    """The kernels' extension module that `spec` names: "this" (this checkout's build), or the
    path of one built from another checkout (its .so in PyTorch's extension cache, named by the
    hash of its sources), loaded beside this one under its own name."""
    if spec == "this":
        module = cpu_build.load()
        if module is None:
            raise SystemExit("this checkout's CPU kernels did not build (see the log above)")
        return module
    path = Path(spec).expanduser()
    found = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    if found is None or not path.is_file():
        raise SystemExit(f"--builds: no extension module at {path}")
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


@contextlib.contextmanager
def using(module: ModuleType) -> Iterator[None]:
    """The engine's kernel calls going to `module` while the block runs."""
    with mock.patch.object(cpu_build, "load", lambda: module):
        yield


def compare_builds(builds: dict[str, ModuleType], cases: dict[str, Callable[[], object]],
                   rounds: int) -> dict[str, dict[str, float]]:
    """Each case's fastest call through each build, seconds: a warm-up call each, then `rounds`
    rounds, each timing every case through every build in turn."""
    best = {case: dict.fromkeys(builds, float("inf")) for case in cases}
    for first in (True,) + (False,) * rounds:
        for case, fn in cases.items():
            for name, module in builds.items():
                with using(module):
                    start = time.perf_counter()
                    fn()
                    if not first:
                        best[case][name] = min(best[case][name], time.perf_counter() - start)
    return best


def report_builds(best: dict[str, dict[str, float]]) -> None:
    names = list(next(iter(best.values())))
    print(f"{'ms, best of the rounds':34}" + "".join(f"{name:>14}" for name in names) + f"  {names[-1]} / {names[0]}")
    for case, times in best.items():
        print(f"{case:34}" + "".join(f"{times[name] * 1e3:14.3f}" for name in names)
              + f"  {times[names[-1]] / times[names[0]]:.3f}")


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
    parser.add_argument("--builds", default=None,
                        help="name=build,...: compare these builds side by side (a build: the path of another "
                             "checkout's extension module, or 'this'), decode in DRAM and prefill, each dtype")
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
    if args.builds:
        builds = {name: load_build(spec) for name, spec in (item.split("=", 1) for item in args.builds.split(","))}
        cases = {}
        for dtype in args.kv_cache_dtypes.split(","):
            cases[f"decode in DRAM, {dtype} cache"] = decode_step(shape, lengths, dtype, args.seed).run
            cases[f"prefill, {dtype} cache"] = prefill_case(shape, prefill_lengths, dtype, args.seed).ours
        report_builds(compare_builds(builds, cases, args.rounds))
        return
    for dtype in args.kv_cache_dtypes.split(","):
        report_decode(measure_decode(shape, lengths, dtype, args.rounds, args.seed), shape, rates)
        report_prefill(measure_prefill(shape, prefill_lengths, dtype, args.rounds, args.seed))


if __name__ == "__main__":
    main()
