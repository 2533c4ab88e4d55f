"""The Dagster code location: every pipeline under example_pipelines/defs.

    dagster dev -f definitions.py

The engine's model and dtype come from DAGSTER_LLM_MODEL (a model folder, default the
embedded SmolLM2-135M-Instruct) and DAGSTER_LLM_DTYPE ("auto", "float32", "bfloat16"); the
embedding assets' model from DAGSTER_LLM_EMBEDDING_MODEL (default: the same SmolLM2 read as
an embedding model, runner="pooling").
"""

import os
from pathlib import Path

import dagster as dg

from dagster_llm import LLMResource, ParquetIOManager

defs = dg.Definitions.merge(
    dg.load_from_defs_folder(path_within_project=Path(__file__).parent),
    dg.Definitions(
        resources={
            "llm": LLMResource(
                model_id=os.environ.get("DAGSTER_LLM_MODEL", "smollm2-135m-instruct"),
                dtype=os.environ.get("DAGSTER_LLM_DTYPE", "auto"),
            ),
            # The embedding assets' engine: an embedding model, or a causal LM read as one.
            "embedder": LLMResource(
                model_id=os.environ.get("DAGSTER_LLM_EMBEDDING_MODEL", "smollm2-135m-instruct"),
                dtype=os.environ.get("DAGSTER_LLM_DTYPE", "auto"),
                runner="pooling",
            ),
            # Tables under $DAGSTER_LLM_OUTPUT_DIR/tables (default output/tables), one file per partition.
            "io_manager": ParquetIOManager(),
        }
    ),
)
