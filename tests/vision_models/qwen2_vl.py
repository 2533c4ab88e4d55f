"""Tiny random Qwen2-VL and Qwen2.5-VL checkpoints with the real PIL image processor, a
video processor config (written by hand: transformers' video processor needs torchvision to
save one), the tiny BPE tokenizer with Qwen's vision and ChatML tokens, and a Qwen2-VL chat
template."""

import json
from pathlib import Path

import torch
import transformers
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.tiny_models import build_tokenizer, save_random

SPECIAL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>", "<|video_pad|>"]
PATCH_SIZE = 7
MERGE_SIZE = 2
# Images resize to between 4 and 48 merged rows (image tokens) of 14 x 14 pixels.
MIN_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 4
MAX_PIXELS = (PATCH_SIZE * MERGE_SIZE) ** 2 * 48
# Video frames resize to between 4 and 12 merged rows; a file is sampled into 2 to 16 frames.
VIDEO_PROCESSOR = {"video_processor_type": "Qwen2VLVideoProcessor",
                   "size": {"shortest_edge": (PATCH_SIZE * MERGE_SIZE) ** 2 * 4,
                            "longest_edge": (PATCH_SIZE * MERGE_SIZE) ** 2 * 12},
                   "patch_size": PATCH_SIZE, "temporal_patch_size": 2, "merge_size": MERGE_SIZE, "min_frames": 2,
                   "max_frames": 16, "cap_pixels_per_frame": False, "do_sample_frames": False,
                   "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}

# Qwen2-VL's template (ChatML; an image part becomes its placeholder), as the hub's checkpoints ship it.
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vision_config(version: str) -> dict:
    """Two blocks of width 32 over 7-pixel patches; Qwen2.5-VL's first block attends within
    windows of 2 x 2 merged rows, its second over the whole image."""
    common = dict(depth=2, num_heads=2, patch_size=PATCH_SIZE, spatial_merge_size=MERGE_SIZE, temporal_patch_size=2)
    if version == "2":
        return dict(common, embed_dim=32, mlp_ratio=2, hidden_size=64)
    return dict(common, hidden_size=32, intermediate_size=48, out_hidden_size=64,
                window_size=2 * MERGE_SIZE * PATCH_SIZE, fullatt_block_indexes=[1])


def build_tiny_qwen2_vl(folder: Path, version: str = "2", seed: int = 0) -> Path:
    """A random Qwen2-VL (`version` "2") or Qwen2.5-VL ("2.5", with tied embeddings) saved
    in `folder` by transformers (the hub's layout: "visual.", the decoder "model."), with
    its image and video processors and tokenizer (the chat template in chat_template.jinja)."""
    if version not in ("2", "2.5"):
        raise ValueError(f"version {version!r}: expected '2' or '2.5'")
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    ids = dict(zip(SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)))
    text = dict(vocab_size=len(tokenizer) + 6, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                eos_token_id=2, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    config_class = transformers.Qwen2VLConfig if version == "2" else transformers.Qwen2_5_VLConfig
    config = config_class(text_config=text, vision_config=_vision_config(version),
                          image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                          vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
                          tie_word_embeddings=version == "2.5")
    model_class = (transformers.Qwen2VLForConditionalGeneration if version == "2"
                   else transformers.Qwen2_5_VLForConditionalGeneration)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    save_random(model, folder)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=PATCH_SIZE,
                             temporal_patch_size=2, merge_size=MERGE_SIZE).save_pretrained(folder)
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_PROCESSOR, indent=2))
    return folder
