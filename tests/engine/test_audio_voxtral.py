"""Voxtral against transformers (float32, a tiny random checkpoint with the real
WhisperFeatureExtractor; no mistral_common: prompt ids are written by hand and features made
as transformers' VoxtralProcessor makes them): the encoder's rows, the token count rule, and
greedy generation with clips of one and several windows beside text prompts, whole, in
chunks and under preemption."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_loader import folder as model_folder
from engine.model_loader.folder import ModelLoadError, check_model_folder
from engine.model_loader.loader import load_model
from engine.model_loader.model_config import resolve_model_config
from engine.models.voxtral import VoxtralProcessor, tokens_per_window
from engine.multimodal.audio import read_audio
from tests.audio_models import assert_config_token_mismatch_refused
from tests.audio_models.voxtral import CHUNK_SECONDS, TOKENS_PER_WINDOW, build_tiny_voxtral

RATE = 16_000
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_voxtral(tmp_path_factory.mktemp("voxtral"))


@pytest.fixture(scope="module")
def reference(folder) -> transformers.PreTrainedModel:
    return transformers.VoxtralForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def processor(folder) -> VoxtralProcessor:
    return VoxtralProcessor(folder, transformers.AutoConfig.from_pretrained(folder),
                            transformers.AutoTokenizer.from_pretrained(folder))


def clips() -> list[tuple[np.ndarray, int]]:
    """(waveform, rate) clips drawn with numpy: a 1.3 s chirp (one window), 5 s of tones with
    noise at 44.1 kHz (three windows once resampled), 2 s of silence-padded bursts (exactly one)."""
    rng = np.random.default_rng(1)
    t = np.arange(int(1.3 * RATE)) / RATE
    chirp = 0.5 * np.sin(2 * np.pi * (200 + 800 * t) * t)
    t44 = np.arange(5 * 44_100) / 44_100
    tones = 0.3 * np.sin(2 * np.pi * (300 + 200 * (t44 > 2.5)) * t44) + 0.05 * rng.standard_normal(len(t44))
    bursts = np.zeros(CHUNK_SECONDS * RATE)
    n = int(0.3 * RATE)
    for start in (int(0.2 * RATE), int(1.1 * RATE)):
        bursts[start : start + n] = np.hanning(n) * np.sin(2 * np.pi * 150 * np.arange(n) / RATE)
    return [(chirp.astype(np.float32), RATE), (tones.astype(np.float32), 44_100), (bursts.astype(np.float32), RATE)]


def reference_features(folder: Path, audio: list[tuple[np.ndarray, int]]) -> torch.Tensor:
    """transformers' VoxtralProcessor._retrieve_input_features on the clips (resampled as the
    engine does): each padded to whole windows, its features split into windows, stacked."""
    extractor = transformers.AutoFeatureExtractor.from_pretrained(folder)
    pieces = []
    for clip in audio:
        features = extractor(read_audio(clip).waveform, sampling_rate=RATE, padding=True, truncation=False,
                             pad_to_multiple_of=extractor.n_samples, return_tensors="pt")["input_features"]
        pieces.append(features.reshape(extractor.feature_size, -1, extractor.nb_max_frames).transpose(0, 1))
    return torch.cat(pieces)


def prompt_text(question: str, audio_tokens: list[int] | None = None, count: int = 0) -> str:
    """Mistral's instruction format with a clip's placeholder (or, for the reference, its
    expanded tokens) before the question."""
    clips_text = ("".join("[BEGIN_AUDIO]" + "[AUDIO]" * n for n in audio_tokens) if audio_tokens is not None
                  else "[BEGIN_AUDIO][AUDIO]" * count)
    return f"<s>[INST]{clips_text}{question}[/INST]"


def test_tokens_per_window_is_mistral_commons_rate(folder):
    """12.5 tokens per second of audio padded to 30 s windows, for the hub's encoder; a
    config whose rows do not regroup whole is refused."""
    assert tokens_per_window(transformers.VoxtralConfig().audio_config) == 375 == 12.5 * 30
    assert tokens_per_window(transformers.AutoConfig.from_pretrained(folder).audio_config) == TOKENS_PER_WINDOW
    with pytest.raises(ValueError, match="do not regroup into rows of intermediate_size 96"):
        tokens_per_window(transformers.VoxtralEncoderConfig(hidden_size=32, intermediate_size=96,
                                                            max_source_positions=100))


def test_encoder_rows_match_transformers(folder, reference, processor):
    audio = clips()
    inputs = [processor.audio_inputs(read_audio(clip)) for clip in audio]
    expected_features = reference_features(folder, audio)
    assert torch.equal(torch.cat([i["input_features"] for i in inputs]), expected_features)
    counts = [len(processor.audio_tokens(read_audio(clip)).replacement) for clip in audio]
    assert counts == [TOKENS_PER_WINDOW, 3 * TOKENS_PER_WINDOW, TOKENS_PER_WINDOW]
    model = load_model(resolve_model_config(folder, EngineConfig(dtype="float32", device="cpu", quantization=None),
                                            eos_token_id=2))
    with torch.no_grad():
        expected = reference.get_audio_features(expected_features).pooler_output
        ours = model.embed_images(inputs)
    assert [len(rows) for rows in ours] == counts
    torch.testing.assert_close(torch.cat(ours), expected, rtol=1e-4, atol=1e-4)


def requests() -> list[tuple[str, list]]:
    """A one-window clip, text only, a three-window clip with a one-window clip, the three-window clip again."""
    chirp, tones, bursts = clips()
    return [("What is this sound?", [chirp]), ("Paris is the capital", []), ("Compare them.", [tones, bursts]),
            ("Describe it.", [tones])]


@pytest.fixture(scope="module")
def expected(folder, reference, processor) -> list[list[int]]:
    """transformers' greedy tokens for each of `requests`, from hand-expanded ids."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    tokens = []
    for question, audio in requests():
        counts = [len(processor.audio_tokens(read_audio(clip)).replacement) for clip in audio]
        ids = tokenizer(prompt_text(question, counts), add_special_tokens=False, return_tensors="pt").input_ids
        extra = {"input_features": reference_features(folder, audio)} if audio else {}
        with torch.no_grad():
            out = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=GREEDY.max_tokens, **extra)
        tokens.append(out[0, ids.shape[1]:].tolist())
    return tokens


