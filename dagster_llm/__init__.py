"""Dagster integration of the engine: LLM generation over prompt tables as assets."""

from dagster_llm.assets import build_generation_asset
from dagster_llm.checks import CheckThresholds
from dagster_llm.components import GenerationComponent
from dagster_llm.config import GenerationRunConfig, SamplingConfig, SamplingOverrides
from dagster_llm.progress import EventLogProgress
from dagster_llm.resource import LLMResource
from dagster_llm.storage import ParquetIOManager, partition_file, write_parquet_atomically

__all__ = [
    "CheckThresholds",
    "EventLogProgress",
    "GenerationComponent",
    "GenerationRunConfig",
    "LLMResource",
    "ParquetIOManager",
    "SamplingConfig",
    "SamplingOverrides",
    "build_generation_asset",
    "partition_file",
    "write_parquet_atomically",
]
