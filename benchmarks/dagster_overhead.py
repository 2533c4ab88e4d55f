"""Overhead of Dagster: the same rows through `LLM.generate` and through a materialization.

Both sides load the model and generate the same chat prompts with the same sampling;
the Dagster side also reads the prompt table through the IO manager, writes Parquet,
records metadata and evaluates the checks. Prints both times and their ratio.

    .venv/bin/python benchmarks/dagster_overhead.py --rows 64 --max-tokens 64
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
    args = parser.parse_args()
    questions = [f"{QUESTIONS[i % len(QUESTIONS)]} (Question {i + 1}.)" for i in range(args.rows)]
    frame = pd.DataFrame({"id": [f"q{i}" for i in range(args.rows)], "prompt": questions})

    LLM().close()  # one-off imports and file caches out of the way of both timings
    started = time.perf_counter()
    with LLM() as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tokenizer(tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False).input_ids} for q in questions]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True),
                     use_tqdm=False)
    direct = time.perf_counter() - started

    @dg.asset
    def questions_table() -> pd.DataFrame:
        return frame

    answers = build_generation_asset("answers", upstream=questions_table, chat=True,
                                     sampling=SamplingConfig(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    with tempfile.TemporaryDirectory() as tmp:
        resources = {"llm": LLMResource(), "io_manager": ParquetIOManager(base_path=tmp)}
        with dg.instance_for_test() as instance:
            dg.materialize([questions_table], resources=resources, instance=instance)
            started = time.perf_counter()
            result = dg.materialize([questions_table, answers], selection=[answers], resources=resources,
                                    instance=instance)
            through_dagster = time.perf_counter() - started
    assert result.success
    print(f"rows={args.rows} max_tokens={args.max_tokens} (model load included on both sides)")
    print(f"LLM.generate:          {direct:7.2f} s")
    print(f"Dagster materialize:   {through_dagster:7.2f} s")
    print(f"overhead: {100 * (through_dagster / direct - 1):+.1f}% (target: at most +15%)")


if __name__ == "__main__":
    main()
