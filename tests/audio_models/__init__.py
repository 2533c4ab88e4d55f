"""Tiny random audio-language models, saved as real model folders with real processors
(the model's WhisperFeatureExtractor, a tokenizer with the audio tokens, a chat template)."""
