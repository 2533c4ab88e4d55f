"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

Both: RMSNorm scaling by (1 + weight), embeddings times sqrt(hidden_size), GeGLU with
tanh-approximated GELU, attention scaled by query_pre_attn_scalar^-0.5, "sandwich" norms
(after attention and after the MLP as well as before each), and layers that alternate
between a sliding window and the whole context (`layer_types`). Gemma 2 soft-caps the
attention scores and the final logits; Gemma 3 normalises each head's queries and keys
and gives its local and global layers their own rotary bases.
"""

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
from torch import nn
from transformers import PretrainedConfig

from engine.attention.layer import AttentionMetadata
from engine.layers.layernorm import GemmaRMSNorm, RMSNorm
from engine.layers.linear import StoredTensor
from engine.models.llama import AttentionOptions, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


# A vision-language checkpoint's language model, as the hub's files and transformers 5 name it.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                            ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Attention and MLP, each between two norms before its output joins the residual."""

    def __init__(self, config: PretrainedConfig, attention: LlamaAttention, mlp: nn.Module, norm: type[RMSNorm]):
        super().__init__(config, attention, mlp, norm)
        self.pre_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = norm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        kept_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual, kept_rows)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, meta, kept_rows))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    norm_class = GemmaRMSNorm
    decoder_layer_class = GemmaDecoderLayer

    def __init__(self, config: PretrainedConfig, *args, **kwargs):
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=true (an embedding model such as EmbeddingGemma) is "
                             "not supported: this engine generates text with causal attention")
        super().__init__(config, *args, **kwargs)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def attention_options(cls, config: PretrainedConfig, index: int) -> AttentionOptions:
        return replace(super().attention_options(config, index), scale=config.query_pre_attn_scalar**-0.5,
                       logit_softcap=getattr(config, "attn_logit_softcapping", None))

    @classmethod
    def embed_scale(cls, config: PretrainedConfig) -> float | None:
        return config.hidden_size**0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits as `LlamaForCausalLM.compute_logits`, soft-capped (Gemma 2):
        cap * tanh(logits / cap)."""
        logits = super().compute_logits(hidden)
        if logits is None or not self.final_logit_softcap:
            return logits
        return torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text model: the 1B (and 270M) checkpoints, and the language model of the
    vision-language ones (`Gemma3ForConditionalGeneration`, see `engine.models.LANGUAGE_MODELS`),
    whose vision tower and projector it skips as the checkpoint loads."""

    qk_norm = True

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, StoredTensor]]
    ) -> Iterator[tuple[str, StoredTensor]]:
        for name, tensor in weights:
            for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
                if name.startswith(prefix):
                    name = replacement + name.removeprefix(prefix)
                    break
            if not name.startswith(_VISION_PREFIXES):
                yield name, tensor
