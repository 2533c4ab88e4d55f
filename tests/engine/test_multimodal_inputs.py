"""`multi_modal_data` and chat parts of more than one modality, before any model reads audio:
a fake processor (LLaVA's, which also reads audio: one placeholder token per 0.1 s of a clip)
pairs each modality's placeholders with its items, the row check reads audio in every form
vLLM takes into the request, names the field of a bad item, and holds each modality to its
own limit; chat parts (OpenAI's input_audio, vLLM's audio_url, transformers' audio) reach
`multi_modal_data["audio"]` (in `LLM.chat` and batch lines alike); and a model that reads no audio refuses it per row. The request
checks run against a stand-in engine (no model is loaded); the text-only model is a real one."""

import base64
import io
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile
import transformers

from engine import LLM, SamplingParams
from engine.config import MultiModalSettings
from engine.entrypoints.chat_utils import chat_items, chat_messages_problem, render_chat, unread_parts_problem
from engine.entrypoints.inputs import RequestChecker
from engine.entrypoints.openai.protocol import CHAT_URL
from engine.entrypoints.openai.serving import generation_request
from engine.models.llava import LlavaMultiModalProcessor
from engine.multimodal.audio import AudioLimits, PromptAudio, audio_hash, read_audio
from engine.multimodal.image import read_image
from engine.multimodal.inputs import ItemTokens
from engine.multimodal.processing import MultiModalInputError
from tests.engine.test_vision_engine import picture
from tests.tiny_models import build_tiny_model, build_tokenizer
from tests.vision_models.llava import build_tiny_llava

RATE = 16_000
SETTINGS = SamplingParams(temperature=0, max_tokens=4)


class ImageAndAudioProcessor(LlavaMultiModalProcessor):
    """LLaVA's processor reading audio too: a clip stands for "<|endoftext|>" (a token the
    tiny tokenizer has and prompts do not use) and becomes one such token per 0.1 s; a clip
    under 50 ms is refused, as a feature extractor refuses one shorter than its frame."""

    modalities = ("image", "audio")
    audio_placeholder = "<|endoftext|>"
    audio_limits = AudioLimits(sample_rate=RATE, max_seconds=2.0)

    @property
    def audio_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.audio_placeholder)

    def audio_tokens(self, audio: PromptAudio) -> ItemTokens:
        if audio.seconds < 0.05:
            raise ValueError("the clip is shorter than one 50 ms frame")
        return ItemTokens([self.placeholder_ids["audio"]] * math.ceil(audio.seconds * 10))


def tone(seconds: float, rate: int = RATE, freq: float = 440.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = RATE) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def data_uri(samples: np.ndarray, rate: int = RATE) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav_bytes(samples, rate)).decode()


@pytest.fixture(scope="module")
def processor(tmp_path_factory) -> ImageAndAudioProcessor:
    folder = build_tiny_llava(tmp_path_factory.mktemp("llava"))
    return ImageAndAudioProcessor(folder, transformers.AutoConfig.from_pretrained(folder),
                                  transformers.AutoTokenizer.from_pretrained(folder))


def checker(processor: ImageAndAudioProcessor, limit: dict[str, int] | None = None) -> RequestChecker:
    """The row checks against a stand-in engine with `processor` and ample room (no model)."""
    settings = MultiModalSettings(limit_mm_per_prompt=limit)
    config = SimpleNamespace(max_num_seqs=8, max_logprobs=20, max_items_per_prompt=settings.max_items_per_prompt)
    model_config = SimpleNamespace(max_model_len=512, hf_config=SimpleNamespace(vocab_size=len(processor.tokenizer)),
                                   sampling_defaults={})
    return RequestChecker(SimpleNamespace(mm_processor=processor, tokenizer=processor.tokenizer, config=config,
                                          model_config=model_config, kv_cache_tokens=4096))


def check(processor: ImageAndAudioProcessor, rows: list, limit: dict[str, int] | None = None) -> list:
    return checker(processor, limit).check(rows, SETTINGS, None, None)


def test_placeholders_pair_with_their_own_modality_in_prompt_order(processor):
    audio, image = processor.placeholders["audio"], processor.placeholders["image"]
    ids = processor.tokenizer(f"hear{audio} see{image} and{audio}{audio} end").input_ids
    clips = [read_audio((tone(s), RATE)) for s in (0.3, 0.1, 0.52)]
    prompt = processor.apply(ids, {"image": [read_image(picture(1))], "audio": clips})
    assert [f.modality for f in prompt.features] == ["audio", "image", "audio", "audio"]
    assert [f.length for f in prompt.features if f.modality == "audio"] == [3, 1, 6]
    assert [f.identifier for f in prompt.features if f.modality == "audio"] == [c.content_hash for c in clips]
    for feature in prompt.features:
        token = processor.placeholder_ids[feature.modality]
        assert prompt.prompt_token_ids[feature.offset : feature.end] == [token] * feature.length
    assert prompt.features[2].offset == prompt.features[1].end + len(processor.tokenizer(" and").input_ids)
    # The expanded ids process to themselves: ids round-trip.
    again = processor.apply(prompt.prompt_token_ids, {"image": [read_image(picture(1))], "audio": clips})
    assert again.prompt_token_ids == prompt.prompt_token_ids
    with pytest.raises(MultiModalInputError, match=r"2 audio clip\(s\) but the prompt has 1 audio placeholder"):
        processor.apply(processor.tokenizer(f"{audio} x").input_ids, {"audio": clips[:2]})
    with pytest.raises(MultiModalInputError, match=r"more audio placeholders '<\|endoftext\|>' than the 0 audio"):
        processor.apply(processor.tokenizer(f"{audio} x").input_ids, {})


