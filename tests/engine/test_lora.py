"""Multi-LoRA: mixed adapters in one batch against transformers + PEFT, slots, errors."""

import json
import random
import shutil
from pathlib import Path

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.kernels import triton as triton_kernels
from tests.lora_adapters import build_lora_adapter, peft_greedy
from tests.tiny_models import build_tiny_model

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# Three adapters that differ in rank, targets and scaling (rsLoRA, per-module rank and alpha).
ADAPTER_SPECS = [
    dict(rank=4, alpha=8, target_modules=ATTENTION),
    dict(rank=8, alpha=16, target_modules=[*MLP, "q_proj"], use_rslora=True),
    dict(rank=16, alpha=4, target_modules=ATTENTION + MLP, rank_pattern={"down_proj": 4}, alpha_pattern={"v_proj": 32}),
]


def prompts_of(count: int, vocab: int, seed: int = 0, max_len: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, max_len))] for _ in range(count)]


def check_mixed_batch_matches_peft(base: Path, root: Path, vocab: int, num_prompts: int, new_tokens: int,
                                   max_len: int = 40, **settings) -> None:
    """Every prompt (3 to `max_len` tokens) with each of three adapters and with none, all
    in one call, equals PEFT's greedy output for that prompt and adapter."""
    adapters = [build_lora_adapter(base, root / f"adapter{i}", seed=i, **spec) for i, spec in enumerate(ADAPTER_SPECS)]
    prompts = prompts_of(num_prompts, vocab, max_len=max_len)
    expected = {None: peft_greedy(base, None, prompts, new_tokens)}
    for i, folder in enumerate(adapters):
        expected[i] = peft_greedy(base, folder, prompts, new_tokens)
    assert all(expected[i] != expected[None] for i in range(3)), "an adapter that changes nothing tests nothing"
    requests = [LoRARequest(f"adapter{i}", i + 1, str(folder)) for i, folder in enumerate(adapters)]
    choice = [None, 0, 1, 2] * num_prompts
    rows = [{"prompt_token_ids": prompts[j // 4]} for j in range(len(choice))]
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=16, **settings) as llm:
        outs = llm.generate(rows, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                            lora_request=[None if c is None else requests[c] for c in choice], use_tqdm=False)
        assert llm.llm_engine.lora_manager.stats.num_slot_loads == 3
        if settings.get("attention_backend") == "triton":
            assert llm.llm_engine.lora_manager.batch.kernel is not None  # the SGMV kernel ran
    for j, (out, c) in enumerate(zip(outs, choice)):
        assert out.outputs[0].token_ids == expected[c][j // 4], f"prompt {j // 4}, adapter {c}"
        assert out.lora_request == out.outputs[0].lora_request == (None if c is None else requests[c])


def test_mixed_adapters_match_peft_on_a_tiny_qwen2(tmp_path):
    base = build_tiny_model(tmp_path / "qwen2", "qwen2")
    check_mixed_batch_matches_peft(base, tmp_path, vocab=300, num_prompts=6, new_tokens=12)


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_mixed_adapters_on_the_triton_backend(tmp_path):
    """Under Triton's interpreter where there is no GPU, which takes about a quarter of a
    second per sequence and decode step here: shorter prompts (15, 22 and 5 tokens; two
    reach a second KV block) and four new tokens, so a prefill step (each adapter's rows a
    group of 42) and three decode steps of 12 rows."""
    base = build_tiny_model(tmp_path / "qwen2", "qwen2")
    check_mixed_batch_matches_peft(base, tmp_path, vocab=300, num_prompts=3, new_tokens=4, max_len=24,
                                   attention_backend="triton")


@pytest.mark.slow
def test_mixed_adapters_match_peft_on_the_embedded_model(tmp_path):
    from engine.model_loader.embedded_model import ensure_embedded_model

    check_mixed_batch_matches_peft(ensure_embedded_model(), tmp_path, vocab=49152, num_prompts=3, new_tokens=10)


@pytest.fixture(scope="module")
def qwen2_with_adapters(tmp_path_factory):
    """A tiny Qwen2 with four adapters (ids 1-4)."""
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "qwen2", "qwen2")
    folders = [build_lora_adapter(base, root / f"a{i}", rank=8, alpha=16, target_modules=ATTENTION + MLP, seed=10 + i)
               for i in range(4)]
    return base, [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def test_two_slots_four_adapters_in_one_call(qwen2_with_adapters):
    base, requests = qwen2_with_adapters
    prompts = [{"prompt_token_ids": p} for p in prompts_of(4, 300, seed=1)]
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=8) as roomy:
        alone = {r.lora_int_id: [o.outputs[0].token_ids for o in roomy.generate(prompts, GREEDY, lora_request=r,
                                                                                  use_tqdm=False)]
                 for r in requests}
    rows = [(p, r) for r in requests for p in prompts]
    random.Random(2).shuffle(rows)
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8) as llm:
        manager = llm.llm_engine.lora_manager
        steps = []
        activate = manager.activate
        manager.activate = lambda reqs: steps.append({r.lora_int_id for r in reqs}) or activate(reqs)
        outs = llm.generate([p for p, _ in rows], GREEDY, lora_request=[r for _, r in rows], use_tqdm=False)
        assert max(len(s) for s in steps) == 2
        assert manager.stats.num_slot_evictions >= 2 and manager.stats.num_host_evictions >= 1
    for (prompt, request), out in zip(rows, outs):
        assert out.outputs[0].token_ids == alone[request.lora_int_id][prompts.index(prompt)]


def test_prefix_cache_is_keyed_by_adapter(qwen2_with_adapters):
    base, requests = qwen2_with_adapters
    prompt = {"prompt_token_ids": prompts_of(1, 300, seed=3)[0] * 3}  # several full blocks
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        first = llm.generate(prompt, GREEDY, lora_request=requests[0], use_tqdm=False)[0]
        other = llm.generate(prompt, GREEDY, lora_request=requests[1], use_tqdm=False)[0]
        plain = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
        again = llm.generate(prompt, GREEDY, lora_request=requests[0], use_tqdm=False)[0]
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in (first, other, plain)}) == 3


