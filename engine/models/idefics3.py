"""Idefics3 and SmolVLM: a SigLIP vision transformer whose patches are pixel-shuffled and
projected into a Llama decoder (vLLM's `Idefics3ForConditionalGeneration`).

An image is resized, cut into rows x cols square sub-images of the encoder's size plus the
whole image shrunk to one (the "global" image); each sub-image becomes `image_seq_len`
embeddings. In the prompt the image's single "<image>" token becomes transformers' text for
it: per sub-image `<fake_token_around_image><row_i_col_j>` and its run of "<image>" tokens,
a newline after each row, then the global image's run between `<fake_token_around_image>`
and `<global-img>`. Only the "<image>" positions take encoder rows. SmolVLM is the same
model; its tokenizer names the special tokens (`tokenizer.image_token`, ...).
"""

from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch
from PIL import Image
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.distributed.communicator import TensorParallelGroup
from engine.layers.linear import ShardSlice, StoredTensor
from engine.models.llama import LlamaForCausalLM
from engine.models.vision_language import VisionEncoderLayer, VisionLanguageModel, vision_linear
from engine.multimodal.inputs import ItemTokens, ProcessedImage
from engine.multimodal.processing import BaseMultiModalProcessor

_PATCH_KERNEL = "vision_model.embeddings.patch_embedding.weight"


@dataclass(frozen=True)
class SpecialTokens:
    """The special tokens that frame an image's runs of image tokens in the prompt."""

    fake: str = "<fake_token_around_image>"
    image: str = "<image>"
    global_image: str = "<global-img>"


class Idefics3Processor(BaseMultiModalProcessor):
    """An image to its sub-images' pixels and its tokens, as transformers'
    `Idefics3Processor` expands an "<image>" of the prompt.

    The expansion holds tokens other than "<image>" (the frame, row/column and global tags,
    newlines), so prompt ids that already hold an image's expansion do not round-trip: a
    prompt gives one "<image>" token per image.
    """

    image_placeholder = SpecialTokens.image

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(path, hf_config, tokenizer)
        self.tokens = self.special_tokens()
        self.image_placeholder = self.tokens.image
        self.image_token_id = hf_config.image_token_id
        if tokenizer.convert_tokens_to_ids(self.tokens.image) != self.image_token_id:
            raise ValueError(f"{path}: the tokenizer's {self.tokens.image!r} is id "
                             f"{tokenizer.convert_tokens_to_ids(self.tokens.image)} but config.json's image_token_id "
                             f"is {self.image_token_id}: the folder's tokenizer and config do not belong together")
        side = self.image_processor.max_image_size["longest_edge"] // hf_config.vision_config.patch_size
        self.image_seq_len = side * side // hf_config.scale_factor**2  # the encoder rows of one sub-image

    def kept_pixels(self) -> int:
        """The image resized to longest_edge on its longer side, and the global image."""
        return self.image_processor.size.longest_edge**2 + self.image_processor.max_image_size["longest_edge"]**2

    def special_tokens(self) -> SpecialTokens:
        """The image's special tokens as this family's processor names them."""
        return SpecialTokens()

    def process_image(self, image: Image.Image) -> ProcessedImage:
        """The sub-images' pixels [n, 3, side, side] and which pixels are image (not padding),
        and the image's expanded tokens."""
        out = self.image_processor(images=image, return_row_col_info=True, return_tensors="pt")
        pixels = out["pixel_values"][0]
        ids = self.tokenizer(self.image_text(int(out["rows"][0][0]), int(out["cols"][0][0])),
                             add_special_tokens=False)["input_ids"]
        is_embed = [token == self.image_token_id for token in ids]
        if sum(is_embed) != len(pixels) * self.image_seq_len:
            raise ValueError(f"{self.path}: an image gave {len(pixels)} sub-images of {self.image_seq_len} "
                             f"tokens but its text holds {sum(is_embed)} {self.tokens.image!r} tokens: the "
                             "tokenizer splits the image tokens (add them as special tokens)")
        data = {"pixel_values": pixels, "pixel_attention_mask": out["pixel_attention_mask"][0].bool()}
        return ProcessedImage(data, ItemTokens(ids, is_embed))

    def image_text(self, rows: int, cols: int) -> str:
        """The text transformers' processor puts for an image cut into rows x cols (0 x 0:
        not cut, the global image alone)."""
        tokens = self.tokens
        run = tokens.image * self.image_seq_len
        whole = f"{tokens.fake}{tokens.global_image}{run}{tokens.fake}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{tokens.fake}<row_{r + 1}_col_{c + 1}>{run}" for c in range(cols)) + "\n"
                       for r in range(rows))
        return f"{grid}\n{whole}"


class SmolVLMProcessor(Idefics3Processor):
    """Idefics3's expansion with the special tokens SmolVLM's tokenizer names."""

    def special_tokens(self) -> SpecialTokens:
        default = SpecialTokens()
        return SpecialTokens(getattr(self.tokenizer, "fake_image_token", None) or default.fake,
                             getattr(self.tokenizer, "image_token", None) or default.image,
                             getattr(self.tokenizer, "global_image_token", None) or default.global_image)


