"""Whisper (vLLM's `WhisperForConditionalGeneration`): an encoder-decoder model. The clip's
log-mel features go through the shared audio encoder (`AudioEncoder`) once; the decoder is a
pre-norm transformer with learned positions whose layers attend to their own tokens (paged,
causal, as any decoder) and then to the encoder's rows through cross-attention, whose keys and
values are written once per sequence into its cross blocks (`CrossAttention`), in the same pool
as the decoder's.

A prompt is a decoder prompt of task tokens ("<|startoftranscript|><|en|><|transcribe|>
<|notimestamps|>", tokenized without the tokenizer's special tokens, as vLLM does) and one clip
of at most the feature extractor's window (30 s), which no prompt token stands for: the
processor puts it in `ProcessedPrompt.cross`.

Parameter names are transformers' less their leading "model." (encoder.*, decoder.*), so the
checkpoint loads by name. Whisper's config maps `hidden_size`, `num_attention_heads` and
`num_hidden_layers` to the encoder's numbers: the decoder reads `d_model`,
`decoder_attention_heads`, `decoder_layers`, `decoder_ffn_dim` and `max_target_positions`.
"""

from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.attention.layer import Attention, AttentionMetadata, CrossAttention, CrossInputs
from engine.distributed.communicator import TensorParallelGroup
from engine.layers.linear import Linear, StoredTensor
from engine.layers.vocab_parallel_embedding import ParallelLMHead
from engine.models.audio_encoder import AudioEncoder
from engine.models.llama import allocate, copy_named_weights
from engine.models.vision_language import vision_activation
from engine.multimodal.audio import AudioLimits, PromptAudio
from engine.multimodal.inputs import MultiModalFeature, ProcessedPrompt
from engine.multimodal.processing import BaseMultiModalProcessor, MultiModalInputError, PromptItem


class WhisperProcessor(BaseMultiModalProcessor):
    """A Whisper row: its decoder prompt as given (no audio placeholder: the clip goes to the
    encoder, `ProcessedPrompt.cross`), and exactly one clip of at most the feature extractor's
    `chunk_length`; the clip's encoder inputs are the extractor's features, padded to the window."""

    modalities = ("audio",)
    cross_modality = "audio"
    add_special_tokens = False

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(path, hf_config, tokenizer)
        from transformers import WhisperFeatureExtractor  # its module loads torch._dynamo, as the image processors'

        self.feature_extractor = WhisperFeatureExtractor.from_pretrained(path)
        self.audio_limits = AudioLimits(self.feature_extractor.sampling_rate)
        self.transcription_window_s = self.feature_extractor.chunk_length
        self.encoder_rows = hf_config.max_source_positions
        self.languages = {token[2:-2]: token_id for token, token_id in tokenizer.get_vocab().items()
                          if token.startswith("<|") and token.endswith("|>") and 2 <= len(token) - 4 <= 3
                          and token[2:-2].isalpha() and token[2:-2].islower()}

    @property
    def placeholder_ids(self) -> dict[str, int]:
        """None at all: no prompt token stands for the clip."""
        return {}

    @property
    def placeholders(self) -> dict[str, str]:
        return {}

    def max_item_rows(self) -> int:
        """A clip's encoder rows: every clip is padded to the window."""
        return self.encoder_rows

    def audio_inputs(self, audio: PromptAudio) -> dict[str, torch.Tensor]:
        """input_features [1, mel bins, window frames], as transformers' extractor makes them."""
        features = self.feature_extractor(audio.waveform, sampling_rate=audio.sample_rate, return_tensors="pt")
        return {"input_features": features["input_features"]}

    def apply(self, token_ids: list[int], items: dict[str, list[PromptItem]]) -> ProcessedPrompt:
        """The decoder prompt as given, and its clip as the encoder's item.

        Raises:
            MultiModalInputError: no clip, more than one, or one longer than the window.
        """
        clips = items.get("audio", [])
        if len(clips) != 1:
            raise MultiModalInputError(
                f"multi_modal_data: Whisper transcribes one clip per prompt, got {len(clips)}: give exactly one, "
                "multi_modal_data={'audio': (waveform, sample_rate)}")
        clip = clips[0]
        if clip.seconds > self.transcription_window_s:
            raise MultiModalInputError(
                f"multi_modal_data['audio'][0]: the clip is {clip.seconds:,.2f} s long, more than Whisper's "
                f"{self.transcription_window_s} s window: use LLM.transcribe, which splits it, or cut it upstream")
        feature = MultiModalFeature(clip.content_hash, 0, self.encoder_rows, clip, modality="audio")
        return ProcessedPrompt(list(token_ids), [], cross=[feature])

    def transcription_prompt(self, language: str, task: str, prompt: str | None) -> str:
        """Whisper's task tokens after the previous text, as vLLM writes them:
        "<|prev|>{prompt}<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>".

        Raises:
            ValueError: a language without a `<|xx|>` token in the tokenizer, a task other than
                "transcribe" or "translate".
        """
        if task not in ("transcribe", "translate"):
            raise ValueError(f"task: expected 'transcribe' or 'translate', got {task!r}")
        known = sorted(self.language_token_ids())
        if language not in known:
            raise ValueError(f"language: {language!r} is not one of the model's languages: use one of "
                             f"{', '.join(known[:20])}{', ...' if len(known) > 20 else ''}")
        previous = f"<|prev|>{prompt}" if prompt else ""
        return f"{previous}<|startoftranscript|><|{language}|><|{task}|><|notimestamps|>"

    def language_token_ids(self) -> dict[str, int]:
        """The tokenizer's language tokens, "<|xx|>" or "<|xxx|>" of lowercase letters ("<|en|>",
        "<|haw|>"), by code."""
        return dict(self.languages)

    def language_detection_prompt(self) -> str:
        """vLLM's: the start of transcript, whose next token is the language's."""
        return "<|startoftranscript|>"


