"""The building blocks of gpt-oss, DeepSeek-V2/V3 and Llama 4 against transformers: MXFP4
expert weights, each family's router (`Routing`) and experts (`FusedMoE`'s biases, clamped
SwiGLU and input-weighted experts) on the MoE blocks transformers builds from tiny configs,
and YaRN rotary frequencies.

No model files: every module is built from its config class with random weights. The
experts are compared in float32 (transformers sums them in the model's dtype, the engine in
float32); routing decisions in bfloat16 too, where they must be the same bits.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import _compute_yarn_parameters

from engine.hardware import detect_cpu
from engine.kernels import triton as triton_kernels
from engine.layers.fused_moe import ClampedSwiGLU, FusedMoE, Routing, deinterleave_gate_up
from engine.layers.rotary import RotaryEmbedding, rope_parameters, yarn_mscale
from engine.quantization import int8
from engine.quantization.int8 import Int8MoEMethod
from engine.quantization.mxfp4 import FP4_MAGNITUDES, dequantize_mxfp4, quantize_mxfp4

needs_triton = pytest.mark.skipif(not triton_kernels.available(torch.device("cpu")) or torch.cuda.is_available(),
                                  reason="the kernel runs here under Triton's interpreter")
# Outputs of size ~1 in float32: the sums' order differs from transformers' (measured below 2e-6).
CLOSE = dict(atol=2e-5, rtol=2e-5)


def randomize(module: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Every parameter and buffer of `module` normal with std scale / sqrt(its last dimension)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) * scale * tensor.shape[-1] ** -0.5)


def hidden_states(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def swiglu(x: torch.Tensor, mlp: torch.nn.Module) -> torch.Tensor:
    """A transformers shared-expert MLP's output computed from its weights."""
    return F.linear(F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight), mlp.down_proj.weight)


def experts_of(num_experts: int, w13: torch.Tensor, w2: torch.Tensor, **variant) -> FusedMoE:
    """A FusedMoE holding w13 [E, 2I, H] and w2 [E, H, I] (and the variant's biases)."""
    biases = {name: variant.pop(name) for name in ("w13_bias", "w2_bias") if name in variant}
    layer = FusedMoE(num_experts, w13.shape[2], w2.shape[2], bias=bool(biases), **variant)
    with torch.no_grad():
        for name, value in dict(w13=w13, w2=w2, **biases).items():
            getattr(layer, name).copy_(value)
    return layer


# MXFP4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantized_mxfp4_equals_transformers(dtype):
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 12, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 12, 4), dtype=torch.uint8, generator=gen)
    scales[0, 0, :3] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # E8M0's extremes (the largest overflows to inf)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, rows]: transformers' x @ W layout
    ours = dequantize_mxfp4(blocks, scales, dtype)
    assert ours.shape == (3, 12, 128) and ours.dtype == dtype
    assert torch.equal(ours.transpose(1, 2), expected)
    assert torch.equal(dequantize_mxfp4(blocks[1], scales[1], dtype), ours[1])  # one expert at a time, as loaders call


def test_quantized_mxfp4_rounds_to_the_nearest_value_ties_to_even_and_round_trips():
    weight = torch.randn(6, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    packed = quantize_mxfp4(weight)
    assert packed.blocks.shape == (6, 4, 16) and packed.scales.shape == (6, 4) and packed.blocks.dtype == torch.uint8
    restored = dequantize_mxfp4(packed.blocks, packed.scales, torch.float32)
    scale = (packed.scales.int() - 127).float().exp2().repeat_interleave(32, dim=1)
    grid = torch.tensor(FP4_MAGNITUDES)
    assert (weight.abs() / scale).max() <= 6.0  # the smallest power of two that saturates nothing
    nearest = (weight.abs().unsqueeze(-1) - grid * scale.unsqueeze(-1)).abs().min(dim=-1).values
    assert torch.equal((weight - restored).abs(), nearest)
    assert torch.equal(dequantize_mxfp4(*vars(quantize_mxfp4(restored)).values(), torch.float32), restored)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 6.0] + [0.0] * 23)
    rounded = dequantize_mxfp4(*vars(quantize_mxfp4(ties)).values(), torch.float32)
    assert rounded[:9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0]


