"""Where vLLM's offline API has a documented or tested behaviour, ours has the same one.

Written from vLLM 0.33's `SamplingParams` and its tests (tests/v1/sample/
test_sampling_params*.py, tests/test_sampling_params.py); the deliberate differences
are in docs/engine.md's "Differences from vLLM", and tested here as differences.
"""

import json
import logging
import math
import shutil
from dataclasses import fields

import pytest

from engine import LLM, ModelLoadError, SamplingParams
from engine.exceptions import ParameterTypeError, VLLMValidationError

PROMPT = "Paris is the capital of"


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", max_model_len=96, kv_cache_memory=64 * 16 * 1024)


def completion(llm: LLM, params: SamplingParams, prompt: object = PROMPT, **kwargs):
    [out] = llm.generate(prompt, params, use_tqdm=False, **kwargs)
    return out.outputs[0]


# --- SamplingParams on its own -------------------------------------------------------

@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.inf), ("temperature", -math.inf), ("temperature", math.nan),
    ("repetition_penalty", math.inf), ("repetition_penalty", math.nan),
    ("top_p", math.nan), ("min_p", math.inf), ("presence_penalty", math.inf), ("frequency_penalty", math.nan),
])
def test_non_finite_sampling_values_are_refused(field, value):
    """vLLM refuses every non-finite sampling value (GHSA-7h4p-rffg-7823)."""
    with pytest.raises(ValueError, match=rf"{field} must be .*got {value}") as err:
        SamplingParams(**{field: value})
    assert err.value.parameter == field and not isinstance(err.value, TypeError)


@pytest.mark.parametrize("bias", [math.inf, -math.inf, math.nan])
def test_a_non_finite_logit_bias_is_refused(bias):
    """A difference: vLLM's constructor lets it through; here it would turn a row's logits into NaN."""
    with pytest.raises(ValueError, match="logit_bias must be None or a mapping of token id to a finite number"):
        SamplingParams(logit_bias={5: bias})


def test_temperature_is_between_0_and_2():
    assert SamplingParams(temperature=2.0).temperature == 2.0
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        SamplingParams(temperature=2.01)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)


def test_a_tiny_temperature_is_raised_to_a_hundredth(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.sampling_params"):
        assert SamplingParams(temperature=1e-4).temperature == 0.01
    assert "temperature 0.0001 is below 0.01" in caplog.text
    assert SamplingParams(temperature=0.01).temperature == 0.01


def test_greedy_turns_the_truncations_off_and_takes_one_completion():
    params = SamplingParams(temperature=0, top_p=0.5, top_k=5, min_p=0.2)
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    with pytest.raises(ValueError, match="n must be 1 when temperature is 0"):
        SamplingParams(n=2, temperature=0)
    assert SamplingParams(n=2, temperature=1.0, top_k=1).n == 2  # greedy by top_k is sampling to vLLM


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(stop=123), "stop"), (dict(stop=[1]), "stop"), (dict(stop_token_ids="not_a_list"), "stop_token_ids"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"), (dict(bad_words={"bad": "word"}), "bad_words"),
    (dict(n="2"), "n"), (dict(n=2.0), "n"), (dict(top_k=2.0), "top_k"), (dict(temperature="0.5"), "temperature"),
    (dict(seed=2.5), "seed"), (dict(ignore_eos="yes"), "ignore_eos"), (dict(extra_args=[1]), "extra_args"),
    (dict(logprobs=1.0), "logprobs"), (dict(max_tokens=5.0), "max_tokens"),
])
def test_a_wrong_type_is_a_type_error_that_names_the_field(kwargs, field):
    """vLLM raises TypeError for some of these and its validation error for others; ours
    is both a TypeError and a ValueError, and always names the field."""
    with pytest.raises(TypeError, match=rf"{field} must be") as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, ValueError) and isinstance(err.value, ParameterTypeError)
    assert err.value.parameter == field


def test_a_bad_value_is_a_value_error_with_the_field_and_value():
    with pytest.raises(VLLMValidationError) as err:
        SamplingParams(top_p=1.5)
    assert (err.value.parameter, err.value.value) == ("top_p", 1.5)
    assert not isinstance(err.value, TypeError)