class WhisperAttention(nn.Module):
    """Multi-head attention with Whisper's projections (q, v and out with a bias, k without):
    over the decoder's own tokens (`attn`, paged and causal), or with `cross` over the encoder's
    rows (`attn` a `CrossAttention` paired with the layer's self-attention)."""

    def __init__(self, width: int, num_heads: int, paired_with: Attention | None = None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, width // num_heads
        self.q_proj = Linear(width, width)
        self.k_proj = Linear(width, width, bias=False)
        self.v_proj = Linear(width, width)
        self.out_proj = Linear(width, width)
        self.attn = (CrossAttention(paired_with) if paired_with is not None
                     else Attention(num_heads, self.head_dim, num_heads))

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Self-attention of the step's rows."""
        q, k, v = (proj(hidden).view(-1, self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(self.attn(q, k, v, meta).view(len(hidden), -1))

    def cross(self, hidden: torch.Tensor, cross: CrossInputs) -> torch.Tensor:
        """Cross-attention of the step's rows, first writing the keys and values of the
        encoder rows the step brings (`cross.states`)."""
        q = self.q_proj(hidden).view(-1, self.num_heads, self.head_dim)
        k = v = None
        if cross.states is not None:
            k, v = (proj(cross.states).view(-1, self.num_heads, self.head_dim) for proj in (self.k_proj, self.v_proj))
        return self.out_proj(self.attn(q, k, v, cross).view(len(hidden), -1))


class WhisperDecoderLayer(nn.Module):
    """Pre-norm self-attention, cross-attention and MLP, each added to the residual stream."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        width, heads = config.d_model, config.decoder_attention_heads
        self.self_attn = WhisperAttention(width, heads)
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.encoder_attn = WhisperAttention(width, heads, paired_with=self.self_attn.attn)
        self.encoder_attn_layer_norm = nn.LayerNorm(width)
        self.fc1 = Linear(width, config.decoder_ffn_dim)
        self.act = vision_activation(config.activation_function, "activation_function")
        self.fc2 = Linear(config.decoder_ffn_dim, width)
        self.final_layer_norm = nn.LayerNorm(width)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata, cross: CrossInputs) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), meta)
        hidden = hidden + self.encoder_attn.cross(self.encoder_attn_layer_norm(hidden), cross)
        return hidden + self.fc2(self.act(self.fc1(self.final_layer_norm(hidden))))


class WhisperDecoder(nn.Module):
    """Token embeddings (times sqrt(d_model) with `scale_embedding`) plus learned positions,
    the layers and a final LayerNorm."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        width = config.d_model
        self.embed_tokens = nn.Embedding(config.vocab_size, width)
        self.embed_positions = nn.Embedding(config.max_target_positions, width)
        self.embed_scale = width**0.5 if config.scale_embedding else 1.0
        self.layers = nn.ModuleList(WhisperDecoderLayer(config) for _ in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                cross: CrossInputs, kept_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) * self.embed_scale + self.embed_positions.weight[positions]
        for layer in self.layers:
            hidden = layer(hidden, meta, cross)
        return self.layer_norm(hidden if kept_rows is None else hidden[kept_rows])


class WhisperForConditionalGeneration(nn.Module):
    """Whisper's encoder and decoder; the language-model head (`proj_out`) is the decoder's
    token embedding, as the checkpoints tie it.

    Construct it on the meta device, then `materialize` and `load_weights`, as the decoder-only
    families. `forward` is the decoder's over the step's rows; `embed_images` runs the encoder
    over the clips a step encodes."""

    processor_class = WhisperProcessor

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_cross_rows = config.max_source_positions  # encoder rows per clip (the window's)
        self.cross_width = config.d_model  # the encoder rows' width
        self.encoder = AudioEncoder(config)
        self.decoder = WhisperDecoder(config)
        self.proj_out = ParallelLMHead(config.d_model, config.vocab_size, group or TensorParallelGroup())
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))

    @classmethod
    def max_positions(cls, config: PretrainedConfig) -> int:
        """The decoder's context: its position table's length."""
        return config.max_target_positions

    def embed_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each clip's encoder rows [max_source_positions, d_model], the clips run as one batch
        (their features are all padded to the window)."""
        features = torch.cat([data["input_features"] for data in inputs])
        return list(self.encoder(features).unbind(0))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None = None, cross: CrossInputs | None = None) -> torch.Tensor:
        """The decoder's final hidden states of the step's rows (of `kept_rows` alone where given).

        Raises:
            ValueError: without `cross` (a decoder step needs its encoder rows).
        """
        if cross is None:
            raise ValueError("Whisper's decoder attends to its encoder: a step needs its cross-attention inputs")
        return self.decoder(input_ids, positions, meta, cross, kept_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.proj_out.logits(hidden)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocates (uninitialized) parameters; the model has no buffers to build."""
        allocate(self, device, dtype)

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()

    def load_weights(self, weights: Iterable[tuple[str, StoredTensor]]) -> None:
        """Copies the checkpoint's tensors in by name ("model." dropped); a tied `proj_out` is
        the token embedding, whether or not the checkpoint stores it.

        Raises:
            ValueError: a tensor the model does not have, one of the wrong shape, or a
                parameter the checkpoint lacks.
        """
        params = dict(self.named_parameters())
        if self.tie_word_embeddings:
            del params["proj_out.weight"]

        def target_of(name: str) -> str | None:
            target = name.removeprefix("model.")
            return None if target == "proj_out.weight" and self.tie_word_embeddings else target

        copy_named_weights(type(self).__name__, params, weights, target_of)
        if self.tie_word_embeddings:
            self.proj_out.weight = self.decoder.embed_tokens.weight
