"""Whisper through the engine (an encoder-decoder model): greedy tokens equal transformers'
`generate` in float32 for a batch of clips of different lengths, tasks and languages, however
the engine schedules them (decoder prompts in chunks, preemption and recompute), each distinct
clip encoded once; and the rows it refuses."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from engine import LLM, BeamSearchParams, SamplingParams
from engine.hardware import detect_cpu
from engine.kernels import triton as triton_kernels
from engine.layers.linear import Linear
from engine.quantization import int8_by_default
from engine.quantization.int8 import Int8LinearMethod
from engine.worker.kv_cache import KVCache, prefill_metadata, prefill_cross_inputs
from tests.audio_models.whisper import SAMPLE_RATE, build_tiny_whisper

PROMPTS = [
    "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
    "<|startoftranscript|><|fr|><|translate|><|notimestamps|>",
    "<|prev|> hello there, how are you<|startoftranscript|><|en|><|transcribe|><|notimestamps|>",
    "<|startoftranscript|><|en|><|translate|>",
]
NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper"))


def clips() -> list[np.ndarray]:
    """Four clips of different lengths within the 2 s window: a tone, a chirp, noise, and
    bursts of a low tone with silence between them."""
    rng = np.random.default_rng(0)
    t = np.arange(2 * SAMPLE_RATE) / SAMPLE_RATE
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    chirp = 0.3 * np.sin(2 * np.pi * (200 + 800 * t) * t)
    bursts = 0.4 * np.sin(2 * np.pi * 150 * t) * (np.sin(2 * np.pi * 3 * t) > 0)
    return [wave.astype(np.float32) for wave in (tone[:16000], chirp[:12000], rng.normal(0, 0.2, 8000),
                                                  bursts[:30000])]


def rows() -> list[dict]:
    """The four clips with their prompts, and the first clip again under the third prompt."""
    waves = clips()
    given = [{"prompt": p, "multi_modal_data": {"audio": (w, SAMPLE_RATE)}} for p, w in zip(PROMPTS, waves)]
    return given + [{"prompt": PROMPTS[2], "multi_modal_data": {"audio": (waves[0], SAMPLE_RATE)}}]


@pytest.fixture(scope="module")
def expected(whisper) -> list[list[int]]:
    """transformers' greedy tokens for each row, one clip at a time (float32)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(whisper)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(whisper)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    tokens = []
    for row in rows():
        wave, rate = row["multi_modal_data"]["audio"]
        features = extractor(wave, sampling_rate=rate, return_tensors="pt").input_features
        prompt = torch.tensor([tokenizer(row["prompt"], add_special_tokens=False).input_ids])
        out = model.generate(features, decoder_input_ids=prompt, max_new_tokens=NEW_TOKENS, do_sample=False)
        tokens.append(out[0, -NEW_TOKENS:].tolist())
    return tokens


def kv_token_bytes(folder: Path) -> int:
    """Bytes of float32 keys and values one token takes (the decoder's layers; cross-attention
    shares their blocks)."""
    config = json.loads((folder / "config.json").read_text())
    return 2 * config["decoder_layers"] * config["d_model"] * 4


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(rows(), GREEDY, use_tqdm=False)]


def test_greedy_tokens_equal_transformers_and_each_clip_is_encoded_once(whisper, expected):
    with LLM(str(whisper), dtype="float32") as llm:
        assert greedy(llm) == expected
        assert llm.get_stats().num_audios_encoded == 4  # the repeated clip once
        assert llm.get_stats().num_images_encoded == 0
        manager = llm.llm_engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks  # cross blocks returned with the rest


