"""Speculative decoding by prompt lookup and by a draft model: the settings, the n-gram
index, and outputs that are the same as without speculation (greedy and seeded rows token
for token, other sampled rows in distribution) through chunked prefill, preemption and
prefix-cache hits."""

import collections
import json
import math

import pytest

from engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from engine.config import AT_LOAD, EngineConfig, SpeculativeConfig
from engine.hardware import detect_cpu
from engine.spec_decode.ngram_proposer import NgramIndex, NgramProposer
from engine.spec_decode.proposer import Proposer, SpecState
from tests.tiny_models import build_tiny_model
from tests.engine.test_correctness import assert_no_leaks
from tests.lora_adapters import build_lora_adapter

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
FAMILIES = ("llama", "qwen3", "gemma2", "phi3", "qwen2_moe")


def test_settings_follow_vllm_and_name_every_bad_key():
    assert SpeculativeConfig.parse({"num_speculative_tokens": 4}) == SpeculativeConfig("ngram", 4, 5, 5)
    assert SpeculativeConfig.parse({"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
                                   ) == SpeculativeConfig("ngram", 2, 3, 3)
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3}) == SpeculativeConfig(
        "draft_model", 3, model="/m")
    assert SpeculativeConfig.parse({"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}
                                   ).method == "draft_model"
    with pytest.raises(ValueError) as caught:
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert "needs the draft model's folder" in str(caught.value) and "['prompt_lookup_max']" in str(caught.value)
    with pytest.raises(ValueError, match="not with method 'ngram'"):
        SpeculativeConfig.parse({"method": "ngram", "model": "/m", "num_speculative_tokens": 2})
    # vLLM's other keys that apply here.
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3, "quantization": "int8",
                                    "draft_tensor_parallel_size": 1, "disable_by_batch_size": 8}) == \
        SpeculativeConfig("draft_model", 3, model="/m", quantization="int8", disable_by_batch_size=8)
    with pytest.raises(ValueError) as caught:
        SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2,
                                 "disable_by_batch_size": 0})
    assert "runs whole on the target's first rank" in str(caught.value)
    assert "['disable_by_batch_size']: a positive integer" in str(caught.value)
    with pytest.raises(ValueError, match=r"\['quantization'\]: a draft model's, not with method 'ngram'"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "quantization": "int8"})
    with pytest.raises(ValueError) as caught:
        EngineConfig(speculative_config={"method": "eagle", "num_speculative_tokens": 0, "lookup": 2,
                                         "prompt_lookup_min": 4, "prompt_lookup_max": 2})
    message = str(caught.value)
    for part in ("['lookup']: not a key", "'eagle' is not supported", "['num_speculative_tokens']",
                 "min <= max, got 4 and 2"):
        assert part in message, message
    with pytest.raises(ValueError, match="async_scheduling=True does not combine with speculative_config"):
        EngineConfig(speculative_config={"num_speculative_tokens": 2}, async_scheduling=True)


def test_speculative_config_is_parsed_once_when_the_settings_are_checked(make_llm, monkeypatch):
    """A config reads the dict once, when it checks it; the engine and the draft model's runner
    take that parsed record (and a copy of the config, as a rank receives it, keeps it)."""
    import copy
    import pickle

    parsed = []
    parse = SpeculativeConfig.parse.__func__
    monkeypatch.setattr(SpeculativeConfig, "parse", classmethod(lambda cls, value: parsed.append(value) or
                                                                parse(cls, value)))
    config = EngineConfig(speculative_config={"num_speculative_tokens": 2})
    assert config.speculative == SpeculativeConfig("ngram", 2, 5, 5) and len(parsed) == 1
    assert pickle.loads(pickle.dumps(config)).speculative is not None and copy.copy(config).speculative
    llm = make_llm(dtype="float32", speculative_config={"num_speculative_tokens": 2})
    engine_config, before = llm.llm_engine.config, len(parsed)
    assert engine_config.speculative is engine_config.speculative and len(parsed) == before


def test_the_index_proposes_what_followed_the_latest_longest_match():
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 5, 6, 7]
    index = NgramIndex(1, 3)  # one index per sequence, its tokens growing
    # "5 6 7" occurred twice before the suffix: the later one, followed by 1 2 5 6.
    assert index.lookup(tokens, 4) == [1, 2, 5, 6]
    assert index.lookup([*tokens, 3], 4) == []  # 3 never occurred before
    assert index.lookup([*tokens, 3, 8, 9, 5], 2) == [6, 7]  # "8 9 5" at 3..5, the longest match
    assert NgramIndex(1, 3).lookup([1, 2, 3], 3) == []
    assert NgramIndex(1, 3).lookup([4, 4], 3) == [4]  # the continuation may reach the suffix itself
    assert NgramIndex(2, 3).lookup([1, 2, 9, 2], 3) == []  # a single-token match is below prompt_lookup_min


