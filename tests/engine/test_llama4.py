"""Llama 4 (text): greedy outputs equal transformers' `generate` in float32 on a tiny random
model whose four layers cover each kind (rotary and chunked with q/k L2 norms, or NoPE
with temperature tuning; dense or experts with a shared expert), with prompts longer than
the attention chunk; through chunked prefill and preemption, on two tensor-parallel ranks,
and on the Triton backend. The reference is checked to chunk its attention as we do."""

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding, apply_rotary_emb

from engine import LLM, LoRARequest, SamplingParams
from engine.kernels import triton as triton_kernels
from engine.layers.linear import ShardSlice
from engine.layers.rotary import RotaryEmbedding, RotaryPairs, RotaryPairsToHalves, rope_parameters
from engine.models import MODEL_REGISTRY, model_class_for
from engine.models.llama4 import Llama4ForCausalLM
from tests.engine.test_correctness import assert_no_leaks, mixed_prompts, reference_greedy
from tests.engine.test_tensor_parallel import GREEDY, MIXED_BATCH, engine_settings, token_ids
from tests.lora_adapters import build_lora_adapter, peft_greedy
from tests.tiny_models import build_tokenizer, save_random

CHUNK = 8
MAX_TOKENS = 16
HEAD_DIM = 16
# Layer 0: rotary, dense; 1: rotary, experts; 2: NoPE, dense; 3: NoPE, experts.
NO_ROPE_LAYERS = [1, 1, 0, 0]
# A 4-layer model's float32 keys and values: 2 KV heads of 16 features.
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * HEAD_DIM * 4