@pytest.mark.cpu_kinds
def test_adapter_requests_do_not_depend_on_the_batch_in_bfloat16(qwen2_with_adapters):
    base, requests = qwen2_with_adapters
    prompts = [{"prompt_token_ids": p} for p in prompts_of(12, 300, seed=4)]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    with LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=3, max_lora_rank=8) as llm:
        llm.generate(prompts[1], params, lora_request=requests[0], use_tqdm=False)
        [alone] = llm.generate(prompts[0], params, lora_request=requests[2], use_tqdm=False)  # in slot 1
    with LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=3, max_lora_rank=8) as llm:
        mixed = llm.generate(prompts, params, lora_request=[requests[i % 4] for i in range(2, 14)], use_tqdm=False)
        assert llm.llm_engine.lora_manager.stats.num_slot_evictions > 0
    assert mixed[0].outputs[0].token_ids == alone.outputs[0].token_ids  # in slot 0, among other adapters
    assert mixed[0].outputs[0].cumulative_logprob == alone.outputs[0].cumulative_logprob


def test_bad_adapters_are_reported_per_row_before_any_work(qwen2_with_adapters, tmp_path):
    base, requests = qwen2_with_adapters
    other = build_tiny_model(tmp_path / "llama", "llama")  # hidden size 64 too, but 2 kv heads of 16
    wide = build_tiny_model(tmp_path / "wide", "qwen2")
    config = json.loads((wide / "config.json").read_text())
    config.update(hidden_size=96, intermediate_size=160)
    shutil.rmtree(wide)
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps(config))
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(wide)).save_pretrained(wide)
    mismatched = build_lora_adapter(wide, tmp_path / "mismatch", rank=4, alpha=8, target_modules=ATTENTION, seed=0)
    high_rank = build_lora_adapter(base, tmp_path / "rank32", rank=32, alpha=8, target_modules=ATTENTION, seed=0)
    head = build_lora_adapter(other, tmp_path / "head", rank=4, alpha=8, target_modules=["lm_head"], seed=0)
    rows = [
        LoRARequest("missing", 11, str(tmp_path / "nowhere")),
        LoRARequest("rank32", 12, str(high_rank)),
        LoRARequest("head", 13, str(head)),
        LoRARequest("mismatch", 14, str(mismatched)),
        LoRARequest("same id, other folder", 1, str(mismatched)),
        requests[0],
    ]
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8) as llm:
        llm.generate("ok", GREEDY, lora_request=requests[0], use_tqdm=False)
        steps = llm.llm_engine.stats.num_steps
        with pytest.raises(ValueError) as error:
            llm.generate(["a b c"] * len(rows), GREEDY, lora_request=rows, use_tqdm=False)
        assert llm.llm_engine.stats.num_steps == steps  # nothing ran
    message = str(error.value)
    assert "5 invalid prompt row(s)" in message
    assert "row 0, lora_request: LoRA adapter 'missing'" in message and "does not exist" in message
    assert "row 1, lora_request:" in message and "rank 32 is above max_lora_rank=8" in message
    assert "max_lora_rank=32" in message
    assert "row 2, lora_request:" in message and "lm_head" in message and "LoRA goes on" in message
    assert "row 3, lora_request:" in message and "maps 64 to" in message and str(tmp_path / "wide") in message
    assert "row 4, lora_request:" in message and "already names" in message
    assert "row 5" not in message
    with LLM(str(base), dtype="float32") as plain:
        with pytest.raises(ValueError, match="row 0, lora_request: adapters need LLM\\(enable_lora=True"):
            plain.generate("a", GREEDY, lora_request=requests[0], use_tqdm=False)