class Decoding:
    """A sequence as the proposer's trimming sees it: proposals and a recent acceptance."""

    def __init__(self, acceptance: float, proposals: int) -> None:
        self.spec = SpecState()
        self.spec.recent.proposed, self.spec.recent.accepted = 1000.0, acceptance * 1000
        self.spec.proposal = list(range(proposals))


def test_proposals_are_kept_where_their_expected_tokens_are_worth_their_rows():
    proposer = NgramProposer(SpeculativeConfig("ngram", 4, 1, 3), max_model_len=1000)
    assert proposer.step_times.fit() is None
    for rows in (1, 2, 4, 8, 16, 32, 64, 96) * 2:  # a fixed 20 ms a step and 0.25 ms a row
        proposer.step_times.add(rows, 0.020 + 0.00025 * rows)
    cost = proposer.step_times.fit()
    assert abs(cost.overhead_s - 0.020) < 1e-6 and abs(cost.per_row_s - 0.00025) < 1e-8
    alone = [Decoding(0.5, 4)]
    proposer.keep_worthwhile(alone)
    assert len(alone[0].spec.proposal) == 4  # one sequence: rows are nearly free
    even = [Decoding(0.5, 4) for _ in range(64)]
    proposer.keep_worthwhile(even)
    assert [len(s.spec.proposal) for s in even] == [1] * 64  # a second token (0.25) is not worth a row
    poor, good = [Decoding(0.1, 4) for _ in range(32)], [Decoding(0.95, 4) for _ in range(32)]
    proposer.keep_worthwhile(poor + good)
    assert all(not s.spec.proposal for s in poor) and all(len(s.spec.proposal) == 4 for s in good)


def both(make_llm, family="llama", **settings):
    return make_llm(family, dtype="float32", **settings), make_llm(family, dtype="float32",
                                                                    speculative_config=NGRAM, **settings)


REPEATING = [[3 + (i % 7) for i in range(40)], [9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8], [20 + i % 5 for i in range(25)]]


def token_ids(outputs):
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_rows_are_the_same_token_for_token(make_llm, family):
    plain, spec = both(make_llm, family)
    prompts = [{"prompt_token_ids": ids} for ids in REPEATING]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False))
    stats = spec.get_stats()
    assert stats.num_draft_tokens > 0 and stats.num_drafts > 0  # proposals were made and verified


