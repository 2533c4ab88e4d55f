"""vLLM's per-request pooling settings."""

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's per-request pooling settings: `normalize` an embedding to unit length (None:
    the model's default, which is True unless its sentence-transformers modules say
    otherwise)."""

    normalize: bool | None = None