def test_mxfp4_shapes_that_do_not_fit_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.zeros(2, 48))
    with pytest.raises(ValueError, match=r"blocks \(2, 3, 16\) and scales \(2, 4\)"):
        dequantize_mxfp4(torch.zeros(2, 3, 16, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.uint8))


# gpt-oss


def gpt_oss_block(seed: int = 0):
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                       num_experts_per_tok=2)
    block = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config)
    randomize(block, seed)
    with torch.no_grad():
        block.experts.gate_up_proj.mul_(6.0)  # gate and up products of std ~6: the clamp at 7 bites
        block.experts.down_proj.mul_(0.125)  # outputs of size ~5
    return config, block


def gpt_oss_experts(config, block, **settings) -> FusedMoE:
    """The engine's experts from transformers' [E, H, 2I] interleaved gate/up and [E, I, H]
    down, as the gpt-oss loader stores them."""
    experts = block.experts
    return experts_of(config.num_local_experts, deinterleave_gate_up(experts.gate_up_proj.transpose(1, 2), dim=1),
                      experts.down_proj.transpose(1, 2), w13_bias=deinterleave_gate_up(experts.gate_up_proj_bias, 1),
                      w2_bias=experts.down_proj_bias, activation=ClampedSwiGLU.of(config), **settings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_routing_equals_transformers(dtype):
    config, block = gpt_oss_block()
    router = block.router.to(dtype)
    x = hidden_states(37, 64).to(dtype)
    logits, expected_weights, expected_ids = router(x)
    weights, ids = Routing.gpt_oss(config).select(logits)
    assert torch.equal(ids, expected_ids)
    assert torch.equal(weights.to(dtype), expected_weights)


@pytest.mark.parametrize("prepacked", [False, True])
def test_gpt_oss_block_equals_transformers(prepacked):
    config, block = gpt_oss_block()
    x = hidden_states(1, 37, 64)
    expected, _ = block(x)
    experts = gpt_oss_experts(config, block)
    if prepacked:
        experts.prepack()
    with torch.no_grad():
        weights, ids = Routing.gpt_oss(config).select(block.router(x[0])[0])
        out = experts(x[0], weights, ids)
    gate = block.experts.gate_up_proj.transpose(1, 2)[:, 0::2] @ x[0].T + block.experts.gate_up_proj_bias[:, 0::2, None]
    assert gate.max() > config.swiglu_limit  # the clamp took part
    torch.testing.assert_close(out, expected[0], **CLOSE)


def test_gpt_oss_experts_load_from_mxfp4_as_transformers_dequantizes_them():
    """The loader's recipe: each expert's *_blocks and *_scales dequantized, its gate/up rows
    de-interleaved; transformers runs the same checkpoint through `convert_moe_packed_tensors`."""
    config, block = gpt_oss_block()
    stored = {name: quantize_mxfp4(getattr(block.experts, name).transpose(1, 2))  # the checkpoint's [E, rows, ...]
              for name in ("gate_up_proj", "down_proj")}
    with torch.no_grad():
        for name, packed in stored.items():
            getattr(block.experts, name).copy_(convert_moe_packed_tensors(packed.blocks, packed.scales,
                                                                          dtype=torch.float32))
    experts = gpt_oss_experts(config, block)
    with torch.no_grad():
        for e in range(config.num_local_experts):
            gate_up, down = (dequantize_mxfp4(packed.blocks[e], packed.scales[e], torch.float32)
                             for packed in stored.values())
            experts.w13[e].copy_(deinterleave_gate_up(gate_up))
            experts.w2[e].copy_(down)
        x = hidden_states(1, 19, 64, seed=2)
        expected, _ = block(x)
        out = experts(x[0], *Routing.gpt_oss(config).select(block.router(x[0])[0]))
    torch.testing.assert_close(out, expected[0], **CLOSE)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_computes_the_gpt_oss_experts(dtype):
    from engine.kernels.triton.fused_moe import fused_moe

    config, block = gpt_oss_block(seed=3)
    x = hidden_states(21, 64)
    weights, ids = Routing.gpt_oss(config).select(block.router(x)[0].detach())
    with torch.no_grad():
        expected = gpt_oss_experts(config, block)(x, weights, ids)
        experts = gpt_oss_experts(config, block).to(dtype)
        experts.kernel = fused_moe
        out = experts(x.to(dtype), weights, ids)
    assert out.dtype == dtype
    # Against the float32 grouped products, outputs of size ~5: float16 rounds ~50-sized intermediates (up to 5e-3).
    close = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=close, rtol=close)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["gpt_oss", "plain"])
