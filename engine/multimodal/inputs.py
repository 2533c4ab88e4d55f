"""The records a prompt's item (an image, an audio clip) leaves in the engine once processed:
where its tokens sit in the prompt and what its encoder reads (`MultiModalFeature`, vLLM's `MultiModalFeatureSpec`
with its `PlaceholderRange`), and the encoder outputs a step hands the model (`MultiModalEmbeds`)."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from PIL import Image

from engine.multimodal.audio import PromptAudio

if TYPE_CHECKING:  # the scheduler reads these records: it need not load the video decoding
    from engine.multimodal.video import PromptVideo


@dataclass
class ItemTokens:
    """The token ids that stand for one item (an image, an audio clip) in the prompt
    (`replacement`, in place of its single placeholder token), which of them take an encoder
    output row (`is_embed`; None: all of them), and for a family with multimodal rotary
    positions the image's patch grid (temporal, height, width)."""

    replacement: list[int]
    is_embed: list[bool] | None = None
    grid: tuple[int, int, int] | None = None

    @property
    def num_embeds(self) -> int:
        """Rows the encoder yields for this item."""
        return len(self.replacement) if self.is_embed is None else sum(self.is_embed)


@dataclass
class ProcessedImage:
    """One image as its family's processor prepares it: the encoder's inputs (`data`, e.g.
    pixel_values, batch dimension of one image) and its tokens."""

    data: dict[str, torch.Tensor]
    tokens: ItemTokens


@dataclass(eq=False)
class MultiModalFeature:
    """An item of a prompt, of `modality` "image", "audio" or "video": its tokens are prompt positions
    [offset, offset + length), `identifier` is its content hash (two prompts with the same
    item share its encoder output and their prefix-cache blocks). The encoder's inputs
    (`data`) are made from `source` when the item is encoded and dropped once it is: a queue
    of prompts holds its images compressed, not as pixels, and its clips as their waveforms,
    not as features, and its videos as their kept frames, not as patches.

    An encoder-decoder model's item (Whisper's clip, in `ProcessedPrompt.cross`) has no prompt
    positions: its decoder attends to its encoder output through cross-attention. Its
    `offset` is 0 and its `length` the encoder's rows."""

    identifier: str
    offset: int
    length: int
    source: "Image.Image | bytes | PromptAudio | PromptVideo" = field(repr=False)
    is_embed: list[bool] | None = field(default=None, repr=False)
    grid: tuple[int, int, int] | None = None
    data: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    modality: str = "image"

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Rows of the encoder's output: one per position that takes an embedding."""
        return self.length if self.is_embed is None else sum(self.is_embed)

    def embed_rows(self, start: int, end: int) -> tuple[list[int], int, int]:
        """Of prompt positions [start, end): those that take an encoder row (relative to
        `start`), and the first and one-past-last encoder row they take."""
        lo, hi = max(start, self.offset), min(end, self.end)
        if lo >= hi:
            return [], 0, 0
        if self.is_embed is None:
            return list(range(lo - start, hi - start)), lo - self.offset, hi - self.offset
        before = sum(self.is_embed[: lo - self.offset])
        positions = [p - start for p in range(lo, hi) if self.is_embed[p - self.offset]]
        return positions, before, before + len(positions)


@dataclass
class MultiModalEmbeds:
    """Encoder outputs placed into a step: `rows` of the step's flat token rows take
    `embeds` [len(rows), hidden] instead of their token embeddings."""

    rows: torch.Tensor
    embeds: torch.Tensor


@dataclass
class ProcessedPrompt:
    """A prompt with its items: the token ids with every item's placeholder expanded, the
    items (of every modality) in prompt order, and for a model with multimodal rotary positions (Qwen2-VL) the
    prompt's [3, len] positions and the offset of the positions of generated tokens. An
    encoder-decoder model's items (Whisper's clip) are in `cross`, not in the prompt."""

    prompt_token_ids: list[int]
    features: list[MultiModalFeature]
    rope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    cross: list[MultiModalFeature] = field(default_factory=list)


def encoder_inputs_on(data: dict[str, torch.Tensor], device: torch.device,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An image's encoder inputs on `device`, the floating-point ones (pixels) in the model's dtype."""
    return {name: value.to(device, dtype if value.is_floating_point() else value.dtype) for name, value in data.items()}
