"""Narrower KV caches (`kv_cache_dtype`): bfloat16 and float16 under a float32 model, int8
(the compiled CPU kernel) and fp8 (the Triton kernels) with a scale per (token, KV head).

Every backend that reads a cache dtype is checked against the dense float32 reference over
the keys and values as the cache stores them (rounded, or quantized and scaled back), so
the kernels' reading is checked tightly and the rounding separately; then whole models:
the compiled kernel against the PyTorch backend on the same cache dtype, both near the
float32 cache, and the memory budget holding more tokens.
"""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import BACKEND_CACHE_DTYPES, EngineConfig, resolve_kv_cache_dtype
from engine.hardware import machine_cpu
from engine.kernels.kv_cache_quant import cache_torch_dtype, dequantize, quantize
from tests.engine.test_sliding_window import BACKENDS, MIXED, mixed_step, paged_case
from tests.engine.test_triton_kernels import DEVICE as TRITON_DEVICE
from tests.engine.test_triton_kernels import reference_attention, tolerance

NARROW = ["bfloat16", "float16", "int8", "fp8"]
# Triton's interpreter computes bfloat16 wrongly: the Triton kernels read a bfloat16 cache on a GPU only.
interpreted_bf16 = pytest.mark.skipif(TRITON_DEVICE.type == "cpu", reason="Triton's interpreter is wrong in bfloat16")
CASES = [pytest.param(b, d, marks=[interpreted_bf16] if (b, d) == ("triton", "bfloat16") else [])
         for b in BACKENDS for d in NARROW if d in BACKEND_CACHE_DTYPES[b]]


