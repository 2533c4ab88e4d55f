"""A prompt with images, audio or videos to token ids and encoder inputs: the part every family
shares (vLLM's `BaseMultiModalProcessor`). A family's processor (beside its model in
`engine.models`) says what one item of each modality it reads becomes (`process_image`,
`audio_tokens`, `video_tokens`); this class finds each item's placeholder token in the prompt, pairs the runs
of each modality's placeholder with that modality's items in prompt order, expands them into
the items' tokens, and records where they sit.

A prompt holds one placeholder token per item (the text a chat template writes for an image
or a clip, or the processor's `placeholders` in a hand-written prompt), or the item's tokens
already expanded (ids from an earlier processing): both are accepted, so that ids round-trip.
"""

import json
from pathlib import Path

import torch
from PIL import Image
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from engine.multimodal.audio import AudioLimits, PromptAudio
from engine.multimodal.image import ImageLimits, PromptImage, decode_budget, image_hash, load_image
from engine.multimodal.inputs import ItemTokens, MultiModalFeature, ProcessedImage, ProcessedPrompt
from engine.multimodal.video import PromptVideo, VideoLimits

# What a row's `multi_modal_data` holds, read and checked, per modality.
PromptItem = PromptImage | PromptAudio | PromptVideo
# How a message names a modality's items, by count: "2 image(s)", "2 audio clip(s)".
ITEM_NOUNS = {"image": "image", "audio": "audio clip", "video": "video"}


class MultiModalInputError(ValueError):
    """A row's images do not fit its prompt; the message starts with the field it names."""


