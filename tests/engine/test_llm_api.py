"""The LLM front end: validation before work, outputs in order, stops, seeds, progress, close."""

import dataclasses
import gc
import shutil
import weakref

import pytest
import torch

from engine import (
    LLM, EngineStats, ModelLoadError, RequestOutput, SamplingParams, StructuredOutputsParams, UnfinishedOutput,
)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32", max_model_len=128, kv_cache_memory=64 * 16 * 1024)


def test_empty_prompt_list_returns_empty(llm):
    assert llm.generate([], SamplingParams()) == []


def test_single_prompt_and_input_order(llm):
    [single] = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert isinstance(single, RequestOutput) and single.finished
    prompts = [f"Paris is the capital {i}" for i in range(10)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert len({o.request_id for o in outs}) == 10


def test_every_bad_row_is_reported_before_any_work(llm):
    engine = llm.llm_engine
    steps = engine.stats.num_steps
    prompts = ["fine", "", "x " * 400, {"prompt_token_ids": [5, 100000]}, 42, {"prompt": "ok"}, {"text": "no"}]
    with pytest.raises(ValueError) as err:
        llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
    message = str(err.value)
    assert "5 invalid prompt row(s); nothing was run" in message
    assert "row 1, prompt: is empty" in message
    assert "row 2, prompt: has" in message and "max_model_len is 128" in message
    assert "row 3, prompt_token_ids: holds ids outside the vocabulary" in message
    assert "row 4, prompt: expected a str" in message and "row 6, prompt: expected a str" in message
    assert "row 0" not in message and "row 5" not in message
    assert engine.stats.num_steps == steps
    assert not engine.has_unfinished_requests()


def test_generate_as_completed_hands_over_each_output_as_it_finishes(llm):
    prompts = [f"Count to {i}:" for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=2 + 3 * i, ignore_eos=True) for i in range(6)]
    expected = llm.generate(prompts, params, use_tqdm=False)
    finished = llm.generate_as_completed(prompts, params, use_tqdm=False)
    assert len(finished) == 6
    pairs = list(finished)
    # Shorter completions finish first; each pair carries its prompt's position.
    assert [index for index, _ in pairs] == list(range(6))
    for index, output in pairs:
        assert output.outputs[0].token_ids == expected[index].outputs[0].token_ids


def test_generate_as_completed_validates_before_iteration_and_aborts_when_closed(llm):
    with pytest.raises(ValueError, match="row 1, prompt: is empty"):
        llm.generate_as_completed(["fine", ""], SamplingParams(max_tokens=2))
    engine = llm.llm_engine
    free = engine.block_manager.num_free_blocks
    params = [SamplingParams(temperature=0, max_tokens=2)] + [SamplingParams(temperature=0, max_tokens=40)] * 3
    finished = iter(llm.generate_as_completed(["a b", "c d", "e f", "g h"], params, use_tqdm=False))
    index, _ = next(finished)
    assert index == 0 and engine.has_unfinished_requests()
    finished.close()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == free


def test_per_prompt_lists_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="sampling_params: got 1 values for 2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_kv_capacity_is_checked_per_row(tiny_models):
    with LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory=4 * 16 * 1024) as small:
        with pytest.raises(ValueError, match=r"row 0, max_tokens: prompt plus max_tokens needs 203 tokens"):
            small.generate(["Paris is"], SamplingParams(max_tokens=200), use_tqdm=False)


def test_sampling_params_validation_names_the_field():
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature must be in \[0, 2\]"):
        SamplingParams(temperature=-1)


def test_max_tokens_gives_length_finish(llm):
    [out] = llm.generate(["The quick"], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_stop_strings_cut_the_text_and_are_reported(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [free] = llm.generate(["Paris is the"], params, use_tqdm=False)
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    [stopped] = llm.generate(["Paris is the"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                              stop=[stop]), use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == text[: text.find(stop)]


def test_stop_token_ids(llm):
    [free] = llm.generate(["Paris is the"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    token = free.outputs[0].token_ids[4]
    first = free.outputs[0].token_ids.index(token)
    [stopped] = llm.generate(["Paris is the"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                              stop_token_ids=[token]), use_tqdm=False)
    assert stopped.outputs[0].token_ids == free.outputs[0].token_ids[: first + 1]
    assert stopped.outputs[0].stop_reason == token


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    [alone] = llm.generate(["Paris is the"], seeded, use_tqdm=False)
    others = [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True)] * 5
    batch = llm.generate(["a b c", "Paris is the", "The quick", "x", "fox", "dog"],
                         [others[0], seeded, *others[1:]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    unseeded = llm.generate(["Paris is the"] * 4, SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in unseeded}) > 1


def test_progress_callable_sees_every_prompt(llm):
    seen = {}

    class Bar:
        def __init__(self, total, **kwargs):
            seen["total"], seen["done"], self.postfix = total, 0, ""

        def update(self, n):
            seen["done"] += n
            seen["postfix"] = self.postfix

        def close(self):
            seen["closed"] = True

    llm.generate(["a", "b", "c"], SamplingParams(max_tokens=3), use_tqdm=Bar)
    assert seen["total"] == seen["done"] == 3 and seen["closed"]
    assert "input:" in seen["postfix"] and "output:" in seen["postfix"]


def test_progress_counts_a_request_once_when_its_completions_finish_together(llm):
    seen = {"done": 0}

    class Bar:
        def __init__(self, total, **kwargs):
            seen["total"], self.postfix = total, ""

        def update(self, n):
            seen["done"] += n

        def close(self):
            pass

    # Greedy completions of equal length finish in the same step.
    llm.generate(["a", "b"], SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=3, ignore_eos=True),
                 use_tqdm=Bar)
    assert seen["total"] == seen["done"] == 2


def test_priority_policy_runs_low_values_first(tiny_models):
    with LLM(str(tiny_models["llama"]), dtype="float32", scheduling_policy="priority", max_num_seqs=1) as llm:
        outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2), priority=[2, 0, 1], use_tqdm=False)
        order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
        assert order == [1, 2, 0]


@pytest.mark.parametrize("enable_lora", [False, True])
def test_close_frees_the_engine(tiny_models, enable_lora):
    llm = LLM(str(tiny_models["llama"]), dtype="float32", enable_lora=enable_lora)
    runner = llm.llm_engine.model_runner
    weights = weakref.ref(runner.model.model.embed_tokens.weight)
    cache = weakref.ref(runner.model.model.layers[0].self_attn.attn.k_cache)
    del runner
    llm.close()
    gc.collect()
    assert weights() is None and cache() is None
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["a"])
    with pytest.raises(RuntimeError, match="this LLM was closed; create a new one"):
        llm.llm_engine


@pytest.mark.parametrize("damage,message", [
    ("config", "has no config.json"),
    ("weights", "has no \\*.safetensors weights"),
    ("tokenizer", "has no tokenizer"),
    ("corrupt", "could not be read"),
])
def test_broken_model_folders_name_the_path(tiny_models, tmp_path, damage, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], folder)
    if damage == "config":
        (folder / "config.json").unlink()
    elif damage == "weights":
        (folder / "model.safetensors").unlink()
    elif damage == "tokenizer":
        (folder / "tokenizer.json").unlink()
    else:
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=message) as err:
        LLM(str(folder))
    assert str(folder) in str(err.value)


