"""Adapter weights in device slots, one stack per projection, applied to a mixed batch."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.layers.linear import Linear, ShardSlice
from engine.layers.rotary import RotaryPairs
from engine.lora.adapter import ModuleLoRA

# Each slot's group of rows is padded to at least this many: like the dense projections
# (see layers/linear.py), tiny products take other kernels that round differently.
_MIN_GROUP_ROWS = 8


@dataclass(frozen=True)
class LoRATarget:
    """A projection an adapter may change: our `layer`, and which of the checkpoint
    tensors stacked in it (q, k or v of a fused q/k/v) the adapter's module names;
    `row_order` where the layer's rows were reordered at load (rotary pairs to halves), which
    an adapter's B then takes too."""

    layer: Linear
    shard: int
    row_order: RotaryPairs | None = None

    @property
    def _slice(self) -> ShardSlice | None:
        return (self.layer.checkpoint_slices or [None] * (self.shard + 1))[self.shard]

    @property
    def checkpoint_shape(self) -> tuple[int, int]:
        """(in_features, out_features) of the whole projection, as the adapter was trained."""
        piece, sizes = self._slice, self.layer.shard_sizes or [self.layer.out_features]
        in_features = piece.full if piece is not None and piece.dim == 1 else self.layer.in_features
        out_features = piece.full if piece is not None and piece.dim == 0 else sizes[self.shard]
        return in_features, out_features

    def local(self, lora: ModuleLoRA) -> ModuleLoRA:
        """The adapter's matrices for this rank: split like the layer's weight (B's rows
        for a column-parallel projection, A's columns for a row-parallel one)."""
        if self.row_order is not None:
            lora = ModuleLoRA(lora.a, self.row_order.to_halves(lora.b))
        piece = self._slice
        if piece is None:
            return lora
        if piece.dim == 0:
            return ModuleLoRA(lora.a, piece.of(lora.b).contiguous())
        return ModuleLoRA(lora.a.narrow(1, piece.start, piece.length).contiguous(), lora.b)


@dataclass(frozen=True)
class LoRARange:
    """Rows [start, end) of a step that run with the adapter in `slot`."""

    slot: int
    start: int
    end: int

    @property
    def num_rows(self) -> int:
        return self.end - self.start


@dataclass
class LoRABatch:
    """The step's rows grouped by slot, for batched products.

    `slots` [groups] are the slots in use; `gather` [groups, rows per group] picks each
    group's rows out of the step's rows, padded with the index one past the last row (a
    zero row); `scatter` is the same with the padding pointing at row 0, which the zero
    rows' zero deltas leave unchanged. When the groups are back to back and of one length
    (one adapter, or an even mix), `block` is (first row, length): the groups are then a
    view of the rows, with the same shapes and so the same results, and no copies.
    `every_slot` says the groups are all `num_slots` slots in order, so that the stacked
    weights serve as they are.
    """

    num_slots: int
    kernel: Callable | None = None  # the Triton SGMV product (see engine.kernels.triton.lora), when set
    every_slot: bool = False
    slots: torch.Tensor | None = None
    slot_list: list[int] = field(default_factory=list)
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None
    block: tuple[int, int] | None = None
    segments: torch.Tensor | None = None
    max_rows: int = 0

    def set(self, ranges: list[LoRARange], num_rows: int, device: torch.device) -> None:
        """`ranges` are the step's runs of rows, one per slot in use."""
        self.slot_list = [r.slot for r in ranges]
        self.every_slot = self.slot_list == list(range(self.num_slots))
        self.slots = self.gather = self.scatter = self.block = self.segments = None
        if not ranges:
            return
        if self.kernel is not None:
            columns = [[r.start for r in ranges], [r.num_rows for r in ranges], self.slot_list]
            self.segments = torch.tensor(columns, dtype=torch.int32, device=device)
            self.max_rows = max(r.num_rows for r in ranges)
            return
        self.slots = torch.tensor(self.slot_list, device=device)
        width = max(_MIN_GROUP_ROWS, max(r.num_rows for r in ranges))
        first = ranges[0].start
        if all((r.start, r.end) == (first + i * width, first + (i + 1) * width) for i, r in enumerate(ranges)):
            self.block = (first, width)
            return
        gather = torch.full((len(ranges), width), num_rows, dtype=torch.long)
        for group, r in enumerate(ranges):
            gather[group, : r.num_rows] = torch.arange(r.start, r.end)
        self.gather = gather.to(device)
        self.scatter = torch.where(gather == num_rows, 0, gather).to(device)


class LoRASlots:
    """One projection's adapters, `num_slots` of them stacked for batched products.

    Each slot is `width` = shards x max_lora_rank wide: `a` [slots, in, width] holds the
    A matrices (transposed), `b` [slots, width, out] the B matrices, an adapter of lower
    rank padded with zeros and a fused projection's (q/k/v, gate/up) B matrices on a
    block diagonal. A step gathers each slot's rows into one group and runs two batched
    products for all groups. A row's delta depends on its own row and adapter only: not
    on which slot holds the adapter, nor on what else is in the batch.
    """

    def __init__(self, layer: Linear, shard_sizes: list[int], num_slots: int, max_rank: int,
                 batch: LoRABatch, dtype: torch.dtype, device: torch.device) -> None:
        self.shard_sizes = shard_sizes
        self.max_rank = max_rank
        width = len(shard_sizes) * max_rank
        self.batch = batch
        self.a = torch.zeros(num_slots, layer.in_features, width, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, width, sum(shard_sizes), dtype=dtype, device=device)
        self.occupied = [False] * num_slots
        layer.lora = self

    def load(self, slot: int, shards: list[ModuleLoRA | None]) -> None:
        """Puts an adapter's matrices for this projection's shards (None: not adapted)
        into `slot`, replacing what was there."""
        self.a[slot] = 0
        self.b[slot] = 0
        row = 0
        for i, (size, lora) in enumerate(zip(self.shard_sizes, shards)):
            if lora is not None:
                first, rank = i * self.max_rank, lora.a.shape[0]
                self.a[slot, :, first : first + rank] = lora.a.t()
                self.b[slot, first : first + rank, row : row + size] = lora.b.t()
            row += size
        self.occupied[slot] = any(s is not None for s in shards)

    def add_deltas(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Adds each row's adapter delta to `out`, in place, and returns it."""
        batch = self.batch
        if not any(self.occupied[slot] for slot in batch.slot_list):
            return out
        if batch.segments is not None:
            shrunk = batch.kernel(x, self.a, batch.segments, batch.max_rows)
            return batch.kernel(shrunk, self.b, batch.segments, batch.max_rows, out=out)
        if batch.every_slot:
            a, b = self.a, self.b
        else:
            a, b = self.a.index_select(0, batch.slots), self.b.index_select(0, batch.slots)
        if batch.block is not None:
            first, length = batch.block
            rows = slice(first, first + len(batch.slot_list) * length)
            deltas = torch.bmm(torch.bmm(x[rows].reshape(len(batch.slot_list), length, -1), a), b)
            out[rows] += deltas.view(-1, out.shape[1])
            return out
        padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
        groups = padded.index_select(0, batch.gather.flatten()).view(*batch.gather.shape, x.shape[1])
        deltas = torch.bmm(torch.bmm(groups, a), b)
        return out.index_add_(0, batch.scatter.flatten(), deltas.view(-1, out.shape[1]))
