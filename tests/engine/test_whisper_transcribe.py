"""`LLM.transcribe` (vLLM's transcription endpoint, offline): a clip longer than Whisper's window
is cut at its quietest moments (`split_windows`), every window of every clip runs in one
`generate`, and a clip's transcript is its windows' texts joined in order; each window's tokens
equal transformers' `generate` on that window. And the refusals, before any work."""

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.multimodal.audio_windows import AudioWindow, split_windows
from tests.audio_models.whisper import CHUNK_SECONDS, SAMPLE_RATE, build_tiny_whisper
from tests.tiny_models import build_tiny_model

PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper"))


def speech_like(samples: int, silences: list[int], seed: int = 0) -> np.ndarray:
    """Tone bursts under noise, with a silent stretch of 1600 samples (100 ms) from each of
    `silences`."""
    rng = np.random.default_rng(seed)
    t = np.arange(samples) / SAMPLE_RATE
    wave = 0.3 * np.sin(2 * np.pi * 220 * t) * (1 + np.sin(2 * np.pi * 4 * t)) + rng.normal(0, 0.05, samples)
    for start in silences:
        wave[start : start + 1600] = rng.normal(0, 1e-4, 1600)
    return wave.astype(np.float32)


def test_windows_end_on_the_planted_silences_and_cover_the_clip():
    # A 2 s window is searched over its last second, in stretches of 1600 samples: the first
    # from 16000, the second from its start + 16000, ...; a silence is planted in each.
    wave = speech_like(96_000, [16_000 + 3 * 1600, 36_800 + 5 * 1600, 60_800 + 8 * 1600])
    windows = split_windows(wave, SAMPLE_RATE, window_s=CHUNK_SECONDS)
    assert windows == [AudioWindow(0, 20_800), AudioWindow(20_800, 44_800), AudioWindow(44_800, 73_600),
                       AudioWindow(73_600, 96_000)]  # the last window is the rest
    assert np.array_equal(np.concatenate([wave[w.start : w.end] for w in windows]), wave)
    noisy = speech_like(200_000, [], seed=1)
    windows = split_windows(noisy, SAMPLE_RATE, window_s=CHUNK_SECONDS)
    assert all(a.end == b.start for a, b in zip(windows, windows[1:])) and windows[-1].end == len(noisy)
    assert all(CHUNK_SECONDS * SAMPLE_RATE / 2 <= w.end - w.start <= CHUNK_SECONDS * SAMPLE_RATE for w in windows[:-1])
    assert split_windows(wave[:32_000], SAMPLE_RATE, window_s=2) == [AudioWindow(0, 32_000)]  # one window's worth
    assert split_windows(wave[:32_001], SAMPLE_RATE, window_s=2) == [AudioWindow(0, 20_800), AudioWindow(20_800, 32_001)]


