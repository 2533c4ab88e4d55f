"""Output tokens per second with speculative decoding against none, on summarisation prompts,
at several batch sizes, in one run: engines on the same model, their runs alternating, the
best of `--repeats` rounds each. Greedy outputs must be the same token for token.

A batch of b is b prompts at once; with `--waves w`, b * w prompts, at most b running at a
time (max_num_seqs=b), so that one slow row does not decide the batch's time.

Methods: "ngram" (prompt lookup) and "draft" (a draft model: `--draft random`, a random
two-layer model of the target's vocabulary, whose proposals are seldom right, shows what a
draft costs; `--draft self`, the target as its own draft, what its proposals cost when all
are right; or a model folder).

Workloads: "paragraphs" (a paragraph of prose to summarise in two or three sentences keeping
its key phrases) and "tickets" (the example pipeline's own prompt over its support tickets,
one-sentence summaries, cycled with numbers to fill large batches).

    .venv/bin/python benchmarks/speculative.py --batches 1,4,16,64 --repeats 3 --workload paragraphs
    .venv/bin/python benchmarks/speculative.py --batches 4 --waves 4 --repeats 3
    .venv/bin/python benchmarks/speculative.py --method draft --draft random --batches 1,4,16
"""

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402

from benchmarks.workloads import PARAGRAPHS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_loader.folder import resolve_model_path  # noqa: E402

INSTRUCTION = "Summarise this text in two or three sentences, keeping its own key phrases:\n\n"
TICKETS = Path(__file__).resolve().parent.parent / "example_pipelines" / "data" / "support_tickets.csv"


def summarisation_prompts(tokenizer, count: int, workload: str = "paragraphs") -> list[dict]:
    """`count` chat prompts of the workload (cycling, numbered so that no two are alike)."""
    if workload == "tickets":
        from example_pipelines.defs.daily_tickets import PROMPT as TICKET_PROMPT  # Dagster: imported only here

        bodies = [body.strip() for body in pd.read_csv(TICKETS)["body"].fillna("") if body.strip()]
        texts = [TICKET_PROMPT.format(body=f"{bodies[i % len(bodies)]} (Ticket {i + 1}.)") for i in range(count)]
    else:
        texts = [f"{INSTRUCTION}{PARAGRAPHS[i % len(PARAGRAPHS)]} (Text {i + 1}.)" for i in range(count)]
    prompts = []
    for text in texts:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        prompts.append({"prompt_token_ids": tokenizer(rendered, add_special_tokens=False).input_ids})
    return prompts


def random_draft(target: Path, folder: Path) -> Path:
    """A random two-layer Llama of the target's vocabulary, with the target's tokenizer."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(target)
    draft = transformers.LlamaConfig(vocab_size=config.vocab_size, hidden_size=128, intermediate_size=256,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=True,
                                     bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(draft).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target / name, folder / name)
    return folder


def speculative_config(args: argparse.Namespace, target: Path, scratch: Path) -> dict:
    if args.method == "ngram":
        low, high = (int(n) for n in args.prompt_lookup.split(","))
        return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                "prompt_lookup_min": low, "prompt_lookup_max": high}
    folder = {"random": lambda: random_draft(target, scratch / "draft"), "self": lambda: target}.get(
        args.draft, lambda: Path(args.draft))()
    return {"model": str(folder), "num_speculative_tokens": args.num_speculative_tokens}


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list[list[int]]]:
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in outputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup", default="2,4", help="min,max n-gram length")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workload", choices=("paragraphs", "tickets"), default="paragraphs")
    parser.add_argument("--waves", type=int, default=1, help="prompts per batch, in batches' worth")
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft", default="random", help="the draft model: random, self or a folder")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags:")[0].strip())
    with tempfile.TemporaryDirectory() as scratch:
        target = resolve_model_path(None)  # the embedded model's folder
        spec = speculative_config(args, target, Path(scratch))
        print(f"model {target.name}, speculative_config {spec}, {args.workload}, greedy, max_tokens "
              f"{args.output_len}, best of {args.repeats}, {args.waves} wave(s) of prompts per batch")
        print(f"{'batch':>5} {'off tok/s':>10} {'spec tok/s':>11} {'ratio':>6} {'accepted':>9} {'mean len':>9}")
        for batch in batches:
            run_batch(args, batch, spec)


def run_batch(args: argparse.Namespace, batch: int, spec: dict) -> None:
    """Both engines at this batch size (max_num_seqs=batch), their runs alternating."""
    settings = dict(dtype=args.dtype, max_num_seqs=batch)
    engines = {"off": LLM(**settings), "spec": LLM(**settings, speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    chosen = summarisation_prompts(engines["off"].get_tokenizer(), batch * args.waves, args.workload)
    for llm in engines.values():
        llm.generate(chosen[:2], params, use_tqdm=False)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[list[int]]] = {}
    before = engines["spec"].get_stats()
    for _ in range(args.repeats):
        for name, llm in engines.items():
            seconds, tokens[name] = timed(llm, chosen, params)
            times[name].append(seconds)
    after = engines["spec"].get_stats()
    assert tokens["off"] == tokens["spec"], f"batch {batch}: greedy outputs differ with speculation"
    count = sum(len(t) for t in tokens["off"])
    off, fast = count / min(times["off"]), count / min(times["spec"])
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    drafts = after.num_drafts - before.num_drafts
    rate = f"{accepted / drafted:9.2f}" if drafted else f"{'-':>9}"
    length = f"{1 + accepted / drafts:9.2f}" if drafts else f"{'-':>9}"
    print(f"{batch:>5} {off:10.1f} {fast:11.1f} {fast / off:6.2f} {rate} {length}", flush=True)
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
