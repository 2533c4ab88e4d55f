"""Speculative decoding: tokens proposed for a sequence are verified by one forward pass of
the model over all of them (`engine.sample.rejection_sampler` says what each verification row
samples with and which proposals are accepted; `Scheduler.update_accepted` counts the
accepted ones' keys and values as computed, the rest's slots are written again)."""