def test_triton_kernel_reads_mxfp4_experts_as_dequantized(dtype, variant):
    """The MXFP4 experts (blocks and scales as stored, rows in `FusedMoE`'s order) give the
    kernel's output on the same experts dequantized (`dequantize_mxfp4` to the dtype), bit
    for bit: the tiles turn into those values before the same products. Every code occurs."""
    from engine.kernels.triton.fused_moe import Mxfp4Weights, fused_moe

    config, block = gpt_oss_block(seed=4)
    x = hidden_states(21, 64).to(dtype)
    weights, ids = Routing.gpt_oss(config).select(block.router(x.float())[0].detach())
    experts = gpt_oss_experts(config, block)
    stored = [quantize_mxfp4(w.detach()) for w in (experts.w13, experts.w2)]
    assert {int(c) for c in torch.unique(torch.cat([t.blocks.flatten() & 15 for t in stored]))} == set(range(16))
    dense = [dequantize_mxfp4(t.blocks, t.scales, dtype) for t in stored]
    packed = Mxfp4Weights(stored[0].blocks.flatten(-2), stored[0].scales, stored[1].blocks.flatten(-2),
                          stored[1].scales)
    extra = {} if variant == "plain" else dict(w13_bias=experts.w13_bias.detach().to(dtype),
                                               w2_bias=experts.w2_bias.detach().to(dtype), limit=7.0, alpha=1.702)
    with torch.no_grad():
        expected = fused_moe(x, dense[0], dense[1], weights, ids, **extra)
        out = fused_moe(x, None, None, weights, ids, mxfp4=packed, **extra)
    assert out.dtype == dtype and torch.equal(out, expected)


def test_tensor_parallel_ranks_add_the_down_bias_once():
    config, block = gpt_oss_block()
    whole = gpt_oss_experts(config, block)
    x = hidden_states(9, 64)
    weights, ids = Routing.gpt_oss(config).select(block.router(x)[0].detach())
    reduced, parts = [], []
    for rank in range(2):
        group = SimpleNamespace(rank=rank, size=2, all_reduce=reduced.append)
        layer = FusedMoE(8, 64, 32, group, bias=True, activation=ClampedSwiGLU.of(config))
        with torch.no_grad():  # this rank's half of each expert's gate and up rows, and of its down columns
            layer.w13.copy_(torch.cat([half.narrow(1, 16 * rank, 16) for half in whole.w13.split(32, 1)], 1))
            layer.w13_bias.copy_(torch.cat([half.narrow(1, 16 * rank, 16) for half in whole.w13_bias.split(32, 1)], 1))
            layer.w2.copy_(whole.w2.narrow(2, 16 * rank, 16))
            layer.w2_bias.copy_(whole.w2_bias)
            parts.append(layer(x, weights, ids))
    assert len(reduced) == 2
    with torch.no_grad():
        torch.testing.assert_close(parts[0] + parts[1], whole(x, weights, ids), **CLOSE)


