"""Speech to text on a loaded `LLM` (vLLM's transcription and translation endpoints, as an
offline call, `LLM.transcribe`): each clip is read and checked before any work, cut into the
model's windows where it is longer (`split_windows`, at quiet points, as vLLM cuts it), and
every window of every clip runs as one prompt of one `generate`; a clip's text is its windows'
texts joined in order, as vLLM joins them. A clip whose language is not given gets it from a
one-token generation over the model's language tokens on its first window, as vLLM detects it."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.multimodal.audio import AudioInputError, AudioLike, PromptAudio, read_audio
from engine.multimodal.audio_windows import AudioWindow, split_windows
from engine.multimodal.processing import SupportsTranscription
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# `LLM.generate` (prompts, sampling params, use_tqdm= -> outputs in prompt order).
Generate = Callable[..., list[RequestOutput]]

TASKS = ("transcribe", "translate")


@dataclass(frozen=True)
class TranscriptionOutput:
    """One clip's transcript: `text`, its windows' texts joined in order; the `language` it
    was transcribed in (given or detected); its duration; its `windows` (sample ranges at the
    model's rate) and each window's output, in order."""

    text: str
    language: str
    duration_s: float
    windows: list[AudioWindow]
    outputs: list[RequestOutput]


@dataclass(frozen=True)
class ClipWindows:
    """A clip read at the model's rate and its windows: what its prompts are made of."""

    clip: PromptAudio
    windows: list[AudioWindow]

    def prompts(self, text: str) -> list[dict[str, Any]]:
        """One prompt of `text` per window, each carrying its window's samples."""
        rate, samples = self.clip.sample_rate, self.clip.waveform
        return [{"prompt": text, "multi_modal_data": {"audio": (samples[w.start:w.end], rate)}}
                for w in self.windows]


def transcription_processor(processor: object) -> SupportsTranscription:
    """The model's multimodal processor (None for a text model), which must transcribe.

    Raises:
        ValueError: the model does not transcribe.
    """
    if not isinstance(processor, SupportsTranscription):
        raise ValueError("the model does not transcribe: load a speech-to-text model (Whisper); a model that reads "
                         "audio in prompts takes clips through generate's multi_modal_data")
    return processor


def request_problems(processor: SupportsTranscription, language: str | None, task: str,
                     prompt: str | None) -> list[str]:
    """What is wrong with the request's settings, one line each."""
    problems = []
    languages = processor.transcription_languages()
    if not languages:
        problems.append("the model's tokenizer has no language token (<|en|>, ...) to prompt it with")
    elif language is not None and language not in languages:
        known = ", ".join(languages) or "none"
        problems.append(f"language: {language!r} is not a language of the model's tokenizer ({known}): pass one of "
                        "them, or None to detect each clip's")
    if task not in TASKS:
        problems.append(f"task: {task!r} must be one of {', '.join(map(repr, TASKS))}")
    if prompt is not None and not isinstance(prompt, str):
        problems.append(f"prompt: must be text or None, got {type(prompt).__name__}")
    return problems


def read_clips(processor: SupportsTranscription, audio: Sequence[AudioLike]) -> tuple[list[ClipWindows], list[str]]:
    """Each clip read at the model's rate and cut into its windows, and the problems of the
    clips that cannot be ("audio[i]: ...")."""
    clips, problems = [], []
    for index, value in enumerate(audio):
        try:
            clip = read_audio(value, processor.audio_limits)
        except AudioInputError as exc:
            problems.append(f"audio[{index}]: {exc}")
            continue
        clips.append(ClipWindows(clip, split_windows(clip.waveform, clip.sample_rate,
                                                     processor.transcription_window_s)))
    return clips, problems


def detect_languages(generate: Generate, processor: SupportsTranscription, clips: list[ClipWindows],
                     use_tqdm: bool) -> list[str]:
    """Each clip's language: the language token the model picks first on its first window."""
    codes = {token: code for code, token in processor.transcription_languages().items()}
    params = SamplingParams(temperature=0.0, max_tokens=1, allowed_token_ids=list(codes))
    firsts = [ClipWindows(c.clip, c.windows[:1]).prompts(processor.language_detection_prompt())[0] for c in clips]
    return [codes[out.outputs[0].token_ids[0]] for out in generate(firsts, params, use_tqdm=use_tqdm)]


def transcribe(processor: SupportsTranscription, generate: Generate, audio: AudioLike | Sequence[AudioLike],
               language: str | None, task: str, prompt: str | None, sampling_params: SamplingParams | None,
               use_tqdm: bool) -> list[TranscriptionOutput]:
    """`LLM.transcribe`'s work (see there), with the model's `processor` and `generate`.

    Raises:
        ValueError: before any work, listing every bad setting and clip.
    """
    values = [audio] if isinstance(audio, (tuple, bytes, bytearray, str)) or hasattr(audio, "__fspath__") else audio
    clips, clip_problems = read_clips(processor, list(values))
    problems = request_problems(processor, language, task, prompt) + clip_problems
    if problems:
        raise ValueError("transcribe: " + "; ".join(problems))
    languages = ([language] * len(clips) if language is not None
                 else detect_languages(generate, processor, clips, use_tqdm) if clips else [])
    prompts = [p for clip, code in zip(clips, languages)
               for p in clip.prompts(processor.transcription_prompt(code, task, prompt))]
    outputs = generate(prompts, sampling_params or SamplingParams(temperature=0.0, max_tokens=None),
                           use_tqdm=use_tqdm)
    transcripts, start = [], 0
    for clip, code in zip(clips, languages):
        mine, start = outputs[start:start + len(clip.windows)], start + len(clip.windows)
        transcripts.append(TranscriptionOutput("".join(o.outputs[0].text for o in mine), code, clip.clip.seconds,
                                               clip.windows, mine))
    return transcripts
