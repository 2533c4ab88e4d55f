"""A tiny random Voxtral checkpoint with the real WhisperFeatureExtractor (2 s windows) and
the tiny BPE tokenizer with Mistral's instruction and audio tokens (hub checkpoints ship
`tekken.json`, read through mistral_common; the tests do not need it)."""

from pathlib import Path

import torch
import transformers

from tests.tiny_models import build_tokenizer, save_random

SPECIAL_TOKENS = ["[INST]", "[/INST]", "[BEGIN_AUDIO]", "[AUDIO]"]
# The extractor's window: 2 s of 16 kHz audio, 200 mel frames, 100 encoder rows, 25 audio tokens
# (rows of d_model 32 regrouped by 4 into the projector's intermediate_size 128).
CHUNK_SECONDS = 2
TOKENS_PER_WINDOW = 25


def build_tiny_voxtral(folder: Path, seed: int = 0) -> Path:
    """A random Voxtral (an audio encoder of width 32, a Llama decoder of width 64) saved in
    `folder` by transformers, with its feature extractor and tokenizer.json."""
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=CHUNK_SECONDS).save_pretrained(folder)
    audio = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_mel_bins=80,
                 max_source_positions=100)
    text = dict(model_type="llama", vocab_size=len(tokenizer) + 4, hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config = transformers.VoxtralConfig(audio_config=audio, text_config=text,
                                        audio_token_id=tokenizer.convert_tokens_to_ids("[AUDIO]"))
    torch.manual_seed(seed)
    save_random(transformers.VoxtralForConditionalGeneration(config).to(torch.float32), folder)
    return folder
