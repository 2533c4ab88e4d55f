"""Tiny random audio models (audio-language ones and Whisper), saved as real model folders with
real processors (the model's WhisperFeatureExtractor, a tokenizer with the audio tokens, a chat
template where the family has one)."""

import re
from pathlib import Path

import pytest
import transformers


def assert_config_token_mismatch_refused(folder: Path, processor_class: type, token: str, field: str) -> None:
    """`folder`'s config, loaded with its audio token id set one past the tokenizer's `token`,
    makes `processor_class` fail naming both ids and config.json's `field` (the check each
    family's processor runs through `BaseMultiModalProcessor.config_token_id`)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    right = config.audio_token_id
    config.audio_token_id = right + 1
    with pytest.raises(ValueError, match=rf"the tokenizer's '{re.escape(token)}' is token {right}, config.json's "
                                         rf"{field} {right + 1}: the folder's files disagree"):
        processor_class(folder, config, tokenizer)
