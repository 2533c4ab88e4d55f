"""Dagster integration of the engine: LLM generation over prompt tables as assets.

`dagster_llm.core` does the work without Dagster; the rest is the Dagster skin: the
resource, the IO manager, the asset factory and component (both read `GenerationSpec`).
The names below load on first use, so that `import dagster_llm.core` does not import
Dagster.
"""

from engine.lazy_exports import lazy_exports

_EXPORTS = {
    "SAMPLING_FIELDS": "dagster_llm.core.sampling",
    "BeamSearchConfig": "dagster_llm.core.sampling",
    "CheckThresholds": "dagster_llm.core.checks",
    "EmbeddingComponent": "dagster_llm.components",
    "EmbeddingOptions": "dagster_llm.core.embedding",
    "EmbeddingRun": "dagster_llm.core.embedding",
    "EmbeddingRunConfig": "dagster_llm.embedding_assets",
    "EmbeddingSpec": "dagster_llm.embedding_spec",
    "GenerationComponent": "dagster_llm.components",
    "GenerationRun": "dagster_llm.core.generation",
    "GenerationRunConfig": "dagster_llm.run_config",
    "GenerationSpec": "dagster_llm.spec",
    "KubernetesStep": "dagster_llm.kubernetes",
    "LLMResource": "dagster_llm.resource",
    "OutputColumn": "dagster_llm.core.structured",
    "OutputSpecError": "dagster_llm.core.structured",
    "ParquetIOManager": "dagster_llm.io_manager",
    "PartitionFiles": "dagster_llm.core.table_store",
    "PartitionInput": "dagster_llm.core.generation",
    "PartitionLockedError": "dagster_llm.core.leases",
    "PartitionResult": "dagster_llm.core.generation",
    "PartitionStats": "dagster_llm.core.generation",
    "RunOptions": "dagster_llm.core.generation",
    "SamplingConfig": "dagster_llm.core.sampling",
    "SamplingOverrides": "dagster_llm.run_config",
    "StructuredOutput": "dagster_llm.core.structured",
    "TableStore": "dagster_llm.core.table_store",
    "TranscriptionComponent": "dagster_llm.components",
    "TranscriptionOptions": "dagster_llm.core.transcription",
    "TranscriptionRun": "dagster_llm.core.transcription",
    "TranscriptionRunConfig": "dagster_llm.transcription_assets",
    "TranscriptionSpec": "dagster_llm.transcription_spec",
    "build_embedding_asset": "dagster_llm.embedding_assets",
    "build_generation_asset": "dagster_llm.assets",
    "build_openai_batch_asset": "dagster_llm.openai_batch_assets",
    "build_transcription_asset": "dagster_llm.transcription_assets",
    "generation_asset": "dagster_llm.assets",
    "partition_file": "dagster_llm.core.table_store",
    "read_openai_batch_file": "dagster_llm.core.openai_batch",
    "write_parquet_atomically": "dagster_llm.core.table_store",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
