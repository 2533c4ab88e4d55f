"""Greedy outputs must equal transformers' `generate` token for token (float32, CPU).

Each family's tiny random model runs a batch of 16 prompts of mixed lengths through the
engine as configured normally, with chunked prefill forced (tiny step budget), with
preemption forced (a KV cache of a few blocks), and with prefix caching hitting.
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import FAMILIES, build_tiny_model
from engine import LLM, SamplingParams

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


# (name, LLM settings). A tiny model's KV cache takes 1 KiB per token in float32.
CONFIGS = [
    ("default", {}),
    ("chunked_prefill", {"max_num_batched_tokens": 7}),
    ("preemption", {"kv_cache_memory": 10 * 16 * 1024, "max_num_batched_tokens": 64}),
    ("small_blocks_no_prefix_cache", {"block_size": 4, "enable_prefix_caching": False, "max_num_seqs": 5}),
]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name,settings", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_greedy_matches_transformers(tiny_models, references, family, name, settings):
    prompts, expected = references
    with LLM(str(tiny_models[family]), dtype="float32", **settings) as llm:
        assert engine_greedy(llm, prompts) == expected[family]
        assert_no_leaks(llm)
        engine = llm.llm_engine
        if name == "preemption":
            assert engine.scheduler.num_preemptions > 0
        if name == "chunked_prefill":
            assert engine.stats.num_steps > sum(len(p["prompt_token_ids"]) for p in prompts) // 7


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
