"""Qwen2-Audio against transformers (float32, a tiny random checkpoint with the real
WhisperFeatureExtractor and Qwen2AudioProcessor as the reference): the encoder's rows, the
prompt's ids, and greedy generation with clips in a batch with text prompts, whole, in
chunks that end inside a clip's tokens, and under preemption; a chat with an input_audio
part; bad rows refused alone."""

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
import transformers

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.hardware import detect_cpu
from engine.layers.linear import Linear
from engine.model_loader.loader import load_model
from engine.model_loader.model_config import resolve_model_config
from engine.models.qwen2_audio import Qwen2AudioProcessor
from engine.multimodal.audio import read_audio
from engine.quantization.int8 import Int8LinearMethod
from tests.audio_models import assert_config_token_mismatch_refused
from tests.audio_models.qwen2_audio import CHUNK_SECONDS, build_tiny_qwen2_audio

RATE = 16_000
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio"))


@pytest.fixture(scope="module")
def reference(folder) -> transformers.PreTrainedModel:
    return transformers.Qwen2AudioForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_processor(folder) -> transformers.Qwen2AudioProcessor:
    return transformers.Qwen2AudioProcessor(transformers.AutoFeatureExtractor.from_pretrained(folder),
                                            transformers.AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def processor(folder) -> Qwen2AudioProcessor:
    return Qwen2AudioProcessor(folder, transformers.AutoConfig.from_pretrained(folder),
                               transformers.AutoTokenizer.from_pretrained(folder))


def clips() -> list[tuple[np.ndarray, int]]:
    """(waveform, rate) clips drawn with numpy: a chirp, a tone with noise at 44.1 kHz (resampled
    to 16 kHz), speech-like bursts padded with silence filling the whole window, a short blip."""
    rng = np.random.default_rng(0)
    t = np.arange(int(1.3 * RATE)) / RATE
    chirp = 0.5 * np.sin(2 * np.pi * (200 + 800 * t) * t)
    t44 = np.arange(int(0.7 * 44_100)) / 44_100
    tone = 0.3 * np.sin(2 * np.pi * 440 * t44) + 0.05 * rng.standard_normal(len(t44))
    bursts = np.zeros(CHUNK_SECONDS * RATE)
    for start in (0.3, 0.8, 1.4):
        n = int(0.25 * RATE)
        envelope = np.hanning(n)
        at = int(start * RATE)
        bursts[at : at + n] = envelope * np.sin(2 * np.pi * 180 * np.arange(n) / RATE) * (1 + rng.random(n))
    blip = 0.4 * np.sin(2 * np.pi * 1000 * np.arange(int(0.12 * RATE)) / RATE)
    return [(chirp.astype(np.float32), RATE), (tone.astype(np.float32), 44_100), (bursts.astype(np.float32), RATE),
            (blip.astype(np.float32), RATE)]


def waveform(clip: tuple[np.ndarray, int]) -> np.ndarray:
    """The clip as both sides' extractor reads it: mono at 16 kHz (the engine's resampling)."""
    return read_audio(clip).waveform


def chat_text(folder: Path, parts: list[dict]) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)


def reference_inputs(hf_processor, text: str, audio: list[tuple[np.ndarray, int]]) -> dict[str, torch.Tensor]:
    if not audio:
        return dict(hf_processor(text=[text], return_tensors="pt"))
    return dict(hf_processor(text=[text], audio=[waveform(clip) for clip in audio], sampling_rate=RATE,
                             return_tensors="pt"))


def load(folder: Path) -> torch.nn.Module:
    model_config = resolve_model_config(folder, EngineConfig(dtype="float32", device="cpu", quantization=None),
                                        eos_token_id=2)
    return load_model(model_config)


