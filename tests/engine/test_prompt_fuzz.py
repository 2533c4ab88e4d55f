"""Prompts of any shape, however hostile, at the engine's own boundary: `LLM.validate` (what the
Dagster side and run_batch check rows with) and `LLM.validate_pooling` return one line per bad
prompt and raise nothing; `generate` and `embed` on the prompts found fine answer every one."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from tests.fuzzing import examples

VOCAB = 320  # tests/tiny_models' tokenizer
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**66), max_value=2**66),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=8),
                    st.just(""), st.just("\ud800x"))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                            max_size=3), max_leaves=6)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, VOCAB - 1), st.integers(-5, 2**40), SCALARS), max_size=8)
PROMPT = st.one_of(
    st.text(max_size=40), SCALARS, st.lists(st.integers(0, VOCAB - 1), max_size=5), JSON,
    st.fixed_dictionaries({}, optional={"prompt": JSON | st.text(max_size=30), "prompt_token_ids": TOKEN_IDS,
                                        "multi_modal_data": JSON, "mm_processor_kwargs": JSON, "cache_salt": JSON}),
)
HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large]
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", kv_cache_memory=1 << 20, max_num_seqs=8, max_model_len=64)


@pytest.fixture(scope="module")
def pooling(make_llm):
    return make_llm(dtype="float32", kv_cache_memory=1 << 20, max_model_len=64, runner="pooling")


@settings(max_examples=examples(200), deadline=None, derandomize=True, suppress_health_check=HEALTH)
@given(prompts=st.lists(PROMPT, min_size=1, max_size=5))
def test_any_prompt_is_checked_and_the_good_ones_generate(llm, prompts):
    problems = llm.validate(prompts, GREEDY)
    assert len(problems) == len(prompts)
    good = [prompt for prompt, problem in zip(prompts, problems) if problem is None]
    for problem in problems:
        assert problem is None or (isinstance(problem, str) and ": " in problem), problem
    outputs = llm.generate(good, GREEDY, use_tqdm=False) if good else []
    assert len(outputs) == len(good)
    for output in outputs:  # two tokens, or as many as max_model_len leaves
        assert 1 <= len(output.outputs[0].token_ids) <= 2 and output.outputs[0].finish_reason == "length"


@settings(max_examples=examples(100), deadline=None, derandomize=True, suppress_health_check=HEALTH)
@given(prompts=st.lists(PROMPT, min_size=1, max_size=5))
def test_any_prompt_to_embed_is_checked_and_the_good_ones_embed(pooling, prompts):
    problems = pooling.validate_pooling(prompts)
    assert len(problems) == len(prompts)
    good = [prompt for prompt, problem in zip(prompts, problems) if problem is None]
    outputs = pooling.embed(good, use_tqdm=False) if good else []
    assert len(outputs) == len(good) and all(o.outputs.embedding for o in outputs)
