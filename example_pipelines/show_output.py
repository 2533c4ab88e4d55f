"""Prints where a generation asset's partition was written and its first rows: the
completions, or the typed columns of a structured output (and any errors).

    python -m example_pipelines.show_output ticket_summaries 2024-06-01
    python -m example_pipelines.show_output ticket_triage 2024-06-01
    python -m example_pipelines.show_output product_attributes    # an unpartitioned asset
"""

import argparse

import dagster as dg
import pandas as pd

from dagster_llm import ParquetIOManager
from dagster_llm.core.schema import generation_schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("asset")
    parser.add_argument("partition", nargs="?", help="the partition key; none for an unpartitioned asset")
    parser.add_argument("--rows", type=int, default=5)
    args = parser.parse_args()
    files = ParquetIOManager().table_store().partition(dg.AssetKey(args.asset).path, args.partition)
    table = files.read().to_pandas()
    where = f" [{args.partition}]" if args.partition is not None else ""
    print(f"\n{args.asset}{where}: {len(table)} rows in {files.location}\n")
    own = generation_schema(None, media=("image", "audio", "video")).names
    typed = [c for c in table.columns if c not in own]  # a structured output's columns
    shown = ["id", *typed] if typed else ["id", "generated_text", "finish_reason"]
    preview = table[shown + (["error"] if table["error"].notna().any() else [])].head(args.rows).astype(object)
    for column in preview.columns[1:]:
        text = preview[column].map(_cell)
        preview[column] = text.where(text.str.len() <= 90, text.str.slice(0, 87) + "...")
    print(preview.to_string(index=False))


def _cell(value: object) -> str:
    """A cell on one line: lists (numpy arrays from Parquet) as lists, nulls as nothing."""
    value = value.tolist() if hasattr(value, "tolist") else value
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return ""
    return str(value).replace("\n", " ")


if __name__ == "__main__":
    main()
