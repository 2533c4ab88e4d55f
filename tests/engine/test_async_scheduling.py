"""Asynchronous scheduling changes when a step's tokens are read back, never which tokens:
every feature gives the same greedy and seeded outputs, token for token and logprob for
logprob, with it on and off. (Unseeded draws share the engine's generator, so they depend
on how steps are composed, in either mode.)

With it on, a step is launched before the previous step's tokens are on the host: its
input ids come from the device, and a sequence found finished one step late has computed
one more row, whose token is never sampled or returned. Penalties, grammars, bad words and
min_tokens are read when the step samples, after the previous tokens landed.
"""

import itertools
import random

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.structured_output.params import StructuredOutputsParams
from tests.engine.test_structured_output import constrained_batch
from tests.lora_adapters import build_lora_adapter
from tests.tiny_models import FAMILIES

VOCAB = 320  # the tiny models' vocabulary


def prompts(count: int, seed: int, shared_prefix: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    return [{"prompt_token_ids": prefix + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))]}
            for _ in range(count)]


def summary(outputs) -> list:
    """Everything a request returns that the mode could change."""
    return [
        (o.prompt_logprobs, o.num_cached_tokens,
         [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob, c.logprobs)
          for c in o.outputs])
        for o in outputs
    ]


def both_modes(model, requests: list[dict], params, **settings) -> list[list]:
    """The summaries of one `generate` call, asynchronous scheduling off then on."""
    runs = []
    for mode in (False, True):
        with LLM(str(model), dtype="float32", async_scheduling=mode, **settings) as llm:
            assert llm.llm_engine.config.async_scheduling is mode
            runs.append(summary(llm.generate(requests, params, use_tqdm=False)))
    return runs


# Each row exercises one feature; together they run in one batch.
FEATURES = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.8, max_tokens=20, seed=7),
    SamplingParams(temperature=0.8, top_k=20, min_p=0.05, max_tokens=20, seed=3, n=3),
    SamplingParams(temperature=0, max_tokens=16, logprobs=3, prompt_logprobs=2),
    SamplingParams(temperature=0, max_tokens=20, presence_penalty=0.5, frequency_penalty=0.4,
                   repetition_penalty=1.3),
    SamplingParams(temperature=0, max_tokens=20, min_tokens=12, stop_token_ids=[5, 6, 7]),
    SamplingParams(temperature=0, max_tokens=30, stop=["e", "a "], include_stop_str_in_output=True),
    SamplingParams(temperature=0, max_tokens=20, logit_bias={11: 3.0, 12: -2.0}, bad_words=["the"]),
    SamplingParams(temperature=0, max_tokens=20, allowed_token_ids=list(range(3, 60))),
    SamplingParams(temperature=1.0, max_tokens=18, n=2, seed=11),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_the_same_outputs_in_both_modes(tiny_models, family):
    requests = prompts(2 * len(FEATURES), seed=1)
    off, on = both_modes(tiny_models[family], requests, FEATURES * 2)
    assert off == on


@pytest.mark.parametrize("settings", [
    {"max_num_batched_tokens": 32},  # chunked prefill: prompts over several steps
    {"kv_cache_memory": 12 * 16 * 1024, "max_num_batched_tokens": 64},  # preemption by recompute
    {"enable_prefix_caching": False},
    {"scheduling_policy": "priority", "max_num_seqs": 4},
    {"attention_backend": "torch"},
])
def test_scheduling_settings_give_the_same_outputs_in_both_modes(tiny_models, settings):
    requests = prompts(len(FEATURES) * 2, seed=2, shared_prefix=20)
    off, on = both_modes(tiny_models["llama"], requests, FEATURES * 2, **settings)
    assert off == on


def test_preemption_happens_with_the_small_cache(tiny_models):
    """The preemption case above really preempts, in the asynchronous mode too."""
    with LLM(str(tiny_models["llama"]), dtype="float32", async_scheduling=True, kv_cache_memory=12 * 16 * 1024,
             max_num_batched_tokens=64) as llm:
        llm.generate(prompts(len(FEATURES) * 2, seed=2, shared_prefix=20), FEATURES * 2, use_tqdm=False)
        assert llm.llm_engine.scheduler.num_preemptions > 0
        assert llm.llm_engine.stats.num_cached_prompt_tokens > 0


def test_structured_outputs_are_the_same_in_both_modes(tiny_models):
    batch, params, _ = constrained_batch()
    params = [SamplingParams(**{**p.__dict__, "seed": 5}) if p.temperature > 0 else p for p in params]
    off, on = both_modes(tiny_models["llama"], batch, params)
    assert off == on
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe"]))
    off, on = both_modes(tiny_models["qwen2"], prompts(6, seed=3), choice)
    assert off == on and {c[2] for o in on for c in o[2]} <= {"yes", "no", "maybe"}


def test_lora_adapters_give_the_same_outputs_in_both_modes(tiny_models, tmp_path):
    base = tiny_models["llama"]
    adapters = [LoRARequest(f"a{i}", i + 1, str(build_lora_adapter(
        base, tmp_path / f"a{i}", rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], seed=i)))
        for i in range(3)]
    requests = prompts(12, seed=4)
    runs = []
    for mode in (False, True):
        with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, async_scheduling=mode) as llm:
            outputs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                   lora_request=[None, *adapters] * 3, use_tqdm=False)
            runs.append(summary(outputs))
    assert runs[0] == runs[1]


def test_closing_early_in_the_asynchronous_mode_frees_everything(tiny_models):
    """A step in flight when the caller stops is dropped; its requests' blocks return and
    the next call is as good as new."""
    requests = prompts(12, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(str(tiny_models["llama"]), dtype="float32", async_scheduling=True) as llm:
        expected = summary(llm.generate(requests, params, use_tqdm=False))
        for taken in (0, 1, 5):
            finished = iter(llm.generate_as_completed(requests, params, use_tqdm=False))
            early = list(itertools.islice(finished, taken))
            finished.close()
            engine = llm.llm_engine
            assert not engine.has_unfinished_requests()
            assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
            # Later calls hit the prefix cache: compare the completions.
            assert [summary([o])[0][2] for _, o in early] == [expected[i][2] for i, _ in early]
        again = summary(llm.generate(requests, params, use_tqdm=False))
        assert [s[2] for s in again] == [s[2] for s in expected]


def test_a_finished_sequence_computes_one_extra_row_and_returns_nothing_more(tiny_models):
    """Stops found one step late: the stop-string and EOS cases end exactly where the
    synchronous mode ends them, and the engine counts one step more than tokens at most."""
    params = [SamplingParams(temperature=0, max_tokens=40, stop=[" "]), SamplingParams(temperature=0, max_tokens=7)]
    off, on = both_modes(tiny_models["llama"], prompts(2, seed=6), params)
    assert off == on
    assert on[1][2][0][3] == "length" and len(on[1][2][0][1]) == 7


def test_the_default_is_on_with_a_gpu_and_off_on_a_cpu(tiny_models):
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        assert llm.llm_engine.config.async_scheduling is (llm.llm_engine.model_config.device.type == "cuda")
    with pytest.raises(TypeError, match="async_scheduling must be True or False or None, got str .yes."):
        LLM(str(tiny_models["llama"]), async_scheduling="yes")
