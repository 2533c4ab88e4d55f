"""Output tokens per second with n-gram speculative decoding against none, on summarisation
prompts, at several batch sizes (that many prompts at once), in one run: two engines on the
same model, their runs alternating, the best of `--repeats` rounds each. Greedy outputs must
be the same token for token.

Workloads: "paragraphs" (a paragraph of prose to summarise in two or three sentences keeping
its key phrases) and "tickets" (the example pipeline's own prompt over its support tickets,
one-sentence summaries, cycled with numbers to fill large batches).

    .venv/bin/python benchmarks/speculative.py --batches 1,4,16,64 --repeats 3 --workload paragraphs
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402

from benchmarks.workloads import PARAGRAPHS  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

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
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    low, high = (int(n) for n in args.prompt_lookup.split(","))
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": low, "prompt_lookup_max": high}
    print(subprocess.run(["lscpu"], capture_output=True, text=True).stdout.split("Flags:")[0].strip())
    settings = dict(dtype=args.dtype, max_num_seqs=max(batches))
    engines = {"off": LLM(**settings), "ngram": LLM(**settings, speculative_config=spec)}
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    prompts = summarisation_prompts(engines["off"].get_tokenizer(), max(batches), args.workload)
    print(f"model {engines['off'].llm_engine.model_config.path.name}, dtype {engines['off'].dtype}, "
          f"speculative_config {spec}, {args.workload}, greedy, max_tokens {args.output_len}, "
          f"best of {args.repeats}")
    print(f"{'batch':>5} {'off tok/s':>10} {'ngram tok/s':>12} {'ratio':>6} {'accepted':>9} {'mean len':>9}")
    for batch in batches:
        chosen = prompts[:batch]
        for llm in engines.values():
            llm.generate(chosen[:2], params, use_tqdm=False)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        before = engines["ngram"].get_stats()
        for _ in range(args.repeats):
            for name, llm in engines.items():
                seconds, tokens[name] = timed(llm, chosen, params)
                times[name].append(seconds)
        after = engines["ngram"].get_stats()
        assert tokens["off"] == tokens["ngram"], f"batch {batch}: greedy outputs differ with speculation"
        count = sum(len(t) for t in tokens["off"])
        off, ngram = count / min(times["off"]), count / min(times["ngram"])
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        drafts = after.num_drafts - before.num_drafts
        rate = f"{accepted / drafted:9.2f}" if drafted else f"{'-':>9}"
        length = f"{1 + accepted / drafts:9.2f}" if drafts else f"{'-':>9}"
        print(f"{batch:>5} {off:10.1f} {ngram:12.1f} {ngram / off:6.2f} {rate} {length}")
    for llm in engines.values():
        llm.close()


if __name__ == "__main__":
    main()
