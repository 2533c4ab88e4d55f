"""The KV cache's settings (`CacheSettings`: block size, memory, element type, GPU memory
share, prefix caching), as vLLM's `config/cache.py`, and the names `kv_cache_dtype` allows
with the attention backends that read each.

A narrower cache holds more tokens in the same memory and makes decode attention read fewer
bytes. "bfloat16" and "float16" store the keys and values rounded; "int8" (the compiled CPU
kernel) and "fp8" (e4m3, the Triton kernels) store each (token, KV head) vector divided by
its own float32 scale (`engine.kernels.kv_cache_quant` quantizes them, loading torch, which
this module does not)."""

from dataclasses import dataclass
from typing import Any

from engine.config.utils import OPERATIONAL, OUTPUT, SettingsGroup, _setting, positive_problems

# The names kv_cache_dtype allows: "auto" (the model's dtype) and the element types.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")

# The cache dtypes each attention backend reads (the PyTorch backend, the reference, reads all).
BACKEND_CACHE_DTYPES: dict[str, tuple[str, ...]] = {
    "torch": KV_CACHE_DTYPES,
    "cpu": ("auto", "float32", "bfloat16", "float16", "int8"),
    "triton": ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3"),
}

# KV cache on a CPU when kv_cache_memory is not set (a GPU's is what gpu_memory_utilization leaves).
DEFAULT_KV_CACHE_MEMORY = 4 << 30


@dataclass
class CacheSettings(SettingsGroup):
    """The paged KV cache: its blocks, its memory and its element type."""

    block_size: int = _setting(16, "Tokens per KV-cache block.", OPERATIONAL)
    kv_cache_memory: int | None = _setting(None, "Bytes of KV cache (vLLM's kv_cache_memory_bytes); default "
                                                 f"{DEFAULT_KV_CACHE_MEMORY >> 30} GiB on a CPU, and on a GPU what "
                                                 "gpu_memory_utilization leaves.", OPERATIONAL)
    kv_cache_dtype: str = _setting("auto", "The KV cache's element type: 'auto' (the model's dtype; bfloat16 on a "
                                           "CPU when dtype is 'auto' too), 'bfloat16' or "
                                           "'float16' (a float32 model's cache at half the bytes), 'int8' (the CPU "
                                           "kernel) or 'fp8' (e4m3, the Triton kernels on a GPU), both with a float32 "
                                           "scale per token and KV head. Narrower caches hold more tokens in "
                                           "kv_cache_memory and make decode attention read fewer bytes.", OUTPUT)
    gpu_memory_utilization: float = _setting(0.9, "Fraction of GPU memory for weights, activations and KV cache, "
                                                  "planned from a measured forward pass at max_num_batched_tokens.", OPERATIONAL)
    enable_prefix_caching: bool = _setting(True, "Reuse the KV blocks of prompt prefixes already computed.", OPERATIONAL)

    def problems(self) -> list[str]:
        problems = positive_problems(self, ["block_size"]) + positive_problems(self, ["kv_cache_memory"], optional=True)
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                            f"got {self.kv_cache_dtype!r}")
        return problems

    def resolved(self, model_config: Any, attention_backend: str) -> dict[str, Any]:
        """The CPU's default memory (a GPU's stays None: the model runner measures it), and
        the cache dtype the backend reads (`resolve_kv_cache_dtype`)."""
        on_cpu = model_config.device.type == "cpu"
        return {"kv_cache_memory": self.kv_cache_memory or (DEFAULT_KV_CACHE_MEMORY if on_cpu else None),
                "kv_cache_dtype": resolve_kv_cache_dtype(self.kv_cache_dtype, model_config.dtype_name,
                                                         attention_backend)}


def resolve_kv_cache_dtype(setting: str, model_dtype: str, backend: str) -> str:
    """The cache dtype's name for `setting` ("auto": the model's dtype), checked against
    what the attention backend reads.

    Raises:
        ValueError: the backend cannot read that cache, naming what it can.
    """
    if setting not in BACKEND_CACHE_DTYPES[backend]:
        hint = {"int8": "on a GPU use 'fp8'", "fp8": "on a CPU use 'int8'", "fp8_e4m3": "on a CPU use 'int8'"}
        readable = ", ".join(repr(name) for name in BACKEND_CACHE_DTYPES[backend])
        raise ValueError(f"kv_cache_dtype={setting!r} cannot be read by the {backend!r} attention backend, which "
                         f"reads {readable}; {hint.get(setting, 'choose one of those')}")
    return model_dtype if setting == "auto" else setting
