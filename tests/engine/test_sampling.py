"""Sampling through the whole engine: determinism, n > 1, stops, processors, logprobs, chat."""

import json
import random
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.output_processor.detokenizer import IncrementalDetokenizer
from tests.processes import run_in_batch_mode

EOS = 2  # the tiny models' EOS id


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm(dtype="float32")


def texts(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def seeded_requests() -> list[tuple[str | dict, SamplingParams]]:
    long_prompt = {"prompt_token_ids": [random.Random(7).randrange(3, 300) for _ in range(300)]}
    return [
        ("Paris is the", SamplingParams(temperature=0.9, seed=1, max_tokens=20, ignore_eos=True, logprobs=2)),
        ("The quick brown", SamplingParams(temperature=1.2, top_p=0.8, seed=2, max_tokens=20, ignore_eos=True,
                                           logprobs=2)),
        ("A paged KV cache", SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=3, max_tokens=20,
                                            ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.2,
                                            logprobs=2)),
        # Longer than one attention query chunk (256), so its prefill is split in every setting.
        (long_prompt, SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=4, max_tokens=20,
                                     ignore_eos=True, logprobs=2)),
    ]


def mixed_neighbours(count: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(0)
    words = ["Numbers 1 2 3", "Unicode café", "Berlin is", "The lazy dog", "Continuous batching"]
    out = []
    for i in range(count):
        kind = i % 4
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(5, 25)),
                  SamplingParams(temperature=1.0, max_tokens=rng.randint(5, 25)),
                  SamplingParams(top_p=0.5, top_k=rng.choice([0, 5, 200]), max_tokens=rng.randint(5, 25)),
                  SamplingParams(frequency_penalty=1.0, max_tokens=rng.randint(5, 25))][kind]
        out.append((f"{words[i % len(words)]} {i}" * (1 + i % 3), params))
    return out


def run(llm, requests):
    prompts, params = zip(*requests)
    return llm.generate(list(prompts), list(params), use_tqdm=False)


def completion(output) -> tuple:
    """Everything a seeded completion computes, down to the float bits of its logprobs."""
    c = output.outputs[0]
    return c.token_ids, c.cumulative_logprob, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]


def check_seeded_requests_do_not_depend_on_the_batch(model: str, **settings: object) -> None:
    """The same seeded requests give bit-identical completions alone, inside a batch of 32
    mixed requests, in reversed order, after prefix-cache hits, and with chunked prefill
    and preemption forced (an engine with `settings` each time)."""
    seeded = seeded_requests()
    with LLM(model, **settings) as llm:
        alone = [completion(run(llm, [r])[0]) for r in seeded]
        batch = mixed_neighbours(32 - len(seeded))
        mixed = batch[:5] + [seeded[0]] + batch[5:14] + [seeded[1]] + batch[14:] + seeded[2:]
        positions = [next(i for i, r in enumerate(mixed) if r is s) for s in seeded]
        outs = run(llm, mixed)  # the seeded prompts' blocks are cached by now
        assert sum(outs[p].num_cached_tokens for p in positions) > 0
        assert [completion(outs[p]) for p in positions] == alone
        reversed_outs = run(llm, list(reversed(mixed)))
        assert [completion(reversed_outs[len(mixed) - 1 - p]) for p in positions] == alone
        llm.reset_prefix_cache()
        assert [completion(run(llm, [r])[0]) for r in seeded] == alone
        room_for_600_tokens = 600 * llm.llm_engine.model_runner.kv_cache.bytes_per_token
    with LLM(model, **settings, kv_cache_memory=room_for_600_tokens, max_num_batched_tokens=48) as small:
        outs = run(small, mixed)
        assert small.llm_engine.scheduler.num_preemptions > 0
        assert [completion(outs[p]) for p in positions] == alone


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2_moe"])
def test_seeded_requests_do_not_depend_on_the_batch(tiny_models, family, dtype):
    """Llama; Gemma 2 (windows, soft-capping); Qwen2-MoE (experts grouped by the batch's
    routing, a shared expert)."""
    check_seeded_requests_do_not_depend_on_the_batch(str(tiny_models[family]), dtype=dtype)


