"""Where the CPU engine's time goes, by part of a step, on the throughput suite's workloads.

Why: on a CPU whose matrix products are fast (AMX), what is not a product decides a step; the
same breakdown on every kind of CPU lets one read them alike and predict a faster one's from a
slower one's (the products shrink by the ratio of the measured product rates, the rest stays).

It runs our engine in this process on workloads of benchmarks/workloads.py (EOS ignored, one
warm-up first) with each part's methods wrapped by a timer that charges a call's time, less
that of the timed calls inside it, to its part. On a CPU every kernel runs as it is called, so
the parts add up to the wall time:

- products: the engine's projections (`Linear`, the gated MLP, whose fused int8 kernel also
  applies the activation) and the language-model head; a compiled decoder stack
  (`engine.model_loader.cpu_decoder_stack`) times its own products and attention;
- attention in steps with prompt rows (prefill, and decode rows that share such a step),
  attention in decode-only steps, and the writes of keys and values into the cache (where a
  backend rotates, writes and attends in one call, `rotate_and_attend`, the rotation and the
  writes count as its attention);
- the rest of the forward pass: norms, rotary, residual adds, embedding and glue;
- sampling (logits to tokens);
- host: the rest of a step (scheduling, step inputs, output processing, detokenizing);
- outside steps: `generate`'s own work before and after its steps.

It prints each part's seconds and share, the rates the products and attention reach against
the machine's measured product rate and copy bandwidth, the workload's fraction of its
roofline (benchmarks/roofline.py), and what it would be on a CPU whose products are
`--faster-products` times faster (the rest unchanged).

    .venv/bin/python benchmarks/step_breakdown.py --workloads b --scale 0.5
    .venv/bin/python benchmarks/step_breakdown.py --workloads b,a,c --scale 0.5 --faster-products 3.6
"""

import argparse
import contextlib
import functools
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import roofline as rl  # noqa: E402
from benchmarks.workloads import Workload, build_workloads  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402

PRODUCTS = "products"
LM_HEAD = "language-model head"
PREFILL_ATTENTION = "attention, steps with prompt rows"
DECODE_ATTENTION = "attention, decode-only steps"
KV_WRITES = "key and value writes"
FORWARD_REST = "rest of the forward (norms, rotary, adds, glue)"
SAMPLING = "sampling"
HOST = "host (schedule, inputs, outputs)"
OUTSIDE = "outside steps"
PARTS = [PRODUCTS, LM_HEAD, PREFILL_ATTENTION, DECODE_ATTENTION, KV_WRITES, FORWARD_REST, SAMPLING, HOST, OUTSIDE]