def test_a_long_clip_transcribes_to_its_windows_generations_joined(whisper):
    """A 6 s clip (4 windows) and a 1 s one in one call: each window's tokens equal
    transformers' `generate` on that window, and the clip's text is its windows' joined."""
    long_clip = speech_like(96_000, [16_000 + 3 * 1600, 36_800 + 5 * 1600, 60_800 + 8 * 1600])
    short_clip = speech_like(16_000, [], seed=2)
    tokenizer = transformers.AutoTokenizer.from_pretrained(whisper)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(whisper)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    prompt = torch.tensor([tokenizer(PROMPT, add_special_tokens=False).input_ids])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    waves = [long_clip[:20_800], long_clip[20_800:44_800], long_clip[44_800:73_600], long_clip[73_600:], short_clip]
    with LLM(str(whisper), dtype="float32") as llm:
        outputs = llm.transcribe([(long_clip, SAMPLE_RATE), (short_clip, SAMPLE_RATE)], sampling_params=params)
        assert llm.get_stats().num_audios_encoded == 5
        by_window = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"audio": (w, SAMPLE_RATE)}} for w in waves],
                                 params, use_tqdm=False)
    long_out, short_out = outputs
    assert [(w.start_s, w.end_s) for w in long_out.windows] == [(0, 1.3), (1.3, 2.8), (2.8, 4.6), (4.6, 6.0)]
    assert long_out.duration_s == 6.0 and short_out.duration_s == 1.0 and len(short_out.windows) == 1
    assert long_out.text == "".join(o.outputs[0].text for o in by_window[:4])
    assert [w.token_ids for w in long_out.windows + short_out.windows] == [list(o.outputs[0].token_ids)
                                                                             for o in by_window]
    assert long_out.token_ids == [t for w in long_out.windows for t in w.token_ids]
    for window, wave in zip(long_out.windows + short_out.windows, waves):
        features = extractor(wave, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        reference = model.generate(features, decoder_input_ids=prompt, max_new_tokens=8, do_sample=False)
        assert window.token_ids == reference[0, -8:].tolist()


def test_transcribe_refuses_before_any_work(whisper, tmp_path):
    clip = (speech_like(16_000, []), SAMPLE_RATE)
    with LLM(str(whisper), dtype="float32") as llm:
        with pytest.raises(ValueError, match="transcribe: language: 'de' is not one of the model's languages: use one of en, fr"):
            llm.transcribe(clip, language="de")
        with pytest.raises(ValueError, match="transcribe: task: expected 'transcribe' or 'translate'"):
            llm.transcribe(clip, task="summarize")
        with pytest.raises(ValueError, match=r"(?s)1 clip\(s\) cannot be read.*audio\[1\]: the waveform has no samples"):
            llm.transcribe([clip, (np.zeros(0, np.float32), SAMPLE_RATE)])
        assert llm.get_stats().num_steps == 0
    with LLM(str(build_tiny_model(tmp_path / "llama", "llama")), dtype="float32") as llm:
        with pytest.raises(ValueError, match="transcribe: the model does not transcribe: load Whisper"):
            llm.transcribe(clip)


def test_language_none_detects_each_clips_language_as_transformers_ranks_them(whisper):
    """vLLM's detection: the greedy token after "<|startoftranscript|>" among the language
    tokens, over the clip's first window; the clip is then transcribed in that language."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(whisper)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(whisper)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    languages = {"en": tokenizer.convert_tokens_to_ids("<|en|>"), "fr": tokenizer.convert_tokens_to_ids("<|fr|>")}
    clips = [speech_like(40_000, [], seed=seed) for seed in range(4)]
    start = torch.tensor([[tokenizer.convert_tokens_to_ids("<|startoftranscript|>")]])
    expected = []
    for clip in clips:
        first = split_windows(clip, SAMPLE_RATE, window_s=CHUNK_SECONDS)[0]
        features = extractor(clip[first.start : first.end], sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        with torch.no_grad():
            logits = model(input_features=features, decoder_input_ids=start).logits[0, -1]
        expected.append(max(languages, key=lambda code: logits[languages[code]].item()))
    assert set(expected) == {"en", "fr"}  # the tiny model (seed 0) hears both among these clips
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with LLM(str(whisper), dtype="float32") as llm:
        outputs = llm.transcribe([(clip, SAMPLE_RATE) for clip in clips], language=None, sampling_params=params)
        assert [o.language for o in outputs] == expected
        given = llm.transcribe([(clip, SAMPLE_RATE) for clip in clips], language=expected[0], sampling_params=params)
    assert [o.token_ids for o in outputs if o.language == expected[0]] == [
        g.token_ids for g, o in zip(given, outputs) if o.language == expected[0]]


def test_a_translation_with_a_prompt_follows_vllms_whisper_prompt(whisper):
    """task="translate" with a prompt: the window runs under `<|prev|>{prompt}` and the task
    tokens, as transformers' `generate` on those ids gives."""
    clip = speech_like(24_000, [], seed=3)
    text = "<|prev|> earlier words<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    tokenizer = transformers.AutoTokenizer.from_pretrained(whisper)
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(whisper)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    features = extractor(clip, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    ids = torch.tensor([tokenizer(text, add_special_tokens=False).input_ids])
    reference = model.generate(features, decoder_input_ids=ids, max_new_tokens=6, do_sample=False)[0, -6:].tolist()
    with LLM(str(whisper), dtype="float32") as llm:
        (out,) = llm.transcribe((clip, SAMPLE_RATE), language="fr", task="translate", prompt=" earlier words",
                                sampling_params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert out.token_ids == reference and out.language == "fr"