@pytest.mark.cpu_kinds
@pytest.mark.long("the embedded SmolLM2 (135M parameters) on 32 requests three times and 4 alone twice, then 32 in a "
                  "small cache; 15-18 s here, 33-52 s as a CPU without native bfloat16 (make test-cpu-kinds)")
@pytest.mark.parametrize("settings", [{}, {"dtype": "bfloat16", "quantization": None, "batch_invariant": True}],
                         ids=["default", "batch_invariant_bfloat16"])
def test_seeded_requests_do_not_depend_on_the_batch_on_the_embedded_model(settings, request):
    """In the default settings (what "auto" picks on this CPU: float32 without native
    bfloat16, else bfloat16 with int8 products or, with AMX, without), and in batch-invariant
    mode with bfloat16 products (where AMX's kernels gave a seeded chat request other tokens
    alone than in a batch of 16)."""
    if run_in_batch_mode(request, settings.get("batch_invariant", False)):
        return
    check_seeded_requests_do_not_depend_on_the_batch("smollm2-135m-instruct", **settings)


def test_n_completions_share_one_prompt_computation(llm):
    prompt = {"prompt_token_ids": [random.Random(1).randrange(3, 320) for _ in range(150)]}
    before = llm.llm_engine.stats.num_prompt_tokens_computed
    [out] = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    assert llm.llm_engine.stats.num_prompt_tokens_computed - before == 150
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # top_k=1 decodes greedily; vLLM refuses n > 1 at temperature 0.
    [greedy] = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)
    [single] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in greedy.outputs] == [single.outputs[0].token_ids] * 3
    bm = llm.llm_engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # the shared blocks were all returned


def test_n_completions_survive_preemption(tiny_models):
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(n=3, temperature=1.0, top_k=1, max_tokens=30, ignore_eos=True)
    with LLM(str(tiny_models["llama"]), dtype="float32") as roomy:
        expected = texts(roomy.generate(prompt, params, use_tqdm=False))
    with LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory=7 * 16 * 512) as tight:  # 7 blocks
        assert texts(tight.generate(prompt, params, use_tqdm=False)) == expected
        assert tight.llm_engine.scheduler.num_preemptions > 0


def test_stop_strings_across_tokens_both_ways(llm):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    [free] = llm.generate(["Paris is the"], params, use_tqdm=False)
    text, ids = free.outputs[0].text, free.outputs[0].token_ids
    tokenizer = llm.get_tokenizer()
    first = len(tokenizer.decode(ids[:3]))  # a stop string that starts in token 3 and ends in token 4
    stop = text[first - 1 : first + 2]
    assert len(stop) == 3
    for include in (False, True):
        [out] = llm.generate(["Paris is the"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                            stop=[stop], include_stop_str_in_output=include),
                             use_tqdm=False)
        end = text.find(stop) + (len(stop) if include else 0)
        assert out.outputs[0].text == text[:end] and out.outputs[0].stop_reason == stop


def test_incremental_detokenizer_never_splits_a_character(tiny_models):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    text = "Unicode: café, naïve, 東京, Ωμέγα, emoji 🙂."
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.encode()) // 4  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in ids:
        detok.add_token(token)
        assert "\ufffd" not in detok.text
    assert detok.text == tokenizer.decode(ids)


def test_stop_on_a_multibyte_character(llm):
    """A stop string that is one character of several bytes, each byte its own token."""
    from engine.output_processor.stop_checker import find_stop

    tokenizer = llm.get_tokenizer()
    tokens = tokenizer("café 東京 done", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [5])
    hit = None
    for token in tokens:
        hit = find_stop(detok, detok.add_token(token), SamplingParams(stop=["東"]))
        if hit:
            break
    assert hit == "東" and detok.text == "café "