@dataclass
class PartTimes:
    """Seconds charged to each part: a timed call's time less its timed calls'."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _open: list[list] = field(default_factory=list)  # [part, seconds of timed calls inside]

    def timed(self, fn: Callable, part: str | Callable[..., str]) -> Callable:
        """`fn` charging its calls to `part` (or to the part `part(*args)` names)."""
        @functools.wraps(fn)
        def call(*args, **kwargs):
            frame = [part(*args, **kwargs) if callable(part) else part, 0.0]
            self._open.append(frame)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self._open.pop()
                self.seconds[frame[0]] += elapsed - frame[1]
                self.calls[frame[0]] += 1
                if self._open:
                    self._open[-1][1] += elapsed
        return call

    def charge(self, part: str, seconds: float, calls: int) -> None:
        """Charges `seconds` that a timed call measured inside itself to `part` (a compiled
        decoder stack's products and attention), not to the part of the call open around them."""
        self.seconds[part] += seconds
        self.calls[part] += calls
        if self._open:
            self._open[-1][1] += seconds


def _attention_part(*args) -> str:
    """The attention part of a backend call (its last argument is the step's metadata)."""
    return PREFILL_ATTENTION if max(args[-1].query_lens) > 1 else DECODE_ATTENTION


@contextlib.contextmanager
def timing(llm: LLM, times: PartTimes) -> Iterator[None]:
    """The parts' methods wrapped while the block runs (on their classes: every instance)."""
    from engine.layers.linear import Linear
    from engine.layers.vocab_parallel_embedding import ParallelLMHead
    from engine.models.llama import LlamaMLP
    from engine.worker.worker import Worker

    engine = llm.llm_engine
    runner = engine.model_runner
    backend = type(runner.kv_cache.backend)
    def product(layer: Linear, *args, **kwargs) -> str:
        return LM_HEAD if isinstance(layer, ParallelLMHead) else PRODUCTS

    targets = [(Linear, "forward", product), (LlamaMLP, "forward", PRODUCTS), (ParallelLMHead, "logits", LM_HEAD),
               (backend, "forward", _attention_part), (backend, "rotate_and_attend", _attention_part),
               (backend, "write_kv", KV_WRITES),
               (Worker, "execute_model", FORWARD_REST), (type(runner.sampler), "sample", SAMPLING),
               (type(engine), "step", HOST)]
    with contextlib.ExitStack() as stack:
        for owner, name, part in targets:
            if not hasattr(owner, name):  # an older engine (a breakdown of another commit, for a comparison)
                continue
            stack.enter_context(mock.patch.object(owner, name, times.timed(getattr(owner, name), part)))
        _time_decoder_stack(times, stack)
        yield


def _time_decoder_stack(times: PartTimes, stack: contextlib.ExitStack) -> None:
    """A compiled decoder stack's products and attention, as the stack itself times them (its
    norms and the loop around its kernels stay in the rest of the forward)."""
    try:
        from engine.model_loader.cpu_decoder_stack import DecoderPlan
    except ImportError:  # an older engine
        return
    seconds = torch.zeros(3, dtype=torch.float64)
    original = DecoderPlan.forward

    def forward(plan, hidden, positions, meta, kept_rows):
        before = seconds.tolist()
        out = original(plan, hidden, positions, meta, kept_rows)
        products, attention, _ = (now - then for now, then in zip(seconds.tolist(), before))
        times.charge(PRODUCTS, products, 3 * plan.layers)
        times.charge(_attention_part(meta), attention, plan.layers)
        return out

    stack.enter_context(mock.patch.object(DecoderPlan, "seconds", seconds))
    stack.enter_context(mock.patch.object(DecoderPlan, "forward", forward))


@dataclass
class Breakdown:
    """One workload's run: wall seconds, each part's, and how many timed calls each took
    (their mean shows a part's fixed cost a call, which does not shrink with faster products)."""

    workload: Workload
    seconds: float
    parts: dict[str, float]
    calls: dict[str, int]
    dtype: str
    kv_cache_dtype: str  # the cache's element type, as the engine names it
    detail: str


def measure(llm: LLM, workload: Workload) -> Breakdown:
    warmup = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in workload.warmup], warmup, use_tqdm=False)
    llm.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
    times = PartTimes()
    with timing(llm, times):
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == workload.max_tokens
    parts = {part: times.seconds.get(part, 0.0) for part in PARTS}
    parts[OUTSIDE] = seconds - sum(parts.values())
    config = llm.llm_engine.config
    detail = f"{llm.dtype}{' + ' + config.quantization if config.quantization else ''}, {config.kv_cache_dtype} KV"
    calls = {part: times.calls.get(part, 0) for part in PARTS}
    return Breakdown(workload, seconds, parts, calls, llm.dtype, config.kv_cache_dtype, detail)


