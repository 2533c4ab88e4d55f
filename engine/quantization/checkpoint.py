"""Pre-quantized checkpoints: FP8 (compressed-tensors' float-quantized and block-wise FP8)
and 4-bit AWQ and GPTQ, read as the projections' weights.

A quantized projection is stored as several tensors (`qweight`, `scales`, `qzeros`,
`g_idx`; or an FP8 `weight` with its `weight_scale`). `quantized_tensors` gathers them
into one `QuantizedTensor` under the name the unquantized weight has (`<prefix>.weight`),
with its [out, in] shape, so that the model's loader places, fuses and splits it as any
weight: `read` gives it dequantized in float32, exactly (q - zero) x scale. A method that
multiplies in the checkpoint's own precision takes it undequantized instead
(`Int4Tensor.int4`). Everything else in the checkpoint passes through unchanged.
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels.int4_layout import unpack_int4
from engine.layers.linear import ShardSlice, StoredTensor

# The tensors one quantized projection is stored as.
INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")
FP8_PARTS = ("weight", "weight_scale", "weight_scale_inv", "input_scale")
# AutoAWQ packs output features 8c + AWQ_ORDER[j] into nibble j of word c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _narrow(tensor: torch.Tensor, piece: ShardSlice | None) -> torch.Tensor:
    return tensor if piece is None else piece.of(tensor)


class QuantizedTensor:
    """One projection's quantized weight, read as its [out, in] float32 dequantization."""

    shape: tuple[int, int]

    def dequantize(self) -> torch.Tensor:
        """The whole weight [out, in] in float32."""
        raise NotImplementedError

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        """The weight dequantized, or its slice `piece` (a tensor-parallel rank's: the
        projection is read whole, one at a time, and the rest dropped)."""
        return _narrow(self.dequantize(), piece)

    def rows(self, start: int, length: int) -> "QuantizedRows":
        """Output features [start, start + length), as a weight of their own (one of the
        projections a checkpoint stores fused)."""
        return QuantizedRows(self, start, length)


class QuantizedRows(QuantizedTensor):
    """Output features of a `QuantizedTensor`, as a tensor of their own."""

    def __init__(self, whole: QuantizedTensor, start: int, length: int) -> None:
        self.whole, self.start, self.shape = whole, start, (length, whole.shape[1])

    def dequantize(self) -> torch.Tensor:
        return self.whole.dequantize().narrow(0, self.start, self.shape[0])

    def int4(self, piece: ShardSlice | None = None) -> "Int4Weight":
        return self.whole.int4().narrow(0, self.start, self.shape[0]).of(piece)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Fp8Tensor(QuantizedTensor):
    """An FP8 weight [out, in] with its scale: one ([] or [1]), one per output feature
    ([out, 1]), or one per `block` x `block` tile ([out / block, in / block], rounded up)."""

    weight: StoredTensor
    scale: StoredTensor
    block: int | None = None

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return tuple(self.weight.shape)

    def dequantize(self) -> torch.Tensor:
        weight, scale = self.weight.read().float(), self.scale.read().float()
        if self.block is not None:
            out, inp = weight.shape
            scale = scale.repeat_interleave(self.block, 0)[:out].repeat_interleave(self.block, 1)[:, :inp]
        elif scale.numel() > 1:
            scale = scale.reshape(-1, 1)
        return weight * scale


