"""CUDA graphs for decode steps: the model's forward captured once per bucketed batch size
and replayed with the step's inputs copied into static buffers, padded to the bucket.

A decode step of a small model is mostly launch overhead: hundreds of small kernels whose
launches cost more than their work. A replay launches them all at once. Padding rows write
nowhere (slot -1) and attend to nothing (context 0); their outputs are dropped.
"""

import logging
import time

import torch
from torch import nn

from engine.attention.layer import AttentionMetadata
from engine.kernels.triton.paged_attention import decode_splits

logger = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 16 up to `max_num_seqs`."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return sorted({*sizes, max_num_seqs})


class CUDAGraphRunner:
    """Captured decode forwards of `model` and the static buffers they read and write."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_model_len: int, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.buckets = decode_buckets(max_num_seqs)
        size, max_blocks = self.buckets[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(size, max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.splits = decode_splits(max_model_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], positions=self.positions[:size],
            query_lens=[1] * size, context_lens=[0] * size, block_size=self.block_size, backend_data=self.splits)

    def capture(self) -> None:
        """Captures every bucket, largest first, sharing one memory pool."""
        start = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.buckets):
            args = (self.input_ids[:size], self.positions[:size], self._metadata(size))
            self.model(*args)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("CUDA graphs: %d decode batch sizes up to %d captured in %.1f s",
                    len(self.buckets), self.buckets[-1], time.monotonic() - start)

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.buckets[-1]

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [seqs, hidden] of a decode step (one new token per sequence),
        its inputs copied on the device into the bucket's buffers."""
        count = len(input_ids)
        size = next(b for b in self.buckets if b >= count)
        width = meta.block_tables.shape[1]
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(meta.positions)
        self.slot_mapping[:count].copy_(meta.slot_mapping)
        self.slot_mapping[count:size].fill_(-1)
        self.seq_lens[:count].copy_(meta.seq_lens)
        self.seq_lens[count:size].zero_()
        self.block_tables[:count, :width].copy_(meta.block_tables)
        self.graphs[size].replay()
        return self.outputs[size][:count]