def tiny_config(**overrides: object) -> transformers.Llama4TextConfig:
    """Hidden 64, 4 heads (2 KV heads) of 16, 4 experts of 32 (top-1) on every second layer,
    dense layers of 96, chunks of 8, temperature tuning that changes every 4 positions, llama3
    rotary scaling that reaches the rotated frequencies."""
    settings = dict(
        vocab_size=320, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=NO_ROPE_LAYERS,
        attention_chunk_size=CHUNK, use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    return transformers.Llama4TextConfig(**{**settings, **overrides})


def build_llama4(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """The tiny random Llama 4 text model (`tiny_config`) saved in float32, with the tests' tokenizer."""
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(tiny_config(**overrides)).float()
    save_random(model, folder)
    build_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def llama4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama4(tmp_path_factory.mktemp("llama4"))


@pytest.fixture(scope="module")
def references(llama4: Path) -> tuple[list[dict], list[list[int]]]:
    prompts = mixed_prompts(seed=4, count=10)
    return prompts, reference_greedy(llama4, prompts, MAX_TOKENS)


def greedy(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


# -- the reference --------------------------------------------------------------------------


def chunked_masks(length: int, chunk: int | None) -> dict[str, torch.Tensor]:
    """Additive masks [1, 1, length, length] for transformers' two layer types, written out:
    causal for the global layers; causal within chunks of `chunk` for the local ones."""
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    causal = key <= query
    local = causal if chunk is None else causal & (key // chunk == query // chunk)
    return {name: torch.zeros(length, length).masked_fill(~seen, float("-inf"))[None, None]
            for name, seen in (("full_attention", causal), ("chunked_attention", local))}


def test_the_reference_attends_within_chunks(llama4):
    """transformers chunks its local layers through the masks it builds: its logits over a
    40-token prompt equal those with chunked masks written out, and differ from those with
    plain causal masks (so the chunks matter to these prompts)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(llama4, dtype=torch.float32, attn_implementation="eager")
    ids = torch.tensor([mixed_prompts(seed=4)[0]["prompt_token_ids"]])
    assert ids.shape[1] > 4 * CHUNK
    with torch.no_grad():
        own = model(ids).logits
        chunked = model(ids, attention_mask=chunked_masks(ids.shape[1], CHUNK)).logits
        causal = model(ids, attention_mask=chunked_masks(ids.shape[1], None)).logits
    torch.testing.assert_close(own, chunked, atol=1e-5, rtol=1e-5)
    assert (own - causal)[0, CHUNK:].abs().max() > 1e-2
    torch.testing.assert_close(own[0, :CHUNK], causal[0, :CHUNK], atol=1e-5, rtol=1e-5)


# -- greedy tokens ----------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [
    {},
    {"max_num_batched_tokens": 16},
    {"kv_cache_memory": 8 * 16 * KV_BYTES_PER_TOKEN, "max_num_batched_tokens": 64},
], ids=["default", "chunked_prefill", "preemption"])
def test_greedy_matches_transformers(llama4, references, settings):
    prompts, expected = references
    with LLM(str(llama4), dtype="float32", **settings) as llm:
        assert greedy(llm, prompts) == expected
        assert_no_leaks(llm)
        engine = llm.llm_engine
        if "kv_cache_memory" in settings:
            assert engine.scheduler.num_preemptions > 0
        if "max_num_batched_tokens" in settings and "kv_cache_memory" not in settings:
            assert engine.stats.num_steps > sum(len(p["prompt_token_ids"]) for p in prompts) // 16


def test_generate_agrees_with_written_out_chunks(llama4, references):
    """The reference tokens (transformers' `generate`: SDPA, its chunked layers' keys in a
    sliding cache) are the argmax of one eager forward per prompt over prompt and output,
    with chunked masks written out (`chunked_masks`)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(llama4, dtype=torch.float32, attn_implementation="eager")
    prompts, expected = references
    assert sum(len(p["prompt_token_ids"]) + len(out) > 2 * CHUNK for p, out in zip(prompts, expected)) >= 8
    with torch.no_grad():
        for i, (prompt, out) in enumerate(zip(prompts, expected)):
            ids = prompt["prompt_token_ids"] + out[:-1]
            logits = model(torch.tensor([ids]), attention_mask=chunked_masks(len(ids), CHUNK)).logits
            assert logits[0, len(prompt["prompt_token_ids"]) - 1:].argmax(-1).tolist() == out, f"prompt {i}"


def test_two_ranks_give_one_ranks_tokens(llama4):
    """Tensor parallelism over gloo (each rank half the heads, half of every expert's and
    the shared and dense MLPs' features) through chunks, prefix hits and preemption."""
    with LLM(str(llama4), **engine_settings(llama4, 1)) as tp1:
        one = tp1.generate(MIXED_BATCH, GREEDY, use_tqdm=False)
    with LLM(str(llama4), **engine_settings(llama4, 2)) as tp2:
        two = tp2.generate(MIXED_BATCH, GREEDY, use_tqdm=False)
        assert tp2.llm_engine.scheduler.num_preemptions > 0
    assert token_ids(two) == token_ids(one)
    assert any(o.num_cached_tokens > 0 for o in two)


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_backend_matches_transformers(llama4, references):
    """The Triton backend (the chunked attention and fused MoE kernels with the weight on
    the experts' input), under Triton's interpreter where there is no GPU, with chunked
    prefill and preemption; few short prompts (the interpreter is slow)."""
    prompts, expected = references
    chosen = [i for i, p in enumerate(prompts) if 2 * CHUNK < len(p["prompt_token_ids"]) <= 50][:2]
    with LLM(str(llama4), dtype="float32", attention_backend="triton", kv_cache_memory=5 * 16 * KV_BYTES_PER_TOKEN,
             max_num_batched_tokens=16) as llm:
        outputs = llm.generate([prompts[i] for i in chosen], SamplingParams(temperature=0, max_tokens=8),
                               use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [expected[i][:8] for i in chosen]
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert_no_leaks(llm)


# -- loading ------------------------------------------------------------------------------------


def test_registered():
    assert MODEL_REGISTRY["Llama4ForCausalLM"] is Llama4ForCausalLM
    assert model_class_for(["Llama4ForCausalLM"], None) is Llama4ForCausalLM


@dataclass(frozen=True)
class InMemory:
    """A checkpoint tensor already in memory."""

    tensor: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        return self.tensor if piece is None else piece.of(self.tensor)


def as_loaded(x: torch.Tensor) -> torch.Tensor:
    """Queries [tokens, heads, head_dim] with each head's features in the order
    `RotaryPairsToHalves` gives the q_proj rows that compute them."""
    rows = InMemory(x.flatten(1).T)  # [heads * head_dim, tokens]: the projection's output features first
    pairs = RotaryPairs(x.shape[-1], 0, x.shape[-1])
    return RotaryPairsToHalves(rows, pairs).read().T.reshape(x.shape)


def test_pairs_to_halves_makes_our_rotary_transformers():
    """Our half-split rotation of the reordered features is transformers' interleaved rotation
    (`apply_rotary_emb`, llama3-scaled frequencies) of the original ones, reordered."""
    config = tiny_config()
    torch.manual_seed(0)
    x = torch.randn(1, 200, 3, HEAD_DIM)
    positions = torch.arange(200)
    expected, _ = apply_rotary_emb(x, x, Llama4TextRotaryEmbedding(config)(x, positions[None]))
    ours = RotaryEmbedding(HEAD_DIM, 256, rope_parameters(config))(positions, as_loaded(x[0]))
    torch.testing.assert_close(ours, as_loaded(expected[0]), atol=1e-6, rtol=1e-6)


# A vision model as small as transformers' Llama 4 builds: what the engine skips.
TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=28,
                   patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
                   pixel_shuffle_ratio=0.5)


def test_vision_language_checkpoint_runs_its_language_model(tmp_path):
    """A `Llama4ForConditionalGeneration` checkpoint (language_model.* beside vision_model.*
    and multi_modal_projector.*) runs its language model on text prompts, with the tokens of
    transformers' language model of it (transformers 5.24's whole model fails on text alone:
    its output reads `image_outputs` from the language model's, which has none)."""
    torch.manual_seed(1)
    config = transformers.Llama4Config(text_config=tiny_config().to_dict(), vision_config=TINY_VISION)
    model = transformers.Llama4ForConditionalGeneration(config).float()
    save_random(model, tmp_path)
    build_tokenizer(tmp_path)
    prompts = mixed_prompts(seed=5, count=4)
    model = transformers.Llama4ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt["prompt_token_ids"]])
            out = model.language_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                                do_sample=False, pad_token_id=0)
            expected.append(out[0, ids.shape[1]:].tolist())
    with LLM(str(tmp_path), dtype="float32") as llm:
        assert type(llm.llm_engine.model_runner.model) is Llama4ForCausalLM
        params = SamplingParams(temperature=0, max_tokens=8)
        assert [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == expected


def test_lora_targets_reorder_the_rotary_layers_q_and_k(tmp_path):
    """LoRA goes on the attention projections and the dense MLPs, by the checkpoint's names,
    not on the experts' layers; on the rotary layers an adapter's B for q_proj and k_proj is
    reordered as their rows are. An adapter on q/k/v/o and the dense MLPs gives PEFT's tokens."""
    with torch.device("meta"):
        model = Llama4ForCausalLM(tiny_config(), max_position=64)
    targets = model.lora_targets()
    assert {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.3.self_attn.o_proj",
            "model.layers.2.feed_forward.gate_proj", "model.layers.2.feed_forward.down_proj"} <= set(targets)
    assert not [t for t in targets if ".layers.1.feed_forward" in t]
    assert targets["model.layers.2.feed_forward.up_proj"].shard == 1
    rotary = [model.layer_kinds[i].rotary for i in range(len(model.layer_kinds))]
    assert True in rotary and False in rotary
    for index, turned in enumerate(rotary):
        for leaf in ("q_proj", "k_proj", "v_proj"):
            order = targets[f"model.layers.{index}.self_attn.{leaf}"].row_order
            assert (order is not None) == (turned and leaf != "v_proj")

    base = build_llama4(tmp_path / "base")
    adapter = build_lora_adapter(base, tmp_path / "adapter", rank=4, alpha=8, seed=0,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    prompts = [p["prompt_token_ids"] for p in mixed_prompts(seed=6, count=4)]
    expected = peft_greedy(base, adapter, prompts, 8)
    assert expected != peft_greedy(base, None, prompts, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               lora_request=LoRARequest("qkvo", 1, str(adapter)), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected


@pytest.mark.parametrize("overrides, option", [
    ({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
    ({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
])
def test_unsupported_options_fail_naming_them(overrides, option):
    with torch.device("meta"), pytest.raises(ValueError, match=option):
        Llama4ForCausalLM(tiny_config(**overrides), max_position=64)
