"""Voxtral: a Whisper-style audio encoder run over each 30 s window of a clip, its rows
regrouped by four and projected, in place of the clip's "[AUDIO]" tokens in a Llama
(Mistral) decoder (vLLM's `VoxtralForConditionalGeneration`). It runs on the
vision-language path, as Qwen2-Audio does.

A clip is padded with silence to whole windows of the feature extractor (`chunk_length`, 30 s
on the hub's checkpoints), its log-mel features computed over the whole padded clip and split
into windows of `nb_max_frames` frames; the encoder runs each window alone, with no mask and
no pooling (`max_source_positions` rows of d_model, 1500 of 1280), and the window's rows,
concatenated in fours ([-1, audio intermediate_size]), go through the projector (linear,
activation, linear): 375 tokens per window, 12.5 per second of padded audio, as
mistral_common counts them. In a prompt a clip is "[BEGIN_AUDIO]" then its run of "[AUDIO]".
"""

import math
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.distributed.communicator import TensorParallelGroup
from engine.models.audio_encoder import AudioEncoder
from engine.models.llama import LlamaForCausalLM
from engine.models.vision_language import VisionLanguageModel, vision_activation, vision_linear
from engine.multimodal.audio import AudioLimits, PromptAudio
from engine.multimodal.inputs import ItemTokens
from engine.multimodal.processing import BaseMultiModalProcessor


def tokens_per_window(audio_config: PretrainedConfig) -> int:
    """A window's tokens: its encoder rows (`max_source_positions` of d_model) regrouped into
    rows of the projector's input width (`intermediate_size`).

    Raises:
        ValueError: a window's rows do not regroup whole (config.json is inconsistent).
    """
    width = audio_config.max_source_positions * audio_config.d_model
    if width % audio_config.intermediate_size:
        raise ValueError(f"config.json audio_config: {audio_config.max_source_positions} rows of hidden_size "
                         f"{audio_config.d_model} do not regroup into rows of intermediate_size "
                         f"{audio_config.intermediate_size}: fix config.json")
    return width // audio_config.intermediate_size


class VoxtralProcessor(BaseMultiModalProcessor):
    """A clip to its windows' features (`input_features` [windows, mel bins, nb_max_frames])
    and its run of "[AUDIO]" tokens, as transformers' `VoxtralProcessor` (through
    mistral_common) makes them."""

    modalities = ("audio",)
    audio_placeholder = "[BEGIN_AUDIO][AUDIO]"

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raises ValueError when the tokenizer's "[AUDIO]" is not config.json's audio token."""
        super().__init__(path, hf_config, tokenizer)
        self.audio_token_id = self.config_token_id("[AUDIO]", hf_config.audio_token_id, "audio_token_id")
        # Imported here, as the image processors are (see BaseMultiModalProcessor).
        from transformers import AutoFeatureExtractor

        self.feature_extractor = AutoFeatureExtractor.from_pretrained(path)
        self.audio_limits = AudioLimits(sample_rate=self.feature_extractor.sampling_rate)
        self.tokens_per_window = tokens_per_window(hf_config.audio_config)

    def audio_tokens(self, audio: PromptAudio) -> ItemTokens:
        """`tokens_per_window` tokens for each window the clip begins."""
        windows = math.ceil(len(audio.waveform) / self.feature_extractor.n_samples)
        return ItemTokens([self.audio_token_id] * (windows * self.tokens_per_window))

    def audio_inputs(self, audio: PromptAudio) -> dict[str, torch.Tensor]:
        """The features of the clip padded with silence to whole windows, split into windows."""
        extractor = self.feature_extractor
        features = extractor(audio.waveform, sampling_rate=audio.sample_rate, padding=True, truncation=False,
                             pad_to_multiple_of=extractor.n_samples, return_tensors="pt")["input_features"]
        return {"input_features": features.reshape(extractor.feature_size, -1, extractor.nb_max_frames).transpose(0, 1)}


class VoxtralProjector(nn.Module):
    """Regrouped encoder rows to the decoder's width: linear_1, the activation, linear_2 (no biases)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.get_text_config().hidden_size
        self.linear_1 = vision_linear(config.audio_config.intermediate_size, hidden, bias=False)
        self.act = vision_activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = vision_linear(hidden, hidden, bias=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(rows)))


class VoxtralForConditionalGeneration(VisionLanguageModel):
    """Voxtral. Checkpoints saved by transformers name the encoder "audio_tower.", the
    projector "multi_modal_projector." and the decoder "language_model." (or with
    transformers 5's "model." before them); the default `vision_weight_name` gives our names.
    (The hub's consolidated Mistral-format files are not read: point the engine at the
    transformers-format folder.)"""

    processor_class = VoxtralProcessor

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None) -> None:
        super().__init__(config, LlamaForCausalLM(config.get_text_config(), max_position=max_position, group=group))
        self.audio_tower = AudioEncoder(config.audio_config)
        self.multi_modal_projector = VoxtralProjector(config)
        self.tokens_per_window = tokens_per_window(config.audio_config)

    @classmethod
    def text_architecture(cls, config: PretrainedConfig) -> str:
        return "LlamaForCausalLM"

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One clip's rows [windows * tokens_per_window, hidden]."""
        return self.embed_images([data])[0]

    def embed_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Every window of the step's clips through the encoder as one batch, each clip's
        windows' rows regrouped and projected."""
        reference = self.audio_tower.layer_norm.weight  # a norm: never prepacked, so on the device in the dtype
        windows = [len(data["input_features"]) for data in inputs]
        features = torch.cat([data["input_features"] for data in inputs]).to(reference.device, reference.dtype)
        rows = self.audio_tower(features).reshape(-1, self.multi_modal_projector.linear_1.in_features)
        embeds = self.multi_modal_projector(rows)
        return list(embeds.split([count * self.tokens_per_window for count in windows]))
