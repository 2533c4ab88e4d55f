"""The scheduler side of a step (vLLM's `v1/core`): requests as `Sequence`s, the `Scheduler`
that picks each step's batch, the `BlockManager` that keeps the paged KV cache's books and its
prefix cache, and beam groups. Pure bookkeeping: nothing here imports model code or torch kernels;
the worker side reads a step's plan through `sched_output.ScheduledBatch`."""