@pytest.mark.cpu_kinds
@pytest.mark.skipif(not detect_cpu().int8_products, reason="int8 products need VNNI, AMX or AVX2")
@pytest.mark.parametrize("compiled", [True, False])
def test_int8_experts_of_a_variant_keep_their_biases_and_clamp(compiled, monkeypatch):
    """gpt-oss's experts at int8 (`Int8MoEMethod`): the biases and the clamped SwiGLU still
    apply, per expert, through the compiled int8 product and through PyTorch's; the output
    is within int8's rounding of the float32 experts', and far from the same experts
    without their biases. Where the CPU has no VNNI the engine refuses int8 (its products
    saturate there: 9% off as an AVX2 CPU)."""
    config, block = gpt_oss_block()
    with torch.no_grad():
        block.experts.gate_up_proj_bias.normal_(0.0, 2.0)
        block.experts.down_proj_bias.normal_(0.0, 2.0)
    x = hidden_states(24, 64)
    weights, ids = Routing.gpt_oss(config).select(F.linear(x, block.router.weight, block.router.bias))
    exact = gpt_oss_experts(config, block)(x, weights, ids)
    if not compiled:
        monkeypatch.setattr(int8.cpu_build, "load", lambda: None)
    experts = gpt_oss_experts(config, block)
    experts.quant_method = Int8MoEMethod()
    experts.prepack()
    assert experts.w13.numel() == 0 and experts.w13_qweight.dtype == torch.int8
    with torch.no_grad():
        quantized = experts(x, weights, ids)
        activation, experts.activation = experts.activation, None
        unclamped = experts(x, weights, ids)
        experts.activation = activation
        experts.w13_bias.zero_()
        experts.w2_bias.zero_()
        unbiased = experts(x, weights, ids)
    gap = {name: ((out - exact).norm() / exact.norm()).item()
           for name, out in (("int8", quantized), ("unclamped", unclamped), ("unbiased", unbiased))}
    assert gap["int8"] < 0.05 and gap["unclamped"] > 4 * gap["int8"] and gap["unbiased"] > 4 * gap["int8"], gap


# DeepSeek-V2 and V3


def deepseek_block(version: int, **settings):
    sizes = dict(hidden_size=32, moe_intermediate_size=16, n_routed_experts=16, num_experts_per_tok=4,
                 n_shared_experts=1, routed_scaling_factor=2.5, experts_implementation="eager")
    if version == 2:
        config = transformers.DeepseekV2Config(**sizes, **settings)
        block = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(config)
    else:
        config = transformers.DeepseekV3Config(**sizes, n_group=4, topk_group=2, **settings)
        block = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(config)
    randomize(block, seed=version)
    if version == 3:  # a correction bias of the scores' size, so that it changes choices
        block.gate.e_score_correction_bias.copy_(torch.rand(16, generator=torch.Generator().manual_seed(5)) * 0.3)
    return config, block


