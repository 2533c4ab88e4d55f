"""An offline LLM inference engine with vLLM's API: continuous batching over a paged KV cache.

Never imports Dagster; `dagster_llm` builds on it.
"""

from engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from engine.llm import LLM
from engine.llm_engine import EngineStats
from engine.lora import LoRARequest
from engine.model_loader import ModelLoadError
from engine.pooling import (
    ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput, EmbeddingRequestOutput, PoolingParams,
    ScoringOutput, ScoringRequestOutput,
)
from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, UnfinishedOutput
from engine.sampling_params import SamplingParams
from engine.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "EngineStats",
    "Logprob",
    "LoRARequest",
    "ModelLoadError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "UnfinishedOutput",
]
