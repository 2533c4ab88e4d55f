"""The machine the suite runs on, and a roofline estimate of what a workload could reach on it.

The roofline takes the faster of two bounds per workload: compute (the workload's FLOPs at the
measured matrix-product rate) and memory (the weights read once per decode step plus the KV cache
read by each decode token, at the measured copy bandwidth). Tokens per second at the bound that
takes longer is the ceiling an engine can approach.
"""

import json
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

@dataclass
class MachineRates:
    """Measured peak rates: matrix products (FLOP/s) per dtype and memory copy bandwidth (bytes/s)."""

    matmul_flops: dict[str, float]
    bandwidth: float

    def describe(self) -> str:
        rates = ", ".join(f"{dtype} {rate / 1e9:.1f} GFLOP/s" for dtype, rate in self.matmul_flops.items())
        return f"matmul [256,576]x[576,3072]: {rates} | memory copy: {self.bandwidth / 1e9:.1f} GB/s"


# Cache element types that torch names otherwise (the GPU caches' FP8).
_ELEMENT_SIZES = {"fp8": 1, "fp8_e4m3": 1}


def element_size(dtype: str) -> int:
    """Bytes an element of `dtype`, a weights' or a KV cache's element type as the engine names it."""
    return _ELEMENT_SIZES.get(dtype) or torch.empty(0, dtype=getattr(torch, dtype)).element_size()


@dataclass
class ModelShape:
    """The model facts the roofline needs, read from config.json and the safetensors headers."""

    matmul_params: int  # every weight a token multiplies through, lm_head included (tied or not)
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, element_size: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * element_size

    def attention_flops(self, contexts: int) -> int:
        """FLOPs of attention (scores and weighted sum) over `contexts` tokens in all, all layers."""
        return 4 * self.layers * self.heads * self.head_dim * contexts


@dataclass
class Roofline:
    """One workload's ceiling in output tokens per second and the bound that sets it."""

    output_tokens_per_s: float
    bound: str  # "compute" or "memory"
    compute_s: float
    memory_s: float


def measure_rates(native_bf16: bool, repeats: int = 10) -> MachineRates:
    """Best-of-`repeats` rates of a [256,576]x[576,3072] product (float32, and bfloat16 if native)
    and of a 256 MiB tensor copy (bytes read plus bytes written)."""
    dtypes = [torch.float32] + ([torch.bfloat16] if native_bf16 else [])
    matmul = {}
    for dtype in dtypes:
        a, b = torch.randn(256, 576, dtype=dtype), torch.randn(576, 3072, dtype=dtype)
        seconds = best_time(lambda a=a, b=b: torch.mm(a, b), repeats)
        matmul[str(dtype).removeprefix("torch.")] = 2 * 256 * 576 * 3072 / seconds
    src = torch.ones(64 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = best_time(lambda: dst.copy_(src), max(3, repeats // 2))
    return MachineRates(matmul, 2 * src.numel() * src.element_size() / seconds)


def model_shape(path: Path) -> ModelShape:
    """Parameter count from the safetensors headers (no weights read) and attention sizes from config.json."""
    config = json.loads((path / "config.json").read_text())
    shapes = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        shapes.update({name: meta["shape"] for name, meta in header.items() if name != "__metadata__"})
    numel = {name: _product(shape) for name, shape in shapes.items()}
    embedding = sum(n for name, n in numel.items() if "embed_tokens" in name)
    has_lm_head = any("lm_head" in name for name in numel)
    # Tied: the embedding is also lm_head's matrix, so it counts once, as lm_head.
    matmul_params = sum(numel.values()) - (embedding if has_lm_head else 0)
    heads = config["num_attention_heads"]
    return ModelShape(matmul_params, config["num_hidden_layers"], heads,
                      config.get("num_key_value_heads", heads),
                      config.get("head_dim") or config["hidden_size"] // heads)


def roofline(shape: ModelShape, rates: MachineRates, prompts: list[int], outputs: list[int],
             shared_prefix: int, element_size: int, max_num_seqs: int,
             kv_element_size: int | None = None) -> Roofline:
    """The ceiling for prompts of the given lengths each generating `outputs[i]` tokens.

    Compute: the products' FLOPs (`product_flops`) plus attention. Memory: the weights read
    once per decode step (`element_size` bytes a weight), at least max(longest output, total
    outputs / max_num_seqs) steps, plus each decode token's read of the KV cache before it
    (`decode_kv_bytes`, `kv_element_size` bytes an element: the weights' where not given). The
    faster of the measured matmul rates stands for the compute peak.
    """
    attention = sum(shape.attention_flops(_sum_range(_computed_from(i, shared_prefix), prompt + output - 1))
                    for i, (prompt, output) in enumerate(zip(prompts, outputs)))  # token t attends to t tokens
    flops = product_flops(shape, prompts, outputs, shared_prefix) + attention
    steps = max(max(outputs), -(-sum(outputs) // max_num_seqs))
    compute_s = flops / max(rates.matmul_flops.values())
    memory_s = (steps * shape.matmul_params * element_size
                + decode_kv_bytes(shape, prompts, outputs, kv_element_size or element_size)) / rates.bandwidth
    seconds = max(compute_s, memory_s)
    return Roofline(sum(outputs) / seconds, "compute" if compute_s >= memory_s else "memory",
                    compute_s, memory_s)


def product_flops(shape: ModelShape, prompts: list[int], outputs: list[int], shared_prefix: int) -> int:
    """The matrix products' FLOPs: 2 x matmul parameters per token fed through the model (the
    last output token never is), a shared prefix counted once, as prefix caching allows."""
    return sum(2 * shape.matmul_params * (prompt + output - 1 - _computed_from(i, shared_prefix))
               for i, (prompt, output) in enumerate(zip(prompts, outputs)))


def decode_kv_bytes(shape: ModelShape, prompts: list[int], outputs: list[int], element_size: int) -> int:
    """Bytes of keys and values the decode tokens read: each one's whole context before it."""
    tokens = sum(_sum_range(prompt, prompt + output - 1) for prompt, output in zip(prompts, outputs))
    return tokens * shape.kv_bytes_per_token(element_size)


def _computed_from(index: int, shared_prefix: int) -> int:
    """Prompt tokens of prompt `index` that a prefix-cache hit skips (all prompts but the first)."""
    return shared_prefix if index > 0 else 0


def best_time(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` calls of `fn` after one warm-up call, in seconds."""
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _sum_range(after: int, last: int) -> int:
    """after+1 + after+2 + ... + last."""
    return (last * (last + 1) - after * (after + 1)) // 2


def _product(shape: list[int]) -> int:
    result = 1
    for n in shape:
        result *= n
    return result