def deepseek_output(config, block, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    logits = F.linear(x, block.gate.weight)  # the router in float32, as transformers'
    weights, ids = routing.select(logits, getattr(block.gate, "e_score_correction_bias", None))
    experts = experts_of(16, block.experts.gate_up_proj, block.experts.down_proj)
    with torch.no_grad():
        return experts(x, weights, ids) + swiglu(x, block.shared_experts)


@pytest.mark.parametrize("version, settings", [
    (2, dict(topk_method="greedy")),
    (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    (3, dict(norm_topk_prob=True)),
    (3, dict(norm_topk_prob=False)),
])
def test_deepseek_routing_and_block_equal_transformers(version, settings):
    config, block = deepseek_block(version, **settings)
    routing = (Routing.deepseek_v2 if version == 2 else Routing.deepseek_v3)(config)
    x = hidden_states(1, 29, 32)
    with torch.no_grad():
        _, expected_weights, expected_ids = block.gate(x)
        logits = F.linear(x[0], block.gate.weight)
        weights, ids = routing.select(logits, getattr(block.gate, "e_score_correction_bias", None))
        expected = block(x)
    ours, theirs = ids.sort(dim=-1), expected_ids.sort(dim=-1)  # transformers leaves each token's k unsorted
    assert torch.equal(ours.values, theirs.values)
    # Renormalised, the k weights' sum differs by its order (one float32 ulp at most).
    torch.testing.assert_close(weights.gather(1, ours.indices), expected_weights.gather(1, theirs.indices),
                               atol=0, rtol=0 if not config.norm_topk_prob else 1.2e-7)
    torch.testing.assert_close(deepseek_output(config, block, x[0], routing), expected[0], **CLOSE)


def test_deepseek_v3_chooses_by_the_biased_scores_and_weighs_by_the_unbiased():
    config, block = deepseek_block(3)
    logits = torch.zeros(1, 16)
    bias = torch.zeros(16)
    bias[[1, 2, 9, 10]] = 1.0  # groups 0 and 2 win (by their two best), and those experts within them
    weights, ids = Routing.deepseek_v3(config).select(logits, bias)
    assert sorted(ids[0].tolist()) == [1, 2, 9, 10]
    torch.testing.assert_close(weights, torch.full((1, 4), 2.5 / 4))  # sigmoid(0) each, renormalised, x 2.5


def test_deepseek_v2_renormalises_where_norm_topk_prob_says():
    """transformers' DeepSeek-V2 router ignores `norm_topk_prob`; DeepSeek's own code and vLLM
    divide by the chosen weights' sum, then scale."""
    config, _ = deepseek_block(2, topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=True)
    weights, _ = Routing.deepseek_v2(config).select(hidden_states(7, 16))
    torch.testing.assert_close(weights.sum(dim=-1), torch.full((7,), 2.5))


def test_routing_refuses_groups_or_a_correction_bias_on_chosen_logits():
    with pytest.raises(ValueError, match="set groups=1"):
        Routing(2, score_chosen=True, groups=4)
    with pytest.raises(ValueError, match="correction_bias has no place"):
        Routing(2, score_chosen=True).select(torch.zeros(1, 8), torch.zeros(8))


# Llama 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama4_block_equals_transformers(dtype):
    config = transformers.Llama4TextConfig(hidden_size=32, intermediate_size=16, num_local_experts=4)
    block = transformers.models.llama4.modeling_llama4.Llama4TextMoe(config)
    randomize(block, seed=4)
    block = block.to(dtype)
    x = hidden_states(23, 32).to(dtype)
    with torch.no_grad():
        expected, logits = block(x)
        weights, ids = Routing.llama4(config).select(logits)
        experts = experts_of(4, block.experts.gate_up_proj.transpose(1, 2), block.experts.down_proj.transpose(1, 2),
                             weights_on_input=True).to(dtype)
        out = experts(x, weights, ids) + swiglu(x, block.shared_expert)
    assert torch.equal(ids[:, 0], logits.argmax(dim=-1))
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, **CLOSE)
    else:  # the same inputs to the experts; sums rounded in another order
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)


# YaRN


@pytest.mark.parametrize("family, settings", [
    ("gpt_oss", {}),  # truncate False, factor 32
    ("deepseek_v3", dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32,
                         beta_slow=1, mscale=1.0, mscale_all_dim=1.0)),
    ("deepseek_v3", dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=512, mscale=0.707,
                         mscale_all_dim=1.0, truncate=True)),
    ("deepseek_v3", dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=1024,
                         attention_factor=1.25, partial_rotary_factor=0.5)),
])
def test_yarn_tables_equal_transformers(family, settings):
    if family == "gpt_oss":
        config = transformers.GptOssConfig(head_dim=64, max_position_embeddings=8192)
    else:
        config = transformers.DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=16384,
                                               rope_parameters=dict(rope_theta=10000.0, **settings))
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    rope = rope_parameters(config)
    layer = RotaryEmbedding(config.head_dim, 300, rope)
    half = layer.rotary_dim // 2
    assert half == inv_freq.numel()
    angles = torch.outer(torch.arange(300, dtype=torch.float32), inv_freq)
    assert torch.equal(layer.cos[:, :half], angles.cos() * attention_factor)
    assert torch.equal(layer.sin[:, half:], angles.sin() * attention_factor)


def test_yarn_mscale_is_deepseeks_softmax_correction():
    assert yarn_mscale(1.0, 0.707) == 1.0
    assert yarn_mscale(40.0, 1.0) == pytest.approx(0.1 * torch.log(torch.tensor(40.0)).item() + 1, rel=1e-6)
