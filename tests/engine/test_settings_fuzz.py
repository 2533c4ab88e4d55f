"""Settings of any value and type, however hostile: `EngineConfig` (what `LLM(...)` and the
Dagster resource take), `SamplingParams` and `SpeculativeConfig` either accept them or raise a
`ValueError`/`TypeError` naming a setting that was given; nothing else escapes (a raw
`TypeError: unhashable type: 'list'` from `speculative_config={"method": ["ngram"]}` did)."""

import math
from dataclasses import fields

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.config import EngineConfig, SpeculativeConfig, engine_settings
from tests.fuzzing import examples

# Values of every JSON type and a few Python ones, of every size; plus each field's own kind of value.
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12), st.binary(max_size=8),
                    st.sampled_from([0, 1, -1, 0.5, "auto", "none", "cpu", "cuda", "float32", "bfloat16", "int8",
                                     "ngram", "[ngram]", "draft_model", "qwen3", "hermes", "LAST", "fcfs"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=6) | st.integers(), inner,
                                                                        max_size=3)),
                      max_leaves=8)
SPECULATIVE_KEYS = [f.name for f in fields(SpeculativeConfig)] + ["bogus"]
SPECULATIVE = st.dictionaries(st.sampled_from(SPECULATIVE_KEYS) | st.text(max_size=5), VALUES, max_size=6)
SETTINGS = [s.name for s in engine_settings() if s.name not in ("model", "tokenizer")]


def _names_a_given_setting(error: Exception, given: dict, prefix: str = "") -> bool:
    return any(f"{prefix}{name}" in str(error) for name in given)


@settings(max_examples=examples(300), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(st.dictionaries(st.sampled_from(SETTINGS), VALUES | SPECULATIVE, max_size=4))
def test_engine_settings_of_any_value_are_accepted_or_named(given):
    try:
        EngineConfig(**given)
    except (ValueError, TypeError) as error:
        assert str(error).startswith("Invalid engine settings: "), repr(error)
        assert _names_a_given_setting(error, given), (given, str(error))


@settings(max_examples=examples(300), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(SPECULATIVE)
def test_speculative_config_of_any_shape_is_accepted_or_named(given):
    try:
        EngineConfig(speculative_config=given)
    except (ValueError, TypeError) as error:
        assert "speculative_config" in str(error), (given, str(error))


SAMPLING = [f.name for f in fields(SamplingParams)] + ["best_of", "logits_processors"]


@settings(max_examples=examples(300), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(SAMPLING), VALUES, max_size=4))
def test_sampling_params_of_any_value_are_accepted_or_named(given):
    try:
        params = SamplingParams(**given)
    except (ValueError, TypeError) as error:
        assert _names_a_given_setting(error, given), (given, str(error))
        return
    assert params.n >= 1 and not math.isnan(params.temperature)


@pytest.mark.parametrize("given, named", [
    ({"speculative_config": {"method": ["ngram"]}}, "speculative_config['method']"),
    ({"gpu_memory_utilization": "0.9"}, "gpu_memory_utilization must be a number, got str"),
    ({"max_num_seqs": True}, "max_num_seqs must be an integer, got bool"),
    ({"limit_mm_per_prompt": {"image": "2"}}, "limit_mm_per_prompt"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
    ({"max_model_len": 1.5}, "max_model_len must be an integer or None"),
])
def test_the_reported_settings_are_named(given, named):
    with pytest.raises((ValueError, TypeError), match="Invalid engine settings: ") as raised:
        EngineConfig(**given)
    assert named in str(raised.value)


def test_a_folder_may_be_a_path_object(tmp_path):
    assert EngineConfig(model=tmp_path, tokenizer=tmp_path).model == str(tmp_path)
