"""Sampling (vLLM's `v1/sample`): from a step's logits to its tokens and logprobs."""
