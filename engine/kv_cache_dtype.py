"""The KV cache's element type (`kv_cache_dtype`): its names, which attention backend reads
which, and how keys and values are quantized into a scaled cache and read back.

A narrower cache holds more tokens in the same memory and makes decode attention read fewer
bytes. "bfloat16" and "float16" store the keys and values rounded; "int8" (the compiled CPU
kernel) and "fp8" (e4m3, the Triton kernels) store each (token, KV head) vector divided by
its own float32 scale, its largest magnitude over the type's largest value, so every vector
uses the type's whole range. The kernels multiply a key's dot product and a value's weight
by its scale; the keys are never widened in memory.
"""

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}

# The cache dtypes each attention backend reads (the PyTorch backend, the reference, reads all).
BACKEND_CACHE_DTYPES: dict[str, tuple[str, ...]] = {
    "torch": tuple(KV_CACHE_DTYPES),
    "cpu": ("auto", "float32", "bfloat16", "float16", "int8"),
    "triton": ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3"),
}

# Largest magnitude each scaled type holds.
_SCALED_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


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


def cache_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved cache dtype name."""
    return KV_CACHE_DTYPES[name]


def is_scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` stores a scale per (token, KV head)."""
    return dtype in _SCALED_MAX


def scaled_max(dtype: torch.dtype) -> float:
    """The largest magnitude a scaled cache of `dtype` stores; 0.0 for an unscaled one."""
    return _SCALED_MAX.get(dtype, 0.0)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` [..., head_dim] as `dtype` values and float32 scales [...]: each vector divided by
    its largest magnitude over the type's largest value (a zero vector gets scale 1)."""
    largest = scaled_max(dtype)
    x = x.float()
    scale = x.abs().amax(dim=-1) / largest
    scale = torch.where(scale > 0, scale, 1.0)
    scaled = x / scale.unsqueeze(-1)
    if dtype == torch.int8:
        scaled = scaled.round_()
    return scaled.clamp_(-largest, largest).to(dtype), scale


def dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`values` [..., head_dim] times their `scale` [...], in float32, then as `dtype`."""
    return (values.float() * scale.unsqueeze(-1)).to(dtype)
