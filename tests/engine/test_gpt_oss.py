"""gpt-oss (`engine.models.gpt_oss`): greedy outputs equal transformers' `generate` (float32,
CPU) for a tiny random model with everything that sets the family apart: attention sinks
(drawn far from zero), q/k/v/o biases, a head_dim that is not hidden / heads, alternating
sliding (8 keys, shorter than most prompts) and full layers, YaRN rotary, a router with a
bias and experts with biases and a clamped SwiGLU (a limit low enough to clamp often).

Checked as configured normally, with chunked prefill at a 16-token step and with
preemption; on two tensor-parallel ranks against one; from an MXFP4 checkpoint written in
the released models' layout, against transformers with the dequantized experts; on the
Triton backend (its fused MoE kernel with biases and the clamp, under Triton's interpreter
without a GPU); and config.json options the engine does not implement fail at load, named.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.hardware import CPU_KIND_ENV, CPU_KINDS, amx_products, detect_cpu
from engine.kernels import cpu_build
from engine.kernels import triton as triton_kernels
from engine.layers.fused_moe import FusedMoE
from engine.models import MODEL_REGISTRY
from engine.models.gpt_oss import GptOssForCausalLM
from engine.quantization import apply_quantization, resolve_quantization
from engine.quantization.int8 import Int8MoEMethod
from engine.quantization.mxfp4 import MXFP4_DEQUANTIZED_WARNING, Mxfp4MoEMethod, dequantize_mxfp4, quantize_mxfp4
from tests.engine.test_correctness import assert_no_leaks, mixed_prompts, reference_greedy
from tests.tiny_models import build_tokenizer, save_random

WINDOW = 8  # the sliding layers' keys: fewer than most prompts have
MAX_TOKENS = 16
LAYERS = 3  # sliding, full, sliding
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0}
# The released checkpoints' quantization_config (config.json).
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                    "model.embed_tokens", "lm_head"]}
EXPERT_TENSORS = ("gate_up_proj", "down_proj")
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
CPU = torch.device("cpu")


def build_gpt_oss(folder: Path, seed: int = 0) -> Path:
    """A tiny random gpt-oss folder (float32 safetensors, the local tokenizer): 3 layers of
    hidden 64, 4 query heads of 32 dimensions over 2 key/value heads, 4 experts (top 2) of
    64 features, the SwiGLU clamped at 1.5; sinks ~ N(0, 1) and router biases ~ N(0, 0.5),
    so that a sink or bias left unloaded changes the tokens."""
    config = transformers.GptOssConfig(
        vocab_size=320, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
        max_position_embeddings=256, rope_parameters=YARN, swiglu_limit=1.5, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)
            layer.mlp.router.bias.normal_(0.0, 0.5)
    save_random(model, folder)
    build_tokenizer(folder)
    return folder


def engine_greedy(llm: LLM, prompts: list[dict], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_greedy_of(model: transformers.PreTrainedModel, prompts: list[dict], outputs: list[list[int]]) -> None:
    """Each of `outputs` (generated past any end-of-sequence token) is what `model` picks
    greedily, checked with one forward pass over prompt and output: each token the argmax
    of its logits at its position, so by induction what `generate` appends."""
    with torch.no_grad():
        for i, (p, out) in enumerate(zip(prompts, outputs)):
            ids = p["prompt_token_ids"]
            logits = model(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]
            assert logits.argmax(-1).tolist() == out, f"prompt {i}"


def kv_bytes_per_token(ranks: int = 1) -> int:
    """Float32 keys and values of one token on one rank: 3 layers x 2 x 2 / ranks heads x 32."""
    return LAYERS * 2 * (2 // ranks) * 32 * 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "gpt_oss")


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    """8 prompts of 1 to 90 tokens, most longer than the window; a third share a 40-token prefix."""
    return mixed_prompts(seed=3, count=8)


@pytest.fixture(scope="module")
def expected(folder, prompts) -> list[list[int]]:
    return reference_greedy(folder, prompts, MAX_TOKENS)


CONFIGS = [
    ("default", {}),
    ("chunked_prefill", {"max_num_batched_tokens": 16}),
    # 8 blocks of 16 tokens: the batch needs several times that, so sequences are preempted.
    ("preemption", {"kv_cache_memory": 8 * 16 * kv_bytes_per_token(), "max_num_batched_tokens": 64}),
]


@pytest.mark.parametrize("name,settings", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_greedy_matches_transformers(folder, prompts, expected, name, settings):
    assert MODEL_REGISTRY["GptOssForCausalLM"] is GptOssForCausalLM
    assert max(len(p["prompt_token_ids"]) for p in prompts) > 4 * WINDOW
    with LLM(str(folder), dtype="float32", **settings) as llm:
        assert engine_greedy(llm, prompts) == expected
        assert_no_leaks(llm)
        engine = llm.llm_engine
        if name == "preemption":
            assert engine.scheduler.num_preemptions > 0
        if name == "chunked_prefill":
            assert engine.stats.num_steps > sum(len(p["prompt_token_ids"]) for p in prompts) // 16
        if name == "default":
            sinks = engine.model_runner.model.model.layers[1].self_attn.attn.sinks
            stored = load_file(folder / "model.safetensors")["model.layers.1.self_attn.sinks"]
            assert sinks.dtype == torch.float32 and torch.equal(sinks, stored)


def test_two_ranks_give_one_ranks_tokens(folder, prompts, expected):
    """Tensor parallelism over gloo: each rank holds half the heads (and their sinks) and
    half of every expert's features; rank 0 alone adds the down products' biases."""
    with LLM(str(folder), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32,
             kv_cache_memory=16 * 16 * kv_bytes_per_token(2)) as llm:
        assert engine_greedy(llm, prompts) == expected
        assert_no_leaks(llm)


def mxfp4_checkpoint(dense: Path, folder: Path) -> dict[str, torch.Tensor]:
    """Writes `dense` into `folder` as the released MXFP4 checkpoints store it (each layer's
    experts as `*_blocks` [E, out, in / 32, 16] and `*_scales` [E, out, in / 32], the rest
    unquantized; quantization_config in config.json); returns the state dict with the
    experts dequantized, in transformers' layout, for the reference model."""
    shutil.copytree(dense, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    tensors, dequantized = load_file(dense / "model.safetensors"), {}
    for name in [n for n in tensors if n.rpartition(".")[2] in EXPERT_TENSORS]:
        rows_first = tensors.pop(name).transpose(1, 2).contiguous()  # [E, in, out] -> [E, out, in]
        quantized = quantize_mxfp4(rows_first)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantized.blocks, quantized.scales
        dequantized[name] = dequantize_mxfp4(quantized.blocks, quantized.scales, torch.float32).transpose(1, 2)
        assert not torch.equal(dequantized[name], rows_first.transpose(1, 2))  # the rounding is visible
    save_file(tensors, folder / "model.safetensors")
    return dequantized


def test_mxfp4_checkpoint_matches_transformers_with_the_dequantized_experts(folder, prompts, tmp_path):
    dequantized = mxfp4_checkpoint(folder, tmp_path / "mxfp4")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference.load_state_dict(dequantized, strict=False)
    with LLM(str(tmp_path / "mxfp4"), dtype="float32") as llm:
        assert llm.llm_engine.model_config.quantization == "mxfp4"
        outputs = engine_greedy(llm, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
        assert_greedy_of(reference, prompts, outputs)
        experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
        assert isinstance(experts, FusedMoE) and experts.quant_method is None


@pytest.mark.skipif(not detect_cpu().int8_products, reason="int8 at load needs VNNI, AMX or AVX2")
def test_mxfp4_checkpoint_runs_int8_on_a_cpu(folder, prompts, tmp_path):
    """quantization="int8" on an MXFP4 checkpoint: the experts dequantized as they load, then
    quantized to int8 with every projection, biases and the clamp kept; the first greedy token
    is the dequantized checkpoint's for all but near ties (the layer-level error is checked in
    tests/engine/test_moe_variants.py)."""
    mxfp4_checkpoint(folder, tmp_path / "mxfp4")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(tmp_path / "mxfp4"), dtype="float32") as llm:
        dequantized = engine_greedy(llm, prompts, params)
    with LLM(str(tmp_path / "mxfp4"), dtype="float32", quantization="int8") as llm:
        assert llm.llm_engine.model_config.quantization == "int8"
        experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
        assert isinstance(experts.quant_method, Int8MoEMethod) and experts.w13_bias is not None
        outputs = engine_greedy(llm, prompts, params)
    assert sum(o[0] == d[0] for o, d in zip(outputs, dequantized)) >= len(prompts) - 2  # 7 of 8 here


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_mxfp4_is_the_checkpoints_own_method(folder, caplog, monkeypatch, request, kind):
    """An MXFP4 checkpoint runs as "mxfp4" (another method contradicts it; an unquantized
    checkpoint cannot take it), except that on a CPU, where its experts are dequantized as
    they load, int8 follows the dtype's rules: asked for where the CPU takes int8 products
    (VNNI, AMX, or AVX2 with the compiled kernels), and by default where a bfloat16 model
    would take it; nothing is handed an MXFP4 product, and a GPU warns that the experts are
    dequantized."""
    monkeypatch.setenv(CPU_KIND_ENV, kind)
    detect_cpu.cache_clear()
    request.addfinalizer(detect_cpu.cache_clear)  # read again, from the environment as it was
    config = transformers.AutoConfig.from_pretrained(folder)
    with pytest.raises(ValueError, match="'mxfp4' needs a checkpoint quantized with it"):
        resolve_quantization("mxfp4", config, CPU)
    config.quantization_config = MXFP4_CONFIG
    assert resolve_quantization("auto", config, CPU) == resolve_quantization(None, config, CPU) == "mxfp4"
    cpu = CPU_KINDS[kind].info()
    vnni = cpu.int8_vnni
    # The engine's own rule: no int8 where oneDNN runs AMX tiles, which this process's oneDNN
    # cap decides (make test keeps a real AMX CPU's oneDNN off AMX; the `amx` run does not).
    by_default = "int8" if vnni and not amx_products(cpu, batch_invariant=False) else "mxfp4"
    assert resolve_quantization("auto", config, CPU, auto_dtype=torch.bfloat16) == by_default
    if vnni or cpu.int16_pair_products and cpu_build.load() is not None:
        assert resolve_quantization("int8", config, CPU) == "int8"
    else:
        with pytest.raises(ValueError, match="'int8' needs"):
            resolve_quantization("int8", config, CPU)
    with pytest.raises(ValueError, match="'fp8' contradicts the checkpoint's 'mxfp4'"):
        resolve_quantization("fp8", config, CPU)
    with torch.device("meta"):
        model = GptOssForCausalLM(config, max_position=64)
    for device, warned in ((CPU, False), (torch.device("cuda"), True)):
        caplog.clear()
        apply_quantization(model, "mxfp4", config, device)
        assert (MXFP4_DEQUANTIZED_WARNING in caplog.text) == warned
    assert all(getattr(m, "quant_method", None) is None for m in model.modules())
    caplog.clear()
    apply_quantization(model, "mxfp4", config, torch.device("cuda"), triton_kernels=True)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert MXFP4_DEQUANTIZED_WARNING not in caplog.text and experts
    for layer in experts:
        assert isinstance(layer.quant_method, Mxfp4MoEMethod) and layer.w13.numel() == 0
        assert (layer.w13_blocks.shape, layer.w2_scales.shape) == ((4, 128, 32), (4, 64, 2))


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_backend_reads_mxfp4_experts_as_stored(folder, prompts, tmp_path):
    """With the Triton kernels an MXFP4 checkpoint's experts stay as stored (a quarter of
    bfloat16's bytes) and the fused MoE kernel reads them: transformers' tokens with the
    dequantized experts, under Triton's interpreter where there is no GPU."""
    dequantized = mxfp4_checkpoint(folder, tmp_path / "mxfp4")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reference.load_state_dict(dequantized, strict=False)
    chosen = [prompts[i] for i in (1, 5)]  # 17 and 2 tokens
    with LLM(str(tmp_path / "mxfp4"), dtype="float32", attention_backend="triton", max_num_batched_tokens=12) as llm:
        experts = llm.llm_engine.model_runner.model.model.layers[0].mlp.experts
        assert isinstance(experts.quant_method, Mxfp4MoEMethod) and experts.w13.numel() == 0
        assert experts.w13_blocks.dtype == torch.uint8
        outputs = engine_greedy(llm, chosen, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert_greedy_of(reference, chosen, outputs)


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_backend_matches_transformers(folder, prompts, expected):
    """The Triton backend and kernels (the fused MoE kernel with expert biases and the
    clamped SwiGLU, attention with sinks and a window), under Triton's interpreter where
    there is no GPU, which takes about 0.1 s a token: three short prompts (two longer than
    the window), the longest in two 12-token steps."""
    chosen = [1, 5, 7]  # 17, 2 and 9 tokens
    with LLM(str(folder), dtype="float32", attention_backend="triton", max_num_batched_tokens=12) as llm:
        params = SamplingParams(temperature=0, max_tokens=6)
        outputs = llm.generate([prompts[i] for i in chosen], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [expected[i][:6] for i in chosen]
        assert_no_leaks(llm)


def with_config(folder: Path, target: Path, **changes: object) -> Path:
    """A copy of `folder` whose config.json has `changes`."""
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **changes}))
    return target


