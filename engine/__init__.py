"""An offline LLM inference engine with vLLM's API: continuous batching over a paged KV cache.

Never imports Dagster; `dagster_llm` builds on it. The public names below load on first use,
so that `import engine.core.scheduler` (or any one module) does not load the whole engine.
"""

from engine.lazy_exports import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "engine.entrypoints.llm",
    "BeamSearchOutput": "engine.beam_search",
    "BeamSearchParams": "engine.beam_search",
    "BeamSearchSequence": "engine.beam_search",
    "ClassificationOutput": "engine.outputs",
    "ClassificationRequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "EmbeddingOutput": "engine.outputs",
    "EmbeddingRequestOutput": "engine.outputs",
    "EngineStats": "engine.outputs",
    "Logprob": "engine.outputs",
    "LoRARequest": "engine.lora.request",
    "ModelLoadError": "engine.model_loader.folder",
    "PoolingParams": "engine.pooling_params",
    "RequestMetrics": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "ScoringOutput": "engine.outputs",
    "ScoringRequestOutput": "engine.outputs",
    "StructuredOutputsParams": "engine.structured_output.params",
    "TranscriptionOutput": "engine.outputs",
    "TranscriptionWindow": "engine.outputs",
    "UnfinishedOutput": "engine.outputs",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
