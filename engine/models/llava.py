"""LLaVA 1.5 and LLaVA-NeXT (vLLM's `llava` and `llava_next`): a CLIP vision transformer
whose hidden states at `vision_feature_layer` go through a two-layer MLP projector into the
decoder's embedding width, over a Llama, Mistral or Qwen2 decoder.

LLaVA 1.5 reads one square crop of the image: one embedding per patch (and the CLS row
with `vision_feature_select_strategy` "full"). LLaVA-NeXT ("anyres") reads the image resized
whole plus a grid of crops at the `image_grid_pinpoints` resolution that fits it best; the
grid's features are cut back to the image's aspect ratio (the image processor padded it to
the pinpoint's) and each row of them ends with the learned `image_newline`, so the number of
an image's tokens depends on its size.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.distributed.communicator import TensorParallelGroup
from engine.layers.linear import StoredTensor
from engine.models.llama import LlamaForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.vision_language import (
    VisionEncoderLayer, VisionLanguageModel, vision_activation, vision_linear,
)
from engine.multimodal.inputs import ItemTokens, ProcessedImage
from engine.multimodal.processing import BaseMultiModalProcessor

# Activations a CLIP tower (`hidden_act`) or a projector (`projector_hidden_act`) may name,
# as transformers' ACT2FN computes them.
# The decoders a LLaVA checkpoint's text_config may hold: model_type -> architecture -> family.
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_DECODERS: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM,
}

_CLIP_LAYER = re.compile(r"encoder\.layers\.(\d+)\.(.+)")


def feature_layers(config: PretrainedConfig) -> list[int]:
    """The CLIP hidden states a LLaVA reads (`vision_feature_layer`, one index or a list whose
    states are concatenated), as counts of layers run: 0 is the embeddings (after the
    pre-layernorm), k the output of layer k; a negative index counts from the last, as
    transformers' `hidden_states` do.

    Raises:
        ValueError: an index past the tower's layers.
    """
    chosen = config.vision_feature_layer
    chosen = [chosen] if isinstance(chosen, int) else list(chosen)
    states = config.vision_config.num_hidden_layers + 1
    for index in chosen:
        if not -states <= index < states:
            raise ValueError(f"config.json vision_feature_layer {index} is outside the vision tower's {states} hidden "
                             f"states: use -{states} to {states - 1}")
    return [index % states for index in chosen]


class ClipVisionEmbeddings(nn.Module):
    """Each patch projected (CLIP's stride-`patch_size` convolution as one product over the
    flattened patches), the class embedding before them, learned positions added."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.image_size = config.image_size
        self.patch_size = config.patch_size
        self.side = config.image_size // config.patch_size
        self.class_embedding = nn.Parameter(torch.empty(config.hidden_size))
        self.patch_embedding = vision_linear(config.num_channels * config.patch_size**2, config.hidden_size,
                                             bias=False)
        self.position_embedding = nn.Embedding(self.side**2 + 1, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 1 + patches, hidden] of pixel_values [images, channels, height, width]."""
        images, channels, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"pixel_values are {height}x{width}, the vision tower reads {self.image_size}x"
                             f"{self.image_size}: the image processor's crop_size must match vision_config.image_size")
        side, patch = self.side, self.patch_size
        patches = pixel_values.reshape(images, channels, side, patch, side, patch).permute(0, 2, 4, 1, 3, 5)
        embeds = self.patch_embedding(patches.reshape(images * side * side, -1)).view(images, side * side, -1)
        cls = self.class_embedding.expand(images, 1, -1)
        return torch.cat([cls, embeds], dim=1) + self.position_embedding.weight


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer (transformers' `CLIPVisionModel`) up to the deepest hidden
    state a LLaVA reads: the layers past it and the post-layernorm are never built."""

    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        if config.model_type != "clip_vision_model":
            raise ValueError(f"config.json vision_config.model_type {config.model_type!r} is not supported: LLaVA "
                             "runs here with a CLIP vision tower ('clip_vision_model')")
        self.embeddings = ClipVisionEmbeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(num_layers))

    def forward(self, pixel_values: torch.Tensor, states: list[int]) -> torch.Tensor:
        """The hidden states `states` (counts of layers run) concatenated on the last
        dimension: [images, 1 + patches, hidden * len(states)]."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        outputs = [hidden]
        for layer in self.layers:
            hidden = layer(hidden)
            outputs.append(hidden)
        return torch.cat([outputs[index] for index in states], dim=-1)

    def weight_name(self, name: str) -> str | None:
        """This tower's parameter for a checkpoint tensor named below the tower, with or
        without transformers 4's "vision_model." (None: a layer past the deepest one read,
        the post-layernorm, the position-id buffer)."""
        name = name.removeprefix("vision_model.")
        if name.startswith("post_layernorm.") or name == "embeddings.position_ids":
            return None
        if (layer := _CLIP_LAYER.fullmatch(name)) is None:
            return name
        index, rest = int(layer.group(1)), layer.group(2)
        if index >= len(self.layers):
            return None
        return f"layers.{index}.{rest}"


def strategy_keeps_cls(config: PretrainedConfig) -> bool:
    """Whether the CLS row is an image embedding: `vision_feature_select_strategy` "full"
    keeps it, "default" drops it.

    Raises:
        ValueError: another strategy.
    """
    chosen = config.vision_feature_select_strategy
    if chosen not in ("default", "full"):
        raise ValueError(f"config.json vision_feature_select_strategy {chosen!r} is not supported: use 'default' "
                         "or 'full'")
    return chosen == "full"


@dataclass(frozen=True)
class AnyresGrid:
    """Where LLaVA-NeXT's grid features of one image lie: the crops' grid (`crop_rows` x
    `crop_cols` crops of the tower's size, the best pinpoint for the image) and the window of
    feature rows and columns kept, without the padding the image processor added around the
    image to reach the pinpoint's aspect ratio."""

    crop_rows: int
    crop_cols: int
    top: int
    left: int
    rows: int
    cols: int


def anyres_grid(config: PretrainedConfig, height: int, width: int) -> AnyresGrid:
    """The grid of an image of `height` x `width` pixels, as transformers' LlavaNextModel
    unpads it (and LlavaNextProcessor counts it: the same rounding)."""
    from transformers.image_processing_utils import select_best_resolution  # heavy: see BaseMultiModalProcessor

    crop = config.vision_config.image_size
    side = crop // config.vision_config.patch_size
    best_height, best_width = select_best_resolution((height, width), config.image_grid_pinpoints)
    crop_rows, crop_cols = best_height // crop, best_width // crop
    full_rows, full_cols = crop_rows * side, crop_cols * side
    if width / height > full_cols / full_rows:
        kept = int(round(height * (full_cols / width), 7))
        pad = (full_rows - kept) // 2
        return AnyresGrid(crop_rows, crop_cols, pad, 0, full_rows - 2 * pad, full_cols)
    kept = int(round(width * (full_rows / height), 7))
    pad = (full_cols - kept) // 2
    return AnyresGrid(crop_rows, crop_cols, 0, pad, full_rows, full_cols - 2 * pad)


class LlavaMultiModalProcessor(BaseMultiModalProcessor):
    """An image becomes the image processor's crop and one "<image>" token per embedding."""

    image_placeholder = "<image>"

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """Raises ValueError when the tokenizer's "<image>" is not config.json's image token."""
        super().__init__(path, hf_config, tokenizer)
        self.image_token_id = hf_config.image_token_id  # LlavaConfig reads image_token_index as this
        if tokenizer.convert_tokens_to_ids(self.image_placeholder) != self.image_token_id:
            raise ValueError(f"the tokenizer's {self.image_placeholder!r} is token "
                             f"{tokenizer.convert_tokens_to_ids(self.image_placeholder)}, config.json's "
                             f"image_token_index is {self.image_token_id}: the folder's tokenizer and config "
                             "do not belong together")
        self.patch_size = hf_config.vision_config.patch_size
        self.keep_cls = strategy_keeps_cls(hf_config)

    def kept_pixels(self) -> int:
        """The crop (or the resize, where the processor does not crop)."""
        processor = self.image_processor
        size = processor.crop_size if getattr(processor, "do_center_crop", False) else processor.size
        return size.height * size.width if size.height else size.shortest_edge**2

    def max_aspect_ratio(self, budget: int) -> float | None:
        """The processor resizes an image's shorter side to shortest_edge before it crops: an
        aspect ratio of r makes it shortest_edge**2 * r pixels, which must stay within the budget."""
        side = self.image_processor.size.shortest_edge if self.image_processor.do_resize else None
        return budget // side**2 if side else None

    def process_image(self, image: Image.Image) -> ProcessedImage:
        pixel_values = self.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        return ProcessedImage({"pixel_values": pixel_values}, self._tokens(*pixel_values.shape[-2:]))

    def image_tokens(self, image: Image.Image) -> ItemTokens:
        """The crop's tokens, known from the image processor's crop size where it crops."""
        processor = self.image_processor
        if not getattr(processor, "do_center_crop", False):
            return super().image_tokens(image)
        return self._tokens(processor.crop_size["height"], processor.crop_size["width"])

    def _tokens(self, height: int, width: int) -> ItemTokens:
        """One "<image>" per patch of a crop of height x width pixels (and the CLS row's where kept)."""
        count = (height // self.patch_size) * (width // self.patch_size) + int(self.keep_cls)
        return ItemTokens([self.image_token_id] * count)


class LlavaNextMultiModalProcessor(LlavaMultiModalProcessor):
    """An image becomes its crops (the resized whole first, then the grid) with its size,
    and one "<image>" token per embedding: the whole's patches, then each kept grid row's
    patches and its newline."""

    def kept_pixels(self) -> int:
        """The whole at the crop's size and the grid of the largest pinpoint."""
        return super().kept_pixels() + max(height * width for height, width in self.hf_config.image_grid_pinpoints)

    def max_aspect_ratio(self, budget: int) -> None:
        """Any: the whole is resized to the crop's size and the grid to its pinpoint, neither
        at the image's aspect ratio."""
        return None

    def process_image(self, image: Image.Image) -> ProcessedImage:
        data = self.image_processor(images=[image], return_tensors="pt")
        return ProcessedImage({"pixel_values": data["pixel_values"], "image_sizes": data["image_sizes"]},
                              self.image_tokens(image))

    def image_tokens(self, image: Image.Image) -> ItemTokens:
        """The whole's patches, then the grid's kept rows with their newlines: from the
        image's size (transformers' image_sizes)."""
        grid = anyres_grid(self.hf_config, image.height, image.width)
        side = self.hf_config.vision_config.image_size // self.patch_size
        return ItemTokens([self.image_token_id] * (side * side + grid.rows * (grid.cols + 1)))


class LlavaProjector(nn.Module):
    """The two-layer MLP from the vision features to the decoder's embedding width."""

    def __init__(self, config: PretrainedConfig, vision_width: int) -> None:
        super().__init__()
        text_width = config.get_text_config().hidden_size
        bias = getattr(config, "multimodal_projector_bias", True)
        self.linear_1 = vision_linear(vision_width, text_width, bias=bias)
        self.act = vision_activation(config.projector_hidden_act, "projector_hidden_act")
        self.linear_2 = vision_linear(text_width, text_width, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


@dataclass(frozen=True)
class PatchKernel:
    """CLIP's patch convolution kernel [hidden, channels, patch, patch] as the flat
    [hidden, channels * patch * patch] matrix of `ClipVisionEmbeddings.patch_embedding`."""

    stored: StoredTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stored.shape[0], math.prod(self.stored.shape[1:])

    def read(self, piece: None = None) -> torch.Tensor:
        return self.stored.read(None).reshape(self.shape)


class LlavaForConditionalGeneration(VisionLanguageModel):
    """LLaVA 1.5: one crop of the image through CLIP and the projector, one embedding per patch."""

    processor_class = LlavaMultiModalProcessor

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None) -> None:
        text = config.get_text_config()
        family = _DECODERS[self.text_architecture(text)]
        super().__init__(config, family(text, max_position=max_position, group=group))
        self.feature_layers = feature_layers(config)
        self.keep_cls = strategy_keeps_cls(config)
        vision = config.vision_config
        self.vision_tower = ClipVisionTower(vision, max(self.feature_layers))
        self.multi_modal_projector = LlavaProjector(config, vision.hidden_size * len(self.feature_layers))

    @classmethod
    def text_architecture(cls, config: PretrainedConfig) -> str:
        """The decoder's architecture by the text config's model_type.

        Raises:
            ValueError: a decoder family the engine does not run under LLaVA.
        """
        if config.model_type not in _ARCHITECTURES:
            raise ValueError(f"config.json text_config.model_type {config.model_type!r} is not supported under "
                             f"LLaVA (supported: {', '.join(_ARCHITECTURES)})")
        return _ARCHITECTURES[config.model_type]

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[crops, embeddings per crop, decoder width] of pixel_values [crops, 3, size, size]."""
        weights = self.vision_tower.embeddings.class_embedding  # the tower's device and dtype
        states = self.vision_tower(pixel_values.to(weights), self.feature_layers)
        if not self.keep_cls:
            states = states[:, 1:]
        crops, tokens, width = states.shape
        return self.multi_modal_projector(states.reshape(crops * tokens, width)).view(crops, tokens, -1)

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.image_features(data["pixel_values"]).flatten(0, 1)

    def embed_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """The images' crops through the tower as one batch where they have one size (the
        image processor's crop: a batch of 4 measured 14% faster an image on a 2-core Zen 4)."""
        pixels = [data["pixel_values"] for data in inputs]
        if len({p.shape for p in pixels}) != 1:
            return super().embed_images(inputs)
        return list(self.image_features(torch.cat(pixels)).unbind(0))

    def vision_weight_name(self, name: str) -> str | None:
        """Tower, projector and newline tensors with or without transformers 5's "model."
        prefix, the tower's with or without its "vision_model." (see `ClipVisionTower.weight_name`)."""
        name = name.removeprefix("model.")
        if not name.startswith("vision_tower."):
            return name
        inner = self.vision_tower.weight_name(name.removeprefix("vision_tower."))
        return None if inner is None else f"vision_tower.{inner}"

    def load_vision_weights(self, weights: list[tuple[str, StoredTensor]]) -> None:
        """The base class's loading, with CLIP's patch convolution read as a flat matrix."""
        flat = [(name, PatchKernel(tensor) if name.endswith("patch_embedding.weight") else tensor)
                for name, tensor in weights]
        super().load_vision_weights(flat)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT: the resized image's features, then the grid's cut to the image's aspect
    ratio, row by row, each row closed by `image_newline`."""

    processor_class = LlavaNextMultiModalProcessor

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None) -> None:
        super().__init__(config, max_position, group)
        if self.keep_cls:
            raise ValueError("config.json vision_feature_select_strategy 'full' is not supported by LLaVA-NeXT (its "
                             "grid of patch features has no place for the CLS rows): use 'default'")
        self.image_newline = nn.Parameter(torch.empty(config.get_text_config().hidden_size))

    def embed_images(self, inputs: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        return [self.embed_multimodal(data) for data in inputs]  # each image has its own grid of crops

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        height, width = data["image_sizes"][0].tolist()
        grid = anyres_grid(self.config, height, width)
        features = self.image_features(data["pixel_values"][0])
        side = self.vision_tower.embeddings.side
        tiles = features[1:].view(grid.crop_rows, grid.crop_cols, side, side, -1).permute(0, 2, 1, 3, 4)
        tiles = tiles.reshape(grid.crop_rows * side, grid.crop_cols * side, -1)
        kept = tiles[grid.top : grid.top + grid.rows, grid.left : grid.left + grid.cols]
        newline = self.image_newline.expand(grid.rows, 1, -1)
        return torch.cat([features[0], torch.cat([kept, newline], dim=1).flatten(0, 1)])