def kv_token_bytes(folder: Path) -> int:
    text = json.loads((folder / "config.json").read_text())["text_config"]
    return 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * text["head_dim"] * 4


@pytest.mark.parametrize("setting", ["default", "chunked", "preempting"])
def test_greedy_generation_matches_transformers(folder, processor, expected, setting):
    """Clips of one and three windows beside a text prompt: whole, in chunks of 8 tokens, and
    with a cache that holds only the longest prompt (preemptions). Three distinct clips: three
    encoder runs (the three-window clip's windows in one), whatever the setting."""
    prompts = [{"prompt": prompt_text(question, count=len(audio)), "multi_modal_data": {"audio": audio}} if audio
               else {"prompt": prompt_text(question)} for question, audio in requests()]
    longest = GREEDY.max_tokens + max(
        len(processor.apply(processor.tokenizer(p["prompt"]).input_ids,
                            {"audio": [read_audio(c) for c in p.get("multi_modal_data", {}).get("audio", [])]})
            .prompt_token_ids) for p in prompts)
    settings = {"default": {}, "chunked": {"max_num_batched_tokens": 8},
                "preempting": {"kv_cache_memory": (-(-longest // 16) + 1) * 16 * kv_token_bytes(folder)}}[setting]
    with LLM(str(folder), dtype="float32", quantization=None, **settings) as llm:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        assert llm.get_stats().num_audios_encoded == 3
        if setting == "preempting":
            assert llm.llm_engine.scheduler.num_preemptions > 0
        if setting == "default":
            assert llm.audio_placeholder == "[BEGIN_AUDIO][AUDIO]"


def test_bad_rows_fail_alone(folder):
    """A clip whose windows' tokens pass max_model_len, and empty bytes: each its row's message."""
    chirp = clips()[0]
    with LLM(str(folder), dtype="float32", quantization=None, max_model_len=128) as llm:
        twelve_seconds = (np.zeros(12 * RATE, np.float32), RATE)  # six windows: 150 tokens
        rows = [{"prompt": prompt_text("ok", count=1), "multi_modal_data": {"audio": chirp}},
                {"prompt": prompt_text("long", count=1), "multi_modal_data": {"audio": twelve_seconds}},
                {"prompt": prompt_text("empty", count=1), "multi_modal_data": {"audio": b""}}]
        problems = llm.validate(rows, GREEDY)
        assert problems[0] is None
        assert problems[1].startswith("multi_modal_data: the prompt's 1 audio clip(s) take 150 tokens")
        assert problems[2].startswith("multi_modal_data['audio'][0]: the bytes are empty")


def test_a_tekken_only_folder_needs_mistral_common(folder, tmp_path, monkeypatch):
    """A hub Voxtral folder's tokenizer is tekken.json alone: without mistral_common the load
    names the extra that brings it; with it, the folder passes the check."""
    hub_like = tmp_path / "voxtral"
    hub_like.mkdir()
    for name in ("config.json", "model.safetensors"):
        (hub_like / name).symlink_to(folder / name)
    (hub_like / "tekken.json").write_text("{}")
    monkeypatch.setattr(model_folder, "mistral_common_installed", lambda: False)
    with pytest.raises(ModelLoadError, match=r"holds Mistral's tekken.json tokenizer only, which transformers reads "
                                             r"through mistral_common: pip install 'dagster-llm\[audio\]'"):
        LLM(str(hub_like))
    monkeypatch.setattr(model_folder, "mistral_common_installed", lambda: True)
    assert check_model_folder(hub_like) == [hub_like / "model.safetensors"]


def test_a_tokenizer_whose_audio_token_is_not_the_configs_is_refused_naming_both(folder):
    """config.json's audio token against the tokenizer's "[AUDIO]": a folder whose files
    disagree fails when its processor is made, naming both ids."""
    assert_config_token_mismatch_refused(folder, VoxtralProcessor, "[AUDIO]", "audio_token_id")