class BaseMultiModalProcessor:
    """Turns (prompt ids, items per modality) into a `ProcessedPrompt` for one model folder.

    Subclasses name the `modalities` they read and, for each, its placeholder token and text
    (`image_token_id` and `image_placeholder`, `audio_token_id` and `audio_placeholder`). A
    family that reads images implements `process_image` (and `image_tokens` where the tokens
    follow from the image's size); one with multimodal rotary positions overrides
    `rope_positions`. A family that reads audio sets `audio_limits` (its feature extractor's
    rate and window rules) and implements `audio_tokens` and `audio_inputs`; one that reads
    no images (Qwen2-Audio) has no image processor. One that reads videos
    does the same with "video": `video_limits` (its video processor's frame rules),
    `video_tokens` and `video_inputs`.
    """

    modalities: tuple[str, ...] = ("image",)  # what the family reads beside text
    image_token_id: int
    image_placeholder: str  # what stands for one image in a prompt's text
    audio_token_id: int
    audio_placeholder: str  # what stands for one clip in a prompt's text
    audio_limits: AudioLimits | None = None  # what a clip may be, for a family that reads audio
    video_limits: VideoLimits | None = None  # what a video may be, for a family that reads videos
    # For a family with its own rotary positions (`rope_positions`), how many the decoder's tables hold.
    max_position: int | None = None
    # An encoder-decoder family's (Whisper's): the modality of the one item each prompt has,
    # which its decoder attends to (`ProcessedPrompt.cross`); None for a decoder-only family.
    cross_modality: str | None = None
    add_special_tokens = True  # whether a prompt's text is tokenized with the tokenizer's special tokens
    # The longest clip a family that transcribes (Whisper) reads at once, in seconds: what
    # `LLM.transcribe` cuts longer clips into; None for a family that does not transcribe.
    transcription_window_s: float | None = None

    def __init__(self, path: Path, hf_config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> None:
        """`hf_config` is the checkpoint's whole config (vision or audio, and text parts). The
        tokenizer takes the processor's chat template (chat_template.json) where it has none.
        A family that reads images gets its image processor and `limits`."""
        self.path = path
        self.hf_config = hf_config
        self.tokenizer = tokenizer
        template = path / "chat_template.json"
        if tokenizer.chat_template is None and template.exists():  # the processor's, in its older file
            tokenizer.chat_template = json.loads(template.read_text())["chat_template"]
        if "image" in self.modalities:
            self._set_up_images()

    def _set_up_images(self) -> None:
        """The image processor (transformers', its PIL backend) and what an image may be for it."""
        # Imported here: transformers' processing modules pull in torch._dynamo (and Triton)
        # and would load with every `import engine`.
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(self.path, backend="pil")
        budget = decode_budget(self.kept_pixels())
        self.limits = ImageLimits(budget, self.max_aspect_ratio(budget),
                                  f"the {self.hf_config.model_type} image processor")

    def config_token_id(self, token: str, token_id: int, field: str) -> int:
        """`token_id` (config.json's `field`), checked to be the tokenizer's id of `token`.

        Raises:
            ValueError: the tokenizer gives `token` another id (the folder's files disagree).
        """
        found = self.tokenizer.convert_tokens_to_ids(token)
        if found != token_id:
            raise ValueError(f"the tokenizer's '{token}' is token {found}, config.json's {field} {token_id}: the "
                             "folder's files disagree")
        return token_id

    @property
    def placeholder_ids(self) -> dict[str, int]:
        """The token that stands for one item in a prompt, per modality the model reads (its
        keys are those modalities)."""
        return {modality: getattr(self, f"{modality}_token_id") for modality in self.modalities}

    @property
    def placeholders(self) -> dict[str, str]:
        """The text that stands for one item in a prompt, per modality the model reads."""
        return {modality: getattr(self, f"{modality}_placeholder") for modality in self.modalities}

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

    def image_tokens(self, image: Image.Image) -> ItemTokens:
        """The prompt tokens of one image; by default from a whole processing, which a family
        whose count follows from the image's size alone overrides (then an image is
        processed once, when it is encoded)."""
        return self.process_image(image).tokens

    def audio_tokens(self, audio: PromptAudio) -> ItemTokens:
        """The prompt tokens of one clip, for a family that reads audio."""
        raise NotImplementedError

    def audio_inputs(self, audio: PromptAudio) -> dict[str, torch.Tensor]:
        """The audio encoder's inputs for one clip (its feature extractor's features), for a
        family that reads audio."""
        raise NotImplementedError

    def video_tokens(self, video: PromptVideo) -> ItemTokens:
        """The prompt tokens of one video, for a family that reads videos."""
        raise NotImplementedError

    def video_inputs(self, video: PromptVideo) -> dict[str, torch.Tensor]:
        """The video encoder's inputs for one video (its kept frames as patches), for a
        family that reads videos."""
        raise NotImplementedError

    def item_tokens(self, modality: str, item: PromptItem) -> ItemTokens:
        """The prompt tokens of one item of `modality`."""
        if modality == "image":
            return self.image_tokens(item.image)
        return self.audio_tokens(item) if modality == "audio" else self.video_tokens(item)

    def encoder_inputs(self, feature: MultiModalFeature) -> dict[str, torch.Tensor]:
        """The encoder's inputs for an item of a prompt, made from its source (an image
        decoded as when its row was checked, a clip's waveform, a video's kept frames)."""
        if feature.modality == "image":
            return self.process_image(load_image(feature.source, self.limits)).data
        return self.audio_inputs(feature.source) if feature.modality == "audio" else self.video_inputs(feature.source)

    def transcription_prompt(self, language: str, task: str, prompt: str | None) -> str:
        """The decoder prompt that transcribes (`task` "transcribe") or translates one window
        of audio in `language`, after the text `prompt` (None: no text), for a family that
        transcribes (sets `transcription_window_s`).

        Raises:
            ValueError: for a family that does not transcribe, or a language or task it does not know.
        """
        raise ValueError(f"the {self.hf_config.model_type} model does not transcribe: load Whisper")

    def language_token_ids(self) -> dict[str, int]:
        """A family that transcribes: the token of each language it knows, by code ("en")."""
        raise ValueError(f"the {self.hf_config.model_type} model does not transcribe: load Whisper")

    def language_detection_prompt(self) -> str:
        """A family that transcribes: the decoder prompt after which its next token names the
        clip's language (among `language_token_ids`)."""
        raise ValueError(f"the {self.hf_config.model_type} model does not transcribe: load Whisper")

    def max_item_rows(self) -> int:
        """The most encoder rows one item of the family yields where that is more than a prompt
        holds (an encoder-decoder family's clip, which takes no prompt positions); 0 for the others."""
        return 0

    def rope_positions(self, token_ids: list[int],
                       features: list[MultiModalFeature]) -> tuple[torch.Tensor, int] | None:
        """[3, len(token_ids)] rotary positions of the prompt and the offset that generated
        tokens' positions carry (position = index + offset), for families whose rotary
        positions are not the token index; None for the others."""
        return None

    def apply(self, token_ids: list[int], items: dict[str, list[PromptItem]]) -> ProcessedPrompt:
        """The prompt with each item's placeholder expanded and its features, in prompt order;
        each modality's placeholders pair with its items (`items[modality]`) in order.
        `items` holds modalities the model reads only (the row check refuses the others).

        Raises:
            MultiModalInputError: a modality's placeholders and its items do not pair up.
        """
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        used = dict.fromkeys(self.placeholder_ids, 0)  # items of each modality placed so far
        last = 0
        for start, length, modality in self._placeholder_runs(token_ids):
            ids += token_ids[last:start]
            given = items.get(modality, [])
            position, end = start, start + length
            while position < end:  # adjacent placeholders, or an item expanded by an earlier processing
                index = used[modality]
                if index == len(given):
                    raise MultiModalInputError(self._count_problem(modality, index + 1, len(given)))
                tokens = self._checked_tokens(modality, given[index], index)
                expanded = tokens.replacement
                taken = len(expanded) if token_ids[position : position + len(expanded)] == expanded else 1
                features.append(_feature(modality, given[index], len(ids), tokens))
                used[modality] += 1
                ids += expanded
                position += taken
            last = end
        for modality, given in items.items():
            if used[modality] < len(given):
                raise MultiModalInputError(self._count_problem(modality, used[modality], len(given)))
        ids += token_ids[last:]
        prompt = ProcessedPrompt(ids, features)
        if (rope := self.rope_positions(ids, features)) is not None:
            prompt.rope_positions, prompt.rope_delta = rope
        return prompt

    def _checked_tokens(self, modality: str, item: PromptItem, index: int) -> ItemTokens:
        """The tokens of the prompt's item `index` of `modality`. The processor is
        transformers' code (or its rules) run on a row's item: whatever it raises (a
        ValueError for a size it refuses, a TypeError, ...) is that item's problem, not the call's.

        Raises:
            MultiModalInputError: naming the item, the processor's reason and the fix.
        """
        try:
            return self.item_tokens(modality, item)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if modality == "image":
                image = item.image
                raise MultiModalInputError(
                    f"multi_modal_data['image'][{index}]: {self.limits.processor} refuses the {image.width}x"
                    f"{image.height} {image.mode} image ({reason}): convert it to an RGB image of ordinary size and "
                    "aspect ratio upstream") from exc
            if modality == "video":
                count, height, width, _ = item.frames.shape
                raise MultiModalInputError(
                    f"multi_modal_data['video'][{index}]: the {self.hf_config.model_type} processor refuses the "
                    f"{count}-frame {width}x{height} video ({reason}): resample or resize it upstream") from exc
            raise MultiModalInputError(
                f"multi_modal_data['{modality}'][{index}]: the {self.hf_config.model_type} processor refuses the "
                f"{item.seconds:,.2f} s clip ({reason}): cut or fix the clip upstream") from exc

    def _placeholder_runs(self, token_ids: list[int]) -> list[tuple[int, int, str]]:
        """(start, length, modality) of each run of one modality's placeholder tokens: single
        placeholders side by side, or items' tokens expanded by an earlier processing."""
        modality_of = {token: modality for modality, token in self.placeholder_ids.items()}
        runs: list[tuple[int, int, str]] = []
        i = 0
        while i < len(token_ids):
            token = token_ids[i]
            if token not in modality_of:
                i += 1
                continue
            start = i
            while i < len(token_ids) and token_ids[i] == token:
                i += 1
            runs.append((start, i - start, modality_of[token]))
        return runs

    def _count_problem(self, modality: str, placeholders: int, items: int) -> str:
        """`placeholders` counts those read: one more than the items where they ran out."""
        noun, placeholder = ITEM_NOUNS[modality], self.placeholders[modality]
        if placeholders < items:
            return (f"multi_modal_data: {items} {noun}(s) but the prompt has {placeholders} {modality} placeholder(s): "
                    f"put {placeholder!r} in the prompt once per {noun} (LLM.chat places them), "
                    f"or drop the extra {noun}s")
        return (f"prompt: has more {modality} placeholders {placeholder!r} than the {items} {noun}(s) "
                f"given: pass one {noun} per placeholder in multi_modal_data['{modality}']")


def _feature(modality: str, item: PromptItem, offset: int, tokens: ItemTokens) -> MultiModalFeature:
    """The record of a prompt's item whose tokens start at `offset`: keyed by its content
    hash, with its compact source (an image's as given, a clip's waveform, a video's kept frames)."""
    if modality == "image":
        return MultiModalFeature(image_hash(item.image), offset, len(tokens.replacement), item.source,
                                 tokens.is_embed, tokens.grid)
    return MultiModalFeature(item.content_hash, offset, len(tokens.replacement), item, tokens.is_embed, tokens.grid,
                             modality=modality)

