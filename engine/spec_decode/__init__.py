"""Speculative decoding: tokens proposed for a sequence are verified by one forward pass of
the model over all of them (`engine.sample.rejection_sampler` decides what is accepted)."""
