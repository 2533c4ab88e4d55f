"""`LLM.transcribe` (issue 65): a clip longer than Whisper's window is cut into windows at
quiet points and each window's tokens equal transformers' `generate` on that window; the text
is the windows' texts joined in order; a clip's language, when not given, is the language
token the model picks first, as transformers' logits pick it; bad settings and clips are
refused before any work, and a model that does not transcribe says so."""

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from engine import LLM, SamplingParams
from engine.multimodal.audio_windows import split_windows
from tests.audio_models.whisper import CHUNK_SECONDS, SAMPLE_RATE, build_tiny_whisper
from tests.tiny_models import build_tiny_model

NEW_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """Bursts of tones with quiet gaps between them, so that the cuts fall in the gaps."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    rng = np.random.default_rng(seed)
    envelope = (np.sin(2 * np.pi * 1.3 * t + seed) > -0.2).astype(np.float32)
    return (envelope * 0.4 * np.sin(2 * np.pi * rng.uniform(150, 600) * t)
            + rng.normal(0, 0.01, len(t))).astype(np.float32)


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("transcribe"))


@pytest.fixture(scope="module")
def reference(whisper):
    """transformers' model, feature extractor and tokenizer (float32)."""
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper, dtype=torch.float32).eval()
    return (model, transformers.WhisperFeatureExtractor.from_pretrained(whisper),
            transformers.AutoTokenizer.from_pretrained(whisper))


@pytest.fixture(scope="module")
def llm(whisper):
    with LLM(str(whisper), dtype="float32") as built:
        yield built


def hf_tokens(reference, window: np.ndarray, prompt: str) -> list[int]:
    model, extractor, tokenizer = reference
    features = extractor(window, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False).input_ids])
    out = model.generate(features, decoder_input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, -NEW_TOKENS:].tolist()


def test_a_long_clip_is_cut_into_windows_each_as_transformers_transcribes_it(llm, reference):
    long_clip, short_clip = speech_like(5.3, 0), speech_like(1.2, 1)
    before = llm.get_stats().num_audios_encoded
    long_out, short_out = llm.transcribe([(long_clip, SAMPLE_RATE), (short_clip, SAMPLE_RATE)], language="en",
                                         sampling_params=GREEDY, use_tqdm=False)
    windows = split_windows(long_clip, SAMPLE_RATE, CHUNK_SECONDS)
    assert long_out.windows == windows and len(windows) == 4 and len(short_out.windows) == 1
    prompt = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
    for window, output in zip(windows, long_out.outputs):
        assert list(output.outputs[0].token_ids) == hf_tokens(reference, long_clip[window.start:window.end], prompt)
    assert long_out.text == "".join(o.outputs[0].text for o in long_out.outputs)
    assert list(short_out.outputs[0].outputs[0].token_ids) == hf_tokens(reference, short_clip, prompt)
    assert (long_out.language, long_out.duration_s) == ("en", pytest.approx(5.3))
    assert llm.get_stats().num_audios_encoded - before == 5  # one encoder run per window


def test_translation_with_a_prompt_follows_vllms_whisper_prompt(llm, reference):
    clip = speech_like(1.5, 2)
    (out,) = llm.transcribe((clip, SAMPLE_RATE), language="fr", task="translate", prompt=" earlier words",
                            sampling_params=GREEDY, use_tqdm=False)
    prompt = "<|prev|> earlier words<|startoftranscript|><|fr|><|translate|><|notimestamps|>"
    assert out.outputs[0].prompt == prompt
    assert list(out.outputs[0].outputs[0].token_ids) == hf_tokens(reference, clip, prompt)


def test_the_language_is_detected_from_the_first_window_when_not_given(llm, reference):
    model, extractor, tokenizer = reference
    clips = [speech_like(2.5, seed) for seed in (3, 4)]
    outs = llm.transcribe([(c, SAMPLE_RATE) for c in clips], sampling_params=GREEDY, use_tqdm=False)
    languages = {tokenizer.convert_tokens_to_ids(f"<|{code}|>"): code for code in ("en", "fr")}
    start = torch.tensor([[tokenizer.convert_tokens_to_ids("<|startoftranscript|>")]])
    for clip, out in zip(clips, outs):
        first = clip[:split_windows(clip, SAMPLE_RATE, CHUNK_SECONDS)[0].end]
        features = extractor(first, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        with torch.no_grad():
            logits = model(input_features=features, decoder_input_ids=start).logits[0, -1]
        ids = list(languages)
        assert out.language == languages[ids[int(torch.argmax(logits[ids]))]]
        assert out.outputs[0].prompt == f"<|startoftranscript|><|{out.language}|><|transcribe|><|notimestamps|>"


def test_bad_settings_and_clips_are_refused_before_any_work(llm):
    steps = llm.get_stats().num_steps
    with pytest.raises(ValueError) as refused:
        llm.transcribe([(speech_like(1.0, 5), SAMPLE_RATE), b"not audio", (np.zeros(0, np.float32), SAMPLE_RATE)],
                       language="xx", task="summarize", use_tqdm=False)
    message = str(refused.value)
    assert message.startswith("transcribe: language: 'xx' is not a language of the model's tokenizer (en, fr): pass "
                              "one of them, or None to detect each clip's; task: 'summarize' must be one of "
                              "'transcribe', 'translate'; audio[1]: ")
    assert "audio[2]: " in message and "audio[0]" not in message
    assert llm.get_stats().num_steps == steps


def test_a_model_that_does_not_transcribe_says_so(tmp_path):
    with LLM(str(build_tiny_model(tmp_path / "llama", "llama")), dtype="float32", max_model_len=64) as text_model:
        with pytest.raises(ValueError, match="the model does not transcribe: load a speech-to-text model"):
            text_model.transcribe((speech_like(1.0, 6), SAMPLE_RATE))
