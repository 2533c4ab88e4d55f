"""Greedy outputs must equal transformers' `generate` token for token (float32, CPU).

Each family's tiny random model runs a batch of 16 prompts of mixed lengths through the
engine as configured normally (the compiled CPU attention kernel where it builds), with
chunked prefill forced (tiny step budget), with preemption forced (a KV cache of a few
blocks), with prefix caching hitting, and on the PyTorch attention backend with all three.
Most prompts are longer than the sliding window of the families that have one (16).
"""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import FAMILIES, build_tiny_model
from engine import LLM, SamplingParams
from engine.kernels import triton as triton_kernels

MAX_TOKENS = 24


def mixed_prompts(seed: int = 0, count: int = 16) -> list[dict]:
    """Token-id prompts of 1 to 90 tokens; a third share a 40-token prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 320) for _ in range(40)]
    prompts = []
    for i in range(count):
        length = rng.choice([1, 2, 5, 9, 17, 33, 64, 90])
        ids = [rng.randrange(3, 320) for _ in range(length)]
        if i % 3 == 0:
            ids = shared + ids[:20]
        prompts.append({"prompt_token_ids": ids})
    return prompts


def reference_greedy(folder, prompts, max_tokens=MAX_TOKENS) -> list[list[int]]:
    """transformers' greedy generate, one prompt at a time (no padding effects)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    outputs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p["prompt_token_ids"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def check_transformers_greedy(folder, prompts, outputs, max_tokens=MAX_TOKENS) -> None:
    """`outputs` are what `reference_greedy` returns, checked with one forward pass of
    transformers' model per prompt (over prompt and output) instead of `generate`'s one per
    token: each output token is the argmax of transformers' float32 logits at its position,
    which is the token `generate` appends there, so by induction `generate` writes the same
    tokens; and an output ends before max_tokens only on, and right after, an end-of-sequence
    token, where `generate` stops. (On the embedded model this takes seconds, `generate` half
    a minute; checked to agree with `generate` on the 16 chat prompts below.)"""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    with torch.no_grad():
        for i, (p, out) in enumerate(zip(prompts, outputs)):
            ids = p["prompt_token_ids"]
            assert 0 < len(out) <= max_tokens, f"prompt {i}: {len(out)} tokens"
            assert not eos & set(out[:-1]), f"prompt {i}: goes on after an end-of-sequence token"
            assert len(out) == max_tokens or out[-1] in eos, f"prompt {i}: stops early without end-of-sequence"
            logits = model(torch.tensor([ids + out[:-1]])).logits[0, len(ids) - 1:]
            greedy = logits.argmax(-1).tolist()
            assert greedy == out, f"prompt {i}: transformers' greedy token differs at output position " \
                                  f"{next(k for k, (a, b) in enumerate(zip(greedy, out)) if a != b)}"