class VisionEmbeddings(nn.Module):
    """Patch embeddings (the checkpoint's stride-`patch` convolution, as a product over
    each patch's pixels) plus learned positions: a sub-image whose real patches are
    h x w of the grid reads the position table at h x w fractions of its side (NaViT's
    bucketing, as transformers' `Idefics3VisionEmbeddings`)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.patch_size = config.patch_size
        self.per_side = config.image_size // config.patch_size
        self.patch_embedding = vision_linear(config.num_channels * self.patch_size**2, config.hidden_size)
        self.position_embedding = nn.Embedding(self.per_side**2, config.hidden_size)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """[n * rows * cols, hidden] for pixels [n, channels, H, W] and patch_mask [n, rows, cols]."""
        n, channels, _, _ = pixels.shape
        rows, cols, p = patch_mask.shape[1], patch_mask.shape[2], self.patch_size
        patches = pixels[:, :, : rows * p, : cols * p].reshape(n, channels, rows, p, cols, p)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(n * rows * cols, channels * p * p)
        return self.patch_embedding(patches) + self.position_embedding(self.position_ids(patch_mask))

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """Each patch's row of the position table; padding patches read row 0."""
        boundaries = torch.arange(1 / self.per_side, 1.0, 1 / self.per_side, device=patch_mask.device)

        def buckets(real: torch.Tensor, length: int) -> torch.Tensor:
            fractions = torch.arange(length, dtype=torch.float32, device=real.device)[None, :] * (1.0 / real)[:, None]
            return torch.bucketize(fractions.clamp(max=1.0 - 1e-6), boundaries, right=True)

        ids = (buckets(patch_mask[:, :, 0].sum(1), patch_mask.shape[1])[:, :, None] * self.per_side
               + buckets(patch_mask[:, 0, :].sum(1), patch_mask.shape[2])[:, None, :])
        return torch.where(patch_mask, ids, 0).reshape(-1)


class VisionEncoder(nn.Module):
    """The encoder layers, in order."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionEncoderLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden, key_mask)
        return hidden


class VisionTransformer(nn.Module):
    """SigLIP's encoder over sub-images padded to one size (transformers'
    `Idefics3VisionTransformer`)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(config)
        self.encoder = VisionEncoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, pixels: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """[n * rows * cols, hidden] for pixels [n, channels, H, W], patch_mask [n, rows, cols]."""
        hidden = self.embeddings(pixels, patch_mask)
        images = len(pixels)
        key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(images, -1)
        hidden = self.encoder(hidden.view(images, -1, hidden.shape[-1]), key_mask)
        return self.post_layernorm(hidden.reshape(-1, hidden.shape[-1]))


class ModalityProjection(nn.Module):
    """The connector's projection (a module of its own, as the checkpoint names it)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = vision_linear(in_features, out_features, bias=False)


class Connector(nn.Module):
    """Pixel shuffle (each scale x scale block of patches becomes one row, scale^2 times as
    wide) and the projection to the decoder's width."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.scale = config.scale_factor
        self.modality_projection = ModalityProjection(config.vision_config.hidden_size * self.scale**2,
                                                      config.get_text_config().hidden_size)

    def forward(self, hidden: torch.Tensor, images: int, rows: int, cols: int) -> torch.Tensor:
        """[images * rows * cols / scale^2, text hidden] from the encoder's [images * rows * cols, hidden]."""
        s, width = self.scale, hidden.shape[-1]
        x = hidden.view(images, rows, cols // s, width * s).permute(0, 2, 1, 3)
        x = x.reshape(images, cols // s, rows // s, width * s * s).permute(0, 2, 1, 3)
        return self.modality_projection.proj(x.reshape(-1, width * s * s))


@dataclass
class _PatchKernel:
    """The checkpoint's convolution kernel [out, channels, p, p] read as the patch
    projection's matrix [out, channels * p * p]."""

    stored: StoredTensor

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stored.shape[0], prod(self.stored.shape[1:])

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        return self.stored.read(piece).flatten(1)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    """The Llama decoder reading images through SigLIP and the pixel-shuffle connector.

    Checkpoint names (transformers 4 and 5 alike): `model.text_model.*` and `lm_head.*`
    are the decoder's `model.*` and `lm_head.*`; `model.vision_model.*` and
    `model.connector.*` this model's `vision_model.*` and `connector.*` (the default
    `vision_weight_name`), the patch convolution's kernel flattened into its projection.
    """

    processor_class = Idefics3Processor
    language_model_prefixes = (("model.text_model.", "model."), ("lm_head.", "lm_head."))

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None) -> None:
        text = config.get_text_config()
        if text.model_type != "llama":
            raise ValueError(f"text_config.model_type {text.model_type!r} is not supported for "
                             f"{type(self).__name__}: its decoder runs as Llama")
        super().__init__(config, LlamaForCausalLM(text, max_position=max_position, group=group))
        self.vision_model = VisionTransformer(config.vision_config)
        self.connector = Connector(config)

    @classmethod
    def text_architecture(cls, config: PretrainedConfig) -> str:
        return "LlamaForCausalLM"

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """[sub-images * image_seq_len, hidden]: the sub-images in order, the global one last."""
        weight = self.vision_model.post_layernorm.weight
        pixels = data["pixel_values"].to(weight.device, weight.dtype)
        p = self.vision_model.embeddings.patch_size
        pixel_mask = data["pixel_attention_mask"].to(weight.device)
        rows, cols = pixel_mask.shape[1] // p, pixel_mask.shape[2] // p
        # A patch is real where any of its pixels is (transformers' rule).
        patch_mask = pixel_mask[:, : rows * p, : cols * p].reshape(len(pixels), rows, p, cols, p).any(4).any(2)
        hidden = self.vision_model(pixels, patch_mask)
        return self.connector(hidden, len(pixels), rows, cols)

    def load_vision_weights(self, weights: list[tuple[str, StoredTensor]]) -> None:
        """The base class's loading, the patch convolution's kernel read as a matrix."""
        super().load_vision_weights([
            (name, _PatchKernel(tensor) if self.vision_weight_name(name) == _PATCH_KERNEL else tensor)
            for name, tensor in weights
        ])


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    """SmolVLM: Idefics3's model, with SmolVLM's names for the image tokens."""

    processor_class = SmolVLMProcessor
