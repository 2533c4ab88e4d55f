"""The Dagster-free core of a generation asset: prompt rows in, each partition's table,
stats and progress out, through the engine's public `LLM` methods only. Nothing here
imports Dagster; `dagster_llm`'s assets are glue around it."""

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
