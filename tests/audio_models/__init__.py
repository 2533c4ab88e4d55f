"""Tiny random audio models of each supported family, saved as real model folders with real
feature extractors and tokenizers that know the families' audio tokens."""
