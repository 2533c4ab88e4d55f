"""Speculative decoding: tokens proposed for a sequence are verified by one forward pass of
the model over all of them (`rows.py` says what each verification row samples with,
`LLMEngine._take_tokens` keeps the accepted ones and `Scheduler.accept_proposals` frees the
rest's slots)."""