def test_unknown_model_name_is_not_downloaded():
    with pytest.raises(ModelLoadError, match="never downloads"):
        LLM("meta-llama/Llama-3-8B")


def test_wrongly_typed_or_encoded_input_is_a_row_problem_not_a_type_error(llm):
    with pytest.raises(ValueError, match="stop must be a list of non-empty strings, got 5"):
        SamplingParams(stop=5)
    with pytest.raises(ValueError, match="bad_words must be a list of words that are not blank"):
        SamplingParams(bad_words=["  "])
    assert SamplingParams(stop="\n").stop == ["\n"]
    problems = llm.validate(["fine", "bad \ud800 text", {"prompt": "also \udfff"}], SamplingParams(max_tokens=2))
    assert problems[0] is None
    assert problems[1].startswith("prompt: holds a lone surrogate '\\ud800' at character 4")
    assert "lone surrogate" in problems[2]
    with pytest.raises(ValueError, match=r"conversation 1, message 0: content must be a string, got int"):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": 5}]], use_tqdm=False)
    assert SamplingParams.rule("temperature") == "in [0, 2] (0 = greedy)"


def test_more_completions_than_max_num_seqs_is_a_row_problem(tiny_models):
    with LLM(str(tiny_models["llama"]), dtype="float32", max_num_seqs=2, kv_cache_memory=64 * 16 * 1024) as small:
        assert small.validate(["a", "b"], [SamplingParams(n=2), SamplingParams(n=3)]) == [
            None, "sampling_params: n=3 completions run side by side, but max_num_seqs is 2: lower n or raise "
                  "max_num_seqs"]


def test_get_stats_is_a_snapshot_of_the_engine_counters(llm):
    before = llm.get_stats()
    assert isinstance(before, EngineStats)
    kept = dataclasses.asdict(before)
    [out] = llm.generate("Stats count every token", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
    after = llm.get_stats()
    assert dataclasses.asdict(before) == kept  # a copy: later work leaves it as it was
    assert after.num_generated_tokens - before.num_generated_tokens == 4
    assert after.num_steps > before.num_steps
    prompt_tokens = (after.num_prompt_tokens_computed - before.num_prompt_tokens_computed
                     + after.num_cached_prompt_tokens - before.num_cached_prompt_tokens)
    assert prompt_tokens == len(out.prompt_token_ids)


def test_unfinished_outputs_lists_the_completions_still_running(llm):
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=0, max_tokens=30, ignore_eos=True, n=2)]
    finished = iter(llm.generate_as_completed(["a b", "c d"], params, use_tqdm=False))
    assert llm.unfinished_outputs() == []  # requests are queued when iteration starts
    index, _ = next(finished)
    assert index == 0
    unfinished = llm.unfinished_outputs()
    assert all(isinstance(u, UnfinishedOutput) for u in unfinished)
    assert [u.max_tokens for u in unfinished] == [30, 30]
    assert all(0 < u.num_generated_tokens < 30 for u in unfinished)
    finished.close()
    assert llm.unfinished_outputs() == []


def test_structured_output_problem_says_why_a_constraint_cannot_compile(llm):
    assert llm.structured_output_problem(StructuredOutputsParams(json={"type": "integer"})) is None
    problem = llm.structured_output_problem(StructuredOutputsParams(regex="a(b"))
    assert problem.startswith("the regex constraint does not compile: Regex parsing error")


def test_dtype_names_the_dtype_the_engine_runs_in(llm, tiny_models):
    assert llm.dtype == "float32"
    with LLM(str(tiny_models["llama"]), kv_cache_memory=64 * 16 * 1024) as auto:
        assert getattr(torch, auto.dtype) == auto.llm_engine.model_config.dtype  # what "auto" picked
