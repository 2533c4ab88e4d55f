"""What the vision-language families share (vLLM's `SupportsMultiModal`): a decoder of one of
the text families, a vision encoder whose outputs take the place of the image tokens'
embeddings, and the checkpoint split between the two as it loads.

A family subclasses `VisionLanguageModel`: it builds its vision encoder and projector in
`__init__`, says what one image's encoder inputs become (`embed_multimodal`, [num_embeds,
hidden] in the decoder's width), names its processor (`processor_class`) and maps the
checkpoint's names (`language_model_prefixes`, `vision_weight_name`).
"""

from collections.abc import Callable, Iterable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from engine.attention.layer import AttentionMetadata
from engine.layers.fused_moe import FusedMoE
from engine.layers.linear import Linear, StoredTensor
from engine.lora.slots import LoRATarget
from engine.models.llama import allocate, copy_named_weights
from engine.multimodal.inputs import MultiModalEmbeds
from engine.multimodal.processing import BaseMultiModalProcessor


class VisionLanguageModel(nn.Module):
    """A decoder (`language_model`, a causal LM of the text families) reading images through
    a vision encoder. `forward` takes the step's encoder outputs (`MultiModalEmbeds`) and puts
    them in the rows of the image tokens; everything else is the decoder's."""

    processor_class: type[BaseMultiModalProcessor]
    # Whether the decoder's rotary positions are [3, tokens] (Qwen2-VL's M-RoPE): the model
    # runner then hands `forward` each token's three positions.
    uses_mrope = False
    # Checkpoint name prefix of the decoder -> the decoder's own ("model.", "lm_head."): the
    # first pair is how transformers 5 saves the checkpoint, the others how older hub files do.
    language_model_prefixes: tuple[tuple[str, str], ...] = (
        ("model.language_model.", "model."), ("lm_head.", "lm_head."),
        ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
    )

    def __init__(self, config: PretrainedConfig, language_model: nn.Module) -> None:
        """`config` is the checkpoint's whole config; `language_model` the decoder built
        from its text part (on the meta device, as the whole model is)."""
        super().__init__()
        self.config = config
        self.language_model = language_model

    @classmethod
    def text_architecture(cls, config: PretrainedConfig) -> str:
        """The architecture of the decoder's family ("LlamaForCausalLM") for the text config."""
        raise NotImplementedError

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's encoder output, [num_embeds, hidden], in the decoder's dtype, from
        the encoder inputs its processor made (`ProcessedImage.data`)."""
        raise NotImplementedError

    def embed_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Each image's encoder output (`embed_multimodal`), for the images a step encodes; a
        family whose images stack into one batch overrides this to run them together."""
        return [self.embed_multimodal(data) for data in inputs]

    def vision_weight_name(self, name: str) -> str | None:
        """This model's parameter for a checkpoint tensor outside the decoder (None: a
        tensor the engine does not use, skipped). By default the name less a leading "model."."""
        return name.removeprefix("model.")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kept_rows: torch.Tensor | None = None, mm_embeds: MultiModalEmbeds | None = None) -> torch.Tensor:
        """The decoder's hidden states, image tokens reading their encoder rows."""
        decoder = self.language_model.model
        embeds = None
        if mm_embeds is not None:
            embeds = decoder.embed_input_ids(input_ids)
            embeds[mm_embeds.rows] = mm_embeds.embeds.to(embeds.dtype)
        return decoder(input_ids, positions, meta, kept_rows, inputs_embeds=embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.language_model.compute_logits(hidden)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Allocates (uninitialized) parameters and builds the buffers `to_empty` leaves unset."""
        allocate(self, device, dtype)
        self.build_buffers(device)

    def build_buffers(self, device: torch.device) -> None:
        """The decoder's rotary tables; a family with buffers of its own extends this."""
        self.language_model.build_buffers(device)

    def prepack(self) -> None:
        for module in self.modules():
            if isinstance(module, (Linear, FusedMoE)):
                module.prepack()

    def lora_targets(self) -> dict[str, LoRATarget]:
        """The decoder's adaptable projections, under the checkpoint's names for them (an
        adapter trained on the whole model names "model.language_model.layers.0...")."""
        theirs, ours = self.language_model_prefixes[0]
        return {theirs + path.removeprefix(ours): target
                for path, target in self.language_model.lora_targets().items()}

    def load_weights(self, weights: Iterable[tuple[str, StoredTensor]]) -> None:
        """The decoder's tensors go to the decoder (streamed); the others to the vision side.

        Raises:
            ValueError: a tensor of the wrong shape, or a parameter the checkpoint lacks.
        """
        vision: list[tuple[str, StoredTensor]] = []

        def decoder_tensors() -> Iterable[tuple[str, StoredTensor]]:
            for name, tensor in weights:
                mapped = self._decoder_name(name)
                if mapped is None:
                    vision.append((name, tensor))
                else:
                    yield mapped, tensor

        self.language_model.load_weights(decoder_tensors())
        self.load_vision_weights(vision)

    def load_vision_weights(self, weights: list[tuple[str, StoredTensor]]) -> None:
        """Copies the encoder's and projector's tensors in, by `vision_weight_name`."""
        params = {name: p for name, p in self.named_parameters() if not name.startswith("language_model.")}
        copy_named_weights(type(self).__name__, params, weights, self.vision_weight_name, "vision ")

    def _decoder_name(self, name: str) -> str | None:
        for theirs, ours in self.language_model_prefixes:
            if name.startswith(theirs):
                return ours + name.removeprefix(theirs)
        return None


def vision_linear(in_features: int, out_features: int, bias: bool = True) -> Linear:
    """A projection of a vision encoder or projector: prepacked like the decoder's, and
    quantized by a method at load (int8 on a CPU, calibrated on drawn pictures; FP8 on a GPU)
    as vLLM's online quantization does the towers, but never read as quantized from a
    checkpoint (quantized vision-language checkpoints store their towers in the dtype)."""
    layer = Linear(in_features, out_features, bias=bias)
    layer.stored_quantized = False
    return layer


class VisionAttention(nn.Module):
    """Bidirectional multi-head self-attention within each image of a ViT tower (CLIP's,
    SigLIP's: q_proj, k_proj, v_proj, out_proj), or each clip of a Whisper-style audio
    encoder (whose k_proj has no bias: `key_bias` False), with no cache."""

    def __init__(self, hidden: int, num_heads: int, key_bias: bool = True) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q_proj = vision_linear(hidden, hidden)
        self.k_proj = vision_linear(hidden, hidden, bias=key_bias)
        self.v_proj = vision_linear(hidden, hidden)
        self.out_proj = vision_linear(hidden, hidden)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [images, tokens, width] -> the same shape; `key_mask` [images, tokens] marks
        the tokens attended to (None: all; padding of a sub-image is not)."""
        images, tokens, width = hidden.shape
        rows = hidden.reshape(images * tokens, width)
        q, k, v = (proj(rows).view(images, tokens, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(images * tokens, width)
        return self.out_proj(out).view(images, tokens, width)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# config.json's activation names (hidden_act of a vision config, projector_hidden_act) -> the function.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "quick_gelu": _quick_gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


def vision_activation(name: str, field: str = "vision_config.hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation config.json's `field` names.

    Raises:
        ValueError: one the engine does not compute.
    """
    if name not in _ACTIVATIONS:
        raise ValueError(f"config.json {field} {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]


class VisionMLP(nn.Module):
    """A vision encoder's MLP: fc2(act(fc1(x))) (CLIP's, SigLIP's, Qwen2-VL's)."""

    def __init__(self, width: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = vision_linear(width, hidden)
        self.act = vision_activation(act)
        self.fc2 = vision_linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """A ViT encoder layer (CLIP's, SigLIP's): pre-norm attention and MLP, each added to the
    residual stream, over hidden [images, tokens, width]."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = VisionAttention(config.hidden_size, config.num_attention_heads)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`key_mask` [images, tokens]: the tokens attended to (None: all)."""
        hidden = hidden + self.self_attn(self.layer_norm1(hidden), key_mask)
        images, tokens, width = hidden.shape
        rows = self.layer_norm2(hidden).reshape(images * tokens, width)
        return hidden + self.mlp(rows).view(images, tokens, width)
