"""DeepSeek-V2 and V3 (`engine.models.deepseek_v2`, latent attention in `engine.attention.mla`):
greedy outputs equal transformers' `generate` (float32, CPU) for tiny random models with
what sets each apart.

V2: queries straight from `q_proj`, a dense first layer, then softmax routing limited to the
best 2 of 4 expert groups (`group_limited_greedy`), a scaling factor, a shared expert.
V3: low-rank queries (`q_lora_rank`), sigmoid routing with a score correction drawn far from
zero, groups ranked by their two best, renormalised weights, YaRN rotary with DeepSeek's
mscale and mscale_all_dim (so the softmax scale carries yarn_mscale**2), interleaved rotary
rows (`rope_interleave`) and, in a third model, rotary rows as halves.

Checked as configured normally (prefills expanded, decodes absorbed; prompts sharing a prefix
read it from the cache), with chunked prefill at a 16-token step, with preemption, with
`batch_invariant=True` (every row absorbed), with an int8 KV cache, on two tensor-parallel
ranks against one, and on the Triton backend under Triton's interpreter. The cache holds
the latent and the rotary key alone, one tensor per layer, and a fixed budget holds as many
more blocks than a multi-head layout would as that saves.
"""

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from engine import LLM, LoRARequest, SamplingParams
from engine.attention.mla import MLAAttention
from engine.hardware import detect_cpu
from engine.kernels import triton as triton_kernels
from engine.kernels.kv_cache_quant import dequantize, quantize
from engine.models import MODEL_REGISTRY
from engine.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from engine.quantization.int8 import Int8LinearMethod
from tests.engine.test_correctness import assert_no_leaks, mixed_prompts, reference_greedy
from tests.lora_adapters import build_lora_adapter, peft_greedy
from tests.tiny_models import build_tokenizer, save_random

MAX_TOKENS = 12
LAYERS = 3  # one dense, two with experts
HEADS, LATENT, ROPE, NOPE, VALUE = 4, 32, 8, 16, 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8, "rope_theta": 10000.0}
SHARED = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, kv_lora_rank=LATENT,
              qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=VALUE, n_routed_experts=8,
              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
              routed_scaling_factor=1.5, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
FAMILIES = {
    "v2": lambda: transformers.DeepseekV2Config(q_lora_rank=None, topk_method="group_limited_greedy", **SHARED),
    "v3": lambda: transformers.DeepseekV3Config(q_lora_rank=24, norm_topk_prob=True, rope_parameters=YARN,
                                                rope_interleave=True, **SHARED),
    "v3_halves": lambda: transformers.DeepseekV3Config(q_lora_rank=24, norm_topk_prob=True, rope_interleave=False,
                                                       **SHARED),
}


