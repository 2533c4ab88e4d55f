"""`LLM.transcribe`'s plan (vLLM's transcription endpoint, offline): each clip read and cut into
the model's windows (`split_windows`), one decoder prompt per window, all of them run as one
`generate`; each clip's window texts then joined in order, without a separator, as vLLM's
endpoint joins them. The Dagster side runs the same prompts through `generate_as_completed`
and joins a row once all its windows are back (`TranscriptionPlan.output`)."""

from dataclasses import dataclass
from typing import Any

from engine.multimodal.audio import AudioInputError, read_audio
from engine.multimodal.audio_windows import AudioWindow, split_windows
from engine.multimodal.processing import BaseMultiModalProcessor
from engine.outputs import RequestOutput, TranscriptionOutput, TranscriptionWindow


@dataclass
class ClipWindows:
    """One clip of a transcription: its duration, its windows (samples at `sample_rate`) and
    the index of its first window's prompt among the plan's."""

    duration_s: float
    sample_rate: int
    windows: list[AudioWindow]
    first_prompt: int


@dataclass
class TranscriptionPlan:
    """The prompts of a transcription, every window of every clip in order, and the clips
    they came from."""

    prompts: list[dict[str, Any]]
    clips: list[ClipWindows]

    def output(self, clip: int, outputs: list[RequestOutput]) -> TranscriptionOutput:
        """Clip `clip`'s transcript from its windows' outputs, in window order."""
        read = self.clips[clip]
        windows = [TranscriptionWindow(w.start / read.sample_rate, w.end / read.sample_rate, o.outputs[0].text,
                                       list(o.outputs[0].token_ids)) for w, o in zip(read.windows, outputs)]
        return TranscriptionOutput("".join(w.text for w in windows), windows,
                                   [t for w in windows for t in w.token_ids], read.duration_s)

    def outputs(self, outputs: list[RequestOutput]) -> list[TranscriptionOutput]:
        """Every clip's transcript, given the outputs of `prompts` in order."""
        return [self.output(i, outputs[c.first_prompt : c.first_prompt + len(c.windows)])
                for i, c in enumerate(self.clips)]


def plan_transcription(processor: BaseMultiModalProcessor | None, audio: Any, language: str, task: str,
                       prompt: str | None) -> TranscriptionPlan:
    """The windows and prompts that transcribe `audio` (one clip, a `(waveform, rate)` tuple
    among them, or a list of clips) with a model that transcribes.

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
        decoder_prompt = processor.transcription_prompt(language, task, prompt)
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
    plan = TranscriptionPlan([], [])
    for clip in read:
        windows = split_windows(clip.waveform, clip.sample_rate, processor.transcription_window_s)
        plan.clips.append(ClipWindows(clip.seconds, clip.sample_rate, windows, len(plan.prompts)))
        plan.prompts += [{"prompt": decoder_prompt,
                          "multi_modal_data": {"audio": (clip.waveform[w.start : w.end], clip.sample_rate)}}
                         for w in windows]
    return plan
