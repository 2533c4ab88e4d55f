"""A code location for the crash tests: three partitions of 24 prompts on a tiny model,
two sequences at a time, so that a partition takes long enough to be killed in the middle.

The model folder comes from CRASH_TEST_MODEL; the tables' root from CRASH_TEST_TABLES (a
folder or an s3:// URL; default: under DAGSTER_LLM_OUTPUT_DIR) and the writer lease's time
to live on an object store from CRASH_TEST_LEASE_TTL_S. With CRASH_TEST_IMAGES=1 each prompt
carries a photo of its own (PNG bytes, for a vision-language CRASH_TEST_MODEL).
"""

import io
import os

import dagster as dg
import pandas as pd
from PIL import Image

from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset

ROWS = 24
MAX_TOKENS = 48
IMAGES = os.environ.get("CRASH_TEST_IMAGES") == "1"
parts = dg.StaticPartitionsDefinition(["p1", "p2", "p3"])


def photo(row: int) -> bytes:
    """A PNG of one color per row."""
    encoded = io.BytesIO()
    Image.new("RGB", (24 + row, 20), (10 * row, 255 - 10 * row, 128)).save(encoded, "PNG")
    return encoded.getvalue()


@dg.asset(partitions_def=parts, backfill_policy=dg.BackfillPolicy.single_run())
def crash_prompts(context: dg.AssetExecutionContext):
    images = {"image": [photo(i) for i in range(ROWS)]} if IMAGES else {}
    frames = {key: pd.DataFrame({"id": [f"{key}-{i}" for i in range(ROWS)],
                                 "prompt": [f"Story {i} of {key} begins" for i in range(ROWS)], **images})
              for key in context.partition_keys}
    return frames if len(frames) > 1 else frames[context.partition_key]


crash_gen = build_generation_asset("crash_gen", upstream=crash_prompts, shard_rows=2, progress_interval_s=1.0,
                                   sampling=SamplingConfig(max_tokens=MAX_TOKENS, ignore_eos=True),
                                   image_column="image" if IMAGES else None, chat=IMAGES)



@dg.asset(partitions_def=parts, backfill_policy=dg.BackfillPolicy.single_run())
def crash_lengths(context: dg.AssetExecutionContext, crash_gen):
    """A downstream asset: the length of each completion, read through the IO manager."""
    tables = crash_gen if isinstance(crash_gen, dict) else {context.partition_key: crash_gen}
    lengths = {key: table.assign(chars=table["generated_text"].str.len())[["id", "chars"]]
               for key, table in tables.items()}
    return lengths if len(lengths) > 1 else lengths[context.partition_key]


defs = dg.Definitions(
    assets=[crash_prompts, crash_gen, crash_lengths],
    resources={
        "llm": LLMResource(model_id=os.environ.get("CRASH_TEST_MODEL", "smollm2-135m-instruct"), dtype="float32",
                           max_num_seqs=2, kv_cache_memory=10 << 20, num_threads=1),
        "io_manager": ParquetIOManager(base_path=os.environ.get("CRASH_TEST_TABLES"),
                                       lease_ttl_s=float(os.environ.get("CRASH_TEST_LEASE_TTL_S", "60"))),
    },
)