def test_through_chunked_prefill_preemption_and_prefix_hits(make_llm, tiny_models):
    """Small steps chunk the prompts, a small KV cache preempts sequences mid-proposal, and
    the prompts repeat, so later ones start from cached blocks."""
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    settings = dict(max_num_batched_tokens=16, kv_cache_memory=12 * 16 * token_bytes, max_num_seqs=6)
    plain, spec = both(make_llm, **settings)
    prompts = [{"prompt_token_ids": REPEATING[i % 3]} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    expected = token_ids(plain.generate(prompts, params, use_tqdm=False))
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == expected
    stats = spec.get_stats()
    assert stats.num_accepted_tokens > 0 and stats.num_cached_prompt_tokens > 0
    assert spec.llm_engine.scheduler.num_preemptions > 0
    assert_no_leaks(spec)


def test_lora_rows_verify_with_their_adapter(make_llm, tiny_models, tmp_path):
    """Rows with different adapters (and none) speculate in one batch; each verifies its
    proposals with its own adapter: the same tokens as without speculation."""
    folders = [build_lora_adapter(tiny_models["llama"], tmp_path / f"a{i}", rank=8, alpha=16, seed=i,
                                  target_modules=["q_proj", "v_proj", "down_proj"]) for i in range(2)]
    adapters = [None, *(LoRARequest(f"a{i}", i + 1, str(folder)) for i, folder in enumerate(folders))]
    plain, spec = both(make_llm, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompts = [{"prompt_token_ids": ids} for ids in REPEATING for _ in adapters]
    requests = adapters * len(REPEATING)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = token_ids(plain.generate(prompts, params, lora_request=requests, use_tqdm=False))
    assert token_ids(spec.generate(prompts, params, lora_request=requests, use_tqdm=False)) == expected
    assert expected[0] != expected[1] != expected[2]  # the adapters change the completions
    assert spec.get_stats().num_accepted_tokens > 0


def assert_same_completions(plain, spec, prompts, params):
    """The same tokens and finish reasons with speculation as without, the first row's
    logprobs too, and some proposals accepted."""
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(expected)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    for a, b in zip(got[0].outputs[0].logprobs, expected[0].outputs[0].logprobs):
        assert {t: round(v.logprob, 4) for t, v in a.items()} == {t: round(v.logprob, 4) for t, v in b.items()}
    assert spec.get_stats().num_accepted_tokens > 0


def test_seeded_rows_are_the_same_with_penalties_stops_and_logprobs(make_llm):
    """A seeded row's token i draws with its own uniform number i, and an accepted row sampled
    with the proposals before it counted: every setting keeps its meaning."""
    plain, spec = both(make_llm)
    prompts = [{"prompt_token_ids": ids} for ids in REPEATING]
    # Low temperatures: the tiny random model's samples then follow its repeating patterns,
    # and the proposals are often right.
    params = [SamplingParams(temperature=0.2, seed=11, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.3, top_k=20, seed=12, max_tokens=20, min_tokens=5,
                             repetition_penalty=1.05, frequency_penalty=0.1),
              SamplingParams(temperature=0.2, top_p=0.9, seed=13, max_tokens=20, stop_token_ids=[21])]
    assert_same_completions(plain, spec, prompts, params)


def test_structured_outputs_verify_proposals_their_grammar_allows(make_llm):
    """A constrained row proposes only what its grammar allows, each verification row is
    masked by the grammar past the proposals before it, and the grammar advances over the
    kept tokens only: the same completions as without speculation."""
    plain, spec = both(make_llm)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}
    constraint = SamplingParams(temperature=0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=schema))
    example = '{"a": 11, "b": 12} {"a": 11, "b": 12} {"a": 11, "b": 12} {"a": 1'
    prompts = [example, "choose: yes no yes no yes no yes", "x"]
    params = [constraint, SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(
        choice=["yes no yes", "no yes no"])), constraint]
    expected = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert token_ids(got) == token_ids(expected)
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    assert got[1].outputs[0].text in ("yes no yes", "no yes no")
    assert spec.get_stats().num_accepted_tokens > 0


def _chi_square(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the bins both samples fill, the rare ones pooled
    (expected counts of at least 5), and its degrees of freedom."""
    total_a, total_b = sum(a.values()), sum(b.values())
    bins, pooled = [], [0, 0]
    for key in set(a) | set(b):
        if a[key] + b[key] >= 10:
            bins.append((a[key], b[key]))
        else:
            pooled[0] += a[key]
            pooled[1] += b[key]
    bins.append(tuple(pooled))
    statistic = 0.0
    for x, y in bins:
        n = x + y
        for observed, total in ((x, total_a), (y, total_b)):
            expected = n * total / (total_a + total_b)
            statistic += (observed - expected) ** 2 / expected if expected else 0.0
    return statistic, len(bins) - 1


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_unseeded_sampled_rows_keep_the_models_distribution(make_llm, tiny_models, monkeypatch, method):
    """1,000 completions of six tokens with and without speculation, drawn from the engine's
    generator (no seeds), where the proposals are often right and often wrong: the
    distributions of each position's token agree (a two-sample chi-square at the 0.1% level
    per position). Prompt lookup at a temperature where the tiny model mostly repeats a
    pattern that the proposals follow and often leaves it (a quarter of them accepted); the
    target as its own draft (its greedy tokens proposed) at a temperature where its samples
    mostly differ from them (an eighth accepted). Its
    power, tried: a verifier that takes the proposal in place of a differing sample 30% of
    the time gives a statistic of 156 against a critical value of 33 (prompt lookup).
    Every proposal is verified here (in a batch this large the engine would keep few: their
    rows would cost more than they save), so that the verification is what is tested.
    The engines' seeds fix the draws, so the test is repeatable."""
    monkeypatch.setattr(Proposer, "keep_worthwhile", lambda self, seqs: None)
    spec_config, temperature = (NGRAM, 0.15) if method == "ngram" else (draft(tiny_models["llama"]), 0.5)
    plain = make_llm("llama", dtype="float32", max_num_seqs=64)
    spec = make_llm("llama", dtype="float32", max_num_seqs=64, speculative_config=spec_config)
    prompt = {"prompt_token_ids": REPEATING[0]}
    params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
    samples = {name: token_ids(llm.generate([prompt] * 1000, params, use_tqdm=False))
               for name, llm in (("plain", plain), ("spec", spec))}
    stats = spec.get_stats()
    assert stats.num_accepted_tokens > 200 and stats.acceptance_rate < 0.6, stats  # often right, often wrong
    for position in range(6):
        statistic, dof = _chi_square(collections.Counter(s[position] for s in samples["plain"]),
                                     collections.Counter(s[position] for s in samples["spec"]))
        # The 0.1% critical value of chi-square, by the Wilson-Hilferty approximation.
        critical = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
        assert statistic < critical, (position, statistic, dof, critical)


