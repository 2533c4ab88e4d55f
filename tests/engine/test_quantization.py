"""Quantized weights: choosing the method (`engine.quantization`), and int8 on the CPU.

int8 is checked against an emulation in float32 (weights and each activation row rounded
to int8 and scaled back, then an ordinary product; a calibrated projection's input scaled and
its outlier channels multiplied in float32): the engine sums in int32, exactly, so the two
differ by float32 rounding only. The compiled kernels and PyTorch's operations that stand in
for them give the same bits.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.engine.test_correctness import MAX_TOKENS, mixed_prompts
from tests.engine.test_fused_moe import moe_case, reference_moe
from engine import LLM, LoRARequest, SamplingParams
from engine import quantization
from engine import hardware
from engine.config import EngineConfig
from engine.distributed.communicator import TensorParallelGroup
from engine.hardware import CPU_KINDS, detect_cpu
from engine.layers.fused_moe import FusedMoE
from engine.layers.linear import Linear
from engine.model_loader.kernel_routing import route_through_cpu_kernels
from engine.models.llama import LlamaMLP
from engine.quantization import apply_quantization, resolve_quantization
from engine.quantization.int8 import (Int8LinearMethod, Int8Smoothing, bfloat16_pairs, int8_gated_mlp, int8_linear,
                                     int8_sums, quantize_rows, quantize_weight)
from engine.worker.calibration import CALIBRATION_TEXTS, calibration_prompts

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="int8 runs on a CPU")
needs_int8 = pytest.mark.skipif(not detect_cpu().int8_products, reason="int8 products need VNNI, AMX or AVX2")


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to int8 levels and scaled back, in float32."""
    q, scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale).view(x.shape)


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] rounded to its int8 levels, in float32."""
    q, scale = quantize_weight(weight)
    return q.t().float() * scale[:, None]


def whole_block_rows() -> int:
    """Rows enough for the int16-pair product to give each thread several whole blocks of 48
    rows (`cpu_int8_product.cpp`, kBlocksPerThread), and to finish each block's rows on the
    thread that summed them; a few more, so the last block is short."""
    return 4 * 48 * torch.get_num_threads() + 5


@pytest.mark.cpu_kinds
def test_int8_products_sum_exactly():
    """The compiled product's int32 sums are exact on every path (oneDNN's with VNNI or AMX,
    int16 pairs on other AVX2 CPUs or under an ISA cap without VNNI): shapes across its tiles
    of 6 rows, blocks of 48 and panels of 16 outputs, whole blocks a task, odd inputs, extreme
    values."""
    from engine.kernels import cpu_build

    kernels = cpu_build.load()
    if kernels is None:
        pytest.skip("the CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 1, 1), (5, 33, 17), (6, 64, 16), (7, 65, 31), (49, 577, 70), (100, 130, 48),
              (whole_block_rows(), 67, 40)]
    for rows, inputs, outputs in shapes:
        xq = torch.randint(-128, 128, (rows, inputs), generator=gen, dtype=torch.int8)
        q = torch.randint(-128, 128, (inputs, outputs), generator=gen, dtype=torch.int8)
        xq[0], q[:, 0] = -128, -128  # the largest sums one row and one output can reach
        expected = (xq.double() @ q.double()).to(torch.int32)
        assert torch.equal(kernels.int8_product(xq, q), expected), (rows, inputs, outputs)
        assert torch.equal(int8_sums(xq, q), expected)  # the PyTorch path the same
    with pytest.raises(RuntimeError, match=r"xq \[rows, in\] and q \[in, out\], contiguous int8"):
        kernels.int8_product(xq.float(), q)


def test_onednn_sums_int8_exactly_only_with_vnni_uncapped(monkeypatch):
    monkeypatch.delenv(hardware.ONEDNN_ISA_ENV, raising=False)
    for kind, exact in (("avx2", False), ("avx512", True), ("amx", True)):
        monkeypatch.setattr(hardware, "machine_cpu", CPU_KINDS[kind].info)
        assert hardware.onednn_sums_int8_exactly() is exact, kind
    for cap, exact in (("AVX2", False), ("AVX512_CORE", False), ("AVX512_CORE_VNNI", True), ("AVX512_CORE_BF16", True)):
        monkeypatch.setenv(hardware.ONEDNN_ISA_ENV, cap)
        assert hardware.onednn_sums_int8_exactly() is exact, cap


def test_weights_quantize_per_output_feature():
    weight = torch.randn(6, 10) * torch.tensor([1, 10, 100, 0, 1, 1])[:, None]
    q, scale = quantize_weight(weight)
    assert q.dtype == torch.int8 and q.shape == (10, 6) and q.is_contiguous()
    assert scale.tolist()[3] == 0 and not q[:, 3].any()  # a zero row stays zero
    assert q.abs().amax(0).tolist() == [127, 127, 127, 0, 127, 127]
    assert ((dequantized(weight) - weight).abs() <= scale[:, None] / 2 + 1e-6).all()


def wide_ranges(channels: int, gen: torch.Generator) -> torch.Tensor:
    """Input ranges of which a few channels are 20x the rest's."""
    ranges = torch.rand(channels, generator=gen) + 0.5
    ranges[[3, 17, 40]] *= 20
    return ranges


