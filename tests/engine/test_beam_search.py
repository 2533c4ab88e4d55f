"""`LLM.beam_search` against transformers' `generate(num_beams=k, do_sample=False)` in
float32: the same beams in the same order with the same length-penalised scores; beams
sharing KV blocks; beam search in one batch with ordinary requests, under preemption,
with asynchronous scheduling and with a LoRA adapter."""

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine import LLM, BeamSearchParams, LoRARequest, SamplingParams
from engine.entrypoints.inputs import RequestChecker
from tests.lora_adapters import build_lora_adapter
from tests.tiny_models import build_tiny_model

EOS = 2
PROMPTS = [[5, 17, 33, 40], [6, 18], [7, 19, 35], [90, 41, 12, 250, 7, 7], [300], [44, 45, 46, 47, 48, 49, 50]]


def eos_prone_model(folder: Path, family: str) -> Path:
    """A tiny random model whose end token is the most likely one at some positions, so
    that beams end at many lengths: its LM-head row points along the mean final hidden
    state, scaled by what the random rows' largest logits need."""
    build_tiny_model(folder, family, tie=False)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.randint(3, 320, (8, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[-1].flatten(0, 1)
        top = model.get_output_embeddings()(hidden).max(-1).values
    direction = hidden.mean(0) / hidden.mean(0).norm()
    along = hidden @ direction
    # The end token wins where scale * along > top: in a tenth of the rows that lie along it.
    scale = torch.quantile((top / along)[along > 0], 0.1)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"][EOS] = direction * scale
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def reference_beams(model, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
                    ignore_eos: bool = False) -> list[tuple[list[int], float]]:
    """transformers' `width` best beams of one prompt (generated ids, up to and with the
    end token) and their scores."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, num_return_sequences=width,
                             do_sample=False, max_new_tokens=max_tokens, length_penalty=length_penalty,
                             eos_token_id=None if ignore_eos else [EOS], pad_token_id=0, output_scores=True,
                             return_dict_in_generate=True)
    beams = []
    for sequence, score in zip(out.sequences, out.sequences_scores.tolist()):
        generated = sequence[len(prompt):].tolist()
        if not ignore_eos and EOS in generated:
            generated = generated[: generated.index(EOS) + 1]
        beams.append((generated, score))
    return beams


def assert_same_beams(outputs, references) -> None:
    for output, expected in zip(outputs, references):
        prompt_len = len(output.sequences[0].tokens) - len(output.sequences[0].logprobs)
        got = [(b.tokens[prompt_len:], b.score) for b in output.sequences]
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, score), (_, want) in zip(got, expected):
            assert score == pytest.approx(want, abs=1e-4)


@pytest.fixture(scope="module")
def eos_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("beam_models")
    return {family: eos_prone_model(root / family, family) for family in ("llama", "qwen3", "gemma2", "phi3", "mixtral")}


CASES = [(2, 1.0), (4, 1.0), (3, 0.0), (3, 2.0), (4, -1.0)]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "phi3", "mixtral"])
def test_beams_equal_transformers(eos_models, family):
    """Each family, with widths 2 to 4 and length penalties from -1 to 2: the same best
    beams, in order, with the same scores; some beams end on the end token and some at
    max_tokens, so both ways of finishing (and the early stop) are compared."""
    folder = eos_models[family]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reasons = set()
    with LLM(str(folder), dtype="float32", max_model_len=256, max_num_seqs=16) as llm:
        for width, penalty in CASES if family == "llama" else CASES[1:3]:
            params = BeamSearchParams(beam_width=width, max_tokens=12, length_penalty=penalty)
            outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
            assert_same_beams(outputs, [reference_beams(model, p, width, 12, penalty) for p in PROMPTS])
            reasons |= {b.finish_reason for o in outputs for b in o.sequences}
    assert reasons == {"stop", "length"}


def test_ignore_eos_runs_every_beam_to_max_tokens(eos_models):
    folder = eos_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with LLM(str(folder), dtype="float32", max_model_len=256) as llm:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:3]],
                                  BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True))
    assert_same_beams(outputs, [reference_beams(model, p, 3, 10, 1.0, ignore_eos=True) for p in PROMPTS[:3]])
    assert all(len(b.logprobs) == 10 and b.finish_reason == "length" for o in outputs for b in o.sequences)


def test_output_fields_follow_vllm(eos_models):
    """`tokens` holds prompt and output, `text` the output without the end token (with it
    under include_stop_str_in_output), `logprobs` the candidates of each step, and
    `cum_logprob` their chosen tokens' sum."""
    folder = eos_models["llama"]
    with LLM(str(folder), dtype="float32", max_model_len=256) as llm:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.decode(p) for p in PROMPTS]
        for include in (False, True):
            params = BeamSearchParams(beam_width=4, max_tokens=12, include_stop_str_in_output=include)
            outputs = llm.beam_search(prompts, params)
            for prompt, output in zip(prompts, outputs):
                prompt_ids = tokenizer(prompt).input_ids
                for beam in output.sequences:
                    assert beam.tokens[: len(prompt_ids)] == prompt_ids
                    generated = beam.tokens[len(prompt_ids):]
                    assert len(beam.logprobs) == len(generated)
                    assert all(len(step) == 8 for step in beam.logprobs)
                    assert beam.cum_logprob == pytest.approx(sum(s[t].logprob for s, t in zip(beam.logprobs, generated)))
                    kept = generated if include or beam.finish_reason == "length" else generated[:-1]
                    assert beam.text == tokenizer.decode(kept)
                assert [b.score for b in output.sequences] == sorted((b.score for b in output.sequences), reverse=True)
            assert any(b.finish_reason == "stop" for o in outputs for b in o.sequences)


def blocks_in_use(llm: LLM) -> int:
    manager = llm.llm_engine.block_manager
    return manager.num_blocks - manager.num_free_blocks


def test_beams_share_kv_blocks(eos_models):
    """Four beams of a 100-token prompt hold the prompt's blocks once: at their peak (10
    blocks here) far fewer than four separate sequences of that length would (32)."""
    folder = eos_models["llama"]
    prompt = [(7 * i) % 300 + 3 for i in range(100)]
    params = BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    with LLM(str(folder), dtype="float32", max_model_len=256, block_size=16, enable_prefix_caching=False) as llm:
        engine = llm.llm_engine
        [request] = [row.request for row in RequestChecker(engine).check_beam_search(
            [{"prompt_token_ids": prompt}], params, None)]
        request.submit(engine, "beams")
        peak, finished = 0, []
        while engine.has_unfinished_requests():
            finished += engine.step_requests()
            peak = max(peak, blocks_in_use(llm))
        output = engine.output(finished[0])
        assert blocks_in_use(llm) == 0
    separate = 4 * math.ceil((len(prompt) + 20) / 16)  # 32
    assert peak <= math.ceil((len(prompt) + 20) / 16) + 4  # one sequence's blocks, and a tail block per beam
    assert peak < separate
    assert len(output.sequences) == 4 and all(len(b.tokens) == 120 for b in output.sequences)


def test_beams_beside_ordinary_requests_and_under_preemption(eos_models):
    """Beam searches and greedy requests in the same steps of one engine whose cache holds
    12 blocks, so that sequences are preempted and recomputed: each result equals what
    it is alone (transformers' beams; the engine's own greedy output)."""
    folder = eos_models["llama"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [p * 6 for p in PROMPTS[:4]]  # 24, 12, 18 and 36 tokens
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(folder), dtype="float32", max_model_len=256) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                               use_tqdm=False)]
    token_bytes = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, float32
    with LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=12 * 16 * token_bytes,
             max_num_batched_tokens=32) as llm:
        engine = llm.llm_engine
        checker = RequestChecker(engine)
        rows = checker.check_beam_search([{"prompt_token_ids": p} for p in prompts], params, None)
        rows += checker.check([{"prompt_token_ids": p} for p in prompts], greedy, None, None)
        for i, row in enumerate(rows):
            row.request.submit(engine, str(i))
        results = {}
        while engine.has_unfinished_requests():
            results |= {seq.request_id: engine.output(seq) for seq in engine.step_requests()}
        assert engine.scheduler.num_preemptions > 0
        assert blocks_in_use(llm) == 0
    assert_same_beams([results[str(i)] for i in range(4)], [reference_beams(model, p, 3, 12, 1.0, True)
                                                             for p in prompts])
    assert [results[str(4 + i)].outputs[0].token_ids for i in range(4)] == alone


