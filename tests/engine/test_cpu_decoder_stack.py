"""The compiled decoder stack (`engine.model_loader.cpu_decoder_stack`): a Llama-style model's
layers in one call on a CPU give the tokens and log-probabilities of the layers run one by one,
bit for bit, and the model runs its layers itself wherever the stack does not fit."""

import pytest
import torch

from engine import SamplingParams
from engine.kernels import cpu_build
from engine.model_loader import cpu_decoder_stack

pytestmark = pytest.mark.skipif(cpu_build.load() is None, reason="the CPU kernels do not build here")

# Prompts of several lengths (a prefill chunk of several sequences, and single rows) and one
# sharing another's first 24 tokens (a prefix-cache hit).
PROMPTS = [list(range(3, 40)), list(range(50, 55)), [7], list(range(3, 27)) + [90, 91, 92]]


def language_model(llm):
    """The LLM's `LlamaModel` (its layers and final norm)."""
    return llm.llm_engine.model_runner.workers.local.model.model


def generate(llm) -> list[tuple]:
    """Greedy tokens and their top log-probabilities, exactly as floats, for PROMPTS."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [(tuple(o.outputs[0].token_ids),
             [sorted((token, entry.logprob) for token, entry in step.items()) for step in o.outputs[0].logprobs])
            for o in outputs]


def fused_and_alone(llm) -> tuple[list, list, cpu_decoder_stack.DecoderPlan]:
    """The outputs with the stack, its plan, and the outputs with the layers run one by one."""
    model = language_model(llm)
    fused = generate(llm)
    plan = cpu_decoder_stack._plans[model]
    llm.reset_prefix_cache()
    routed, model.fused = model.fused, None
    try:
        alone = generate(llm)
    finally:
        model.fused = routed
    return fused, alone, plan


@pytest.mark.parametrize(("family", "settings"), [
    ("llama", {}),
    ("llama", {"quantization": "int8"}),
    ("llama", {"kv_cache_dtype": "int8"}),
    ("llama", {"kv_cache_dtype": "bfloat16", "max_num_batched_tokens": 16}),  # prompts in chunks
    ("llama3", {}),  # scaled rotary tables
    ("qwen2", {}),  # biases on q, k and v
    ("mistral", {}),  # a sliding window
])
def test_the_same_bits_as_the_layers_one_by_one(make_llm, family, settings):
    llm = make_llm(family, dtype="float32", max_model_len=128, **settings)
    fused, alone, plan = fused_and_alone(llm)
    assert plan.stack is not None, plan.reason
    assert fused == alone


def test_models_it_does_not_fit_run_their_layers(make_llm):
    llm = make_llm("qwen3", dtype="float32", max_model_len=128)
    fused, alone, plan = fused_and_alone(llm)
    assert plan.stack is None and "query and key norms" in plan.reason
    assert fused == alone


def test_while_a_module_has_a_hook_the_layers_run_one_by_one(make_llm):
    llm = make_llm("llama", dtype="float32", max_model_len=128)
    model = language_model(llm)
    first = generate(llm)
    assert cpu_decoder_stack._plans[model].stack is not None
    seen = []
    handle = model.layers[1].mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    try:
        llm.reset_prefix_cache()
        assert generate(llm) == first
    finally:
        handle.remove()
    assert len(seen) >= 6  # the prompts' steps, then five decode steps
    seen.clear()
    generate(llm)
    assert not seen


def test_a_new_cache_or_an_adapter_is_seen_before_the_next_step(make_llm):
    llm = make_llm("llama", dtype="float32", max_model_len=128)
    model = language_model(llm)
    generate(llm)
    plan = cpu_decoder_stack._plans[model]
    assert plan.stack is not None, plan.reason
    assert plan.current(model)
    attention = model.layers[0].self_attn
    cache = attention.attn.k_cache
    attention.attn.k_cache = cache.clone()  # what `KVCache.allocate` does to every layer
    try:
        assert not plan.current(model)
    finally:
        attention.attn.k_cache = cache
    attention.qkv_proj.lora = object()  # what enabling LoRA sets on every projection
    try:
        assert not plan.current(model)
        assert "adapters" in cpu_decoder_stack._unfit(model)
    finally:
        attention.qkv_proj.lora = None
    assert cpu_decoder_stack._unfit(model) == ""


def test_the_kernels_missing_leave_the_layers_alone(make_llm, monkeypatch):
    llm = make_llm("llama", dtype="float32", max_model_len=128)
    model = language_model(llm)
    monkeypatch.setattr(cpu_build, "load", lambda: None)
    assert cpu_decoder_stack._unfit(model) == "the CPU kernels are not built"
