"""The example batch as a Dagster asset: the example prompts' completions as Parquet."""

import dagster as dg
import pandas as pd

from engine import LLM, SamplingParams
from example_pipelines.batch_generate import DEFAULT_OUTPUT, PROMPTS_CSV, generate_table, write_parquet_atomically


@dg.asset(kinds={"parquet"}, description="Completions of the example prompts by the embedded SmolLM2 model.")
def example_generations(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    prompts = pd.read_csv(PROMPTS_CSV)
    with LLM() as llm:
        table = generate_table(prompts, llm, SamplingParams(temperature=0, max_tokens=64))
    write_parquet_atomically(table, DEFAULT_OUTPUT)
    return dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(DEFAULT_OUTPUT.resolve())),
        "dagster/row_count": table.num_rows,
    })


defs = dg.Definitions(assets=[example_generations])
