"""A tiny random Whisper checkpoint: 2 encoder and 2 decoder layers of width 64 (4 heads) over a 2 s
window (transformers' real `WhisperFeatureExtractor` with `chunk_length=2`: 200 mel frames,
100 encoder rows), and the tiny BPE tokenizer with Whisper's task tokens, `<|endoftext|>` its
end of text."""

from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

from tests.tiny_models import build_tokenizer, save_random

TASK_TOKENS = ["<|startoftranscript|>", "<|en|>", "<|fr|>", "<|transcribe|>", "<|translate|>", "<|notimestamps|>",
               "<|prev|>"]
CHUNK_SECONDS = 2
SAMPLE_RATE = 16_000


def build_tiny_whisper(folder: Path, seed: int = 0) -> Path:
    """A random `WhisperForConditionalGeneration` saved into `folder` with its feature
    extractor and tokenizer; no token is suppressed (`suppress_tokens` and
    `begin_suppress_tokens` None), so transformers' `generate` is plain greedy decoding."""
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": TASK_TOKENS, "eos_token": "<|endoftext|>"})
    tokenizer.save_pretrained(folder)
    ids = tokenizer.convert_tokens_to_ids
    extractor = transformers.WhisperFeatureExtractor(chunk_length=CHUNK_SECONDS)
    frames = extractor.nb_max_frames
    config = transformers.WhisperConfig(
        vocab_size=len(tokenizer), d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=extractor.feature_size,
        max_source_positions=frames // 2, max_target_positions=64, decoder_start_token_id=ids("<|startoftranscript|>"),
        eos_token_id=ids("<|endoftext|>"), pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"),
        begin_suppress_tokens=None, suppress_tokens=None)
    torch.manual_seed(seed)
    model = transformers.WhisperForConditionalGeneration(config).to(torch.float32)
    save_random(model, folder)
    extractor.save_pretrained(folder)
    return folder