def smoothing_case(weight: torch.Tensor, gen: torch.Generator) -> Int8Smoothing:
    """A smoothing planned from `wide_ranges`."""
    return Int8Smoothing.plan(weight, wide_ranges(weight.shape[1], gen))


def emulated_product(x: torch.Tensor, weight: torch.Tensor, smoothing: Int8Smoothing | None) -> torch.Tensor:
    """x @ weight.T in float32 as int8 rounds it: with `smoothing`, the scaled input's rows and
    the smoothed weight rounded, and the outlier channels' exact product added."""
    x = x.float()
    if smoothing is None:
        return fake_quantize_rows(x) @ dequantized(weight).t()
    index = smoothing.outlier_index
    rounded = fake_quantize_rows(x * smoothing.input_scale) @ dequantized(smoothing.smoothed(weight)).t()
    return rounded + x[..., index] @ weight.float()[:, index].t()


def test_smoothing_moves_the_widest_channels_out_and_keeps_the_product():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 72, generator=gen)
    smoothing = smoothing_case(weight, gen)
    assert {3, 17, 40} <= set(smoothing.outlier_index.tolist())
    assert len(smoothing.outlier_index) == 72 // 8  # at most OUTLIER_CHANNELS, an eighth of a narrow input
    kept = smoothing.input_scale > 0
    assert kept.sum() == 72 - 9 and not smoothing.input_scale[smoothing.outlier_index].any()
    torch.testing.assert_close(smoothing.outlier_weight, weight[:, smoothing.outlier_index].t())
    # without rounding, the smoothed product plus the outliers' is the product
    x = torch.randn(5, 72, generator=gen)
    rebuilt = (x * smoothing.input_scale) @ smoothing.smoothed(weight).t()
    rebuilt += x[:, smoothing.outlier_index] @ smoothing.outlier_weight
    torch.testing.assert_close(rebuilt, x @ weight.t(), atol=1e-4, rtol=1e-4)


