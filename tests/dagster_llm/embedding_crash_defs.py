"""A code location for the embedding crash test: one partition of ROWS texts embedded
one at a time on one thread, so that it takes long enough to be killed in the middle; with
CRASH_TEST_ONE_AT_A_TIME=0 (the rerun that resumes it) as many at a time as fit, on every core.

The tables' root comes from DAGSTER_LLM_OUTPUT_DIR."""

import os

import dagster as dg
import pandas as pd

from dagster_llm import LLMResource, ParquetIOManager, build_embedding_asset

ROWS = 60
ONE_AT_A_TIME = os.environ.get("CRASH_TEST_ONE_AT_A_TIME", "1") == "1"
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
        "embedder": LLMResource(runner="pooling", dtype="float32", max_num_seqs=1 if ONE_AT_A_TIME else 16,
                                num_threads=1 if ONE_AT_A_TIME else None, kv_cache_memory=64 << 20),
        "io_manager": ParquetIOManager(),
    },
)
