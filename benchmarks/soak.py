"""Soak test: thousands of requests through one LLM with a KV cache small enough to preempt
constantly, watching for memory growth and lost blocks.

The prompts (random token ids, a third of them starting with one of four shared prefixes,
so that prefix caching is exercised) go through in chunks of `generate` calls; after each
chunk it prints the process's RSS (VmRSS) and peak (VmHWM), the preemptions the scheduler
counted, throughput, and whether every KV block came back. Some requests ask for n=2
completions; with `--policy priority` requests get random priorities. Every completion
must have exactly its max_tokens (EOS is ignored); a mismatch or a lost block is reported
and makes the exit status 1.

    .venv/bin/python benchmarks/soak.py                                  # 5,000 prompts, tiny llama
    .venv/bin/python benchmarks/soak.py --prompts 500 --model smollm2-135m-instruct
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import random  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model_loader.embedded_model import EMBEDDED_MODEL_NAME  # noqa: E402
from engine.model_loader.folder import resolve_model_path  # noqa: E402
from engine.model_loader.model_config import resolve_model_config  # noqa: E402
from engine.models.llama import head_dim_of  # noqa: E402

TINY = "tiny"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=5000, help="requests in all (default 5000)")
    parser.add_argument("--chunks", type=int, default=10, help="generate calls to split them over (default 10)")
    parser.add_argument("--model", default=TINY,
                        help=f"'{TINY}' (a random tiny llama built into a temporary folder, the default), "
                             f"'{EMBEDDED_MODEL_NAME}' or a model folder")
    parser.add_argument("--kv-blocks", type=int, default=32, help="KV-cache blocks (default 32)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--policy", choices=["fcfs", "priority"], default="priority")
    parser.add_argument("--max-prompt-len", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens drawn (default 48)")
    parser.add_argument("--n2-fraction", type=float, default=0.1, help="share of requests with n=2 (default 0.1)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: a tiny model gains nothing from more)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def rss_mib(field: str = "VmRSS") -> float:
    """This process's resident set size (or VmHWM, its peak) in MiB, from /proc/self/status."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def model_folder(name: str, workdir: Path) -> Path:
    """The model folder for `--model`; the tiny llama is built with the tests' helper."""
    if name == TINY:
        from tests.tiny_models import build_tiny_model

        return build_tiny_model(workdir / "tiny-llama", "llama")
    return resolve_model_path(name)


def kv_cache_bytes(path: Path, dtype: str, num_blocks: int, block_size: int) -> int:
    """The kv_cache_memory that holds exactly `num_blocks` blocks of this model."""
    config = resolve_model_config(path, EngineConfig(model=str(path), dtype=dtype), None)
    hf = config.hf_config
    kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    element = config.dtype.itemsize
    return num_blocks * block_size * 2 * hf.num_hidden_layers * kv_heads * head_dim_of(hf) * element


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int
    n: int
    priority: int