@needs_int8
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, bias", [(1, True), (7, False), (40, True)])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
def test_int8_linear_matches_the_emulation(cpu_path, dtype, rows, bias, smoothed):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 72, generator=gen).to(dtype)
    x[0] = 0  # a zero row: scale 0, no division by it
    # the weights in the model's dtype: a bfloat16 model's outliers go two at a time (9 of them here)
    weight = torch.randn(40, 72, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    smoothing = smoothing_case(weight, gen) if smoothed else None
    q, scale = quantize_weight(smoothing.smoothed(weight) if smoothed else weight)
    out = int8_linear(x, q, scale, b, smoothing)
    expected = emulated_product(x, weight, smoothing) + (b.float() if bias else 0)
    assert out.dtype == dtype and out.shape == (rows, 40)
    close = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # the output's rounding
    torch.testing.assert_close(out.float(), expected, atol=close * expected.abs().max().item(), rtol=close)


@needs_int8
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize("step", ["few_rows", "whole_blocks"])
def test_the_kernel_and_pytorch_agree_and_rows_ignore_the_batch(monkeypatch, dtype, smoothed, step):
    from engine.kernels import cpu_build

    if cpu_build.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(1)
    rows = 33 if step == "few_rows" else whole_block_rows()
    x, weight = torch.randn(rows, 96, generator=gen).to(dtype), torch.randn(50, 96, generator=gen).to(dtype)
    smoothing = smoothing_case(weight, gen) if smoothed else None
    assert smoothing is None or (smoothing.outlier_pairs is not None) == (dtype == torch.bfloat16)
    q, scale = quantize_weight(smoothing.smoothed(weight) if smoothed else weight)
    compiled = int8_linear(x, q, scale, None, smoothing)
    for t in range(0, rows, 1 if step == "few_rows" else 37):
        assert torch.equal(int8_linear(x[t : t + 1], q, scale, None, smoothing), compiled[t : t + 1]), t
    monkeypatch.setattr(cpu_build, "load", lambda: None)
    if smoothed:  # the kernel sums the outlier channels in fused multiply-adds, PyTorch in a product
        torch.testing.assert_close(int8_linear(x, q, scale, None, smoothing).float(), compiled.float(),
                                   rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
    else:
        assert torch.equal(int8_linear(x, q, scale, None, smoothing), compiled)


def test_outlier_pairs_hold_two_bfloat16_channels_a_word():
    columns = torch.randn(5, 7).bfloat16()  # 5 channels [k, out]: the last one has no partner
    pairs = bfloat16_pairs(columns)
    assert pairs.dtype == torch.int32 and pairs.shape == (2, 7)
    low = (pairs & 0xFFFF).short().view(torch.bfloat16)
    high = (pairs >> 16).short().view(torch.bfloat16)
    assert torch.equal(low, columns[0:4:2]) and torch.equal(high, columns[1:4:2])


def int8_mlp(dtype: torch.dtype, activation: str, smoothed: bool, gen: torch.Generator) -> LlamaMLP:
    """A gated MLP (biases on) quantized to int8 and routed as the model loader routes it,
    calibrated with `wide_ranges` when `smoothed`."""
    config = LlamaConfig(hidden_size=72, intermediate_size=100, num_attention_heads=4, hidden_act=activation,
                         mlp_bias=True)
    mlp = LlamaMLP(config, TensorParallelGroup())
    for parameter in mlp.parameters():
        parameter.data = (torch.randn(parameter.shape, generator=gen) * 0.1).to(dtype)
    apply_quantization(mlp, "int8", config, CPU)
    route_through_cpu_kernels(mlp)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        if smoothed:
            layer.input_range = wide_ranges(layer.in_features, gen)
        layer.prepack()
    return mlp


@needs_int8
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("smoothed", [False, True], ids=["plain", "smoothed"])
@pytest.mark.parametrize("step", ["few_rows", "whole_blocks"])
def test_the_fused_int8_mlp_gives_the_bits_of_its_steps_in_turn(dtype, activation, smoothed, step):
    from engine.kernels import cpu_build

    if cpu_build.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(2)
    mlp = int8_mlp(dtype, activation, smoothed, gen)
    assert mlp.fused is int8_gated_mlp
    rows = 37 if step == "few_rows" else whole_block_rows()  # in no multiple of the kernel's tiles
    x = torch.randn(rows, 72, generator=gen).to(dtype)
    x[5] = 0
    fused = mlp(x)
    assert fused.shape == (rows, 72) and fused.dtype == dtype
    mlp.fused = None  # gate/up product, activation, down product: three passes over the step
    assert torch.equal(fused, mlp(x))
    for t in (0, 5, rows - 1):  # and a row's result ignores the rest of the step
        mlp.fused = int8_gated_mlp
        assert torch.equal(mlp(x[t : t + 1]), fused[t : t + 1])


@needs_int8
def test_the_fused_int8_mlp_steps_aside_for_adapters_and_unquantized_weights():
    from engine.kernels import cpu_build

    if cpu_build.load() is None:
        pytest.skip("the CPU kernels cannot be built here")
    gen = torch.Generator().manual_seed(3)
    config = LlamaConfig(hidden_size=72, intermediate_size=100, num_attention_heads=4)
    mlp = LlamaMLP(config, TensorParallelGroup())
    apply_quantization(mlp, "int8", config, CPU)
    route_through_cpu_kernels(mlp)
    x = torch.randn(4, 72, generator=gen)
    # before prepack (as the calibration runs the model) the weights are not quantized yet
    assert int8_gated_mlp(x, mlp.gate_up_proj, mlp.down_proj, "silu") is None
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.prepack()
    assert int8_gated_mlp(x, mlp.gate_up_proj, mlp.down_proj, "silu") is not None
    mlp.down_proj.lora = object()  # an adapter adds its delta to the activations' product
    assert int8_gated_mlp(x, mlp.gate_up_proj, mlp.down_proj, "silu") is None
    plain = LlamaMLP(config, TensorParallelGroup())
    route_through_cpu_kernels(plain)
    assert plain.fused is None  # unquantized projections keep the activation kernel alone


def int8_experts(w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
    layer = FusedMoE(w13.shape[0], w13.shape[2], w2.shape[2]).to(w13.dtype)
    layer.w13.data.copy_(w13)
    layer.w2.data.copy_(w2)
    apply_quantization(torch.nn.ModuleList([layer]), "int8", LlamaConfig(), CPU)
    layer.prepack()
    return layer


def reference_int8_moe(x, w13, w2, weights, ids):
    """The experts' weighted sum with the weights and every product's input rows rounded as
    int8 (a SwiGLU's activation after rounding to x's dtype, as the layer computes it)."""
    x32 = fake_quantize_rows(x)
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for j, expert in enumerate(ids[t].tolist()):
            gate, up = (dequantized(w13[expert]) @ x32[t]).to(x.dtype).chunk(2)
            act = (F.silu(gate) * up).to(x.dtype)
            out[t] += weights[t, j] * (dequantized(w2[expert]) @ fake_quantize_rows(act[None])[0])
    return out


@needs_int8
@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k, only", [(33, 8, 2, (0, 2, 3, 5, 7)), (1, 8, 2, None),
                                                          (20, 4, 1, (2,))])
def test_int8_experts_match_the_emulation(cpu_path, dtype, tokens, experts, top_k, only):
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, dtype=dtype, only=only)
    layer = int8_experts(w13, w2)
    assert layer.w13.numel() == 0 and layer.w13_qweight.dtype == torch.int8
    with torch.no_grad():
        out = layer(x, weights, ids)
        assert torch.equal(layer(x[:1], weights[:1], ids[:1]), out[:1])
    assert out.dtype == dtype
    close = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(out.float(), reference_int8_moe(x, w13, w2, weights, ids), atol=close, rtol=close)
    # and the int8 model stays near the unquantized one (outputs of size ~1)
    torch.testing.assert_close(out.float(), reference_moe(x, w13, w2, weights, ids), atol=0.1, rtol=0.1)


