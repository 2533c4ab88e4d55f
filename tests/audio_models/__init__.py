"""Tiny random audio models (audio-language ones and Whisper), saved as real model folders with
real processors (the model's WhisperFeatureExtractor, a tokenizer with the audio tokens, a chat
template where the family has one)."""