def make_requests(args: argparse.Namespace, vocab_size: int, max_model_len: int) -> list[Request]:
    """Random prompts; a third start with one of four shared prefixes of 16-48 tokens."""
    rng = random.Random(args.seed)
    low = min(300, vocab_size // 2)  # past the special tokens of either model
    token = lambda: rng.randrange(low, vocab_size)  # noqa: E731
    prefixes = [[token() for _ in range(rng.randint(16, 48))] for _ in range(4)]
    capacity = min(args.kv_blocks * args.block_size, max_model_len)
    requests = []
    for _ in range(args.prompts):
        length = rng.randint(1, args.max_prompt_len)
        prompt = rng.choice(prefixes)[:length] if rng.random() < 1 / 3 else []
        prompt += [token() for _ in range(length - len(prompt))]
        max_tokens = min(rng.randint(1, args.max_tokens), capacity - length)
        n = 2 if rng.random() < args.n2_fraction else 1
        priority = rng.randint(0, 3) if args.policy == "priority" else 0
        requests.append(Request(prompt, max_tokens, n, priority))
    return requests


def run_chunk(llm: LLM, requests: list[Request]) -> tuple[int, int, int]:
    """Generates one chunk; returns (prompt tokens, output tokens, completions of the wrong length)."""
    outputs = llm.generate(
        [{"prompt_token_ids": r.prompt_token_ids} for r in requests],
        [SamplingParams(temperature=0, max_tokens=r.max_tokens, n=r.n, ignore_eos=True) for r in requests],
        priority=[r.priority for r in requests] if llm.llm_engine.config.scheduling_policy == "priority" else None,
        use_tqdm=False,
    )
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(len(c.token_ids) for out in outputs for c in out.outputs)
    wrong = sum(1 for out, r in zip(outputs, requests) for c in out.outputs
                if len(c.token_ids) != r.max_tokens or len(out.outputs) != r.n)
    return prompt_tokens, output_tokens, wrong


def main() -> int:
    args = parse_args()
    print(f"RSS at start: {rss_mib():.1f} MiB", flush=True)
    with tempfile.TemporaryDirectory() as workdir:
        return soak(args, model_folder(args.model, Path(workdir)))


def soak(args: argparse.Namespace, path: Path) -> int:
    """Runs the chunks, printing a line after each; returns the exit status."""
    llm = LLM(str(path), dtype=args.dtype, block_size=args.block_size,
              kv_cache_memory=kv_cache_bytes(path, args.dtype, args.kv_blocks, args.block_size),
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              scheduling_policy=args.policy, enable_prefix_caching=not args.no_prefix_caching,
              num_threads=args.threads, seed=args.seed)
    engine = llm.llm_engine
    bm = engine.block_manager
    requests = make_requests(args, engine.model_config.hf_config.vocab_size, engine.model_config.max_model_len)
    print(f"model {args.model}; {bm.num_blocks} KV blocks x {args.block_size} tokens; "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"policy {args.policy}, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
          f"{args.threads} thread(s)", flush=True)
    print(f"{len(requests)} requests ({sum(r.n == 2 for r in requests)} with n=2), prompts of "
          f"1-{args.max_prompt_len} tokens, max_tokens 1-{args.max_tokens}, {args.chunks} generate calls", flush=True)
    print(f"RSS after load: {rss_mib():.1f} MiB", flush=True)

    size = -(-len(requests) // args.chunks)
    failures = 0
    totals = [0, 0, 0.0]  # prompt tokens, output tokens, seconds
    first_rss = None
    for chunk, start in enumerate(range(0, len(requests), size), start=1):
        preemptions = engine.scheduler.num_preemptions
        started = time.perf_counter()
        prompt_tokens, output_tokens, wrong = run_chunk(llm, requests[start : start + size])
        seconds = time.perf_counter() - started
        leaked = bm.num_blocks - bm.num_free_blocks
        failures += wrong + (leaked != 0) + engine.has_unfinished_requests()
        totals[0] += prompt_tokens
        totals[1] += output_tokens
        totals[2] += seconds
        rss = rss_mib()
        first_rss = first_rss or rss
        print(f"chunk {chunk:2d}: {min(size, len(requests) - start)} requests in {seconds:6.1f} s, "
              f"{output_tokens / seconds:7.1f} output tok/s, {(prompt_tokens + output_tokens) / seconds:7.1f} total "
              f"tok/s; preemptions +{engine.scheduler.num_preemptions - preemptions} "
              f"(total {engine.scheduler.num_preemptions}); blocks free {bm.num_free_blocks}/{bm.num_blocks}; "
              f"wrong lengths {wrong}; RSS {rss:.1f} MiB (peak {rss_mib('VmHWM'):.1f})", flush=True)
    print(f"total: {len(requests)} requests in {totals[2]:.1f} s, {totals[1] / totals[2]:.1f} output tok/s, "
          f"{(totals[0] + totals[1]) / totals[2]:.1f} total tok/s, {engine.scheduler.num_preemptions} preemptions, "
          f"{engine.stats.num_steps} steps; RSS after chunk 1 {first_rss:.1f} MiB, after the last "
          f"{rss_mib():.1f} MiB ({rss_mib() - first_rss:+.1f})", flush=True)
    llm.close()
    print(f"RSS after close: {rss_mib():.1f} MiB", flush=True)
    if failures:
        print(f"FAILED: {failures} problem(s) (wrong lengths, lost blocks or unfinished requests)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