ENGINE_NAMES = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                "up_proj": "gate_up_proj"}


def engine_smoothing(engine_model: torch.nn.Module) -> dict[str, Int8Smoothing]:
    """Each calibrated projection's smoothing, by transformers' name of each projection that
    feeds on the same input (q, k and v share qkv_proj's input scale and outliers)."""
    found = {}
    for name, module in engine_model.named_modules():
        if hasattr(module, "input_scale"):
            found[name] = Int8Smoothing(module.input_scale.clone(), module.outlier_index.clone(), torch.empty(0))
    return found


def emulate_int8(model: torch.nn.Module, smoothing: dict[str, Int8Smoothing]) -> None:
    """transformers' model with what `quantization="int8"` rounds rounded the same way:
    every projection but the head's, smoothed where the engine's is (`engine_smoothing`)."""
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        parent, _, leaf = name.rpartition(".")
        plan = smoothing.get(f"{parent}.{ENGINE_NAMES.get(leaf, leaf)}")
        weight, bias = module.weight.data.clone(), module.bias

        def forward(x, weight=weight, bias=bias, plan=plan):
            out = emulated_product(x, weight, plan)
            return out if bias is None else out + bias

        module.forward = forward


@needs_int8
def test_calibration_measures_each_projections_input_range(llama_with_biases, monkeypatch):
    """The ranges int8 smooths by are the largest |x| per input channel of each projection over
    the calibration text, as transformers' model computes its inputs (one prefill of them all)."""
    measured_by_layer = {}
    quantize = Int8LinearMethod.weight_to_quantize

    def spy(self, layer):
        measured_by_layer[layer] = layer.__dict__["input_range"]
        return quantize(self, layer)

    monkeypatch.setattr(Int8LinearMethod, "weight_to_quantize", spy)
    with LLM(str(llama_with_biases), dtype="float32", quantization="int8") as llm:
        names = {module: name for name, module in llm.llm_engine.model_runner.model.named_modules()}
        prompts = calibration_prompts(llm.get_tokenizer(), 512)
    measured = {names[layer]: ranges for layer, ranges in measured_by_layer.items()}
    assert len(prompts) == len(CALIBRATION_TEXTS) and len(measured) == 4 * 2
    model = AutoModelForCausalLM.from_pretrained(llama_with_biases, dtype=torch.float32).eval()
    expected: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        parent, _, leaf = name.rpartition(".")
        if leaf in ("q_proj", "o_proj", "gate_proj", "down_proj"):
            def record(_, args, key=f"{parent}.{ENGINE_NAMES.get(leaf, leaf)}"):
                peak = args[0].abs().reshape(-1, args[0].shape[-1]).amax(0)
                expected[key] = torch.maximum(expected[key], peak) if key in expected else peak
            module.register_forward_pre_hook(record)
    with torch.no_grad():
        for prompt in prompts:
            model(torch.tensor([prompt]))
    assert measured.keys() == expected.keys()
    for name, ranges in measured.items():
        torch.testing.assert_close(ranges, expected[name], rtol=1e-4, atol=1e-5, msg=name)


