"""Tiny random Idefics3 and SmolVLM checkpoints: SigLIP (2 layers, hidden 32), the
pixel-shuffle connector and a 2-layer Llama, with the family's real PIL image processor
(small sizes: an image gives up to 3 x 3 sub-images plus the global one), the tiny BPE
tokenizer with the family's image tokens, and its chat template."""

import json
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import DEFAULT_CHAT_TEMPLATE as SMOLVLM_CHAT_TEMPLATE

from tests.tiny_models import build_tokenizer, save_random

# Idefics3's template (the hub's, with the tokenizer's own BOS for "<|begin_of_text|>").
IDEFICS3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}{{ ': ' + message['content'] }}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}{{ ': ' }}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# SmolVLM's tokenizer names its image tokens; Idefics3's processor uses these strings itself.
NAMED_TOKENS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
                "end_of_utterance_token": "<end_of_utterance>", "global_image_token": "<global-img>"}
ROW_COL_TOKENS = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
VOCAB_SIZE = 384


def _tokenizer(folder: Path, smolvlm: bool) -> transformers.PreTrainedTokenizerBase:
    """The tiny BPE tokenizer plus the image tokens (SmolVLM's under their attribute names)."""
    build_tokenizer(folder)
    if smolvlm:
        tokenizer = AutoTokenizer.from_pretrained(folder, extra_special_tokens=NAMED_TOKENS)
        tokenizer.add_tokens(["<|im_start|>", *ROW_COL_TOKENS], special_tokens=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        tokenizer.add_tokens([*NAMED_TOKENS.values(), *ROW_COL_TOKENS], special_tokens=True)
    tokenizer.chat_template = SMOLVLM_CHAT_TEMPLATE if smolvlm else IDEFICS3_CHAT_TEMPLATE
    assert len(tokenizer) <= VOCAB_SIZE
    return tokenizer


def _config(smolvlm: bool, image_token_id: int) -> transformers.PretrainedConfig:
    """SmolVLM's encoder side does not divide the image into whole patches (60 px, patch 14:
    4 x 4 patches, as SmolVLM2's 384 px at patch 14), Idefics3's does (32 px, patch 8)."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=60 if smolvlm else 32, patch_size=14 if smolvlm else 8)
    text = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    family = transformers.SmolVLMConfig if smolvlm else transformers.Idefics3Config
    return family(vision_config=vision, text_config=text, scale_factor=2, image_token_id=image_token_id,
                  tie_word_embeddings=False)


def image_seq_len(config: transformers.PretrainedConfig) -> int:
    """Tokens of one sub-image, as transformers' model computes it."""
    vision = config.vision_config
    return (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2


def build_tiny_idefics3(folder: Path, smolvlm: bool = False, seed: int = 0) -> Path:
    """A random Idefics3 (or SmolVLM) folder: config, safetensors, image processor,
    tokenizer, chat template (and Idefics3's processor_config.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(folder, smolvlm)
    config = _config(smolvlm, tokenizer.convert_tokens_to_ids("<image>"))
    side = config.vision_config.image_size
    image_class = SmolVLMImageProcessorPil if smolvlm else Idefics3ImageProcessorPil
    image_processor = image_class(size={"longest_edge": 3 * side}, max_image_size={"longest_edge": side})
    if smolvlm:  # SmolVLMProcessor needs num2words and a video processor (torchvision): saved in parts
        image_processor.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "processor_config.json").write_text(json.dumps(
            {"image_seq_len": image_seq_len(config), "processor_class": "SmolVLMProcessor"}, indent=2))
    else:
        transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                       image_seq_len=image_seq_len(config),
                                       chat_template=IDEFICS3_CHAT_TEMPLATE).save_pretrained(folder)
    torch.manual_seed(seed)
    family = transformers.SmolVLMForConditionalGeneration if smolvlm else transformers.Idefics3ForConditionalGeneration
    model = family(config).to(torch.float32)
    save_random(model, folder)
    return folder