def report(run: Breakdown, shape: rl.ModelShape, rates: rl.MachineRates, faster: float) -> None:
    """The parts' table, the rates reached, the roofline fraction and the faster CPU's prediction."""
    workload, total = run.workload, run.seconds
    prompts, outputs = [len(p) for p in workload.prompts], workload.max_tokens
    element_size, kv_element_size = rl.element_size(run.dtype), rl.element_size(run.kv_cache_dtype)
    print(f"({workload.name}) {workload.description}: {total:.2f} s, {workload.output_tokens / total:.1f} output "
          f"tok/s ({run.detail})")
    print(f"  {'part':<52} {'s':>7} {'share':>7} {'calls':>7} {'us/call':>8}")
    for part in PARTS:
        calls = run.calls[part]
        each = f"{run.parts[part] / calls * 1e6:8.1f}" if calls else f"{'':>8}"
        print(f"  {part:<52} {run.parts[part]:7.2f} {run.parts[part] / total:7.1%} {calls or '':>7} {each}")
    products = run.parts[PRODUCTS] + run.parts[LM_HEAD]
    print(f"  {'not a matrix product':<52} {total - products:7.2f} {(total - products) / total:7.1%}")
    flops = rl.product_flops(shape, prompts, outputs, workload.shared_prefix_len)
    peak = max(rates.matmul_flops.values())
    print(f"  products: {flops / products / 1e9:.0f} GFLOP/s, {flops / products / peak:.0%} of the measured "
          f"{peak / 1e9:.0f}")
    decode_bytes = rl.decode_kv_bytes(shape, prompts, outputs, kv_element_size)
    if run.parts[DECODE_ATTENTION]:
        print(f"  attention, decode-only steps: at most {decode_bytes / run.parts[DECODE_ATTENTION] / 1e9:.1f} GB/s "
              f"of cache read (every decode row's keys and values), copy bandwidth {rates.bandwidth / 1e9:.1f}")
    bound = rl.roofline(shape, rates, prompts, outputs, workload.shared_prefix_len, element_size, 256, kv_element_size)
    ours = workload.output_tokens / total
    print(f"  roofline: {bound.output_tokens_per_s:.0f} output tok/s ({bound.bound}-bound); ours at "
          f"{ours / bound.output_tokens_per_s:.1%}")
    faster_rates = rl.MachineRates({k: v * faster for k, v in rates.matmul_flops.items()}, rates.bandwidth)
    faster_bound = rl.roofline(shape, faster_rates, prompts, outputs, workload.shared_prefix_len, element_size, 256,
                               kv_element_size)
    predicted = total - products * (1 - 1 / faster)
    print(f"  with products {faster:g}x faster and the rest as here: {predicted:.2f} s, "
          f"{workload.output_tokens / predicted:.0f} output tok/s, {workload.output_tokens / predicted / faster_bound.output_tokens_per_s:.1%} "
          f"of that CPU's roofline ({faster_bound.output_tokens_per_s:.0f}); not a product {(total - products) / predicted:.0%}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--model", default=None, help="a model folder or name (default: the embedded model)")
    parser.add_argument("--workloads", default="b", help="comma-separated: a, b, c")
    parser.add_argument("--scale", type=float, default=0.5, help="shrinks the workloads (benchmarks/workloads.py)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--quantization", default="auto", type=lambda v: None if v == "none" else v,
                        help="our quantization: auto (the default's), none, or a method")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache block (default: the engine's)")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--faster-products", type=float, default=3.6,
                        help="the prediction's product speed-up (3.6: a Sapphire Rapids' AMX over a Zen 4)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    from transformers import AutoTokenizer

    from engine.model_loader.folder import resolve_model_path

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model)
    cpu = detect_cpu()
    rates = rl.measure_rates(cpu.native_bf16)
    shape = rl.model_shape(model_path)
    print(f"CPU: {cpu.describe()} | threads: {args.threads}\n{rates.describe()}")
    workloads = build_workloads(args.workloads.split(","), AutoTokenizer.from_pretrained(model_path), args.scale,
                                args.seed)
    block_size = {} if args.block_size is None else {"block_size": args.block_size}
    with LLM(str(model_path), quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
             num_threads=args.threads, batch_invariant=args.batch_invariant, **block_size) as llm:
        for workload in workloads:
            report(measure(llm, workload), shape, rates, args.faster_products)


if __name__ == "__main__":
    main()
