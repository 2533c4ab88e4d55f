"""Prints where a generation asset's partition was written and its first rows.

    python -m example_pipelines.show_output ticket_summaries 2024-06-01
"""

import argparse

import dagster as dg
import pandas as pd

from dagster_llm import ParquetIOManager


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("asset")
    parser.add_argument("partition")
    parser.add_argument("--rows", type=int, default=5)
    args = parser.parse_args()
    path = ParquetIOManager().path_for(dg.AssetKey(args.asset), args.partition)
    table = pd.read_parquet(path)
    print(f"\n{args.asset} [{args.partition}]: {len(table)} rows in {path.resolve()}\n")
    preview = table[["id", "generated_text", "finish_reason"]].head(args.rows).copy()
    text = preview["generated_text"].fillna("").str.replace("\n", " ", regex=False)
    preview["generated_text"] = text.where(text.str.len() <= 90, text.str.slice(0, 87) + "...")
    print(preview.to_string(index=False))


if __name__ == "__main__":
    main()