def stored(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x` as a cache of dtype `name` gives it back, in float32."""
    dtype = cache_torch_dtype(name)
    if name in ("int8", "fp8"):
        return dequantize(*quantize(x, dtype), torch.float32)
    return x.to(dtype).float()


def expected_over(case, step: list[tuple[int, int, int]], keys: list[torch.Tensor],
                  values: list[torch.Tensor]) -> torch.Tensor:
    """The dense reference of `step` over these keys and values."""
    layer = case.layer
    return torch.cat([
        reference_attention(case.queries[s][end - new : end], keys[s][:end], values[s][:end], end - new,
                            layer.scale, layer.sliding_window, layer.logit_softcap)
        for s, end, new in step])


def reading_tolerance(backend: str, name: str, head_dim: int) -> dict[str, float]:
    """How closely a backend reads a cache as stored: float32's tolerance, but for the compiled
    kernel's int8 path (AVX2 and head sizes of 64, 128 or 256, as it is built here),
    which rounds the queries and the value weights to int16 for exact int32 dot products
    (relative error 2**-16 a term)."""
    if backend == "cpu" and name == "int8" and head_dim in (64, 128, 256) and {"avx2", "fma"} <= machine_cpu().flags:
        return {"atol": 1e-3, "rtol": 1e-3}
    return tolerance(torch.float32)


@pytest.mark.parametrize(("backend", "name"), CASES)
@pytest.mark.parametrize("head_dim", [64, 48])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 16, "logit_softcap": 5.0}], ids=["plain", "window_cap"])
def test_backends_read_the_cache_as_stored(backend, name, head_dim, options):
    """Float32 queries over a narrower cache: the dense reference over the stored keys and
    values, within float32's tolerance; and within the dtype's rounding of the reference
    over the exact ones."""
    case = paged_case(backend, [new + cached for new, cached in MIXED], head_dim, 16, torch.float32,
                      cache_dtype=cache_torch_dtype(name), **options)
    step = mixed_step(MIXED)
    out = case.run(step)
    as_stored = expected_over(case, step, [stored(k, name) for k in case.keys], [stored(v, name) for v in case.values])
    torch.testing.assert_close(out, as_stored, **reading_tolerance(backend, name, head_dim))
    exact = case.expected(step)
    rounding = {"bfloat16": 2e-2, "float16": 3e-3, "int8": 2e-2, "fp8": 0.15}[name]
    assert 0 < (out - exact).abs().max() < rounding


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_vectors_round_within_half_a_step(name):
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    x[0, 0] = 0.0
    values, scale = quantize(x, cache_torch_dtype(name))
    assert scale.shape == (50, 3) and scale[0, 0] == 1.0 and values[0, 0].float().abs().max() == 0
    largest = x.abs().amax(-1, keepdim=True)
    error = (dequantize(values, scale, torch.float32) - x).abs()
    # int8: half a level of largest / 127; e4m3: 3 mantissa bits, half a unit in the last place.
    bound = largest / 254 if name == "int8" else x.abs().clamp(min=largest * 2**-9) * 2**-4
    assert (error <= bound * 1.0001).all()


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the CPU kernel is not built")
@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "int8"])
def test_cpu_store_writes_what_pytorch_does(source, name):
    """The compiled cache write: PyTorch's cast, or for int8 `quantize`'s bits and scales."""
    from engine.kernels import cpu_attention

    torch.manual_seed(0)
    x = (torch.randn(7, 3, 64) * torch.logspace(-3, 2, 64)).to(source)
    x[2, 1] = 0
    cache = torch.zeros(3, 40, 64, dtype=cache_torch_dtype(name))
    scale = torch.zeros(3, 40) if name == "int8" else torch.empty(0)
    slots = torch.tensor([5, 0, 39, 17, 3, 22, 8])
    cpu_attention.store_kv(x, cache, scale, slots)
    written = cache[:, slots].transpose(0, 1)
    if name == "int8":
        values, scales = quantize(x, torch.int8)
        assert torch.equal(written, values) and torch.equal(scale[:, slots].T, scales)
        assert int((scale != 0).sum()) == 7 * 3
    else:
        assert torch.equal(written, x.to(cache.dtype))
    assert int((cache != 0).any(-1).sum()) == 7 * 3 - 1  # the zero vector stays zero


@pytest.mark.skipif("triton" not in BACKENDS, reason="triton is not installed")
def test_triton_store_quantizes_as_pytorch_does():
    """The fp8 cache's bytes and scales written by the store kernel are PyTorch's quantize."""
    from engine.kernels.triton.kv_store import store_kv

    torch.manual_seed(1)
    k, v = torch.randn(2, 5, 3, 32, device=TRITON_DEVICE) * torch.logspace(-2, 2, 32, device=TRITON_DEVICE)
    cache = [torch.zeros(2, 8, 3, 32, dtype=torch.float8_e4m3fn, device=TRITON_DEVICE) for _ in range(2)]
    scales = [torch.zeros(2, 8, 3, device=TRITON_DEVICE) for _ in range(2)]
    slots = torch.tensor([3, 9, -1, 0, 15], device=TRITON_DEVICE)
    store_kv(k, v, *cache, *scales, slots)
    for new, values, scale in zip((k, v), cache, scales):
        expected_values, expected_scale = quantize(new, torch.float8_e4m3fn)
        written = [0, 1, 3, 4]
        flat_slots = slots[written]
        assert torch.equal(values.view(-1, 3, 32)[flat_slots].view(torch.uint8),
                           expected_values[written].view(torch.uint8))
        assert torch.equal(scale.view(-1, 3)[flat_slots], expected_scale[written])
        assert int((scale != 0).sum()) == 4 * 3


def test_each_backend_reads_only_its_caches():
    assert resolve_kv_cache_dtype("auto", "bfloat16", "cpu") == "bfloat16"
    assert resolve_kv_cache_dtype("int8", "float32", "cpu") == "int8"
    assert resolve_kv_cache_dtype("fp8", "bfloat16", "triton") == "fp8"
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' cannot be read by the 'cpu' attention backend.*"
                                         "on a CPU use 'int8'"):
        resolve_kv_cache_dtype("fp8", "float32", "cpu")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' cannot be read by the 'triton'.*on a GPU use 'fp8'"):
        resolve_kv_cache_dtype("int8", "bfloat16", "triton")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', .*got 'int4'"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.mark.parametrize("dtype, kv_cache_dtype, backend, device, expected", [
    ("auto", "auto", "cpu", "cpu", "bfloat16"),  # the compiled kernel's cache, a float32 model's too
    ("float32", "auto", "cpu", "cpu", "float32"),  # an explicit dtype keeps its own cache
    ("auto", "float32", "cpu", "cpu", "float32"),
    ("auto", "int8", "cpu", "cpu", "int8"),
    ("auto", "auto", "torch", "cpu", "float32"),  # the reference backend: the model's dtype
    ("auto", "auto", "triton", "cuda", "float32"),
])
def test_auto_cache_dtype(tiny_models, dtype, kv_cache_dtype, backend, device, expected):
    """'auto' is the model's dtype, except on the CPU kernel with dtype 'auto' too: there a
    bfloat16 cache under a float32 model halves what decode reads for 62/64 greedy agreement."""
    from transformers import LlamaConfig

    from engine.config import ModelConfig

    model = ModelConfig(tiny_models["llama"], LlamaConfig(), torch.float32, torch.device(device), 128)
    config = EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype).resolve(model, backend)
    assert config.kv_cache_dtype == expected


def test_fp8_on_the_cpu_kernel_is_refused_before_loading(tiny_models):
    if "cpu" not in BACKENDS:
        pytest.skip("the CPU kernel is not built")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' cannot be read by the 'cpu'"):
        LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_dtype="fp8", attention_backend="cpu")


def greedy(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's 12 greedy tokens and their logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outputs]


def common_prefix_gap(ours: list[tuple[list[int], list[float]]], theirs: list[tuple[list[int], list[float]]]) -> float:
    """The largest logprob difference over the tokens both runs chose alike, up to the first
    difference of each prompt (a random model's near-ties may then go either way)."""
    gaps = [0.0]
    for (tokens, logprobs), (other_tokens, other_logprobs) in zip(ours, theirs):
        for token, logprob, other, other_logprob in zip(tokens, logprobs, other_tokens, other_logprobs):
            if token != other:
                break
            gaps.append(abs(logprob - other_logprob))
    return max(gaps)


@pytest.mark.parametrize("name", ["int8", "bfloat16"])
def test_a_model_on_a_narrower_cache(make_llm, name):
    """The compiled kernel and the PyTorch backend agree on the same narrower cache (prefix
    hits, chunked prefill and decode reading the stored scales), both near the float32
    cache and not equal to it; the budget holds as many more tokens as the cache is
    narrower."""
    if "cpu" not in BACKENDS:
        pytest.skip("the CPU kernel is not built")
    shared = list(range(5, 45))
    prompts = [shared + [60 + i] * (3 + i) for i in range(4)] * 2  # the second half hits the prefix cache
    budget = 1 << 20
    common = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 32, "kv_cache_memory": budget}
    runs = {}
    for key, settings in {"full": {}, "cpu": {"kv_cache_dtype": name},
                          "torch": {"kv_cache_dtype": name, "attention_backend": "torch"}}.items():
        llm = make_llm(**common, **settings)
        runs[key] = greedy(llm, prompts)
        runs[key + "_blocks"] = llm.llm_engine.model_runner.kv_cache.num_blocks
        runs[key + "_bytes"] = llm.llm_engine.model_runner.kv_cache.bytes_per_token
    assert [t for t, _ in runs["cpu"]] == [t for t, _ in runs["torch"]]
    for (_, cpu), (_, ref) in zip(runs["cpu"], runs["torch"]):
        torch.testing.assert_close(torch.tensor(cpu), torch.tensor(ref), atol=1e-4, rtol=0)
    assert runs["cpu"][:4] == runs["cpu"][4:]
    assert 0 < common_prefix_gap(runs["cpu"], runs["full"]) < 0.05
    layers = llm.llm_engine.model_runner.kv_cache.layers
    heads, dim = sum(layer.num_kv_heads for layer in layers), layers[0].head_dim
    per_head = {"int8": dim + 4, "bfloat16": 2 * dim}[name]  # int8: a float32 scale per head
    assert runs["cpu_bytes"] == 2 * heads * per_head and runs["full_bytes"] == 2 * heads * 4 * dim
    assert runs["cpu_blocks"] == budget // (16 * runs["cpu_bytes"]) > runs["full_blocks"]
