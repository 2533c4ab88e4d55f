"""What happens to a sampled token: the stop checks, the grammar's and the reasoning
section's advance, the text, the logprobs, and the outputs built at the end, where the
completion's reasoning and tool calls are read apart (vLLM's `v1/engine/output_processor.py`
and `detokenizer.py`, v0's `engine/output_processor/`)."""
