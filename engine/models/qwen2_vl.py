"""Qwen2-VL and Qwen2.5-VL: a vision transformer over an image's patches at its own
resolution, whose outputs (each 2 x 2 patches merged into one row) take the place
of the image's "<|image_pad|>" tokens in a Qwen2 decoder with multimodal rotary positions
(vLLM's `Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`).

The image processor resizes an image to a multiple of patch_size * spatial_merge_size,
repeats it `temporal_patch_size` times (a one-frame video) and flattens it into patches
[grid_t * grid_h * grid_w, channels * temporal_patch_size * patch_size**2], ordered so that
each run of spatial_merge_size**2 patches is one merged row; the patch embedding is then a
matrix product. The encoder turns its patches by a 2-D rotary embedding (height, width)
and attends within the image; Qwen2.5-VL attends within windows of merged rows except in
its `fullatt_block_indexes` blocks, with the merged rows reordered window by window and
put back after the merger.

A video is frames resized alike (transformers' `Qwen2VLVideoProcessor` rules, reproduced
here: its module needs torchvision), each `temporal_patch_size` frames one temporal patch,
read by the same encoder, which attends within each temporal patch.

In the decoder every token has three rotary positions (temporal, height, width: M-RoPE,
`MRotaryEmbedding`): text tokens count up with three equal positions, an image's or video's
tokens take their (t, h, w) place in the merged grid from where the text before them stopped
(Qwen2.5-VL spaces a video's temporal positions by `tokens_per_second` times the seconds a
temporal patch spans), and the text after an item goes on from max(grid_h, grid_w) /
spatial_merge_size further (transformers' rule; vLLM goes on from the item's largest position).
"""

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.distributed.communicator import TensorParallelGroup
from engine.layers.linear import ShardSlice, StoredTensor
from engine.layers.rotary import MRotaryEmbedding, rope_parameters
from engine.models.llama import head_dim_of
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.vision_language import VisionLanguageModel, VisionMLP, vision_activation, vision_linear
from engine.multimodal.image import ImageLimits
from engine.multimodal.inputs import ItemTokens, MultiModalFeature, ProcessedImage
from engine.multimodal.processing import BaseMultiModalProcessor, MultiModalInputError
from engine.multimodal.video import PromptVideo, VideoLimits