@needs_int8
def test_a_mixture_of_experts_calibrates_and_runs_int8(tmp_path):
    """The calibration runs the experts on their loaded weights (they are quantized after it),
    then the projections are smoothed and the experts int8, and the model stays near float32's."""
    from tests.tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe")
    prompts = mixed_prompts(count=4)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)
    with LLM(str(folder), dtype="float32") as llm:
        reference = llm.generate(prompts, params, use_tqdm=False)
    with LLM(str(folder), dtype="float32", quantization="int8") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        model = llm.llm_engine.model_runner.model
        experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
        assert experts and all(m.w13_qweight.dtype == torch.int8 for m in experts)
        assert any(hasattr(m, "input_scale") for m in model.modules() if isinstance(m, Linear))
    for ours, full in zip(outputs, reference):  # each greedy first token's logprob: the two models' top ones
        top = [o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob for o in (ours, full)]
        assert abs(top[0] - top[1]) < 0.1, top


def chosen_logprobs(llm: LLM, prompts: list[dict],
                    lora_request: LoRARequest | None = None) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's greedy tokens and their logprobs (with `lora_request`'s adapter, if given)."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0), use_tqdm=False,
                        lora_request=lora_request)
    return [(o.outputs[0].token_ids, torch.tensor([step[t].logprob for t, step in
                                                   zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]))
            for o in outs]


@needs_int8
@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 7}, {"attention_backend": "torch"}],
                         ids=["default", "chunked_prefill", "torch_backend"])