def test_adapters_under_preemption_priorities_chunking_and_forks(qwen2_with_adapters):
    """Twenty requests (n of 1 or 3, greedy or seeded, three adapters or none) through two
    slots, priorities, a 40-token step budget and a KV cache small enough to preempt:
    every completion equals the request run alone, bit for bit (bfloat16)."""
    base, requests = qwen2_with_adapters
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": p} for p in prompts_of(20, 300, seed=5)]
    params = [SamplingParams(n=n, temperature=0.8 if n > 1 else t, seed=i,  # vLLM refuses n > 1 at temperature 0
                             max_tokens=rng.randint(3, 20), ignore_eos=True)
              for i, n, t in ((i, rng.choice([1, 3]), rng.choice([0, 0.8])) for i in range(20))]
    adapters = [rng.choice([None, *requests[:3]]) for _ in range(20)]

    def completions(outs):
        return [[c.token_ids for c in o.outputs] for o in outs]

    with LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=3, max_lora_rank=8) as llm:
        alone = [completions(llm.generate(p, s, lora_request=a, use_tqdm=False))[0]
                 for p, s, a in zip(prompts, params, adapters)]
        room_for_160_tokens = 160 * llm.llm_engine.model_runner.kv_cache.bytes_per_token
    with LLM(str(base), dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=8, scheduling_policy="priority",
             kv_cache_memory=room_for_160_tokens, max_num_batched_tokens=40) as small:
        outs = small.generate(prompts, params, lora_request=adapters, priority=[rng.randint(0, 3) for _ in range(20)],
                              use_tqdm=False)
        assert small.llm_engine.scheduler.num_preemptions > 0
        assert small.llm_engine.lora_manager.stats.num_slot_evictions > 0
    assert completions(outs) == alone


def test_adapters_on_a_mixture_of_experts(tmp_path):
    """Qwen2-MoE (a sparse first layer with a shared expert, a dense second layer): an
    adapter on the attention projections matches PEFT; one that reaches into the
    mixture-of-experts layer (PEFT's gate_proj matches the shared expert's) is refused
    before any work, saying what to train instead, and so is one naming Mixtral's experts."""
    base = build_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe")
    attention = build_lora_adapter(base, tmp_path / "attention", rank=4, alpha=8, target_modules=ATTENTION, seed=0)
    gate = build_lora_adapter(base, tmp_path / "gate", rank=4, alpha=8, target_modules=["gate_proj"], seed=1)
    prompts = prompts_of(3, 300, max_len=30)
    expected = peft_greedy(base, attention, prompts, 8)
    assert expected != peft_greedy(base, None, prompts, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        good = LoRARequest("attention", 1, str(attention))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=good, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        with pytest.raises(ValueError) as error:
            llm.generate("a b", params, lora_request=LoRARequest("gate", 2, str(gate)), use_tqdm=False)
    message = str(error.value)
    assert "model.layers.0.mlp.shared_expert.gate_proj, part of a mixture-of-experts layer" in message
    assert 'target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]' in message

    mixtral = build_tiny_model(tmp_path / "mixtral", "mixtral")
    experts = build_lora_adapter(mixtral, tmp_path / "experts", rank=4, alpha=8, target_modules=["q_proj"], seed=2)
    config = json.loads((experts / "adapter_config.json").read_text())
    (experts / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "w1"]}))
    with LLM(str(mixtral), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        with pytest.raises(ValueError, match="targets w1, which this model cannot adapt .*mixtures of experts"):
            llm.generate("a b", params, lora_request=LoRARequest("experts", 3, str(experts)), use_tqdm=False)
