"""Data and tensor parallelism on this machine's CPU cores, against one process using
all of them, in the same run.

- data parallel: `--cores` replicas of 1 thread each against 1 replica of `--cores`
  threads, on the embedded SmolLM2-135M-Instruct (or `--model`).
- tensor parallel: `--cores` ranks of 1 thread each against 1 rank of `--cores`
  threads. The embedded model's 9 heads do not split in two, so this runs a random
  model of a similar size whose heads do (12 query, 4 key/value heads, hidden 768, 12
  layers, SmolLM2's vocabulary and tokenizer), written to a temporary folder.

Every engine is built once; the runs take turns for `--repeats` rounds from an empty
prefix cache, and the best of each is compared. Chat prompts, EOS ignored. Rank 0 and
replica 0 run in this process, so its thread count is set before each run.

    .venv/bin/python benchmarks/parallel.py --num-prompts 64 --output-len 64
"""

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import chat_prompt_ids  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.model_loader.embedded_model import ensure_embedded_model  # noqa: E402


def random_model(folder: Path, tokenizer_folder: Path) -> Path:
    """A random Llama of about SmolLM2-135M's size whose heads split over 2 and 4 ranks."""
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)
    return folder


def best_rates(engines: dict[str, tuple[LLM, int]], prompts: list[dict], params: SamplingParams,
               repeats: int) -> dict[str, float]:
    """Output tokens per second of each engine (with its rank 0's threads), best of
    `repeats` rounds, the engines taking turns."""
    rates: dict[str, float] = {name: 0.0 for name in engines}
    for _ in range(repeats):
        for name, (llm, threads) in engines.items():
            torch.set_num_threads(threads)
            llm.reset_prefix_cache()
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates[name] = max(rates[name], tokens / elapsed)
    return rates


def compare(title: str, model: str, prompts: list[dict], params: SamplingParams, args: argparse.Namespace,
            setting: str) -> None:
    """Builds the parallel engine and the one-process engine, times them, prints the ratio."""
    cores = args.cores
    common = dict(dtype=args.dtype, max_model_len=1024, kv_cache_memory=1 << 30)
    engines = {
        f"{setting}={cores} x 1 thread": (LLM(model, **common, **{setting: cores}, num_threads=1), 1),
        f"1 process x {cores} threads": (LLM(model, **common, num_threads=cores), cores),
    }
    rates = best_rates(engines, prompts, params, args.repeats)
    (parallel, rate_a), (single, rate_b) = rates.items()
    print(f"{title}: {parallel} {rate_a:.1f} output tok/s; {single} {rate_b:.1f}; ratio {rate_a / rate_b:.2f}x")
    for llm, _ in engines.values():
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder of the data-parallel run (default: embedded)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags:")[0].strip())
    print(f"CPU: {detect_cpu().describe()}; {args.num_prompts} chat prompts x {args.output_len} new tokens, "
          f"EOS ignored, dtype {args.dtype}, best of {args.repeats} alternating rounds")
    embedded = ensure_embedded_model()
    tokenizer = transformers.AutoTokenizer.from_pretrained(embedded)
    prompts = [{"prompt_token_ids": ids} for ids in chat_prompt_ids(tokenizer, args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    compare("data parallel", args.model or str(embedded), prompts, params, args, "data_parallel_size")
    with tempfile.TemporaryDirectory() as folder:
        model = random_model(Path(folder), embedded)
        compare("tensor parallel", str(model), prompts, params, args, "tensor_parallel_size")


if __name__ == "__main__":
    main()
