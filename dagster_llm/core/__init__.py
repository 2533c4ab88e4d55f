"""The Dagster-free core of the assets: prompt, text and OpenAI batch rows in, each
partition's table, stats and progress out. `dagster_llm`'s assets are glue around it.

Its dependencies run one way: nothing here imports Dagster or a module of `dagster_llm`
outside the core, and everything taken from the engine (the `LLM` and its API types, chat
rendering, tool_choice, images, the model cache folder, the OpenAI batch protocol) is named
in one module, `dagster_llm.core.engine_surface`, the only one that imports `engine`.
tests/dagster_llm/test_layout.py checks both."""

from dagster_llm.core.checks import CheckOutcome, CheckThresholds, evaluate
from dagster_llm.core.generation import GenerationRun, PartitionInput, PartitionResult, PartitionStats, RunOptions
from dagster_llm.core.prompts import PartitionSettings, PromptRow, PromptTableError, PromptTableRules, read_rows
from dagster_llm.core.sampling import SAMPLING_FIELDS, SamplingConfig, SamplingField
from dagster_llm.core.structured import OutputColumn, OutputSpecError, StructuredOutput
from dagster_llm.core.leases import PartitionLockedError
from dagster_llm.core.table_store import PartitionFiles, TableStore

__all__ = [
    "SAMPLING_FIELDS",
    "CheckOutcome",
    "CheckThresholds",
    "GenerationRun",
    "OutputColumn",
    "OutputSpecError",
    "PartitionFiles",
    "PartitionInput",
    "PartitionLockedError",
    "PartitionResult",
    "PartitionSettings",
    "PartitionStats",
    "PromptRow",
    "PromptTableError",
    "PromptTableRules",
    "RunOptions",
    "SamplingConfig",
    "SamplingField",
    "StructuredOutput",
    "TableStore",
    "evaluate",
    "read_rows",
]
