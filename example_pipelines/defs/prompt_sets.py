"""The prompt sets, one static partition each: factual questions and creative requests."""

from pathlib import Path

import dagster as dg
import pandas as pd

PROMPT_SETS_CSV = Path(__file__).resolve().parents[1] / "data" / "prompt_sets.csv"
prompt_set_partitions = dg.StaticPartitionsDefinition(["factual", "creative"])


@dg.asset(partitions_def=prompt_set_partitions, group_name="prompt_sets", kinds={"csv"})
def prompt_sets(context: dg.AssetExecutionContext) -> pd.DataFrame:
    """The partition's prompts from the shipped prompt_sets.csv."""
    table = pd.read_csv(PROMPT_SETS_CSV, dtype=str)
    return table[table["prompt_set"] == context.partition_key][["id", "prompt"]].reset_index(drop=True)