def test_encoder_rows_match_transformers(folder, reference, hf_processor, processor):
    """Each clip's rows, from our features in one batch, equal what transformers' model puts
    in its audio tokens (its projector's output over its processor's features, cut to the
    clip's tokens); the features themselves are the extractor's."""
    audio = clips()
    inputs = [processor.audio_inputs(read_audio(clip)) for clip in audio]
    theirs = reference_inputs(hf_processor, "<|AUDIO|>" * len(audio), audio)
    assert torch.equal(torch.cat([i["input_features"] for i in inputs]), theirs["input_features"])
    assert torch.cat([i["mel_frames"] for i in inputs]).tolist() == theirs["feature_attention_mask"].sum(-1).tolist()
    captured = []
    handle = reference.model.multi_modal_projector.register_forward_hook(lambda m, a, out: captured.append(out))
    try:
        with torch.no_grad():
            reference(**theirs)
    finally:
        handle.remove()
    model = load(folder)
    with torch.no_grad():
        ours = model.embed_images(inputs)
    counts = [len(processor.audio_tokens(read_audio(clip)).replacement) for clip in audio]
    assert counts == [len(rows) for rows in ours] == [32, 17, 50, 3]
    for rows, expected, count in zip(ours, captured[0], counts, strict=True):
        torch.testing.assert_close(rows, expected[:count], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("count", [0, 1, 2])
def test_prompt_ids_match_transformers_processor(folder, hf_processor, processor, count):
    audio = clips()[:count]
    parts = [{"type": "text", "text": "Listen."}, *[{"type": "audio"}] * count, {"type": "text", "text": "Well?"}]
    text = chat_text(folder, parts)
    prompt = processor.apply(processor.tokenizer(text).input_ids, {"audio": [read_audio(clip) for clip in audio]})
    assert prompt.prompt_token_ids == reference_inputs(hf_processor, text, audio)["input_ids"][0].tolist()
    assert [f.modality for f in prompt.features] == ["audio"] * count


def requests(folder: Path) -> list[tuple[str, list]]:
    """A clip, text only, two clips in one prompt, the first clip again with other text."""
    chirp, tone, bursts, _ = clips()
    return [
        (chat_text(folder, [{"type": "audio"}, {"type": "text", "text": "What is this sound?"}]), [chirp]),
        (chat_text(folder, [{"type": "text", "text": "Paris is the capital"}]), []),
        (chat_text(folder, [{"type": "audio"}, {"type": "text", "text": "and"}, {"type": "audio"}]), [tone, bursts]),
        (chat_text(folder, [{"type": "audio"}, {"type": "text", "text": "Describe it."}]), [chirp]),
    ]


@pytest.fixture(scope="module")
def expected(folder, reference, hf_processor) -> list[list[int]]:
    """transformers' greedy tokens for each of `requests`."""
    tokens = []
    for text, audio in requests(folder):
        inputs = reference_inputs(hf_processor, text, audio)
        with torch.no_grad():
            out = reference.generate(**inputs, do_sample=False, max_new_tokens=GREEDY.max_tokens)
        tokens.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    return tokens


def kv_token_bytes(folder: Path) -> int:
    text = json.loads((folder / "config.json").read_text())["text_config"]
    return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * (
        text["hidden_size"] // text["num_attention_heads"]) * 4


def wav_base64(clip: tuple[np.ndarray, int]) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, *clip, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize("setting", ["default", "chunked", "preempting"])
def test_greedy_generation_matches_transformers(folder, processor, expected, setting):
    """Clips and text prompts in one batch: whole, in chunks of 8 tokens (which end inside
    the clips' tokens), and with a cache that holds only the longest prompt (preemptions).
    Three distinct clips: three encoder runs, whatever the setting."""
    prompts = [{"prompt": text, "multi_modal_data": {"audio": audio}} if audio else {"prompt": text}
               for text, audio in requests(folder)]
    longest = GREEDY.max_tokens + max(
        len(processor.apply(processor.tokenizer(text).input_ids, {"audio": [read_audio(c) for c in audio]})
            .prompt_token_ids) for text, audio in requests(folder))
    settings = {"default": {}, "chunked": {"max_num_batched_tokens": 8},
                "preempting": {"kv_cache_memory": (-(-longest // 16) + 1) * 16 * kv_token_bytes(folder)}}[setting]
    with LLM(str(folder), dtype="float32", quantization=None, **settings) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        stats, engine = llm.get_stats(), llm.llm_engine
        assert stats.num_audios_encoded == 3 and stats.num_images_encoded == 0
        if setting == "preempting":
            assert engine.scheduler.num_preemptions > 0
        if setting == "default":  # the chirp again, sent as OpenAI's input_audio part: no new encoder run
            chat = [{"role": "user", "content": [
                {"type": "input_audio", "input_audio": {"data": wav_base64(clips()[0]), "format": "wav"}},
                {"type": "text", "text": "What is this sound?"}]}]
            assert list(llm.chat(chat, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == expected[0]
            assert llm.get_stats().num_audios_encoded == 3
            assert llm.audio_placeholder == "<|audio_bos|><|AUDIO|><|audio_eos|>" and llm.image_placeholder is None
            assert llm.audio_limits.max_seconds == CHUNK_SECONDS


def test_bad_rows_fail_alone_before_any_work(folder):
    """A clip longer than the window (transformers would cut it silently), one with no
    samples, one too short for a token, bytes that are no audio, an image: each its row's
    message; the good row runs."""
    chirp = clips()[0]
    long_clip = (np.zeros(3 * RATE, np.float32), RATE)
    with LLM(str(folder), dtype="float32", quantization=None) as llm:
        p = llm.audio_placeholder
        rows = [
            {"prompt": p + " ok", "multi_modal_data": {"audio": chirp}},
            {"prompt": p + " long", "multi_modal_data": {"audio": long_clip}},
            {"prompt": p + " empty", "multi_modal_data": {"audio": (np.zeros(0, np.float32), RATE)}},
            {"prompt": p + " short", "multi_modal_data": {"audio": (np.zeros(100, np.float32), RATE)}},
            {"prompt": p + " noise", "multi_modal_data": {"audio": b"not audio at all"}},
            {"prompt": p + " picture", "multi_modal_data": {"image": b"\x89PNG"}},
            {"prompt": p + p + " one", "multi_modal_data": {"audio": [chirp]}},
        ]
        problems = llm.validate(rows, GREEDY)
        assert problems[0] is None
        assert problems[1] == ("multi_modal_data['audio'][0]: the clip is 3.0 s long, more than the 2 s accepted: cut "
                               "it into shorter clips upstream")
        assert problems[2].startswith("multi_modal_data['audio'][0]: the waveform has no samples")
        assert problems[3] == ("multi_modal_data['audio'][0]: the qwen2_audio processor refuses the 0.01 s clip "
                               "(ValueError: 100 samples make no audio token: give at least 321 samples (20.0625 ms)): "
                               "cut or fix the clip upstream")
        assert problems[4].startswith("multi_modal_data['audio'][0]: the bytes are not audio")
        assert problems[5] == (
            "multi_modal_data['image']: the model reads no image: drop the images, or load a vision-language model "
            "(Idefics3ForConditionalGeneration, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration, "
            "Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, SmolVLMForConditionalGeneration)")
        assert problems[6].startswith("prompt: has more audio placeholders")
        assert llm.get_stats().num_steps == 0
        outputs = llm.generate(rows[:1], GREEDY, use_tqdm=False)
        assert len(outputs[0].outputs[0].token_ids) == GREEDY.max_tokens


@pytest.mark.skipif(not detect_cpu().int8_products, reason="int8 products need VNNI, AMX or AVX2")
def test_int8_quantizes_the_audio_tower_calibrated_on_drawn_clips(folder, processor):
    """int8 covers the audio tower and projector as the decoder, each projection smoothed by
    the input ranges the calibration clips reached; a clip's rows stay close to float32's."""
    inputs = [processor.audio_inputs(read_audio(clip)) for clip in clips()]
    rows = {}
    for quantization in (None, "int8"):
        with LLM(str(folder), dtype="float32", quantization=quantization) as llm:
            model = llm.llm_engine.model_runner.model
            with torch.inference_mode():
                rows[quantization] = torch.cat(model.embed_images(inputs))
    tower = [m for name, m in model.named_modules()
             if name.startswith(("audio_tower.", "multi_modal_projector.")) and isinstance(m, Linear)]
    assert tower and all(isinstance(m.quant_method, Int8LinearMethod) and m.smoothing is not None for m in tower)
    cosine = torch.nn.functional.cosine_similarity(rows[None], rows["int8"], dim=-1)
    assert cosine.min() > 0.98, cosine.min()


def test_a_tokenizer_whose_audio_token_is_not_the_configs_is_refused_naming_both(folder):
    """config.json's audio token against the tokenizer's "<|AUDIO|>": a folder whose files
    disagree fails when its processor is made, naming both ids."""
    assert_config_token_mismatch_refused(folder, Qwen2AudioProcessor, "<|AUDIO|>", "audio_token_index")