def build_deepseek(folder: Path, family: str, seed: int = 0) -> Path:
    """A tiny random DeepSeek folder (float32 safetensors, the local tokenizer); V3's score
    corrections ~ N(0, 0.5), so that one left unloaded changes the tokens."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            bias = getattr(layer.mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.normal_(0.0, 0.5)
    save_random(model, folder)
    build_tokenizer(folder)
    return folder


def engine_greedy(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def latent_bytes_per_token(element: int = 4) -> int:
    """The latent cache of one token: every layer's latent and rotary key, nothing per head."""
    return LAYERS * (LATENT + ROPE) * element


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {family: build_deepseek(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    """8 prompts of 1 to 90 tokens; a third share a 40-token prefix."""
    return mixed_prompts(seed=3, count=8)


@pytest.fixture(scope="module")
def expected(folders, prompts) -> dict[str, list[list[int]]]:
    return {family: reference_greedy(folder, prompts, MAX_TOKENS) for family, folder in folders.items()}


CONFIGS = [
    ("default", {}),
    ("chunked_prefill", {"max_num_batched_tokens": 16}),
    # 8 blocks of 16 tokens: the batch needs several times that, so sequences are preempted.
    ("preemption", {"kv_cache_memory": 8 * 16 * latent_bytes_per_token(), "max_num_batched_tokens": 64}),
    ("batch_invariant", {"batch_invariant": True}),
]


@pytest.mark.parametrize("family", ["v2", "v3"])
@pytest.mark.parametrize("name,settings", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_greedy_matches_transformers(folders, prompts, expected, family, name, settings):
    with LLM(str(folders[family]), dtype="float32", **settings) as llm:
        outputs = engine_greedy(llm, prompts)
        engine = llm.llm_engine
        layers = [m for m in engine.model_runner.model.modules() if isinstance(m, MLAAttention)]
        assert len(layers) == LAYERS and all(layer.expand_prefill != (name == "batch_invariant") for layer in layers)
        assert outputs == expected[family]
        assert_no_leaks(llm)
        if name == "preemption":
            assert engine.scheduler.num_preemptions > 0
        if name == "chunked_prefill":
            assert engine.stats.num_steps > sum(len(p["prompt_token_ids"]) for p in prompts) // 16


def test_int8_cache(folders, prompts, expected):
    """An int8 latent cache (a float32 scale per token and layer): the compiled kernel and the
    PyTorch backend read it alike, prefills expand the latents it stores; the rounding lets
    greedy paths part from float32's only after their first tokens."""
    runs = {}
    for backend in ("auto", "torch"):
        with LLM(str(folders["v2"]), dtype="float32", kv_cache_dtype="int8", attention_backend=backend,
                 max_num_batched_tokens=32) as llm:
            runs[backend] = engine_greedy(llm, prompts)
            assert llm.llm_engine.model_runner.kv_cache.bytes_per_token == LAYERS * (LATENT + ROPE + 4)
    assert runs["auto"] == runs["torch"]
    assert all(o[:2] == e[:2] for o, e in zip(runs["auto"], expected["v2"]))
    assert runs["auto"] != expected["v2"]


@pytest.mark.skipif(not detect_cpu().int8_products, reason="int8 at load needs VNNI, AMX or AVX2")
@pytest.mark.parametrize("family", ["v2", "v3"])
def test_int8_at_load(folders, prompts, expected, family):
    """quantization="int8" (the default for bfloat16 on such a CPU): the projections, the
    reordered rotary ones included, and the experts run int8, `kv_b_proj` keeps the dtype
    (absorbed at load); greedy paths start as float32's but for near ties."""
    with LLM(str(folders[family]), dtype="float32", quantization="int8") as llm:
        attention = llm.llm_engine.model_runner.model.model.layers[1].self_attn
        assert isinstance(attention.kv_a_proj_with_mqa.quant_method, Int8LinearMethod)
        assert attention.kv_b_proj.quant_method is None and attention.attn.w_uk.dtype == torch.float32
        outputs = engine_greedy(llm, prompts)
    assert sum(o[0] == e[0] for o, e in zip(outputs, expected[family])) >= len(prompts) - 2


def test_rotary_rows_as_halves(folders, prompts, expected):
    """V3 with `rope_interleave=False`: the rows load as stored."""
    with LLM(str(folders["v3_halves"]), dtype="float32") as llm:
        assert engine_greedy(llm, prompts) == expected["v3_halves"]


def test_the_cache_holds_the_latent_and_rotary_key_alone(folders):
    """One tensor per layer of (latent + rope) values per slot, read as keys and values; at a
    fixed budget the blocks are those bytes' share, (2 x heads x (nope + rope + value)) /
    2 / (latent + rope) = 4 times a multi-head cache of the same heads' blocks here (DeepSeek-V2's
    sizes: 128 heads, 576 latent values against 2 x 128 x 128, 57 times)."""
    budget, block = 1 << 20, 16
    with LLM(str(folders["v3"]), dtype="float32", kv_cache_memory=budget, block_size=block, max_num_seqs=1024) as llm:
        kv_cache = llm.llm_engine.model_runner.kv_cache
        assert kv_cache.bytes_per_token == latent_bytes_per_token()
        slots = (kv_cache.num_blocks + 1) * block
        for layer in kv_cache.layers:
            assert layer.v_cache is layer.k_cache
            assert layer.k_cache.numel() * layer.k_cache.element_size() == slots * (LATENT + ROPE) * 4
        assert kv_cache.num_blocks == budget // (block * latent_bytes_per_token())
        multi_head = LAYERS * HEADS * (NOPE + ROPE + VALUE) * 4
        assert kv_cache.num_blocks == 4 * (budget // (block * multi_head))


def test_two_ranks_give_one_ranks_tokens(folders, prompts, expected):
    """Each rank holds half the heads (and their rows of q_b_proj and kv_b_proj) and half of
    every expert's features, with the whole latent cache."""
    with LLM(str(folders["v3"]), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=32,
             kv_cache_memory=16 * 16 * latent_bytes_per_token()) as llm:
        assert engine_greedy(llm, prompts) == expected["v3"]
        assert_no_leaks(llm)


@pytest.mark.parametrize("family, modules", [
    ("v2", ["q_proj", "kv_a_proj_with_mqa", "o_proj"]),
    ("v3", ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]),
])
def test_lora_matches_peft(folders, tmp_path, family, modules):
    """An adapter on the latent attention's projections (the rotary rows of its B reordered as
    the weights' are) and, for V2, the dense and shared experts. down_proj gives PEFT's tokens;
    one on kv_b_proj, which is absorbed at load, is refused before any work."""
    adapter = build_lora_adapter(folders[family], tmp_path / "adapter", rank=4, alpha=8, seed=0,
                                 target_modules=modules)
    prompts = [p["prompt_token_ids"] for p in mixed_prompts(seed=6, count=4)]
    expected = peft_greedy(folders[family], adapter, prompts, 8)
    assert expected != peft_greedy(folders[family], None, prompts, 8)
    absorbed = build_lora_adapter(folders[family], tmp_path / "absorbed", rank=4, alpha=8, seed=1,
                                  target_modules=["kv_b_proj"])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(folders[family]), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               lora_request=LoRARequest("latent", 1, str(adapter)), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        with pytest.raises(ValueError, match="kv_b_proj"):
            llm.generate("a b", params, lora_request=LoRARequest("absorbed", 2, str(absorbed)), use_tqdm=False)


def test_registry_and_unsupported_options(folders, tmp_path):
    assert MODEL_REGISTRY["DeepseekV2ForCausalLM"] is DeepseekV2ForCausalLM
    assert MODEL_REGISTRY["DeepseekV3ForCausalLM"] is DeepseekV3ForCausalLM
    config = FAMILIES["v2"]()
    config.topk_method = "noaux_tc"
    with pytest.raises(ValueError, match="topk_method is 'noaux_tc'.*supported: greedy, group_limited_greedy"):
        DeepseekV2ForCausalLM(config, max_position=64)
    config = FAMILIES["v3"]()
    config.scoring_func = "softmax"
    with pytest.raises(ValueError, match="scoring_func is 'softmax'.*supported: sigmoid"):
        DeepseekV3ForCausalLM(config, max_position=64)
    folder = build_deepseek(tmp_path / "freq", "v2")
    config_file = folder / "config.json"
    config_file.write_text(config_file.read_text().replace('"first_k_dense_replace": 1',
                                                           '"first_k_dense_replace": 1, "moe_layer_freq": 2'))
    with pytest.raises(ValueError, match="moe_layer_freq is 2"):
        LLM(str(folder), dtype="float32")


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_backend_matches_transformers(folders, prompts, expected):
    """The Triton backend (its decode kernel over the latent cache, the fused MoE kernel with
    DeepSeek's weights), under Triton's interpreter where there is no GPU: three short
    prompts, the longest in two 12-token steps."""
    chosen = [1, 5, 7]  # 17, 2 and 9 tokens
    with LLM(str(folders["v3"]), dtype="float32", attention_backend="triton", max_num_batched_tokens=12) as llm:
        outputs = llm.generate([prompts[i] for i in chosen], SamplingParams(temperature=0, max_tokens=6),
                               use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [expected["v3"][i][:6] for i in chosen]


def latent_reference(q: torch.Tensor, cache: torch.Tensor, latent: int, scale: float) -> torch.Tensor:
    """Dense attention of q [heads, width] over keys `cache` [context, width], values their
    first `latent` values, in float64."""
    keys = cache.double()
    probs = ((q.double() @ keys.T) * scale).softmax(dim=-1)
    return probs @ keys[:, :latent]


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
@pytest.mark.parametrize("latent,rope,heads,cache_dtype", [(32, 8, 4, torch.float32), (64, 16, 20, torch.float32),
                                                          (32, 8, 4, torch.float8_e4m3fn)])
def test_latent_decode_kernel_matches_dense_attention(latent, rope, heads, cache_dtype):
    """`mla_decode_attention` over a paged latent cache (shuffled blocks of 16): contexts of 1
    key, 40, and 600 (two partitions), a padding row of none (zeros out); heads past a tile
    of 16; an fp8 cache with its scales, against dense attention over the values it stores."""
    from engine.kernels.triton.mla_decode import mla_decode_attention
    from engine.kernels.triton.paged_attention import decode_splits
    from tests.engine.test_triton_kernels import DEVICE

    torch.manual_seed(0)
    width, block, lengths = latent + rope, 16, [1, 40, 600, 0]
    blocks = [-(-n // block) for n in lengths]
    order = torch.randperm(sum(blocks) + 1)
    tables = torch.zeros(len(lengths), max(blocks), dtype=torch.int32)
    first = 0
    for row, count in enumerate(blocks):
        tables[row, :count] = order[first : first + count]
        first += count
    vectors = torch.randn((sum(blocks) + 1) * block, width)
    scales = torch.empty(0)
    if cache_dtype != torch.float32:
        stored, scales = quantize(vectors.unsqueeze(1), cache_dtype)
        vectors = dequantize(stored, scales, torch.float32)[:, 0]
        cache = stored.view(-1, block, 1, width)
        scales = scales.view(-1, block, 1).to(DEVICE)
    else:
        cache = vectors.view(-1, block, 1, width)
    q = torch.randn(len(lengths), heads, width)
    scale = 0.3
    out = mla_decode_attention(q.to(DEVICE), cache.to(DEVICE), torch.tensor(lengths, dtype=torch.int32).to(DEVICE),
                               tables.to(DEVICE), decode_splits(max(lengths)), scale, latent,
                               scales if scales.numel() else None).cpu()
    assert out.shape == (len(lengths), heads, latent)
    for row, n in enumerate(lengths):
        if n == 0:
            assert not out[row].any()
            continue
        positions = torch.arange(n)
        slots = tables[row, positions // block].long() * block + positions % block
        expected = latent_reference(q[row], vectors[slots], latent, scale)
        torch.testing.assert_close(out[row].double(), expected, atol=1e-4, rtol=1e-4)