def engine_greedy(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def references(tiny_models):
    prompts = mixed_prompts()
    return prompts, {f: reference_greedy(tiny_models[f], prompts) for f in FAMILIES}


# (name, LLM settings). The tiny models' KV cache takes 512 bytes (Llama) to 1 KiB per token in float32.
CONFIGS = [
    ("default", {}),
    ("chunked_prefill", {"max_num_batched_tokens": 7}),
    ("preemption", {"kv_cache_memory": 10 * 16 * 1024, "max_num_batched_tokens": 64}),
    ("small_blocks_no_prefix_cache", {"block_size": 4, "enable_prefix_caching": False, "max_num_seqs": 5}),
    ("torch_backend", {"attention_backend": "torch", "kv_cache_memory": 10 * 16 * 1024, "max_num_batched_tokens": 16}),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name,settings", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_greedy_matches_transformers(tiny_models, references, family, name, settings):
    prompts, expected = references
    with LLM(str(tiny_models[family]), dtype="float32", **settings) as llm:
        assert engine_greedy(llm, prompts) == expected[family]
        assert_no_leaks(llm)
        engine = llm.llm_engine
        if name in ("preemption", "torch_backend"):
            assert engine.scheduler.num_preemptions > 0
        if name == "chunked_prefill":
            assert engine.stats.num_steps > sum(len(p["prompt_token_ids"]) for p in prompts) // 7


# One family for each set of Triton launches: Llama (also what Qwen2, Llama 3 and Mistral
# load as: the same kernels on the same layouts; their biases, rotary tables and windows are
# PyTorch's or the attention kernel's arguments, which Gemma covers), Qwen3 (RMSNorm on each
# head, head_dim 32), Gemma 2 (soft-capping, alternating windows, GeGLU), Gemma 3 (two rotary
# tables), Phi-3 (partial rotation), Mixtral (the fused MoE kernel, renormalised top-k) and
# Qwen2-MoE (the fused MoE kernel without renormalising, a shared expert). Every family runs
# on the default backend above (which is the Triton backend on a GPU).
TRITON_FAMILIES = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe")


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
@pytest.mark.parametrize("family", TRITON_FAMILIES)
def test_triton_backend_matches_transformers(tiny_models, references, family):
    """The Triton backend (and its fused kernels) end to end, under Triton's interpreter
    where there is no GPU: chunked prefill (16-token steps), prefix-cache hits (three
    prompts share 40 tokens) and preemption (an 8-block cache; two sequences are preempted
    after some of their tokens were generated, and recomputed). Fewer prompts and tokens
    than above, and short ones: the interpreter takes about 0.1 s for every token computed.
    Contexts longer than one key tile (64) are checked in test_triton_kernels.py and
    test_attention_backends.py."""
    prompts, expected = references
    chosen = [0, 5, 6, 9, 7, 8, 10]  # 41, 17, 45, 45, 2, 1 and 5 tokens; 0, 6 and 9 share 40
    params = SamplingParams(temperature=0, max_tokens=8)
    config = json.loads((tiny_models[family] / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    with LLM(str(tiny_models[family]), dtype="float32", attention_backend="triton",
             kv_cache_memory=8 * 16 * token_bytes, max_num_batched_tokens=16) as llm:
        outputs = llm.generate([prompts[i] for i in chosen], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [expected[family][i][:8] for i in chosen]
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert sum(o.num_cached_tokens for o in outputs) > 0
        assert_no_leaks(llm)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_prefix_cache_hits_give_the_same_tokens(tiny_models, references, family):
    prompts, expected = references
    with LLM(str(tiny_models[family]), dtype="float32", block_size=8) as llm:
        first = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        second = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first] == expected[family]
        assert [o.outputs[0].token_ids for o in second] == expected[family]
        hits = [o.num_cached_tokens for o in second]
        for prompt, cached in zip(prompts, hits):
            length = len(prompt["prompt_token_ids"])
            assert cached == (length - 1) // 8 * 8  # every full block but the one with the last token
        assert_no_leaks(llm)


def test_untied_embeddings_and_text_prompts(tmp_path):


    folder = build_tiny_model(tmp_path / "untied", "llama", seed=3, tie=False)
    texts = ["Paris is the capital", "The quick brown fox", "A paged KV cache stores keys"]
    with LLM(str(folder), dtype="float32") as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tokenizer(t).input_ids} for t in texts]
        outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference_greedy(folder, prompts)
        assert [o.prompt for o in outs] == texts


@pytest.mark.cpu_kinds
def test_bfloat16_projections_match_float32(tiny_models):
    """The bfloat16 CPU path computes what float32 computes: through oneDNN's prepacked
    weights where oneDNN runs bfloat16 (AVX-512), the plain product elsewhere (on the CPU also
    where there is a GPU)."""
    from engine.hardware import detect_cpu
    from engine.layers.linear import Linear

    prompts = mixed_prompts(seed=1, count=16)
    with LLM(str(tiny_models["qwen2"]), dtype="bfloat16", device="cpu") as llm:
        linears = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, Linear)]
        assert linears and all((m.packed_weight is not None) == detect_cpu().onednn_bf16 for m in linears)
        layer = linears[0]
        x = torch.randn(5, layer.in_features, dtype=torch.bfloat16)
        weight = layer.weight
        if layer.packed_weight is not None:
            weight = torch.ops.mkldnn._linear_pointwise(torch.eye(layer.in_features, dtype=torch.bfloat16),
                                                        layer.packed_weight, None, "none", [], "").t()
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, layer.bias))
        low = engine_greedy(llm, prompts)
    with LLM(str(tiny_models["qwen2"]), dtype="float32", device="cpu") as llm:
        high = engine_greedy(llm, prompts)
    # A random tiny model's logits are flat, so bfloat16 rounding flips a few first tokens
    # (14 of 16 agree, measured); a broken path would agree by chance (1 in 320).
    assert sum(a[0] == b[0] for a, b in zip(low, high)) >= 12


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about autumn leaves falling on a quiet river at dusk.",
    "Explain in detail how a paged KV cache reduces memory fragmentation in LLM serving systems, "
    "and why continuous batching improves throughput compared with static batching.",
    "List three primary colors.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 17 times 23?",
]