def test_vllms_conversions():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop_token_ids=[7, 3, 7, 1, 3]).stop_token_ids == [7, 3, 1]
    assert SamplingParams(bad_words=["a", "b", "a"]).bad_words == ["a", "b"]
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    with pytest.raises(ValueError, match="logprobs must be None, -1"):
        SamplingParams(logprobs=-2)
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(("kwargs", "words"), [
    (dict(n=2, best_of=3), "sample n completions with logprobs=0 and keep the one with the highest cumulative_logprob"),
    (dict(logits_processors=[lambda ids, logits: logits]), "use logit_bias, allowed_token_ids, bad_words"),
])
def test_fields_vllm_refuses_are_refused_with_the_way_out(kwargs, words):
    """vLLM's V1 engine refused these with a ValueError, and 0.33 dropped them (a TypeError)."""
    with pytest.raises(ValueError, match=words) as err:
        SamplingParams(**kwargs)
    assert isinstance(err.value, TypeError)
    assert SamplingParams(logits_processors=[]) == SamplingParams()


def test_from_optional_takes_none_as_unset():
    assert SamplingParams.from_optional() == SamplingParams()
    public = [f.name for f in fields(SamplingParams)]
    explicit_none = SamplingParams.from_optional(**dict.fromkeys(public))
    for f in fields(SamplingParams):
        value = getattr(explicit_none, f.name)
        if f.name in ("seed", "max_tokens", "logprobs", "prompt_logprobs", "logit_bias", "allowed_token_ids",
                      "structured_outputs", "extra_args"):
            assert value is None, f.name
        else:
            assert value == getattr(SamplingParams(), f.name), f.name
    biased = SamplingParams.from_optional(logit_bias={"5": 250, 6: -300.0, "7": 1.5}, temperature=None)
    assert biased.logit_bias == {5: 100.0, 6: -100.0, 7: 1.5} and biased.temperature == 1.0


def test_update_from_generation_config_adds_the_other_eos_ids():
    params = SamplingParams(stop_token_ids=[9])
    params.update_from_generation_config({"eos_token_id": [2, 7, 9]}, eos_token_id=2)
    assert params.stop_token_ids == [9, 7]
    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({"eos_token_id": 7}, eos_token_id=2)
    assert ignoring.stop_token_ids == []


def test_stop_strings_need_detokenize():
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(detokenize=False, stop=["x"])


def test_clone_is_a_deep_copy():
    params = SamplingParams(stop=["x"], extra_args={"tag": [1]})
    copy = params.clone()
    copy.stop.append("y")
    copy.extra_args["tag"].append(2)
    assert params.stop == ["x"] and params.extra_args == {"tag": [1]} and copy == SamplingParams(
        stop=["x", "y"], extra_args={"tag": [1, 2]})


# --- generate() --------------------------------------------------------------------------

def test_priorities_are_accepted_and_ignored_under_fcfs(llm):
    """vLLM's V1 engine takes `priority` under the default policy and schedules by arrival."""
    prompts = ["a b", "c d", "e f"]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain = llm.generate(prompts, params, use_tqdm=False)
    prioritised = llm.generate(prompts, params, priority=[2, 0, 1], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in prioritised] == [o.outputs[0].token_ids for o in plain]


def test_max_logprobs_caps_what_a_request_may_ask_for(llm, tiny_models):
    steps = llm.llm_engine.stats.num_steps
    with pytest.raises(ValueError, match=r"row 1, logprobs: asks for 21 logprobs per token, but max_logprobs is 20"):
        llm.generate(["a", "b"], [SamplingParams(logprobs=20), SamplingParams(logprobs=21)], use_tqdm=False)
    with pytest.raises(ValueError, match=r"row 0, prompt_logprobs: asks for 320 logprobs per token"):
        llm.generate(["a"], SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    assert llm.llm_engine.stats.num_steps == steps
    assert len(completion(llm, SamplingParams(logprobs=20, max_tokens=2)).logprobs[0]) >= 20
    with LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, max_logprobs=-1) as unlimited:
        [out] = unlimited.generate(PROMPT, SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=2),
                                   use_tqdm=False)
    vocab = 320
    for entry in [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]:
        assert len(entry) == vocab
        assert math.isclose(sum(math.exp(lp.logprob) for lp in entry.values()), 1.0, rel_tol=1e-4)
    with pytest.raises(ValueError, match="max_logprobs must be -1"):
        LLM(str(tiny_models["llama"]), max_logprobs=-2)


