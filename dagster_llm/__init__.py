"""Dagster integration of the engine: LLM generation over prompt tables as assets."""

from dagster_llm.assets import build_generation_asset
from dagster_llm.checks import CheckThresholds
from dagster_llm.components import GenerationComponent
from dagster_llm.generation import GenerationRun, PartitionInput, PartitionResult, PartitionStats, RunOptions
from dagster_llm.resource import LLMResource
from dagster_llm.sampling import SAMPLING_FIELDS, GenerationRunConfig, SamplingConfig, SamplingOverrides
from dagster_llm.storage import ParquetIOManager
from dagster_llm.store import PartitionFiles, PartitionLockedError, partition_file, write_parquet_atomically
from dagster_llm.structured import OutputColumn, OutputSpecError, StructuredOutput

__all__ = [
    "SAMPLING_FIELDS",
    "CheckThresholds",
    "GenerationComponent",
    "GenerationRun",
    "GenerationRunConfig",
    "LLMResource",
    "OutputColumn",
    "OutputSpecError",
    "ParquetIOManager",
    "PartitionFiles",
    "PartitionInput",
    "PartitionLockedError",
    "PartitionResult",
    "PartitionStats",
    "RunOptions",
    "SamplingConfig",
    "SamplingOverrides",
    "StructuredOutput",
    "build_generation_asset",
    "partition_file",
    "write_parquet_atomically",
]
