"""A prompt with images to token ids and encoder inputs: the part every family shares (vLLM's
`BaseMultiModalProcessor`). A family's processor (beside its model in `engine.models`) says
what one image becomes (`process_image`); this class finds each image's placeholder token in
the prompt, expands it into the image's tokens, and records where they sit.

A prompt holds one placeholder token per image (the text a chat template writes for an image,
or `image_placeholder` in a hand-written prompt), or the image's tokens already expanded (ids
from an earlier processing): both are accepted, so that ids round-trip.
"""

import json
from pathlib import Path

import torch
from PIL import Image
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.multimodal.image import ImageLimits, PromptImage, decode_budget, image_hash, load_image
from engine.multimodal.inputs import ImageTokens, MultiModalFeature, ProcessedImage, ProcessedPrompt


class MultiModalInputError(ValueError):
    """A row's images do not fit its prompt; the message starts with the field it names."""


class BaseMultiModalProcessor:
    """Turns (prompt ids, images) into a `ProcessedPrompt` for one model folder.

    Subclasses set `image_token_id` and `image_placeholder` and implement `process_image`
    (and `image_tokens` where the tokens follow from the image's size); a family with
    multimodal rotary positions overrides `rope_positions`.
    """

    image_token_id: int
    image_placeholder: str  # what stands for one image in a prompt's text

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """`hf_config` is the checkpoint's whole config (vision and text parts). The
        tokenizer takes the processor's chat template (chat_template.json) where it has none."""
        self.path = path
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        # Imported here: transformers' processing modules pull in torch._dynamo (and Triton)
        # and would load with every `import engine`.
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil")
        template = path / "chat_template.json"
        if tokenizer.chat_template is None and template.exists():  # the processor's, in its older file
            tokenizer.chat_template = json.loads(template.read_text())["chat_template"]
        budget = decode_budget(self.kept_pixels())
        self.limits = ImageLimits(budget, self.max_aspect_ratio(budget),
                                  f"the {hf_config.model_type} image processor")

    def kept_pixels(self) -> int:
        """The most pixels of an image the image processor keeps (what it resizes to), which
        sizes the decode budget."""
        raise NotImplementedError

    def max_aspect_ratio(self, budget: int) -> float | None:
        """The widest aspect ratio the image processor takes (None: any), for an image within
        `budget` pixels."""
        return None

    def process_image(self, image: Image.Image) -> ProcessedImage:
        """The encoder inputs and prompt tokens of one image."""
        raise NotImplementedError

    def image_tokens(self, image: Image.Image) -> ImageTokens:
        """The prompt tokens of one image; by default from a whole processing, which a family
        whose count follows from the image's size alone overrides (then an image is
        processed once, when it is encoded)."""
        return self.process_image(image).tokens

    def encoder_inputs(self, feature: MultiModalFeature) -> dict[str, torch.Tensor]:
        """The encoder's inputs for an image of a prompt, made from its source (decoded as
        when its row was checked)."""
        return self.process_image(load_image(feature.source, self.limits)).data

    def rope_positions(self, token_ids: list[int],
                       features: list[MultiModalFeature]) -> tuple[torch.Tensor, int] | None:
        """[3, len(token_ids)] rotary positions of the prompt and the offset that generated
        tokens' positions carry (position = index + offset), for families whose rotary
        positions are not the token index; None for the others."""
        return None

    def apply(self, token_ids: list[int], images: list[PromptImage]) -> ProcessedPrompt:
        """The prompt with each image's placeholder expanded and its features.

        Raises:
            MultiModalInputError: the prompt's placeholders and its images do not pair up.
        """
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        last = 0
        for start, length in self._placeholder_runs(token_ids):
            ids += token_ids[last:start]
            position, end = start, start + length
            while position < end:  # adjacent placeholders, or an image expanded by an earlier processing
                if len(features) == len(images):
                    raise MultiModalInputError(self._count_problem(len(features) + 1, len(images)))
                image = images[len(features)]
                tokens = self._checked_tokens(image.image, len(features))
                expanded = tokens.replacement
                taken = len(expanded) if token_ids[position : position + len(expanded)] == expanded else 1
                features.append(MultiModalFeature(image_hash(image.image), len(ids), len(expanded), image.source,
                                                  tokens.is_embed, tokens.grid))
                ids += expanded
                position += taken
            last = end
        if len(features) < len(images):
            raise MultiModalInputError(self._count_problem(len(features), len(images)))
        ids += token_ids[last:]
        prompt = ProcessedPrompt(ids, features)
        if (rope := self.rope_positions(ids, features)) is not None:
            prompt.rope_positions, prompt.rope_delta = rope
        return prompt

    def _checked_tokens(self, image: Image.Image, index: int) -> ImageTokens:
        """The tokens of the prompt's image `index`. The image processor is transformers' code
        run on a row's image: whatever it raises (a ValueError for a size it refuses, a
        TypeError, ...) is that image's problem, not the call's.

        Raises:
            MultiModalInputError: naming the image, the processor's reason and the fix.
        """
        try:
            return self.image_tokens(image)
        except Exception as exc:
            raise MultiModalInputError(
                f"multi_modal_data['image'][{index}]: {self.limits.processor} refuses the {image.width}x"
                f"{image.height} {image.mode} image ({type(exc).__name__}: {exc}): convert it to an RGB image of "
                "ordinary size and aspect ratio upstream") from exc

    def _placeholder_runs(self, token_ids: list[int]) -> list[tuple[int, int]]:
        """(start, length) of each run of image tokens: single placeholders side by side,
        or images' tokens expanded by an earlier processing."""
        runs: list[tuple[int, int]] = []
        i = 0
        while i < len(token_ids):
            if token_ids[i] != self.image_token_id:
                i += 1
                continue
            start = i
            while i < len(token_ids) and token_ids[i] == self.image_token_id:
                i += 1
            runs.append((start, i - start))
        return runs

    def _count_problem(self, placeholders: int, images: int) -> str:
        """`placeholders` counts those read: one more than the images where they ran out."""
        if placeholders < images:
            return (f"multi_modal_data: {images} image(s) but the prompt has {placeholders} image placeholder(s): "
                    f"put {self.image_placeholder!r} in the prompt once per image (LLM.chat places them), "
                    "or drop the extra images")
        return (f"prompt: has more image placeholders {self.image_placeholder!r} than the {images} image(s) "
                "given: pass one image per placeholder in multi_modal_data['image']")