@dataclass(frozen=True)
class Int4Weight:
    """A 4-bit weight in the form the products take, whatever format stored it: `q` [in, out]
    (0..15), `zeros` and `scales` [groups, out], `group_index` [in] (the group of each input
    feature); w[k, n] = (q[k, n] - zeros[g, n]) x scales[g, n] with g = group_index[k]."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    group_index: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """w [out, in] in float32."""
        zeros, scales = self.zeros[self.group_index].float(), self.scales[self.group_index].float()
        return ((self.q.float() - zeros) * scales).t()

    def of(self, piece: ShardSlice | None) -> "Int4Weight":
        """The slice `piece` of the weight (all of it for None)."""
        return self if piece is None else self.narrow(piece.dim, piece.start, piece.length)

    def narrow(self, dim: int, start: int, length: int) -> "Int4Weight":
        """Output features (dim 0) or input features (dim 1) [start, start + length)."""
        if dim == 0:
            return Int4Weight(self.q.narrow(1, start, length), self.zeros.narrow(1, start, length),
                              self.scales.narrow(1, start, length), self.group_index)
        return Int4Weight(self.q.narrow(0, start, length), self.zeros, self.scales,
                          self.group_index.narrow(0, start, length))


@dataclass(frozen=True)
class Int4Tensor(QuantizedTensor):
    """An AWQ or GPTQ weight: its stored tensors and how they are packed."""

    qweight: StoredTensor
    qzeros: StoredTensor
    scales: StoredTensor
    g_idx: StoredTensor | None
    awq: bool
    zero_offset: int = 0  # GPTQ's original format stores each zero point minus one

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return tuple(self.scales.shape[1:2]) + (self.qweight.shape[0] * (1 if self.awq else 8),)

    def int4(self, piece: ShardSlice | None = None) -> Int4Weight:
        """The weight undequantized (of `piece` only, if given)."""
        if self.awq:
            q = unpack_int4(self.qweight.read(), 1, AWQ_ORDER)
            zeros = unpack_int4(self.qzeros.read(), 1, AWQ_ORDER)
        else:
            q = unpack_int4(self.qweight.read(), 0)
            zeros = unpack_int4(self.qzeros.read(), 1) + self.zero_offset
        scales = self.scales.read()
        inputs = q.shape[0]
        if self.g_idx is not None:
            group_index = self.g_idx.read().long()
        else:
            group_index = torch.arange(inputs) // (inputs // scales.shape[0])
        return Int4Weight(q.to(torch.uint8), zeros.to(torch.uint8), scales, group_index).of(piece)

    def dequantize(self) -> torch.Tensor:
        return self.int4().dequantize()


@dataclass(frozen=True)
class CheckpointFormat:
    """How a checkpoint's `quantization_config` stores quantized projections."""

    method: str
    block: int | None = None  # block-wise FP8's tile side
    zero_offset: int = 0

    @classmethod
    def of(cls, method: str, settings: dict[str, Any]) -> "CheckpointFormat":
        """The format `settings` (config.json's quantization_config) describe."""
        if method == "fp8" and settings.get("weight_block_size"):
            rows, columns = settings["weight_block_size"]
            if rows != columns:
                raise ValueError(f"FP8 blocks of {rows} x {columns} are not supported, only square ones")
            return cls(method, block=int(rows))
        if method == "gptq" and settings.get("checkpoint_format", "gptq") == "gptq":
            return cls(method, zero_offset=1)
        return cls(method)

    def quantized_tensors(self, weights: Iterable[tuple[str, StoredTensor]]
                          ) -> Iterator[tuple[str, StoredTensor | QuantizedTensor]]:
        """The checkpoint's tensors with each quantized projection's gathered into one
        `QuantizedTensor` named `<prefix>.weight`; the others as they are."""
        stored = dict(weights)
        used: set[str] = set()
        for name in list(stored):
            prefix, _, kind = name.rpartition(".")
            if (quantized := self._gather(prefix, kind, stored)) is not None:
                parts = INT4_PARTS if self.method in ("awq", "gptq") else FP8_PARTS
                used.update(f"{prefix}.{part}" for part in parts)
                yield f"{prefix}.weight", quantized
        yield from ((name, tensor) for name, tensor in stored.items() if name not in used)

    def _gather(self, prefix: str, kind: str, stored: dict[str, StoredTensor]) -> QuantizedTensor | None:
        """The projection at `prefix` as one tensor, when `kind` is its main quantized part."""
        if kind == "qweight":
            return Int4Tensor(stored[f"{prefix}.qweight"], stored[f"{prefix}.qzeros"], stored[f"{prefix}.scales"],
                              stored.get(f"{prefix}.g_idx"), self.method == "awq", self.zero_offset)
        scale = stored.get(f"{prefix}.weight_scale_inv" if self.block else f"{prefix}.weight_scale")
        if kind == "weight" and scale is not None:
            return Fp8Tensor(stored[f"{prefix}.weight"], scale, self.block)
        return None