def test_int8_model_matches_the_emulation(llama_with_biases, settings):
    """Greedy tokens and their logprobs as the emulation computes them, closer to it than the
    unquantized model is (so the check sees the rounding)."""
    prompts = mixed_prompts(count=8)
    model = AutoModelForCausalLM.from_pretrained(llama_with_biases, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(llama_with_biases, dtype=torch.float32).eval()
    with LLM(str(llama_with_biases), dtype="float32", quantization="int8", **settings) as llm:
        outputs = chosen_logprobs(llm, prompts)
        engine_model = llm.llm_engine.model_runner.model
        linears = [m for m in engine_model.modules() if isinstance(m, Linear)]
        smoothing = engine_smoothing(engine_model)
    assert len(smoothing) == 4 * 2  # every projection of both layers was calibrated
    emulate_int8(model, smoothing)
    gap_to_plain = 0.0
    with torch.no_grad():
        for i, (p, (out, logprobs)) in enumerate(zip(prompts, outputs)):
            ids = torch.tensor([p["prompt_token_ids"] + out[:-1]])
            start = len(p["prompt_token_ids"]) - 1
            expected = model(ids).logits[0, start:].log_softmax(-1)
            assert expected.argmax(-1).tolist() == out, f"prompt {i}"
            torch.testing.assert_close(logprobs, expected[range(len(out)), out], atol=1e-4, rtol=0)
            unquantized = plain(ids).logits[0, start:].log_softmax(-1)[range(len(out)), out]
            gap_to_plain = max(gap_to_plain, (logprobs - unquantized).abs().max().item())
    assert gap_to_plain > 1e-3
    quantized = [m for m in linears if m.quant_method is not None]
    assert quantized and all(m.qweight.dtype == torch.int8 for m in quantized)
    assert {type(m).__name__ for m in linears if m.quant_method is None} == {"ParallelLMHead"}


@pytest.mark.parametrize("kind, auto_dtype, expected", [
    ("avx512_bf16", torch.bfloat16, "int8"),
    ("amx", torch.bfloat16, None),  # AMX's bfloat16 products are the faster
    ("avx512_bf16", None, None),  # a dtype was asked for
    ("avx512_bf16", torch.float32, None),  # float32 asked for (auto picks bfloat16 there)
    ("avx512", torch.float32, None), ("avx2", torch.float32, None),
])
def test_int8_is_the_default_where_the_cpu_picks_bfloat16_and_has_vnni(onednn_uncapped, monkeypatch, kind,
                                                                       auto_dtype, expected):
    monkeypatch.setattr(quantization, "detect_cpu", CPU_KINDS[kind].info)
    config = LlamaConfig()
    assert resolve_quantization("auto", config, CPU, auto_dtype) == expected
    # Batch-invariant mode, or oneDNN capped below AMX by hand, runs AVX-512 kernels, where int8 is the faster.
    invariant = "int8" if kind in ("amx", "avx512_bf16") and auto_dtype == torch.bfloat16 else None
    assert resolve_quantization("auto", config, CPU, auto_dtype, batch_invariant=True) == invariant
    monkeypatch.setenv(hardware.ONEDNN_ISA_ENV, "AVX512_CORE_BF16")
    assert resolve_quantization("auto", config, CPU, auto_dtype) == invariant
    assert resolve_quantization(None, config, CPU, auto_dtype) is None  # vLLM's default: the checkpoint's or none
    assert resolve_quantization("auto", config, torch.device("cuda"), torch.bfloat16) is None
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    assert resolve_quantization("auto", config, CPU, auto_dtype) == "awq"


def test_int8_is_the_default_for_pooling_on_avx2_without_vnni(monkeypatch):
    """On a Zen 3 (AVX2, no VNNI, float32 by default) embeddings and classes run int16-pair
    int8 products by default where the compiled kernels are built; generation stays float32."""
    config = LlamaConfig()
    built = object()
    monkeypatch.setattr(quantization.cpu_build, "load", lambda: built)
    for kind, auto_dtype, pooling, expected in (
            ("avx2", torch.float32, True, "int8"), ("avx2", torch.float32, False, None),
            ("avx2", None, True, None),  # a dtype was asked for
            ("avx512", torch.float32, True, None),  # VNNI without bfloat16: oneDNN's int8 not measured faster
            ("avx512_bf16", torch.float32, True, None)):  # float32 asked for where auto picks bfloat16
        monkeypatch.setattr(quantization, "detect_cpu", CPU_KINDS[kind].info)
        assert resolve_quantization("auto", config, CPU, auto_dtype, pooling=pooling) == expected, (kind, pooling)
        assert resolve_quantization(None, config, CPU, auto_dtype, pooling=pooling) is None
    monkeypatch.setattr(quantization, "detect_cpu", CPU_KINDS["avx2"].info)
    assert resolve_quantization("int8", config, CPU, pooling=False) == "int8"  # asked for, generation too
    monkeypatch.setattr(quantization.cpu_build, "load", lambda: None)  # no compiler: no int16 pairs
    assert resolve_quantization("auto", config, CPU, torch.float32, pooling=True) is None
    with pytest.raises(ValueError, match="'int8' needs a CPU with VNNI or AMX, or AVX2 with the compiled CPU kernels"):
        resolve_quantization("int8", config, CPU)


@pytest.mark.cpu_kinds
@needs_int8
def test_the_default_quantization_follows_the_dtype_setting(llama_with_biases, tmp_path):
    """A bfloat16 checkpoint on a bfloat16-native CPU runs int8 unless dtype or quantization is
    given, except where this process's oneDNN runs AMX tiles (bfloat16's products the faster:
    `make test` keeps a real AMX CPU's oneDNN off them, the `amx` run of tests/cpu_kinds.py
    does not); the resolved setting is what the engine reports."""
    from tests.tiny_models import build_tokenizer

    if not detect_cpu().native_bf16:
        pytest.skip("this CPU runs float32 by default")
    by_default = None if hardware.amx_products(detect_cpu(), batch_invariant=False) else "int8"
    AutoModelForCausalLM.from_pretrained(llama_with_biases, dtype=torch.bfloat16).save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    for settings, expected in (({}, by_default), ({"dtype": "bfloat16"}, None), ({"quantization": None}, None),
                               ({"max_model_len": 16}, by_default)):  # the calibration text cut to the context
        with LLM(str(tmp_path), **settings) as llm:
            assert llm.llm_engine.config.quantization == expected, settings


def test_quantization_is_checked_before_loading(monkeypatch):
    with pytest.raises(ValueError, match="quantization must be 'auto', None or one of .*'int8'.*, got 'int4'"):
        EngineConfig(quantization="int4")
    config = LlamaConfig()
    assert resolve_quantization(None, config, CPU) is None
    monkeypatch.setattr(quantization, "detect_cpu", CPU_KINDS["avx512"].info)
    assert resolve_quantization("int8", config, CPU) == "int8"
    monkeypatch.setattr(quantization, "detect_cpu", CPU_KINDS["avx2"].info)
    monkeypatch.setattr(quantization.cpu_build, "load", lambda: None)
    with pytest.raises(ValueError, match="'int8' needs a CPU with VNNI or AMX, or AVX2 with the compiled CPU "
                                         "kernels; this is a CPU"):
        resolve_quantization("int8", config, CPU)
    with pytest.raises(ValueError, match="'fp8' needs a GPU with FP8 units .*; this is a CPU"):
        resolve_quantization("fp8", config, CPU)
    with pytest.raises(ValueError, match="'awq' needs a checkpoint quantized with it"):
        resolve_quantization("awq", config, CPU)
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    assert resolve_quantization(None, config, CPU) == "awq"
    with pytest.raises(ValueError, match="'int8' contradicts the checkpoint's 'awq'"):
        resolve_quantization("int8", config, CPU)
    config.quantization_config = {"quant_method": "gptq", "bits": 8}
    with pytest.raises(ValueError, match="gptq quantization_config has bits=8 .only 4-bit"):
        resolve_quantization(None, config, CPU)
    config.quantization_config = {"quant_method": "exl2"}
    with pytest.raises(ValueError, match="quantized with 'exl2' .* cannot load"):
        resolve_quantization(None, config, CPU)
    config.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    with pytest.raises(ValueError, match="format='pack-quantized' .only 'float-quantized' FP8"):
        resolve_quantization(None, config, CPU)


def test_each_device_gets_its_product(monkeypatch):
    """Which method each checkpoint format runs with, by device, the GPU's FP8 detection
    mocked both ways: FP8 and 4-bit products on a GPU, dequantized weights (with the reason)
    where there is none."""
    from engine.quantization.checkpoint import CheckpointFormat
    from engine.quantization.fp8 import Fp8LinearMethod
    from engine.quantization.int4 import Int4LinearMethod

    gpu, per_channel, blocks = torch.device("cuda"), CheckpointFormat("fp8"), CheckpointFormat("fp8", block=128)
    monkeypatch.setattr(quantization, "_describe", lambda device: "an A100 (compute capability (8, 0))")
    for fp8_units in (True, False):
        monkeypatch.setattr(quantization, "fp8_products_available", lambda device, units=fp8_units: units)
        linear, experts, reason = quantization._methods("fp8", per_channel, gpu)
        assert (type(linear), reason is None) == ((Fp8LinearMethod, True) if fp8_units else (type(None), False))
        assert quantization._methods("fp8", blocks, gpu)[2] == "block-wise FP8 products are not built yet; " \
                                                              "the dtype's run instead"
        if fp8_units:
            assert quantization.resolve_quantization("fp8", LlamaConfig(), gpu) == "fp8"
        else:
            with pytest.raises(ValueError, match="'fp8' needs a GPU with FP8 units .*; this is an A100"):
                quantization.resolve_quantization("fp8", LlamaConfig(), gpu)
    for method in ("awq", "gptq"):
        linear, experts, reason = quantization._methods(method, CheckpointFormat(method), gpu)
        assert isinstance(linear, Int4LinearMethod) and experts is None and reason is None
        assert quantization._methods(method, CheckpointFormat(method), CPU)[:2] == (None, None)
    linear, experts, _ = quantization._methods("int8", None, CPU)
    assert type(linear).__name__ == "Int8LinearMethod" and type(experts).__name__ == "Int8MoEMethod"