def test_min_tokens_ignore_eos_and_stop_token_ids(llm):
    eos_first = SamplingParams(temperature=0, max_tokens=20, logit_bias={EOS: 100.0})
    [out] = llm.generate(["Paris"], eos_first, use_tqdm=False)
    assert out.outputs[0].token_ids == [EOS] and out.outputs[0].finish_reason == "stop"
    [out] = llm.generate(["Paris"], SamplingParams(temperature=0, max_tokens=20, min_tokens=5,
                                                   logit_bias={EOS: 100.0}), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].token_ids[-1] == EOS
    assert EOS not in out.outputs[0].token_ids[:5]
    [out] = llm.generate(["Paris"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True,
                                                   logit_bias={EOS: 100.0}), use_tqdm=False)
    assert out.outputs[0].token_ids == [EOS] * 9 and out.outputs[0].finish_reason == "length"


def test_allowed_tokens_bad_words_and_bias(llm):
    allowed = [10, 11, 12, 13]
    [out] = llm.generate(["Paris is"], SamplingParams(temperature=1.0, seed=0, max_tokens=25, ignore_eos=True,
                                                      allowed_token_ids=allowed), use_tqdm=False)
    assert set(out.outputs[0].token_ids) <= set(allowed)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    [free] = llm.generate(["Paris is the"], params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    banned = free.outputs[0].token_ids[0]
    word = tokenizer.decode([banned]).strip()
    [out] = llm.generate(["Paris is the"], SamplingParams(temperature=0, max_tokens=25, ignore_eos=True,
                                                          bad_words=[word]), use_tqdm=False)
    variants = {tuple(tokenizer(v, add_special_tokens=False).input_ids) for v in (word, " " + word)}
    assert all(len(v) > 1 or v[0] not in out.outputs[0].token_ids for v in variants)
    assert out.outputs[0].token_ids[0] != banned
    [out] = llm.generate(["Paris is the"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                          logit_bias={77: 50.0}), use_tqdm=False)
    assert out.outputs[0].token_ids == [77] * 5


def test_logprobs_equal_a_float64_log_softmax_of_reference_logits(llm, tiny_models):
    prompt = [5, 17, 42, 99, 7, 250, 33]
    [out] = llm.generate({"prompt_token_ids": prompt},
                         SamplingParams(temperature=0.8, seed=4, max_tokens=8, ignore_eos=True, logprobs=3,
                                        prompt_logprobs=2, repetition_penalty=1.3), use_tqdm=False)
    completion = out.outputs[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0].double()
    reference = torch.log_softmax(logits, dim=-1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = reference[len(prompt) - 1 + step]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(3)
        for rank, (value, token_id) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert abs(entry[token_id].logprob - value) < 1e-4 and entry[token_id].rank == rank
        total += entry[token].logprob
    assert abs(completion.cumulative_logprob - total) < 1e-6
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        row = reference[position - 1]
        entry = out.prompt_logprobs[position]
        assert abs(entry[prompt[position]].logprob - row[prompt[position]].item()) < 1e-4
        assert len(entry) in (2, 3)


def test_defaults_come_from_generation_config(tiny_models, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_models["llama"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.3,
                                                               "top_k": 7, "max_new_tokens": 9}))
    with LLM(str(folder), dtype="float32") as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.top_p) == (0.3, 7, 9, 1.0)
        [out] = llm.generate(["Paris"], use_tqdm=False)
        assert len(out.outputs[0].token_ids) <= 9


def test_sampling_token_ids_are_checked_against_the_vocabulary(llm):
    with pytest.raises(ValueError, match="row 0, sampling_params: stop_token_ids, logit_bias or allowed_token_ids"):
        llm.generate(["Paris"], SamplingParams(logit_bias={100000: 1.0}), use_tqdm=False)


@pytest.mark.slow
def test_chat_renders_the_template_without_a_second_bos():
    with LLM(dtype="float32") as llm:
        tokenizer = llm.get_tokenizer()
        conversation = [{"role": "user", "content": "What is the capital of France?"}]
        [out] = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        assert out.prompt_token_ids == list(expected)
        assert "Paris" in out.outputs[0].text
        two = llm.chat([conversation, [{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=4),
                       use_tqdm=False)
        assert len(two) == 2 and two[0].prompt.startswith("<|im_start|>")