@pytest.mark.parametrize("schedule", ["chunked", "preempting", "preempting_async"])
def test_chunked_decoder_prompts_and_preemption_change_no_token(whisper, expected, schedule):
    cross_blocks = -(-100 // 16)
    # Chunks of 3 tokens (a clip's 100 encoder rows still run whole: a step's first item
    # always fits); or two sequences' cross blocks and first decoder blocks and one block
    # more: every sequence outgrows its first block (prompt plus 20 tokens), so one of two is
    # preempted, and recomputes from its cross blocks on; also with asynchronous scheduling
    # (a GPU's default: a preempted sequence may have a token in flight).
    settings = ({"max_num_batched_tokens": 3} if schedule == "chunked" else
                {"kv_cache_memory": (2 * (cross_blocks + 1) + 1) * 16 * kv_token_bytes(whisper),
                 "async_scheduling": schedule == "preempting_async"})
    with LLM(str(whisper), dtype="float32", **settings) as llm:
        assert greedy(llm) == expected
        engine = llm.llm_engine
        assert engine.stats.num_audios_encoded == 4  # held in the encoder cache through recomputes
        assert engine.scheduler.num_preemptions > 0 or schedule == "chunked"
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_whisper_rows_are_refused_with_their_fix(whisper):
    wave = clips()[0]
    long_clip = np.zeros(3 * SAMPLE_RATE, dtype=np.float32)
    with LLM(str(whisper), dtype="float32") as llm:
        good = {"prompt": PROMPTS[0], "multi_modal_data": {"audio": (wave, SAMPLE_RATE)}}
        bad = [
            PROMPTS[0],
            {"prompt": PROMPTS[0], "multi_modal_data": {"audio": [(wave, SAMPLE_RATE), (wave, SAMPLE_RATE)]}},
            {"prompt": PROMPTS[0], "multi_modal_data": {"audio": (long_clip, SAMPLE_RATE)}},
            {"prompt": PROMPTS[0], "multi_modal_data": {"image": b"png"}},
            {"prompt": PROMPTS[0], "multi_modal_data": {"audio": b"not audio"}},
        ]
        explicit = {"encoder_prompt": {"prompt": "", "multi_modal_data": good["multi_modal_data"]},
                    "decoder_prompt": PROMPTS[0]}  # vLLM's encoder-decoder form
        assert llm.generate([explicit], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
            llm.generate([good], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        bad += [{"encoder_prompt": {"prompt": "text", "multi_modal_data": good["multi_modal_data"]},
                 "decoder_prompt": PROMPTS[0]},
                {"encoder_prompt": {"multi_modal_data": good["multi_modal_data"]}, "decoder_prompt": 5}]
        problems = llm.validate([good, *bad])
        assert problems[0] is None
        assert "whisper generates from audio only" in problems[1]
        assert "one clip per prompt, got 2" in problems[2]
        assert "3.00 s long" in problems[3] and "LLM.transcribe" in problems[3]
        assert "multi_modal_data['image']: the model reads no image" in problems[4]
        assert problems[5].startswith("multi_modal_data['audio'][0]:")
        assert problems[6].startswith("encoder_prompt: expected {'prompt': '', 'multi_modal_data'")
        assert problems[7].startswith("decoder_prompt: expected the decoder's prompt")
        with pytest.raises(ValueError, match="encoder-decoder model with no chat template"):
            llm.chat([{"role": "user", "content": [{"type": "audio", "audio": (wave, SAMPLE_RATE)}]}], GREEDY)
        steps = llm.get_stats().num_steps
        with pytest.raises(ValueError, match="nothing was run"):
            llm.generate(bad[:1], GREEDY, use_tqdm=False)
        assert llm.get_stats().num_steps == steps


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_attention_backend_gives_the_same_tokens(whisper, expected, backend):
    """The compiled CPU kernel (the default, above), PyTorch's products and the Triton
    kernels (under Triton's interpreter without a GPU: three rows, 6 tokens, a greedy prefix
    of the reference's) read the cross blocks alike."""
    if backend == "triton" and not triton_kernels.installed():
        pytest.skip("triton is not installed")
    count, tokens = (3, 6) if backend == "triton" else (len(expected), NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(str(whisper), dtype="float32", attention_backend=backend) as llm:
        outputs = llm.generate(rows()[:count], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == [e[:tokens] for e in expected[:count]]


def test_beams_and_completions_share_their_cross_blocks(whisper, monkeypatch):
    """Beam search equals transformers' (`generate(num_beams=2)`: the same beams, in order,
    with the same scores), n=2 completions run; every fork shares its parent's cross blocks
    (never copied), and every block is free again after."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(whisper)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(whisper)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    given = rows()[:3]
    references = []
    for row in given:
        wave, rate = row["multi_modal_data"]["audio"]
        features = extractor(wave, sampling_rate=rate, return_tensors="pt").input_features
        prompt = torch.tensor([tokenizer(row["prompt"], add_special_tokens=False).input_ids])
        # The generation mixin's own: Whisper's long-form `generate` does not return several beams.
        out = transformers.GenerationMixin.generate(
            model, input_features=features, decoder_input_ids=prompt, num_beams=2, num_return_sequences=2,
            do_sample=False, max_new_tokens=8, output_scores=True, return_dict_in_generate=True)
        references.append([(s[-8:].tolist(), score) for s, score in zip(out.sequences, out.sequences_scores.tolist())])
    with LLM(str(whisper), dtype="float32") as llm:
        manager = llm.llm_engine.block_manager
        shared = []
        fork = manager.fork

        def recording_fork(parent, child):
            fork(parent, child)
            shared.append(bool(parent.blocks.cross) and child.blocks.cross == parent.blocks.cross)

        monkeypatch.setattr(manager, "fork", recording_fork)
        outputs = llm.beam_search(given, BeamSearchParams(beam_width=2, max_tokens=8))
        for output, expected in zip(outputs, references):
            assert [b.tokens[-8:] for b in output.sequences] == [tokens for tokens, _ in expected]
            assert [b.score for b in output.sequences] == pytest.approx([s for _, s in expected], abs=1e-4)
        sampled = llm.generate(given, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)
        assert all(len(o.outputs) == 2 for o in sampled)
        assert shared and all(shared)
        assert manager.num_free_blocks == manager.num_blocks


def test_default_settings_load_and_run_and_unsupported_ones_are_refused(whisper):
    """Every setting at its default (the dtype the CPU picks, quantization "auto": int8 where a
    text model's would be): the context is the decoder's max_target_positions, not the
    encoder's numbers the config's mapped names give; LoRA and a quantization other than int8
    are refused."""
    with LLM(str(whisper)) as llm:
        engine = llm.llm_engine
        int8 = int8_by_default(torch.device("cpu"), engine.model_config.dtype)
        assert engine.model_config.max_model_len == 64
        assert engine.model_config.quantization == ("int8" if int8 else None)
        assert engine.kv_cache_tokens % 16 == 0 and llm.image_placeholder is None
        outputs = llm.generate(rows()[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    with pytest.raises(ValueError, match="LoRA adapters are not supported for encoder-decoder"):
        LLM(str(whisper), dtype="float32", enable_lora=True)
    with pytest.raises(ValueError, match="quantization='fp8' is not supported"):
        LLM(str(whisper), dtype="float32", quantization="fp8")


def test_a_quantized_whisper_checkpoint_is_refused_naming_its_method(whisper, tmp_path):
    """A checkpoint stored with a method (AWQ here) is refused at load, as an asked-for one is:
    only int8 at load covers the encoder and the decoder."""
    folder = tmp_path / "whisper-awq"
    shutil.copytree(whisper, folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization='awq' is not supported for WhisperForConditionalGeneration"):
        LLM(str(folder))


@pytest.mark.skipif(not detect_cpu().int8_products, reason="int8 products need VNNI, AMX or AVX2")
def test_int8_covers_encoder_and_decoder_calibrated_on_drawn_clips(whisper):
    """int8 quantizes every projection of the encoder and the decoder, each smoothed by the
    input ranges reached on the calibration clips and text (the decoder attending to the
    clips' encoder rows, which its cross-attention keys and values are made of); the encoder's
    rows and the prompt tokens' log-probabilities stay close to float32's."""
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(whisper)
    features = extractor(clips(), sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    encoded, logprobs = {}, {}
    for quantization in (None, "int8"):
        with LLM(str(whisper), dtype="float32", quantization=quantization) as llm:
            model = llm.llm_engine.model_runner.model
            with torch.inference_mode():
                encoded[quantization] = torch.stack(model.embed_images([{"input_features": features}]))
            outputs = llm.generate(rows(), scored, use_tqdm=False)
            logprobs[quantization] = [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outputs]
    projections = [m for name, m in model.named_modules() if isinstance(m, Linear) and name != "proj_out"]
    assert len(projections) == 2 * 6 + 2 * 10  # 6 in each encoder layer, 10 in each decoder layer
    assert all(isinstance(m.quant_method, Int8LinearMethod) and m.smoothing is not None for m in projections)
    cosine = torch.nn.functional.cosine_similarity(encoded[None], encoded["int8"], dim=-1)
    assert cosine.min() > 0.98, cosine.min()
    gaps = [abs(a - b) for ours, theirs in zip(logprobs[None], logprobs["int8"]) for a, b in zip(ours, theirs)]
    assert max(gaps) < 0.15, gaps


def test_the_memory_profile_runs_the_decoder_with_stand_in_cross_inputs(whisper):
    """A GPU sizes the KV cache after a measured pass (`_profile_step`), which gives an
    encoder-decoder model stand-in cross inputs: here that pass's inputs run on the CPU, over a
    one-block scratch cache, as the profile's do."""
    with LLM(str(whisper), dtype="float32") as llm:
        model = llm.llm_engine.model_runner.model
        scratch = KVCache(model, "torch", 16, torch.float32, torch.device("cpu"))
        scratch.allocate(1)
        meta = prefill_metadata([5, 3], scratch)
        cross = prefill_cross_inputs(model, meta, scratch)
        assert cross.states.shape == (200, 64) and cross.meta.context_lens == [100] * 8
        scratch.backend.prepare(meta)
        scratch.backend.prepare(cross.meta)
        with torch.inference_mode():
            assert model(torch.zeros_like(meta.positions), meta.positions, meta, cross=cross).shape == (8, 64)


def test_encoder_rows_equal_transformers_whisper_encoder(whisper):
    """The loaded model's encoder (the shared `AudioEncoder` under Whisper's checkpoint names)
    on a step's batch of clips: transformers' `model.encoder` rows, rtol 1e-4."""
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(whisper)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    features = extractor([wave for wave in clips()], sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    with torch.no_grad():
        expected = model.model.encoder(features).last_hidden_state
    with LLM(str(whisper), dtype="float32") as llm:
        with torch.inference_mode():
            encoded = llm.llm_engine.model_runner.model.embed_images([{"input_features": f[None]} for f in features])
    assert len(encoded) == 4 and all(r.shape == (100, 64) for r in encoded)
    torch.testing.assert_close(torch.stack(encoded), expected, rtol=1e-4, atol=1e-4)


def test_a_row_whose_cross_blocks_do_not_fit_the_cache_is_refused(whisper):
    """The row check counts a prompt's cross blocks (7 of 16 tokens for 100 encoder rows) in
    its KV need: 4 prompt tokens and 20 more fit 8 blocks alone, not beside them."""
    with LLM(str(whisper), dtype="float32", kv_cache_memory=8 * 16 * kv_token_bytes(whisper)) as llm:
        assert llm.llm_engine.kv_cache_tokens == 128
        row = rows()[0]
        assert llm.validate([row], SamplingParams(max_tokens=8)) == [None]  # 12 + 112 tokens
        [problem] = llm.validate([row], SamplingParams(max_tokens=20))
        assert problem == ("max_tokens: prompt plus max_tokens needs 24 and its encoder rows 112 tokens of KV cache, "
                           "which holds 128: lower max_tokens or raise kv_cache_memory / gpu_memory_utilization")