@pytest.mark.parametrize("changes,message", [
    ({"rope_parameters": {**YARN, "rope_type": "dynamic"}}, "rope_type 'dynamic' is not supported"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     r"layer_types\[1\] is 'chunked_attention'"),
], ids=["rope_type", "layer_types"])
def test_an_unimplemented_option_fails_at_load_naming_it(folder, tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(with_config(folder, tmp_path / "changed", **changes)), dtype="float32")


def test_a_config_without_the_swiglu_limit_fails_naming_it(folder):
    config = transformers.PretrainedConfig(**{key: value for key, value in
                                              json.loads((folder / "config.json").read_text()).items()
                                              if key != "swiglu_limit"})
    with pytest.raises(ValueError, match="lacks swiglu_limit"), torch.device("meta"):
        GptOssForCausalLM(config, max_position=64)


def test_a_config_without_swiglu_alpha_takes_the_released_one(folder):
    """The released config.json has no swiglu_alpha (transformers before 5.24 give none)."""
    settings = {key: value for key, value in json.loads((folder / "config.json").read_text()).items()
                if key != "swiglu_alpha"}
    with torch.device("meta"):
        model = GptOssForCausalLM(transformers.PretrainedConfig(**settings), max_position=64)
    assert model.model.layers[0].mlp.experts.activation.alpha == 1.702
