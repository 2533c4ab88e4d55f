"""A KV cache's element types as torch dtypes, and how keys and values are quantized into a
scaled cache and read back: the reference the kernels' scaled caches match (their names, and
the attention backends that read each, are `engine.config.cache`'s, which loads no torch).

"int8" (the compiled CPU kernel) and "fp8" (e4m3, the Triton kernels) store each (token, KV
head) vector divided by its own float32 scale, its largest magnitude over the type's largest
value, so every vector uses the type's whole range. The kernels multiply a key's dot product
and a value's weight by its scale; the keys are never widened in memory.
"""

import torch

# The torch dtype of each resolved cache dtype name (`engine.config.cache.KV_CACHE_DTYPES` but "auto").
_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}

# Largest magnitude each scaled type holds.
_SCALED_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def cache_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved cache dtype name."""
    return _TORCH_DTYPES[name]


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
