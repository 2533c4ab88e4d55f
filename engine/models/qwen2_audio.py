"""Qwen2-Audio: a Whisper-style audio encoder whose pooled rows, projected to the decoder's
width, take the place of a clip's "<|AUDIO|>" tokens in a Qwen2 decoder (vLLM's
`Qwen2AudioForConditionalGeneration`). It runs on the vision-language path: the clip is a
prompt item like an image, encoded once, its output cached and placed into the steps that
hold its tokens.

The checkpoint's own WhisperFeatureExtractor makes a clip's log-mel features, padded to its
window (`chunk_length`, 30 s on the hub's checkpoints), with the clip's own frame count: the
encoder masks the keys past it, and the clip takes ((frames - 1) // 2 + 1 - 2) // 2 + 1
tokens. transformers' processor cuts a clip longer than the window silently; the engine
refuses it, per row.
"""

import math
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.distributed.communicator import TensorParallelGroup
from engine.models.audio_encoder import AudioEncoder, pooled_rows
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.vision_language import VisionLanguageModel, vision_linear
from engine.multimodal.audio import AudioLimits, PromptAudio
from engine.multimodal.inputs import ItemTokens
from engine.multimodal.processing import BaseMultiModalProcessor


class Qwen2AudioProcessor(BaseMultiModalProcessor):
    """A clip to its features (`input_features` [1, mel bins, window frames] and `mel_frames`
    [1], its own frames) and its run of "<|AUDIO|>" tokens, as transformers'
    `Qwen2AudioProcessor` expands one."""

    modalities = ("audio",)
    audio_placeholder = "<|audio_bos|><|AUDIO|><|audio_eos|>"

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raises ValueError when the tokenizer's "<|AUDIO|>" is not config.json's audio token."""
        super().__init__(path, hf_config, tokenizer)
        self.audio_token_id = self.config_token_id("<|AUDIO|>", hf_config.audio_token_id, "audio_token_index")
        # Imported here, as the image processors are (see BaseMultiModalProcessor).
        from transformers import AutoFeatureExtractor

        self.feature_extractor = AutoFeatureExtractor.from_pretrained(path)
        extractor = self.feature_extractor
        self.audio_limits = AudioLimits(sample_rate=extractor.sampling_rate, max_seconds=extractor.chunk_length)
        # The fewest samples that make one token: three mel frames (two conv rows, pooled to one).
        self.min_samples = 2 * extractor.hop_length + 1

    def audio_tokens(self, audio: PromptAudio) -> ItemTokens:
        """One token per pooled encoder row of the clip's own mel frames (one frame per
        `hop_length` samples, begun; the window's at most).

        Raises:
            ValueError: a clip too short to make one token.
        """
        samples = len(audio.waveform)
        if samples < self.min_samples:
            raise ValueError(f"{samples} samples make no audio token: give at least {self.min_samples} samples "
                             f"({self.min_samples / audio.sample_rate * 1000:g} ms)")
        extractor = self.feature_extractor
        frames = min(math.ceil(samples / extractor.hop_length), extractor.nb_max_frames)
        return ItemTokens([self.audio_token_id] * pooled_rows(frames))

    def audio_inputs(self, audio: PromptAudio) -> dict[str, torch.Tensor]:
        """The extractor's features padded to its window, as transformers' processor asks for
        them, and the clip's own frame count (its attention mask's sum)."""
        out = self.feature_extractor(audio.waveform, sampling_rate=audio.sample_rate, padding="max_length",
                                     return_attention_mask=True, return_tensors="pt")
        return {"input_features": out["input_features"], "mel_frames": out["attention_mask"].sum(-1)}


class Qwen2AudioProjector(nn.Module):
    """The encoder's rows to the decoder's width: one linear map."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.linear = vision_linear(config.audio_config.d_model, config.get_text_config().hidden_size)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear(rows)


class Qwen2AudioForConditionalGeneration(VisionLanguageModel):
    """Qwen2-Audio. Checkpoints name the encoder "audio_tower.", the projector
    "multi_modal_projector." and the decoder "language_model." (the hub's files, and
    transformers' save_pretrained), or with transformers 5's "model." before the first two
    and "model.language_model." for the decoder; the default `vision_weight_name` (a leading
    "model." stripped) gives our names for both."""

    processor_class = Qwen2AudioProcessor

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None) -> None:
        super().__init__(config, Qwen2ForCausalLM(config.get_text_config(), max_position=max_position, group=group))
        self.audio_tower = AudioEncoder(config.audio_config, avg_pool=True)
        self.multi_modal_projector = Qwen2AudioProjector(config)

    @classmethod
    def text_architecture(cls, config: PretrainedConfig) -> str:
        return "Qwen2ForCausalLM"

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One clip's rows [tokens, hidden]."""
        return self.embed_images([data])[0]

    def embed_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The step's clips through the encoder as one batch (each is padded to the window),
        each clip's rows cut to its tokens."""
        reference = self.audio_tower.layer_norm.weight  # a norm: never prepacked, so on the device in the dtype
        features = torch.cat([data["input_features"] for data in inputs]).to(reference.device, reference.dtype)
        frames = torch.cat([data["mel_frames"] for data in inputs]).to(reference.device)
        rows = self.audio_tower(features, frames)
        clips, count, width = rows.shape
        embeds = self.multi_modal_projector(rows.reshape(clips * count, width)).view(clips, count, -1)
        return [clip[:tokens] for clip, tokens in zip(embeds, pooled_rows(frames).tolist())]