# transformers' `smart_resize` raises for a wider aspect ratio (vLLM's Qwen2-VL processor too).
QWEN2_VL_MAX_ASPECT_RATIO = 200
# Where a folder keeps its video processor's settings, in the order transformers looks
# (`BaseVideoProcessor.get_video_processor_dict`): the hub's Qwen2-VL folders have only the last.
VIDEO_PROCESSOR_FILES = ("processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json")
# The normalisation transformers' Qwen2-VL processors default to (OpenAI CLIP's).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Qwen2VLVideoRules:
    """transformers' `Qwen2VLVideoProcessor` settings (its class defaults, then a folder's
    values): each frame resized to a multiple of patch_size * merge_size pixels within
    [min_pixels, max_pixels] (`cap_pixels_per_frame`: within an even share of
    `max_video_tokens` tokens' pixels too), rescaled and normalised; frames pad to a multiple
    of `temporal_patch_size` by repeating the last."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_folder(cls, path: Path) -> "Qwen2VLVideoRules":
        """The rules a model folder gives: the first of `VIDEO_PROCESSOR_FILES` present
        (processor_config.json's "video_processor" part), `min_pixels`/`max_pixels` over
        `size`, as `Qwen2VLVideoProcessor.__init__` reads them."""
        settings: dict = {}
        for name in VIDEO_PROCESSOR_FILES:
            if (path / name).exists():
                settings = json.loads((path / name).read_text())
                settings = settings.get("video_processor", {}) if name == "processor_config.json" else settings
                if settings:
                    break
        size = settings.get("size") or {}
        pixels = {"min_pixels": settings.get("min_pixels", size.get("shortest_edge")),
                  "max_pixels": settings.get("max_pixels", size.get("longest_edge"))}
        known = {name: settings[name] for name in cls.__dataclass_fields__ if name in settings}
        known.update({name: value for name, value in pixels.items() if value is not None})
        for name in ("image_mean", "image_std"):
            if name in known:
                known[name] = tuple(known[name])
        return cls(**{**known, "cap_pixels_per_frame": bool(known.get("cap_pixels_per_frame"))})

    def frame_size(self, frames: int, height: int, width: int) -> tuple[int, int]:
        """The (height, width) each of a video's `frames` frames resizes to (`resize`)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch_size * self.merge_size
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            total = int(self.max_video_tokens * factor * factor * 0.9)
            max_pixels = max(min(max_pixels, total * self.temporal_patch_size // frames), int(self.min_pixels * 1.05))
        return smart_resize(height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=max_pixels)

    def grid(self, frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The patch grid (temporal, height, width) of `frames` frames already resized."""
        return -(-frames // self.temporal_patch_size), height // self.patch_size, width // self.patch_size

    def patches(self, frames: np.ndarray) -> torch.Tensor:
        """Resized uint8 frames [T, H, W, 3] as flattened patches [grid_t * grid_h * grid_w,
        3 * temporal_patch * patch**2]: rescaled and normalised in one step (as transformers
        fuses them), the last frame repeated up to whole temporal patches, each run of
        merge**2 patches one merged row (`patchify`)."""
        video = torch.from_numpy(frames.astype(np.float32)).permute(0, 3, 1, 2)
        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        video = (video - mean[:, None, None]) / std[:, None, None]
        if pad := -len(video) % self.temporal_patch_size:
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)))
        t, h, w = self.grid(len(video), video.shape[2], video.shape[3])
        p, m, tp = self.patch_size, self.merge_size, self.temporal_patch_size
        patches = video.view(t, tp, 3, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(t * h * w, 3 * tp * p * p)


class Qwen2VLProcessor(BaseMultiModalProcessor):
    """An image or a video to its flattened patches, grid and "<|image_pad|>" or
    "<|video_pad|>" run, as transformers' `Qwen2VLProcessor` expands one; and the prompt's
    M-RoPE positions, as its model's `get_rope_index` computes them."""

    modalities = ("image", "video")
    image_placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    video_placeholder = "<|vision_start|><|video_pad|><|vision_end|>"

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__(path, hf_config, tokenizer)
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = hf_config.video_token_id
        self.merge_size = hf_config.vision_config.spatial_merge_size
        self.video_rules = Qwen2VLVideoRules.from_folder(path)
        rules = self.video_rules
        frame = ImageLimits(self.limits.max_pixels, QWEN2_VL_MAX_ASPECT_RATIO, f"the {hf_config.model_type} "
                            "video processor")
        self.video_limits = VideoLimits(frame, min_frames=rules.min_frames, max_frames=rules.max_frames,
                                        temporal_patch_size=rules.temporal_patch_size, frame_size=rules.frame_size)
        self.max_position = hf_config.get_text_config().max_position_embeddings  # `Qwen2VLDecoder`'s tables

    def kept_pixels(self) -> int:
        """max_pixels: `smart_resize` scales every image to at most that."""
        return self.image_processor.size.longest_edge

    def max_aspect_ratio(self, budget: int) -> float:
        """`smart_resize` refuses an image whose longer side is over 200 times its shorter one."""
        return QWEN2_VL_MAX_ASPECT_RATIO

    def process_image(self, image: Image.Image) -> ProcessedImage:
        """pixel_values [patches, channels * temporal_patch * patch**2], image_grid_thw [1, 3]
        and one image token per merged row."""
        out = self.image_processor(images=image, return_tensors="pt")
        grid = out["image_grid_thw"]
        return ProcessedImage({"pixel_values": out["pixel_values"], "image_grid_thw": grid},
                              self._tokens(tuple(int(x) for x in grid.view(3))))

    def image_tokens(self, image: Image.Image) -> ItemTokens:
        """The tokens of the grid the image processor resizes the image to (transformers'
        `smart_resize`: sides multiples of patch x merge, pixels within min and max)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        processor = self.image_processor
        if not processor.do_resize:
            return super().image_tokens(image)
        patch = processor.patch_size
        height, width = smart_resize(image.height, image.width, factor=patch * processor.merge_size,
                                     min_pixels=processor.size["shortest_edge"],
                                     max_pixels=processor.size["longest_edge"])
        return self._tokens((1, height // patch, width // patch))

    def _tokens(self, grid: tuple[int, int, int], token_id: int | None = None) -> ItemTokens:
        """One image token (or `token_id`) per merged patch of a (temporal, height, width) patch grid."""
        token = self.image_token_id if token_id is None else token_id
        return ItemTokens([token] * (math.prod(grid) // self.merge_size**2), grid=grid)

    def video_tokens(self, video: PromptVideo) -> ItemTokens:
        """One video token per merged patch of the kept frames' grid (frames already resized)."""
        count, height, width, _ = video.frames.shape
        return self._tokens(self.video_rules.grid(count, height, width), self.video_token_id)

    def video_inputs(self, video: PromptVideo) -> dict[str, torch.Tensor]:
        """pixel_values_videos [patches, channels * temporal_patch * patch**2] and video_grid_thw [1, 3]."""
        grid = self.video_rules.grid(*video.frames.shape[:3])
        return {"pixel_values_videos": self.video_rules.patches(video.frames),
                "video_grid_thw": torch.tensor([grid])}

    def time_interval(self, feature: MultiModalFeature) -> float:
        """How far apart an item's temporal patches are in the temporal positions: 1 (Qwen2-VL,
        and every image)."""
        return 1.0

    def rope_positions(self, token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        """[3, len(token_ids)] positions and the offset of generated tokens' (max + 1 - length).

        Raises:
            MultiModalInputError: a position past the decoder's rotary tables (a long video).
        """
        pieces = []
        start = 0  # the position the next run starts from
        done = 0  # tokens placed so far
        for feature in features:
            pieces.append(torch.arange(feature.offset - done).expand(3, -1) + start)
            start += feature.offset - done
            t, h, w = feature.grid
            temporal = (torch.arange(t) * self.time_interval(feature)).long()
            grid = torch.meshgrid(temporal, torch.arange(h // self.merge_size), torch.arange(w // self.merge_size),
                                  indexing="ij")
            pieces.append(torch.stack(grid).reshape(3, -1) + start)
            start += max(h, w) // self.merge_size
            done = feature.end
        pieces.append(torch.arange(len(token_ids) - done).expand(3, -1) + start)
        positions = torch.cat(pieces, dim=1)
        if (largest := int(positions.max())) >= self.max_position:
            raise MultiModalInputError(
                f"multi_modal_data: the prompt's items reach rotary position {largest}, past the model's "
                f"{self.max_position} (max_position_embeddings): give shorter videos (fewer frames, or a lower fps)")
        return positions, largest + 1 - len(token_ids)


class Qwen2_5_VLProcessor(Qwen2VLProcessor):
    """Qwen2.5-VL's: Qwen2-VL's, with a video's temporal positions in time (`time_interval`)."""

    def time_interval(self, feature: MultiModalFeature) -> float:
        """A video's temporal patches are `tokens_per_second` times the seconds each spans
        (temporal_patch_size frames at the kept frames' rate) apart."""
        if feature.modality != "video":
            return 1.0
        seconds = self.video_rules.temporal_patch_size / feature.source.fps
        return self.hf_config.vision_config.tokens_per_second * seconds


class PatchEmbed(nn.Module):
    """The patch embedding: checkpoints hold it as a Conv3d over [channels, temporal_patch,
    patch, patch] with stride equal to the kernel, which on flattened patches is a matrix
    product (`load_vision_weights` flattens the kernel)."""

    def __init__(self, config: PretrainedConfig, dim: int) -> None:
        super().__init__()
        kernel = (config.in_channels, config.temporal_patch_size, config.patch_size, config.patch_size)
        self.proj = vision_linear(math.prod(kernel), dim, bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels)


@dataclass(frozen=True)
class FlattenedKernel:
    """A checkpoint's Conv3d kernel [out, *kernel_shape] read as the matrix [out, prod(kernel_shape)]."""

    tensor: StoredTensor

    @property
    def shape(self) -> tuple[int, ...]:
        out, *kernel = self.tensor.shape
        return out, math.prod(kernel)

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        return self.tensor.read(piece).reshape(self.shape)


class VisionAttention(nn.Module):
    """Multi-head attention of an image's patches over the patches of their own segment
    (the image, or a window of it), turned by the 2-D rotary embedding."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = vision_linear(dim, 3 * dim)
        self.proj = vision_linear(dim, dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        """x [patches, dim]; cos and sin [patches, head_dim] (float32); bounds the segments'
        cumulative lengths [segments + 1]."""
        q, k, v = self.qkv(x).view(len(x), 3, self.num_heads, -1).unbind(1)
        q, k = (_rotate_vision(t, cos, sin) for t in (q, k))
        return self.proj(_attend_segments(q, k, v, bounds).reshape(len(x), -1))


def _rotate_vision(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [patches, heads, head_dim] turned in float32 (as transformers does) by cos and sin
    [patches, head_dim], whose halves repeat the frequencies."""
    half = x.shape[-1] // 2
    y = x.float()
    rotated_half = torch.cat((-y[..., half:], y[..., :half]), dim=-1)
    return (y * cos.unsqueeze(1) + rotated_half * sin.unsqueeze(1)).to(x.dtype)


def _attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Attention [patches, heads, head_dim] of each segment's patches among themselves; the
    segments (`bounds`, cumulative) run as one batch, padded to the longest with the padding
    keys masked out."""
    lengths = bounds.diff()
    if len(lengths) == 1:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return out.transpose(0, 1)
    offsets = torch.arange(int(lengths.max()), device=q.device)
    valid = offsets < lengths[:, None]  # [segments, longest]
    rows = (bounds[:-1, None] + offsets).where(valid, 0)
    q, k, v = (t[rows].transpose(1, 2) for t in (q, k, v))  # [segments, heads, longest, head_dim]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :])
    return out.transpose(1, 2)[valid]


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's encoder MLP: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, config: PretrainedConfig, dim: int) -> None:
        super().__init__()
        self.gate_proj = vision_linear(dim, config.intermediate_size)
        self.up_proj = vision_linear(dim, config.intermediate_size)
        self.down_proj = vision_linear(config.intermediate_size, dim)
        self.act = vision_activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm attention and MLP, each added to the stream."""

    def __init__(self, dim: int, num_heads: int, norm: Callable[[int], nn.Module], mlp: nn.Module) -> None:
        super().__init__()
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bounds)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each run of spatial_merge_size**2 patches, normed, concatenated and projected by a
    GELU MLP into one row of the decoder's width."""

    def __init__(self, dim: int, out_dim: int, merge_size: int, norm: nn.Module) -> None:
        super().__init__()
        self.merged_dim = dim * merge_size**2
        self.ln_q = norm
        self.mlp = nn.Sequential(vision_linear(self.merged_dim, self.merged_dim), nn.GELU(),
                                 vision_linear(self.merged_dim, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged_dim))


@dataclass(frozen=True)
class PatchLayout:
    """How one image's patches go through the blocks: the order of its merged rows there
    (None: the processor's) and, per block, the cumulative bounds of the segments its
    patches attend within."""

    order: torch.Tensor | None
    block_bounds: list[torch.Tensor]


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's encoder: LayerNorms, a quick-GELU MLP, attention over the whole image."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.merge_size = config.spatial_merge_size
        dim = self.width(config)
        self.head_dim = dim // config.num_heads
        self.patch_embed = PatchEmbed(config, dim)
        self.blocks = nn.ModuleList([
            VisionBlock(dim, config.num_heads, self.norm, self.mlp(config, dim))
            for _ in range(config.depth)
        ])
        self.merger = PatchMerger(dim, self.out_width(config), self.merge_size, self.norm(dim))
        self.register_buffer("inv_freq", self.inverse_frequencies(), persistent=False)

    @classmethod
    def width(cls, config: PretrainedConfig) -> int:
        """The patches' width inside the encoder."""
        return config.embed_dim

    @classmethod
    def out_width(cls, config: PretrainedConfig) -> int:
        """The merged rows' width: the decoder's."""
        return config.hidden_size

    @classmethod
    def norm(cls, dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6)

    @classmethod
    def mlp(cls, config: PretrainedConfig, dim: int) -> nn.Module:
        return VisionMLP(dim, int(dim * config.mlp_ratio), config.hidden_act)

    def inverse_frequencies(self) -> torch.Tensor:
        """The 2-D rotary embedding's frequencies: head_dim / 4 of them, for the height and
        again for the width."""
        theta = (getattr(self.config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = self.head_dim // 2
        return 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter)

    def build_buffers(self, device: torch.device) -> None:
        """The rotary frequencies on `device` (after `to_empty`, which leaves them unset)."""
        self.inv_freq = self.inverse_frequencies().to(device)

    def layout(self, grid: tuple[int, int, int], device: torch.device) -> PatchLayout:
        """Every block attends within each frame of the image."""
        t, h, w = grid
        frames = torch.arange(t + 1, device=device) * (h * w)
        return PatchLayout(None, [frames] * len(self.blocks))

    def rotary(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [patches, head_dim] of each patch's (row, column) in the patch grid,
        the patches in the processor's order (each merged run of patches together)."""
        t, h, w = grid
        m = self.merge_size
        rows = torch.arange(h, device=device).view(h // m, 1, m, 1).expand(-1, w // m, -1, m).reshape(-1)
        cols = torch.arange(w, device=device).view(1, w // m, 1, m).expand(h // m, -1, m, -1).reshape(-1)
        angles = torch.cat((rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq), dim=-1).repeat(t, 1)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()

    def forward(self, pixels: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """The merged rows [t * h * w / merge**2, out width] of one image's patches."""
        layout = self.layout(grid, pixels.device)
        x = self.patch_embed(pixels)
        cos, sin = self.rotary(grid, pixels.device)
        if layout.order is not None:
            x, cos, sin = (self._by_merged_row(part, layout.order) for part in (x, cos, sin))
        for block, bounds in zip(self.blocks, layout.block_bounds):
            x = block(x, cos, sin, bounds)
        merged = self.merger(x)
        return merged if layout.order is None else merged[torch.argsort(layout.order)]

    def _by_merged_row(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """x [patches, ...] with its runs of merge**2 patches in `order`."""
        unit = self.merge_size**2
        return x.view(len(x) // unit, unit, -1)[order].view(len(x), -1)


class Qwen2_5VisionTransformer(Qwen2VisionTransformer):
    """Qwen2.5-VL's encoder: RMSNorms, a gated MLP, and attention within windows of
    `window_size` pixels except in the `fullatt_block_indexes` blocks."""

    @classmethod
    def width(cls, config: PretrainedConfig) -> int:
        return config.hidden_size

    @classmethod
    def out_width(cls, config: PretrainedConfig) -> int:
        return config.out_hidden_size

    @classmethod
    def norm(cls, dim: int) -> nn.Module:
        return nn.RMSNorm(dim, eps=1e-6)

    @classmethod
    def mlp(cls, config: PretrainedConfig, dim: int) -> nn.Module:
        return GatedVisionMLP(config, dim)

    def layout(self, grid: tuple[int, int, int], device: torch.device) -> PatchLayout:
        """The merged rows window by window (each window's row by row, the windows row by
        row, frame by frame); the full-attention blocks attend within each frame, the
        others within each window."""
        t, h, w = grid
        m = self.merge_size
        side = self.config.window_size // m // self.config.patch_size  # a window's side, in merged rows
        if side < 1:
            raise ValueError(f"vision_config.window_size {self.config.window_size} is under one merged row "
                             f"({m * self.config.patch_size} pixels): fix config.json")
        rows, cols = h // m, w // m
        across, down = -(-cols // side), -(-rows // side)
        merged = torch.arange(t * rows * cols, device=device).view(t, rows, cols)
        padded = F.pad(merged, (0, across * side - cols, 0, down * side - rows), value=-1)
        windows = padded.view(t, down, side, across, side).permute(0, 1, 3, 2, 4).reshape(-1, side * side)
        sizes = (windows >= 0).sum(dim=1)
        window_bounds = F.pad(sizes[sizes > 0].cumsum(0) * m**2, (1, 0))
        frames = torch.arange(t + 1, device=device) * (h * w)
        full = set(self.config.fullatt_block_indexes)
        return PatchLayout(windows[windows >= 0],
                           [frames if i in full else window_bounds for i in range(len(self.blocks))])


class Qwen2VLDecoder(Qwen2ForCausalLM):
    """The Qwen2 decoder, its queries and keys turned by M-RoPE (positions [3, tokens])."""

    def _rotary(self, layer_type: str) -> MRotaryEmbedding:
        """Tables for the model's whole `max_position_embeddings`, whatever max_model_len: a
        video's temporal positions (Qwen2.5-VL's, in time) can run past its token count."""
        positions = max(self.max_position, getattr(self.config, "max_position_embeddings", 0) or 0)
        return MRotaryEmbedding(head_dim_of(self.config), positions, rope_parameters(self.config, layer_type))


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2-VL. Checkpoints name the encoder "visual." and the decoder "model." (the hub's
    files, and what transformers' save_pretrained writes), or by transformers 5's module
    names "model.visual." and "model.language_model."; the default `vision_weight_name`
    (a leading "model." stripped) gives our `visual.` for both."""

    processor_class = Qwen2VLProcessor
    uses_mrope = True
    language_model_prefixes = (
        ("model.language_model.", "model."), ("lm_head.", "lm_head."),
        # The hub's layout: the decoder is "model." itself (but "model.visual." is not).
        ("model.embed_tokens.", "model.embed_tokens."), ("model.layers.", "model.layers."),
        ("model.norm.", "model.norm."),
    )
    encoder_class: type[Qwen2VisionTransformer] = Qwen2VisionTransformer

    def __init__(self, config: PretrainedConfig, max_position: int, group: TensorParallelGroup | None = None) -> None:
        super().__init__(config, Qwen2VLDecoder(config.get_text_config(), max_position=max_position, group=group))
        self.visual = self.encoder_class(config.vision_config)

    @classmethod
    def text_architecture(cls, config: PretrainedConfig) -> str:
        return "Qwen2ForCausalLM"

    def embed_multimodal(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's or video's merged rows [grid_t * grid_h * grid_w / merge**2, hidden].

        Raises:
            ValueError: `data` holds more than one item's grid.
        """
        kind = "video" if "video_grid_thw" in data else "image"
        grids = data[f"{kind}_grid_thw"].reshape(-1, 3)
        if len(grids) != 1:
            raise ValueError(f"{kind}_grid_thw: embed_multimodal takes one item at a time, got {len(grids)} grids")
        pixels = data["pixel_values_videos" if kind == "video" else "pixel_values"]
        reference = self.visual.merger.ln_q.weight  # a norm: never prepacked, so on the device in the dtype
        t, h, w = (int(x) for x in grids[0])
        return self.visual(pixels.to(reference.device, reference.dtype), (t, h, w))

    def build_buffers(self, device: torch.device) -> None:
        super().build_buffers(device)
        self.visual.build_buffers(device)

    def load_vision_weights(self, weights: list[tuple[str, StoredTensor]]) -> None:
        """The encoder's tensors, the patch embedding's Conv3d kernel as a matrix."""
        super().load_vision_weights([
            (name, FlattenedKernel(tensor) if name.endswith("patch_embed.proj.weight") else tensor)
            for name, tensor in weights
        ])


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL's decoder with the windowed encoder and videos' positions in time."""

    processor_class = Qwen2_5_VLProcessor
    encoder_class = Qwen2_5VisionTransformer
