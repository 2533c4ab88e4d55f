"""A code location for the embedding crash test: one partition of ROWS texts embedded
one at a time on one thread, so that it takes long enough to be killed in the middle.

The tables' root comes from DAGSTER_LLM_OUTPUT_DIR."""

import dagster as dg
import pandas as pd

from dagster_llm import LLMResource, ParquetIOManager, build_embedding_asset

ROWS = 24
parts = dg.StaticPartitionsDefinition(["p1"])


def texts(key: str) -> pd.DataFrame:
    return pd.DataFrame({"id": [f"{key}-{i}" for i in range(ROWS)],
                         "text": [f"Ticket {i} of {key}: the export to CSV fails for report {i} " * 6
                                  for i in range(ROWS)]})


@dg.asset(partitions_def=parts)
def crash_texts(context: dg.AssetExecutionContext) -> pd.DataFrame:
    return texts(context.partition_key)


crash_embeddings = build_embedding_asset("crash_embeddings", upstream=crash_texts, shard_rows=2)

defs = dg.Definitions(
    assets=[crash_texts, crash_embeddings],
    resources={
        "embedder": LLMResource(runner="pooling", dtype="float32", max_num_seqs=1, num_threads=1,
                                kv_cache_memory=64 << 20),
        "io_manager": ParquetIOManager(),
    },
)