def test_audio_in_every_form_reaches_the_request(processor, tmp_path):
    clip = tone(0.25)
    path = tmp_path / "clip.wav"
    path.write_bytes(wav_bytes(clip))
    forms = [(clip, RATE), (tone(0.25, 44_100), 44_100), wav_bytes(clip), str(path), path, f"file://{path}",
             data_uri(clip)]
    audio = processor.placeholders["audio"]
    rows = [{"prompt": f"{audio} what is it?", "multi_modal_data": {"audio": form}} for form in forms]
    rows.append({"prompt": f"{audio}{audio} two", "multi_modal_data": {"audio": [(clip, RATE), str(path)]}})
    checked = check(processor, rows)
    assert [row.problem for row in checked] == [None] * len(rows)
    same = audio_hash(read_audio((clip, RATE), processor.audio_limits).waveform, RATE)
    for row in checked:
        features = row.request.multi_modal.features
        assert {f.modality for f in features} == {"audio"} and all(f.length == 3 for f in features)
        assert isinstance(features[0].source, PromptAudio)
    assert checked[1].request.multi_modal.features[0].identifier != same  # resampled: other samples
    assert {r.request.multi_modal.features[0].identifier for i, r in enumerate(checked) if i != 1} == {same}


def test_bad_items_name_their_field_and_fail_alone(processor, tmp_path):
    audio, image = processor.placeholders["audio"], processor.placeholders["image"]
    good = (tone(0.2), RATE)
    rows = [
        {"prompt": f"{audio}{audio} x", "multi_modal_data": {"audio": [good, b"not audio at all"]}},
        {"prompt": f"{audio} x", "multi_modal_data": {"audio": (tone(3.0), RATE)}},
        {"prompt": f"{audio} x", "multi_modal_data": {"audio": f"file://{tmp_path}/absent.wav"}},
        {"prompt": f"{audio} x", "multi_modal_data": {"audio": (tone(0.01), RATE)}},
        {"prompt": f"{audio} x", "multi_modal_data": {"audio": tone(0.2)}},
        {"prompt": f"{image}{audio} x", "multi_modal_data": {"image": picture(1), "audio": [good, good]}},
        {"prompt": f"{image} x", "multi_modal_data": {"video": [picture(1)]}},
        {"prompt": f"{image} x", "multi_modal_data": {"image": picture(1), "sound": good}},
        {"prompt": f"{image}{audio} ok", "multi_modal_data": {"image": picture(1), "audio": good}},
    ]
    problems = [row.problem for row in check(processor, rows)]
    expected = ["multi_modal_data['audio'][1]: the bytes are not audio", "multi_modal_data['audio'][0]: the clip is "
                "3.0 s long", "multi_modal_data['audio'][0]: ", "multi_modal_data['audio'][0]: the llava processor "
                "refuses the 0.01 s clip (ValueError: the clip is shorter", "multi_modal_data['audio'][0]: expected "
                "(waveform, sample_rate)", "multi_modal_data: 2 audio clip(s) but the prompt has 1",
                "multi_modal_data['video']: the model reads no video: drop the videos", "multi_modal_data: expected {'image'"]
    for problem, start in zip(problems, expected):
        assert problem is not None and problem.startswith(start), (start, problem)
    assert "absent.wav" in problems[2] and "sample rate beside it" in problems[4] and "'sound'" in problems[7]
    assert problems[-1] is None


def test_each_modality_has_its_own_limit(processor):
    audio, image = processor.placeholders["audio"], processor.placeholders["image"]
    clip = (tone(0.1), RATE)

    def row(images: int, clips: int) -> dict:
        return {"prompt": image * images + audio * clips + " x",
                "multi_modal_data": {"image": [picture(1)] * images, "audio": [clip] * clips}}

    defaults = [r.problem for r in check(processor, [row(8, 4), row(9, 0), row(0, 5)])]
    assert defaults[0] is None and "holds 9 images, but limit_mm_per_prompt allows 8" in defaults[1]
    assert defaults[2] == (
        "multi_modal_data: holds 5 audio clips, but limit_mm_per_prompt allows 4: use fewer audio clips, or raise "
        "LLM(limit_mm_per_prompt={'audio': n})")
    limited = [r.problem for r in check(processor, [row(2, 1), row(1, 2), row(9, 0)], {"audio": 1})]
    assert limited[0] is None and "allows 1" in limited[1] and "allows 8" in limited[2]
    assert MultiModalSettings(limit_mm_per_prompt={"video": 0, "audio": 0}).problems() == []
    for bad in ({"sound": 1}, {"audio": -1}, {"audio": "2"}, {"image": True}):
        assert "limit_mm_per_prompt must be None or a dict of {'image': n, 'audio': n, 'video': n}" in \
            MultiModalSettings(limit_mm_per_prompt=bad).problems()[0]


