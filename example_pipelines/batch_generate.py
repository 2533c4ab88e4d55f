"""The example batch job: the example prompts through the embedded model into a Parquet table.

    python -m example_pipelines.batch_generate [--output PATH] [--max-tokens N]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from engine import LLM, SamplingParams

PROMPTS_CSV = Path(__file__).parent / "data" / "example_prompts.csv"
DEFAULT_OUTPUT = Path(os.environ.get("DAGSTER_LLM_OUTPUT_DIR", "output")) / "example_generations.parquet"


def generate_table(prompts: pd.DataFrame, llm: LLM, params: SamplingParams) -> pa.Table:
    """One row per prompt row: the chat-rendered prompt's completion and its token counts."""
    tokenizer = llm.get_tokenizer()
    rendered = [
        {"prompt_token_ids": tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)}
        for text in prompts["prompt"]
    ]
    outputs = llm.generate(rendered, params)
    return pa.table({
        "id": prompts["id"].astype(str).tolist(),
        "prompt": prompts["prompt"].tolist(),
        "generated_text": [o.outputs[0].text for o in outputs],
        "finish_reason": [o.outputs[0].finish_reason for o in outputs],
        "prompt_tokens": [len(o.prompt_token_ids) for o in outputs],
        "completion_tokens": [len(o.outputs[0].token_ids) for o in outputs],
    })


def write_parquet_atomically(table: pa.Table, path: Path) -> None:
    """Writes beside the target and renames, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description="Generate completions for the example prompts.")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    prompts = pd.read_csv(PROMPTS_CSV)
    started = time.perf_counter()
    with LLM() as llm:
        table = generate_table(prompts, llm, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    write_parquet_atomically(table, args.output)
    elapsed = time.perf_counter() - started
    print(f"\nWrote {table.num_rows} generations to {args.output.resolve()} in {elapsed:.1f} s\n")
    preview = table.to_pandas()[["id", "prompt", "generated_text", "finish_reason"]].head(5)
    for column in ("prompt", "generated_text"):
        text = preview[column].str.replace("\n", " ", regex=False)
        preview[column] = text.where(text.str.len() <= 50, text.str.slice(0, 47) + "...")
    print(preview.to_string(index=False))


if __name__ == "__main__":
    main()