@pytest.mark.slow
def test_the_embedded_model_gives_the_same_greedy_summaries():
    """One engine, with its proposer and then without (what an engine without
    speculative_config runs), so that the model loads once."""
    prompts = ["Repeat this sentence twice: the invoice for May shows two charges for one subscription.",
               "Summarise: The export to CSV button does nothing when I click it in Firefox. Summary:"]
    params = SamplingParams(temperature=0, max_tokens=40)
    with LLM(dtype="float32", speculative_config=NGRAM) as llm:
        speculated = token_ids(llm.generate(prompts, params, use_tqdm=False))
        assert llm.get_stats().num_accepted_tokens > 0
        llm.llm_engine.proposer = None
        assert speculated == token_ids(llm.generate(prompts, params, use_tqdm=False))


def draft(folder, k=3):
    return {"model": str(folder), "num_speculative_tokens": k}


@pytest.mark.parametrize("drafter", ["llama", "qwen3"])
def test_a_draft_model_gives_the_same_greedy_tokens(make_llm, tiny_models, drafter):
    """The target as its own draft proposes what it would decode: nearly every proposal is
    accepted (its cache entries right through lazy catch-up and rejected proposals); a
    random model of another family is seldom right, and the tokens are the same either way."""
    plain = make_llm("llama", dtype="float32")
    spec = make_llm("llama", dtype="float32", speculative_config=draft(tiny_models[drafter]))
    prompts = [{"prompt_token_ids": ids} for ids in REPEATING]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False))
    stats = spec.get_stats()
    assert stats.num_draft_tokens > 0
    if drafter == "llama":
        assert stats.acceptance_rate > 0.95, stats.acceptance_rate


