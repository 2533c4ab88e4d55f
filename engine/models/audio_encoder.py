"""The Whisper-style audio encoder that Qwen2-Audio, Voxtral and Whisper share (vLLM's
`WhisperEncoder`, which its Qwen2-Audio and Voxtral reuse): a clip's log-mel features
[mel bins, frames] go through two 1-D convolutions (the second of stride 2, so one row per
two frames), plus the checkpoint's position table, then pre-norm transformer layers
attending over the whole clip, and a final LayerNorm.

Options: Qwen2-Audio masks the keys of the rows past a clip's own frames (its features are
padded to the window) and halves the rows by average pooling before the final norm.
Whisper and Voxtral attend over the padding as well and keep every row.

Parameter names are transformers' (`WhisperEncoder`, `Qwen2AudioEncoder`, `VoxtralEncoder`:
conv1, conv2, embed_positions, layers.N.self_attn.{q,k,v,out}_proj,
layers.N.self_attn_layer_norm, layers.N.fc1/fc2, layers.N.final_layer_norm, layer_norm), so
a checkpoint's encoder tensors load under a prefix alone. As in transformers, the configs'
`scale_embedding` is not applied: none of these encoders multiplies by it.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.models.vision_language import VisionAttention, vision_activation, vision_linear


def conv_rows(mel_frames: int | torch.Tensor) -> int | torch.Tensor:
    """Rows the convolution stem makes of `mel_frames` frames (the stride-2 conv halves them, rounding up)."""
    return (mel_frames - 1) // 2 + 1


def pooled_rows(mel_frames: int | torch.Tensor) -> int | torch.Tensor:
    """Rows an encoder with `avg_pool` yields for a clip of `mel_frames` frames: its conv rows,
    halved by the pool (Qwen2-Audio's audio tokens per clip)."""
    return (conv_rows(mel_frames) - 2) // 2 + 1


class AudioEncoderLayer(nn.Module):
    """Pre-norm self-attention and MLP (fc2(act(fc1(x)))), each added to the residual stream,
    over hidden [clips, rows, d_model]."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        width = config.d_model
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.self_attn = VisionAttention(width, config.encoder_attention_heads, key_bias=False)
        self.final_layer_norm = nn.LayerNorm(width)
        self.fc1 = vision_linear(width, config.encoder_ffn_dim)
        self.act = vision_activation(config.activation_function, "audio_config.activation_function")
        self.fc2 = vision_linear(config.encoder_ffn_dim, width)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`key_mask` [clips, rows]: the rows attended to (None: all)."""
        hidden = hidden + self.self_attn(self.self_attn_layer_norm(hidden), key_mask)
        clips, rows, width = hidden.shape
        flat = self.final_layer_norm(hidden).reshape(clips * rows, width)
        return hidden + self.fc2(self.act(self.fc1(flat))).view(clips, rows, width)


class AudioEncoder(nn.Module):
    """The encoder of a Whisper-style `config` (Whisper's own, or an audio_config):
    features [clips, num_mel_bins, frames] -> rows [clips, frames / 2 (/ 2 with
    `avg_pool`), d_model]. The clips of a batch have the same number of frames (their
    extractor pads them to its window)."""

    def __init__(self, config: PretrainedConfig, avg_pool: bool = False) -> None:
        super().__init__()
        width = config.d_model
        self.avg_pool = avg_pool
        # Convolutions, not products: the stem stays an nn.Conv1d, neither prepacked nor quantized.
        self.conv1 = nn.Conv1d(config.num_mel_bins, width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(width, width, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, width)
        self.layers = nn.ModuleList(AudioEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(width)

    def forward(self, features: torch.Tensor, mel_frames: torch.Tensor | None = None) -> torch.Tensor:
        """The clips' rows. `mel_frames` [clips], where given, is each clip's own frame count
        before padding: the rows past its `conv_rows` are no key of attention (they still
        yield rows, which the caller drops).

        Raises:
            ValueError: more rows than the position table holds (features longer than the window).
        """
        features = features.to(self.conv1.weight.dtype)
        hidden = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        rows = hidden.shape[1]
        if rows > self.embed_positions.num_embeddings:
            raise ValueError(f"{features.shape[-1]} mel frames make {rows} rows, more than the encoder's "
                             f"{self.embed_positions.num_embeddings} positions: pad or cut features to the window")
        hidden = hidden + self.embed_positions.weight[:rows]
        key_mask = None
        if mel_frames is not None:
            key_mask = torch.arange(rows, device=hidden.device) < conv_rows(mel_frames.to(hidden.device))[:, None]
        for layer in self.layers:
            hidden = layer(hidden, key_mask)
        if self.avg_pool:
            hidden = F.avg_pool1d(hidden.transpose(1, 2), 2).transpose(1, 2)
        return self.layer_norm(hidden)