def test_chat_audio_parts_become_multi_modal_data(tmp_path):
    clip = tone(0.2)
    path = tmp_path / "clip.wav"
    path.write_bytes(wav_bytes(clip))
    encoded = base64.b64encode(wav_bytes(clip)).decode()
    parts = [{"type": "input_audio", "input_audio": {"data": encoded, "format": "wav"}},
             {"type": "audio_url", "audio_url": {"url": data_uri(clip)}},
             {"type": "audio_url", "audio_url": f"file://{path}"},
             {"type": "audio", "audio": (clip, RATE)},
             {"type": "image_url", "image_url": {"url": "x.png"}},
             {"type": "text", "text": "Which is louder?"}]
    messages = [{"role": "user", "content": parts}]
    assert chat_messages_problem(messages) is None
    items = chat_items(messages)
    assert items["image"] == ["x.png"] and items["audio"][1:3] == [data_uri(clip), f"file://{path}"]
    assert items["audio"][0] == f"data:audio/wav;base64,{encoded}"
    hashes = {read_audio(value).content_hash for value in items["audio"]}
    assert hashes == {read_audio((clip, RATE)).content_hash}
    build_tokenizer(tmp_path / "tok")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    template = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
                "{% else %}<{{ p['type'] }}>{% endif %}{% endfor %}{% endfor %}")
    prompt = render_chat(tokenizer, messages, chat_template=template)
    assert prompt["prompt"] == "<audio><audio><audio><audio><image>Which is louder?"
    assert prompt["multi_modal_data"] == items
    line = generation_request(CHAT_URL, {"messages": messages, "chat_template": template}, tokenizer)
    assert line.prompts == [prompt]  # a batch line's parts pass its checks alike
    assert unread_parts_problem(messages, {"image", "audio"}) is None
    assert unread_parts_problem(messages, {"image"}) == (
        "message 0: content part 0 is audio ('input_audio'), but the model reads no audio: drop the audio, or "
        "load an audio-language model")


@pytest.mark.parametrize("part, words", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "flac"}}, "'format': 'wav' or 'mp3'"),
    ({"type": "input_audio", "input_audio": "AAAA"}, "has no audio: give {'type': 'input_audio'"),
    ({"type": "audio_url", "audio_url": {"link": "x.wav"}}, "has no audio: give {'type': 'audio_url', 'audio_url': "
                                                             "...} with {'url': 'data:...' or 'file://...'}"),
    ({"type": "audio"}, "has no audio: give {'type': 'audio', 'audio': ...}"),
    ({"type": "video_url", "video_url": {"link": "x.mp4"}}, "has no video: give {'type': 'video_url', 'video_url': "
                                                             "...} with {'url': 'data:...' or 'file://...'}"),
    ({"type": "file", "file": {"url": "x.pdf"}}, "content part 0 is 'file': content parts are text"),
])
def test_bad_audio_parts_say_what_to_give(part, words):
    problem = chat_messages_problem([{"role": "user", "content": [part]}])
    assert problem is not None and problem.startswith("message 0: content part 0") and words in problem, problem


def test_a_text_model_refuses_audio_per_row_and_in_chat(tmp_path):
    with LLM(str(build_tiny_model(tmp_path / "llama", "llama")), dtype="float32", max_model_len=64) as llm:
        rows = [{"prompt": "hi", "multi_modal_data": {"audio": (tone(0.2), RATE)}}, "hi",
                {"prompt": "hi", "multi_modal_data": {"audio": b"not even audio"}},
                {"prompt": "hi", "multi_modal_data": {"image": picture(1), "audio": (tone(0.2), RATE)}}]
        problems = llm.validate(rows, SETTINGS)
        assert problems[0] == problems[2] == (
            "multi_modal_data['audio']: the model reads no audio: drop the audio clips, or load an audio-language "
            "model (Qwen2AudioForConditionalGeneration, VoxtralForConditionalGeneration, "
            "WhisperForConditionalGeneration)")
        assert problems[1] is None and "the model reads text only" in problems[3]
        assert llm.video_placeholder is None and llm.video_limits is None
        messages = [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x.wav"}}]}]
        with pytest.raises(ValueError, match=r"conversation 0, message 0: content part 0 is audio \('audio_url'\), "
                                             "but the model reads no audio"):
            llm.chat(messages, use_tqdm=False)
        assert llm.get_stats().num_steps == 0
