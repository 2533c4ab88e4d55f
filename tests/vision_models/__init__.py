"""Tiny random vision-language models of each supported family, saved as real model folders
with real processors (image processor, tokenizer with the image tokens, chat template)."""