def test_asynchronous_scheduling_gives_the_same_beams(eos_models):
    folder = eos_models["qwen3"]
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    rows = [{"prompt_token_ids": p} for p in PROMPTS]
    with LLM(str(folder), dtype="float32", max_model_len=256) as llm:
        expected = [[(b.tokens, b.score) for b in o.sequences] for o in llm.beam_search(rows, params)]
    with LLM(str(folder), dtype="float32", max_model_len=256, async_scheduling=True) as llm:
        got = [[(b.tokens, b.score) for b in o.sequences] for o in llm.beam_search(rows, params)]
    assert got == expected


def test_beam_search_with_a_lora_adapter_equals_peft(eos_models, tmp_path):
    """Beams of the base model and of an adapter in one call: each prompt's beams equal
    transformers' beam search with PEFT's adapter (or without it)."""
    from peft import PeftModel

    folder = eos_models["llama"]
    adapter = build_lora_adapter(folder, tmp_path / "adapter", rank=8, alpha=16,
                                 target_modules=["q_proj", "v_proj", "down_proj"], seed=3)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                      adapter).eval()
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("tuned", 1, str(adapter))
    with LLM(str(folder), dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8) as llm:
        outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS[:3] * 2], params,
                                  lora_request=[None] * 3 + [lora] * 3)
    expected = [reference_beams(base, p, 3, 8, 1.0, True) for p in PROMPTS[:3]]
    expected += [reference_beams(tuned, p, 3, 8, 1.0, True) for p in PROMPTS[:3]]
    assert expected[:3] != expected[3:], "an adapter that changes nothing tests nothing"
    assert_same_beams(outputs, expected)
    assert all(b.lora_request == lora for o in outputs[3:] for b in o.sequences)


def test_bad_beam_search_settings_are_refused_before_any_work(eos_models):
    with pytest.raises(ValueError, match="beam_width must be a positive integer"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    with LLM(str(eos_models["llama"]), dtype="float32", max_model_len=64, max_num_seqs=4) as llm:
        with pytest.raises(ValueError, match="beam_width=5 beams run side by side, but max_num_seqs is 4"):
            llm.beam_search(["hello"], BeamSearchParams(beam_width=5, max_tokens=4))
        with pytest.raises(ValueError, match=r"row 1, prompt: is empty"):
            llm.beam_search(["hello", ""], BeamSearchParams(beam_width=2, max_tokens=4))
        assert llm.get_stats().num_steps == 0
