"""Overhead of Dagster: the same rows through `LLM.generate` and through a materialization.

Both sides load the model and generate the same chat prompts with the same sampling,
alternating for `--repeats` rounds; the best time of each side is compared.
the Dagster side also reads the prompt table through the IO manager, writes Parquet,
records metadata and evaluates the checks. Prints both times and their ratio.

    .venv/bin/python benchmarks/dagster_overhead.py --rows 64 --max-tokens 64 --repeats 3
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import QUESTIONS  # noqa: E402
from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    questions = [f"{QUESTIONS[i % len(QUESTIONS)]} (Question {i + 1}.)" for i in range(args.rows)]
    frame = pd.DataFrame({"id": [f"q{i}" for i in range(args.rows)], "prompt": questions})

    @dg.asset
    def questions_table() -> pd.DataFrame:
        return frame

    answers = build_generation_asset("answers", upstream=questions_table, chat=True,
                                     sampling=SamplingConfig(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))

    def run_direct() -> float:
        started = time.perf_counter()
        with LLM() as llm:
            tokenizer = llm.get_tokenizer()
            prompts = [{"prompt_token_ids": tokenizer(tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
                add_special_tokens=False).input_ids} for q in questions]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                         use_tqdm=False)
        return time.perf_counter() - started

    def run_dagster(instance: dg.DagsterInstance, resources: dict) -> float:
        started = time.perf_counter()
        result = dg.materialize([questions_table, answers], selection=[answers], resources=resources,
                                instance=instance)
        assert result.success
        return time.perf_counter() - started

    LLM().close()  # one-off imports and file caches out of the way of both timings
    direct_times, dagster_times = [], []
    with tempfile.TemporaryDirectory() as tmp, dg.instance_for_test() as instance:
        resources = {"llm": LLMResource(), "io_manager": ParquetIOManager(base_path=tmp)}
        dg.materialize([questions_table], resources=resources, instance=instance)
        for _ in range(args.repeats):  # alternating, so that drift on a busy machine hits both
            direct_times.append(run_direct())
            dagster_times.append(run_dagster(instance, resources))
    direct, through_dagster = min(direct_times), min(dagster_times)
    print(f"rows={args.rows} max_tokens={args.max_tokens} repeats={args.repeats}, best of each "
          "(model load included on both sides)")
    print(f"LLM.generate:          {direct:7.2f} s")
    print(f"Dagster materialize:   {through_dagster:7.2f} s")
    print(f"overhead: {100 * (through_dagster / direct - 1):+.1f}% (target: at most +15%)")


if __name__ == "__main__":
    main()