def test_detokenize_false_gives_tokens_without_text(llm):
    """vLLM's test_detokenize_false: token ids and logprobs as usual, no text anywhere."""
    params = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    [texted] = llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)
    [bare] = llm.generate(PROMPT, SamplingParams(**params, detokenize=False), use_tqdm=False)
    assert bare.outputs[0].token_ids == texted.outputs[0].token_ids and texted.outputs[0].text
    assert bare.outputs[0].text == ""
    for entries in (bare.prompt_logprobs[1:], bare.outputs[0].logprobs):
        assert entries and all(3 <= len(entry) <= 4 for entry in entries)
        assert all(lp.decoded_token is None for entry in entries for lp in entry.values())


def test_max_tokens_none_generates_up_to_the_context(llm):
    prompt = {"prompt_token_ids": list(range(3, 23))}
    out = completion(llm, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), prompt)
    assert len(out.token_ids) == 96 - 20 and out.finish_reason == "length"


def test_extra_args_travel_without_effect(llm):
    params = dict(temperature=0, max_tokens=5, ignore_eos=True)
    assert completion(llm, SamplingParams(**params, extra_args={"trace": "x"})).token_ids == \
        completion(llm, SamplingParams(**params)).token_ids


def test_allowed_token_ids_as_in_vllm(llm):
    """vLLM's test_allowed_token_ids: the last token is the one allowed; empty, negative
    and out-of-vocabulary lists are refused."""
    assert set(completion(llm, SamplingParams(allowed_token_ids=[10], max_tokens=3)).token_ids) == {10}
    for bad in ([], [-1], [10_000_000]):
        with pytest.raises(ValueError):
            llm.generate(PROMPT, SamplingParams(allowed_token_ids=bad), use_tqdm=False)


def test_stop_token_ids_stop_at_the_first_one_met(llm):
    """vLLM's test_stop_token_ids: whichever order they are given in."""
    free = completion(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)).token_ids
    first, second = free[5], free[6]
    if first in free[:5] or second in free[:5]:
        pytest.skip("the greedy completion repeats a token early; the check needs two new ones")
    for ids in ([second, first], [first, second]):
        out = completion(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=ids))
        assert out.token_ids[-1] == first and out.stop_reason == first


def test_seeds_repeat_and_differ(llm):
    """vLLM's test_seed."""
    params = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    one, again, other = (completion(llm, SamplingParams(**params, seed=s)).token_ids for s in (42, 42, 43))
    assert one == again and one != other


# --- Model folders -------------------------------------------------------------------------

def test_a_config_without_architectures_loads_by_model_type(tiny_models, tmp_path):
    """As in transformers' AutoModelForCausalLM and vLLM: model_type names the class."""
    folder = tmp_path / "no_architectures"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64) as named, \
            LLM(str(folder), dtype="float32", max_model_len=64) as resolved:
        assert completion(resolved, params).token_ids == completion(named, params).token_ids
    config["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"architecture \['GPT2LMHeadModel'\] is not supported"):
        LLM(str(folder), dtype="float32")


# --- chat() ----------------------------------------------------------------------------------

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if tools %}[{{ tools | length }} tools]{% endif %}{{ suffix or '' }}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def chat_prompt(llm: LLM, messages: list, **kwargs) -> str:
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                     chat_template=TEMPLATE, **kwargs)
    return out.prompt


def test_chat_takes_openai_text_parts(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    assert chat_prompt(llm, parts) == chat_prompt(llm, [{"role": "user", "content": "Hello\nthere"}]) == \
        "<user>Hello\nthere</s><assistant>"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]
    with pytest.raises(ValueError, match=r"conversation 0, message 0: content part 0 is an image \('image_url'\), "
                                         "but the model reads text only"):
        llm.chat(image, use_tqdm=False, chat_template=TEMPLATE)


def test_chat_continues_the_final_message(llm):
    messages = [{"role": "user", "content": "Tell a story"}, {"role": "assistant", "content": "Once upon"}]
    assert chat_prompt(llm, messages, add_generation_prompt=False, continue_final_message=True) == \
        "<user>Tell a story</s><assistant>Once upon"
    with pytest.raises(ValueError, match="add_generation_prompt and continue_final_message cannot both be True"):
        llm.chat(messages, use_tqdm=False, continue_final_message=True)


def test_chat_passes_tools_and_template_kwargs(llm):
    messages = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert chat_prompt(llm, messages, tools=tools, chat_template_kwargs={"suffix": "!"}) == \
        "<user>Hi</s>[1 tools]!<assistant>"
