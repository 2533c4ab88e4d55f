"""The device side of a step (vLLM's `v1/worker` and `v1/executor`).

Names against vLLM's:
- `ModelRunner` (`model_runner.py`): the rank-0 driver of one step: builds the inputs from a
  `ScheduledBatch`, launches the forward pass, samples or pools, collects the results. It is the
  rank-0 half of vLLM's `GPUModelRunner` plus the executor handle.
- `WorkerGroup` (`worker_group.py`): rank 0's fan-out of every call to all tensor-parallel ranks,
  as vLLM's `MultiprocExecutor`; `tp_worker.py` is the loop the ranks 1.. run.
- `Worker` (`worker.py`): one rank: its weights, KV cache and the forward pass (`execute_model`,
  logits): vLLM's `GPUWorker` plus the forward half of `GPUModelRunner`. Ranks 1.. need only this,
  which is why the split differs from vLLM's.
The rest are the step's parts: `input_batch` (the batch's tensors), `sampling_metadata`,
`kv_cache` (the cache's tensors), `cuda_graphs`, `device_queue` (async scheduling) and
`calibration` (int8 input ranges measured on a scratch cache at load)."""