@pytest.mark.cpu_kinds
@pytest.mark.long("the embedded SmolLM2 (135M parameters) in four engine set-ups, 16 chat prompts each, against transformers; 34 s as an AVX2 CPU")
def test_embedded_model_matches_transformers():
    """The real SmolLM2 weights, 16 chat prompts of mixed lengths, in four engine set-ups.
    transformers' greedy tokens are checked by `check_transformers_greedy` (one forward pass
    per prompt; `generate` token by token took half a minute of this test)."""
    from engine.model_loader.folder import resolve_model_path

    path = resolve_model_path(None)
    with LLM(dtype="float32", max_model_len=512) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = []
        for i in range(16):
            messages = [{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] + " " * (i // 8)}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            prompts.append({"prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids})
        expected = engine_greedy(llm, prompts)
        check_transformers_greedy(path, prompts, expected)
        # Second pass over the same prompts: prefix-cache hits.
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert all(o.num_cached_tokens > 0 for o in outs)
        assert_no_leaks(llm)
    with LLM(dtype="bfloat16", max_model_len=512) as llm:
        # Only the first token is compared, so four are enough (a prefill and decode steps;
        # the emulated bfloat16 of a CPU without native bfloat16 is slow).
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        low = [o.outputs[0].token_ids for o in outs]
        # bfloat16 drifts from float32 within a few tokens on some prompts, as transformers'
        # own bfloat16 does (measured: its first divergences at tokens 1, 1, 2, 3); the
        # first token agrees on 15 of 16 here, and a broken path would agree on none.
        assert sum(a[0] == b[0] for a, b in zip(low, expected)) >= 14
    per_block = 16 * llm_kv_bytes_per_token_fp32()
    # The small cache (16 blocks: every prompt and completion fits, not all 16 at once) preempts.
    for settings in ({"max_num_batched_tokens": 48},
                     {"kv_cache_memory": 16 * per_block, "enable_prefix_caching": False}):
        with LLM(dtype="float32", max_model_len=512, **settings) as llm:
            assert engine_greedy(llm, prompts) == expected
            if "kv_cache_memory" in settings:
                assert llm.llm_engine.scheduler.num_preemptions > 0
            assert_no_leaks(llm)


def llm_kv_bytes_per_token_fp32() -> int:
    """SmolLM2-135M: 30 layers x (K and V) x 3 KV heads x 64 dims x 4 bytes."""
    return 30 * 2 * 3 * 64 * 4


def test_longrope_short_and_long_factors_match_transformers(tmp_path):
    """Phi-3's LongRoPE (with Phi-4-mini's partial rotation): an engine whose context stays
    within the pretraining length uses the short factors, one that reaches past it the long
    ones, for every position; transformers picks by the sequence's length, so each is
    checked on prompts that stay on its side (short ones, and ones already past 32 tokens)."""
    rotary_pairs = 16 * 3 // 4 // 2
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 32, "short_factor": [1.0 + i / 10 for i in range(rotary_pairs)],
            "long_factor": [2.0 + i for i in range(rotary_pairs)]}
    folder = build_tiny_model(tmp_path / "phi3_longrope", "phi3", max_position_embeddings=128, rope_parameters=rope,
                              original_max_position_embeddings=32)
    rng = random.Random(5)
    short = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in (3, 11, 20)]
    long = [{"prompt_token_ids": [rng.randrange(3, 320) for _ in range(n)]} for n in (33, 47, 70)]
    params = SamplingParams(temperature=0, max_tokens=8)
    for max_model_len, prompts in ((32, short), (128, long)):
        with LLM(str(folder), dtype="float32", max_model_len=max_model_len) as llm:
            outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert outputs == reference_greedy(folder, prompts, max_tokens=8), f"max_model_len={max_model_len}"


def test_the_language_model_of_a_gemma3_vision_checkpoint(tmp_path):
    """Gemma 3's vision-language checkpoints (4B and up): the engine runs their language model
    for text prompts, skipping the vision tower's weights, with transformers' greedy tokens."""
    import transformers

    text = json.loads((build_tiny_model(tmp_path / "text", "gemma3") / "config.json").read_text())
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                                       image_token_index=5, boi_token_index=6, eoi_token_index=7)
    torch.manual_seed(1)
    model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.15)
    folder = tmp_path / "vision"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tmp_path / "text" / name).read_bytes())
    prompts = mixed_prompts(seed=2, count=4)
    expected = reference_greedy(folder, prompts, max_tokens=8)
    with LLM(str(folder), dtype="float32") as llm:
        assert llm.llm_engine.model_config.hf_config.architectures == ["Gemma3ForCausalLM"]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
