"""How right the generation progress ETA is: runs chat prompts with mixed max_tokens (most
rows stop at EOS well before it) through the Dagster-free generation core, records every
progress line, and prints each ETA against the time that was actually left.

    .venv/bin/python benchmarks/eta_accuracy.py --rows 96 --interval 2

The target: after the first 10% of the run, every ETA within 2x of the truth.
"""

import argparse
import random
import re
import time

import pandas as pd

from dagster_llm import GenerationRun, PartitionInput, RunOptions, SamplingConfig
from dagster_llm.core.prompts import PartitionSettings, PromptTableRules, read_rows
from engine import LLM

TOPICS = ["a lighthouse", "tax forms", "a lost cat", "quantum dots", "bread", "a chess opening", "rain", "Mars"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=96)
    parser.add_argument("--interval", type=float, default=2.0)
    args = parser.parse_args()
    rng = random.Random(0)
    frame = pd.DataFrame({
        "id": [f"r{i}" for i in range(args.rows)],
        "prompt": [f"In {rng.choice([1, 2, 4])} sentences, tell me about {rng.choice(TOPICS)}." for _ in range(args.rows)],
        "max_tokens": [rng.choice([32, 64, 128]) for _ in range(args.rows)],
    })
    lines: list[tuple[float, str]] = []
    with LLM(args.model) as llm:
        settings = PartitionSettings(None, SamplingConfig(temperature=0), None, None, llm.get_default_sampling_params())
        rows = read_rows(frame, settings, PromptTableRules(chat=True), llm.get_tokenizer())
        run = GenerationRun(llm, {}, RunOptions(model_id=args.model, code_version="eta", resume=False,
                                                progress_interval_s=args.interval),
                            lambda line: lines.append((time.monotonic(), line)))
        started = time.monotonic()
        list(run.generate([PartitionInput(None, rows)]))
        ended = time.monotonic()
    total = ended - started
    worst = 1.0
    print(f"{args.rows} rows in {total:.1f} s")
    print("elapsed  share  eta_s  actual_left_s  ratio")
    for at, line in lines:
        match = re.search(r"ETA (\d+) s", line)
        if not match or at >= ended:
            continue
        eta, left, share = float(match.group(1)), ended - at, (at - started) / total
        ratio = max(eta, 0.5) / max(left, 0.5)
        if share >= 0.1:
            worst = max(worst, ratio, 1 / ratio)
        print(f"{at - started:7.1f}  {share:5.0%}  {eta:5.0f}  {left:13.1f}  {ratio:5.2f}  {line[21:]}")
    print(f"worst ratio after the first 10%: {worst:.2f}x (target: within 2x)")


if __name__ == "__main__":
    main()
