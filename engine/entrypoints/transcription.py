"""`LLM.transcribe`'s plan (vLLM's transcription endpoint, offline): each clip read and cut into
the model's windows (`split_windows`), one decoder prompt per window, all of them run as one
`generate`; each clip's window texts then joined in order, without a separator, as vLLM's
endpoint joins them. A clip without a language has it detected first, as vLLM detects it: one
token after "<|startoftranscript|>" over its first window, among the language tokens alone. The
Dagster side runs the same prompts through `generate_as_completed` and joins a row once all its
windows are back (`TranscriptionPlan.output`)."""

from dataclasses import dataclass
from typing import Any

from engine.multimodal.audio import AudioInputError, PromptAudio, read_audio
from engine.multimodal.audio_windows import AudioWindow, split_windows
from engine.multimodal.processing import BaseMultiModalProcessor
from engine.outputs import RequestOutput, TranscriptionOutput, TranscriptionWindow
from engine.sampling_params import SamplingParams


@dataclass
class ClipWindows:
    """One clip of a transcription, read, and its windows (samples at its rate)."""

    audio: PromptAudio
    windows: list[AudioWindow]

    def rows(self, decoder_prompt: str) -> list[dict[str, Any]]:
        """A `generate` row per window, under `decoder_prompt`."""
        rate = self.audio.sample_rate
        return [{"prompt": decoder_prompt, "multi_modal_data": {"audio": (self.audio.waveform[w.start : w.end], rate)}}
                for w in self.windows]


@dataclass
class TranscriptionPlan:
    """A transcription's clips, read and cut into windows, and what to run for them: the
    language detection of the clips without one (`detection_rows`), then one row per window of
    every clip in order (`rows`)."""

    processor: BaseMultiModalProcessor
    clips: list[ClipWindows]
    task: str
    prompt: str | None

    def detection_rows(self) -> list[dict[str, Any]]:
        """vLLM's language detection prompt on each clip's first window."""
        start = self.processor.language_detection_prompt()
        return [clip.rows(start)[0] for clip in self.clips]

    def detection_params(self) -> SamplingParams:
        """One greedy token among the model's language tokens."""
        return SamplingParams(temperature=0, max_tokens=1,
                              allowed_token_ids=sorted(self.processor.language_token_ids().values()))

    def detected(self, outputs: list[RequestOutput]) -> list[str]:
        """Each clip's language from its detection output."""
        language_of = {token: language for language, token in self.processor.language_token_ids().items()}
        return [language_of[output.outputs[0].token_ids[0]] for output in outputs]

    def rows(self, languages: list[str]) -> list[dict[str, Any]]:
        """A row per window of every clip in order, each clip under its language's prompt."""
        return [row for clip, language in zip(self.clips, languages)
                for row in clip.rows(self.processor.transcription_prompt(language, self.task, self.prompt))]

    def output(self, clip: int, language: str, outputs: list[RequestOutput]) -> TranscriptionOutput:
        """Clip `clip`'s transcript from its windows' outputs, in window order."""
        read, rate = self.clips[clip], self.clips[clip].audio.sample_rate
        windows = [TranscriptionWindow(w.start / rate, w.end / rate, o.outputs[0].text, list(o.outputs[0].token_ids))
                   for w, o in zip(read.windows, outputs)]
        return TranscriptionOutput("".join(w.text for w in windows), windows,
                                   [t for w in windows for t in w.token_ids], read.audio.seconds, language)

    def outputs(self, languages: list[str], outputs: list[RequestOutput]) -> list[TranscriptionOutput]:
        """Every clip's transcript, given the outputs of `rows(languages)` in order."""
        transcripts, first = [], 0
        for i, (clip, language) in enumerate(zip(self.clips, languages)):
            transcripts.append(self.output(i, language, outputs[first : first + len(clip.windows)]))
            first += len(clip.windows)
        return transcripts


def plan_transcription(processor: BaseMultiModalProcessor | None, audio: Any, language: str | None, task: str,
                       prompt: str | None) -> TranscriptionPlan:
    """The clips of `audio` (one clip, a `(waveform, rate)` tuple among them, or a list of
    clips) read and cut into the windows of a model that transcribes, with the settings checked
    (`language` None: detected per clip).

    Raises:
        ValueError: before any work: a model that does not transcribe, a language or task it
            does not know, a prompt that is not text, and every clip that cannot be read
            (`audio[i]: ...`), all at once.
    """
    if processor is None or processor.transcription_window_s is None:
        raise ValueError("transcribe: the model does not transcribe: load Whisper")
    if prompt is not None and not isinstance(prompt, str):
        raise ValueError(f"transcribe: prompt: expected text or None, got {type(prompt).__name__}")
    try:
        known = processor.language_token_ids()
        if language is None and not known:
            raise ValueError("language: the model has no language tokens to detect one by: give language")
        processor.transcription_prompt(next(iter(known)) if language is None else language, task, prompt)
    except ValueError as exc:
        raise ValueError(f"transcribe: {exc}") from exc
    clips = audio if isinstance(audio, list) else [audio]
    read, problems = [], []
    for i, value in enumerate(clips):
        try:
            read.append(read_audio(value, processor.audio_limits))
        except AudioInputError as exc:
            problems.append(f"audio[{i}]: {exc}")
    if problems:
        raise ValueError(f"transcribe: {len(problems)} clip(s) cannot be read; nothing was run:\n  "
                         + "\n  ".join(problems))
    windows = [ClipWindows(clip, split_windows(clip.waveform, clip.sample_rate, processor.transcription_window_s))
               for clip in read]
    return TranscriptionPlan(processor, windows, task, prompt)