def test_a_draft_model_through_chunked_prefill_preemption_prefix_hits_and_forks(make_llm, tiny_models):
    """The draft's cache shares the target's block tables: small steps chunk the prompts (and
    the draft's first catch-up over a 40-token prompt goes in passes of 16 tokens), a KV
    cache sized for both models preempts sequences (which forget their draft entries),
    repeated prompts start from cached blocks and n=2 forks share them. With the target as
    its own draft, acceptance stays near one: no draft entry is read stale."""
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    settings = dict(dtype="float32", max_num_batched_tokens=16, kv_cache_memory=2 * 12 * 16 * token_bytes,
                    max_num_seqs=6)
    plain = make_llm("llama", **settings)
    spec = make_llm("llama", speculative_config=draft(tiny_models["llama"], k=4), **settings)
    assert spec.llm_engine.block_manager.num_blocks == plain.llm_engine.block_manager.num_blocks // 2
    prompts = [{"prompt_token_ids": REPEATING[i % 3]} for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    forked = SamplingParams(temperature=0.5, seed=3, n=2, max_tokens=30, ignore_eos=True)
    for params in (greedy, [greedy] * 5 + [forked]):
        before = spec.get_stats()
        expected = [[list(c.token_ids) for c in o.outputs] for o in plain.generate(prompts, params, use_tqdm=False)]
        got = [[list(c.token_ids) for c in o.outputs] for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        if params is greedy:  # sampled rows reject the draft's greedy tokens as often as they differ
            after = spec.get_stats()
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            assert accepted > 0.95 * (after.num_draft_tokens - before.num_draft_tokens)
            assert after.num_cached_prompt_tokens > 0 and spec.llm_engine.scheduler.num_preemptions > 0
    assert_no_leaks(spec)


def test_a_draft_model_keeps_every_setting(make_llm, tiny_models):
    """Seeded rows with penalties, min_tokens, stops and logprobs give the same tokens and
    logprobs; a structured-output row decodes without proposals (its grammar could judge
    the draft's tokens only once they exist) and gives the same text."""
    plain = make_llm("llama", dtype="float32")
    spec = make_llm("llama", dtype="float32", speculative_config=draft(tiny_models["llama"]))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prompts = [{"prompt_token_ids": ids} for ids in REPEATING] + ["x"]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.9, top_k=20, seed=12, max_tokens=20, min_tokens=5,
                             repetition_penalty=1.05, frequency_penalty=0.1, bad_words=["a"]),
              SamplingParams(temperature=0.7, top_p=0.9, seed=13, max_tokens=20, stop_token_ids=[21]),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))]
    assert_same_completions(plain, spec, prompts, params)


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_a_draft_model_is_quantized_as_the_target_is_at_load(make_llm, tiny_models, quantization):
    """The draft follows the target's quantization at load, which the CPU decides (int8 with
    VNNI, else none; `make test-cpu-kinds` runs this as each kind), its int8 input ranges
    measured on the calibration text: the target as its own draft then proposes what it
    decodes, and the tokens are the same as without speculation."""
    if quantization == "int8" and not detect_cpu().int8_products:
        pytest.skip("int8 products at load need VNNI, AMX or AVX2")
    plain = make_llm("llama", quantization=quantization)
    spec = make_llm("llama", quantization=quantization, speculative_config=draft(tiny_models["llama"]))
    target = spec.llm_engine.config.quantization
    assert spec.llm_engine.model_runner.draft.model_config.quantization == (target if target in AT_LOAD else None)
    assert spec.llm_engine.model_runner.draft.model_config.dtype == spec.llm_engine.model_config.dtype
    prompts = [{"prompt_token_ids": ids} for ids in REPEATING]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert token_ids(spec.generate(prompts, params, use_tqdm=False)) == token_ids(
        plain.generate(prompts, params, use_tqdm=False))
    assert spec.get_stats().acceptance_rate > 0.5


def test_no_proposals_above_disable_by_batch_size(make_llm):
    """vLLM's `disable_by_batch_size`: with more sequences running than it allows, none
    speculates; alone, one does."""
    spec = make_llm("llama", dtype="float32", speculative_config={**NGRAM, "disable_by_batch_size": 2})
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    spec.generate([{"prompt_token_ids": ids} for ids in REPEATING], params, use_tqdm=False)
    assert spec.get_stats().num_drafts == 0
    spec.generate([{"prompt_token_ids": REPEATING[0]}], params, use_tqdm=False)
    assert spec.get_stats().num_drafts > 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_each_attention_backend_verifies_proposals(make_llm, tiny_models, backend):
    """The verification rows are short query runs over cached context, like chunks of a
    prefill, in every attention backend (the compiled CPU one is the default of the tests
    above; Triton's kernels run in its interpreter here): the same greedy tokens with prompt
    lookup and with a draft model."""
    prompts = [{"prompt_token_ids": ids} for ids in REPEATING[:2]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs, accepted = [], []
    for spec in (None, NGRAM, draft(tiny_models["llama"])):
        llm = make_llm("llama", dtype="float32", attention_backend=backend, speculative_config=spec)
        outputs.append(token_ids(llm.generate(prompts, params, use_tqdm=False)))
        accepted.append(llm.get_stats().num_accepted_tokens)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]
    assert accepted[1] > 0 and accepted[2] > 0


def test_a_draft_model_that_cannot_serve_is_refused_at_start(tiny_models, tmp_path, monkeypatch):
    """Before any model loads: the draft's settings are resolved and checked first."""
    import engine.worker.worker

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the draft was checked")

    monkeypatch.setattr(engine.worker.worker, "load_model", no_loading)
    other_vocab = build_tiny_model(tmp_path / "wide", "llama", vocab_size=400)
    with pytest.raises(ValueError, match="its vocabulary has 400 tokens, the target's 320"):
        LLM(str(tiny_models["llama"]), speculative_config=draft(other_vocab))
    with pytest.raises(ValueError, match=r"speculative_config\['model'\]=.*quantization='awq' needs a checkpoint"):
        LLM(str(tiny_models["llama"]), speculative_config={**draft(tiny_models["llama"]), "quantization": "awq"})
    with pytest.raises(ValueError, match="is not a local folder"):
        LLM(str(tiny_models["llama"]), speculative_config=draft(tmp_path / "missing"))
