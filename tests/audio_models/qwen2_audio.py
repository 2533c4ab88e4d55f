"""A tiny random Qwen2-Audio checkpoint with the real WhisperFeatureExtractor (a 2 s window),
the tiny BPE tokenizer with Qwen's audio and ChatML tokens, and Qwen2-Audio's chat template."""

from pathlib import Path

import torch
import transformers

from tests.tiny_models import build_tokenizer, save_random

SPECIAL_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>", "<|im_start|>", "<|im_end|>"]
# The extractor's window: 2 s of 16 kHz audio, 200 mel frames, 100 encoder positions, at most 50 audio tokens.
CHUNK_SECONDS = 2
MAX_SOURCE_POSITIONS = 100


def build_tiny_qwen2_audio(folder: Path, seed: int = 0) -> Path:
    """A random Qwen2-Audio (an audio encoder of width 32, a Qwen2 decoder of width 64)
    saved in `folder` by transformers, with its feature extractor and tokenizer (the chat
    template is transformers' Qwen2AudioProcessor default, which the hub's checkpoints ship)."""
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    feature_extractor = transformers.WhisperFeatureExtractor(chunk_length=CHUNK_SECONDS)
    tokenizer.chat_template = transformers.Qwen2AudioProcessor(feature_extractor, tokenizer).default_chat_template
    tokenizer.save_pretrained(folder)
    feature_extractor.save_pretrained(folder)
    audio = dict(d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, num_mel_bins=80,
                 max_source_positions=MAX_SOURCE_POSITIONS)
    text = dict(model_type="qwen2", vocab_size=len(tokenizer) + 3, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.Qwen2AudioConfig(audio_config=audio, text_config=text,
                                           audio_token_id=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(seed)
    save_random(transformers.Qwen2AudioForConditionalGeneration(config).to(torch.float32), folder)
    return folder
