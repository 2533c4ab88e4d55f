"""Adapter weights in device slots, one set per projection, applied to a mixed batch."""

from dataclasses import dataclass, field

import torch

from engine.layers.linear import Linear, prepack, project
from engine.lora.adapter import ModuleLoRA


@dataclass
class LoRABatch:
    """The step's rows by slot: (slot, first row, end row) for each run of rows whose
    requests use the adapter in that slot. The model runner orders the step's tokens so
    that each adapter's rows are contiguous; rows of requests without one are in none."""

    ranges: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class _SlotWeights:
    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    packed_a: torch.Tensor | None
    packed_b: torch.Tensor | None


class LoRASlots:
    """One projection's adapters, one per device slot, and the step's mapping.

    A fused projection (q/k/v, gate/up) stacks its shards' A matrices and puts their B
    matrices on a block diagonal, so each slot costs two products per projection. The
    delta of a run of rows is (x @ A.T) @ B.T: it depends on those rows and the adapter
    only, never on which slot holds the adapter or what else is in the batch.
    """

    def __init__(self, layer: Linear, shard_sizes: list[int], num_slots: int, batch: LoRABatch,
                 device: torch.device) -> None:
        self.shard_sizes = shard_sizes
        self.batch = batch
        self.device = device
        self.weights: list[_SlotWeights | None] = [None] * num_slots
        layer.lora = self

    def load(self, slot: int, shards: list[ModuleLoRA | None]) -> None:
        """Puts an adapter's matrices for this projection's shards (None: not adapted)
        into `slot`; an adapter that touches none of them leaves the slot empty."""
        present = [(i, s) for i, s in enumerate(shards) if s is not None]
        if not present:
            self.weights[slot] = None
            return
        dtype = present[0][1].a.dtype
        a = torch.cat([s.a for _, s in present]).to(self.device)
        b = torch.zeros(sum(self.shard_sizes), a.shape[0], dtype=dtype, device=self.device)
        col = 0
        for i, s in present:
            row = sum(self.shard_sizes[:i])
            b[row : row + self.shard_sizes[i], col : col + s.a.shape[0]] = s.b
            col += s.a.shape[0]
        self.weights[slot] = _SlotWeights(a, b, prepack(a), prepack(b))

    def add_deltas(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Adds each adapter's delta to its rows of `out`, in place."""
        for slot, start, end in self.batch.ranges:
            w = self.weights[slot]
            if w is not None:
                hidden = project(x[start:end], w.a, w.packed_a)
                out[start:end] += project(hidden, w.b, w.packed_b)
