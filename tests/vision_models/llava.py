"""Tiny random LLaVA 1.5 and LLaVA-NeXT checkpoints: a CLIP vision tower, the two-layer
projector and a Llama decoder, with transformers' real image processors, a tokenizer that
knows "<image>" and a chat template in llava-hf's style."""

from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from tests.tiny_models import build_tokenizer, save_random

IMAGE_TOKEN = "<image>"
# Crops of the vision tower's size: one per crop, the best pinpoint taken for each image.
GRID_PINPOINTS = [[32, 64], [64, 32], [64, 64], [96, 32], [32, 96]]
# llava-hf's template: per message "ROLE: ", its images first ("<image>\n" each), then its texts.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}{{ part['text'] + ' ' }}{% endfor %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


def build_tiny_llava(folder: Path, next_: bool = False, seed: int = 0, **overrides: object) -> Path:
    """A random `LlavaForConditionalGeneration` (or with `next_` a `LlavaNextForConditionalGeneration`)
    saved into `folder` with its processor; `overrides` replace fields of the whole config
    (`vision_feature_layer=[0, -1]`, `vision_feature_select_strategy="full"`)."""
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=16,
                                           hidden_act="quick_gelu")
    text = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    image_token = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    fields = dict(vision_config=vision, text_config=text, image_token_index=image_token, projector_hidden_act="gelu",
                  **overrides)
    sizes = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    if next_:
        config = transformers.LlavaNextConfig(**fields, image_grid_pinpoints=GRID_PINPOINTS)
        model_class, processor_class = transformers.LlavaNextForConditionalGeneration, transformers.LlavaNextProcessor
        image_processor = transformers.LlavaNextImageProcessorPil(**sizes, image_grid_pinpoints=GRID_PINPOINTS)
    else:
        config = transformers.LlavaConfig(**fields)
        model_class, processor_class = transformers.LlavaForConditionalGeneration, transformers.LlavaProcessor
        image_processor = transformers.CLIPImageProcessorPil(**sizes)
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    save_random(model, folder)
    processor = processor_class(image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
                                vision_feature_select_strategy=config.vision_feature_select_strategy,
                                num_additional_image_tokens=1, chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(folder)
    return folder
