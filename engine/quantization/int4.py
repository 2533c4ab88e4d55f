"""4-bit weights (AWQ and GPTQ checkpoints) multiplied as they are stored, on a GPU.

The checkpoint's projections arrive undequantized (`Int4Tensor.int4`); the fused ones
(q/k/v, gate/up) are stacked along their output features and handed to the Triton kernel
(`engine.kernels.triton.w4a16`), which dequantizes a tile at a time inside the product: a
quarter of the bytes a 16-bit weight reads. GPTQ's activation order (`desc_act`) is kept
by sorting the input features by group once and each activation row's features the same
way. A projection the kernel cannot take (a checkpoint tensor not quantized, fused parts
with different activation orders, groups of unequal size) is dequantized instead.
"""

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.quantization.checkpoint import Int4Weight

if TYPE_CHECKING:
    from engine.layers.linear import Linear, ShardSlice

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelWeight:
    """A fused projection as the kernel takes it: `q` [in, out] with its input features
    sorted by group (`input_order`), so each group is `group_size` consecutive rows."""

    q: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    input_order: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.q.shape[0] // self.scales.shape[0]


def kernel_form(shards: list[Int4Weight]) -> KernelWeight | None:
    """The fused projection's shards joined for the kernel; None where they cannot be
    (different activation orders, groups of unequal size)."""
    group_index = shards[0].group_index
    if any(not torch.equal(s.group_index, group_index) for s in shards[1:]):
        return None
    counts = torch.bincount(group_index)
    if counts.min() != counts.max() or group_index.numel() % 8:
        return None
    order = torch.argsort(group_index, stable=True)
    return KernelWeight(torch.cat([s.q for s in shards], 1)[order], torch.cat([s.zeros for s in shards], 1),
                        torch.cat([s.scales for s in shards], 1), order)


class Int4LinearMethod:
    """A `Linear`'s 4-bit weight for the Triton kernel: buffers `qweight` (packed),
    `scales`, `zeros` and, under an activation order, `input_order`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def create_weights(self, layer: "Linear") -> None:
        """No 16-bit weight is allocated: the checkpoint's tensors fill `int4_shards`."""
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype, device="meta"), requires_grad=False)
        layer.shard_sizes = layer.shard_sizes or [layer.out_features]
        layer.int4_shards = [None] * len(layer.shard_sizes)

    def load_shard(self, layer: "Linear", shard: int, tensor, piece: "ShardSlice | None") -> None:
        """Keeps one checkpoint tensor of the projection (this rank's slice of it): its
        4-bit form, or the tensor itself where it is not quantized."""
        int4 = getattr(tensor, "int4", None)
        layer.int4_shards[shard] = int4(piece) if int4 is not None else tensor.read(piece)

    def process_weights(self, layer: "Linear") -> None:
        shards, layer.int4_shards = layer.int4_shards, None
        if shards is None:
            return
        device, dtype = self.device, layer.weight.dtype
        joined = kernel_form(shards) if all(isinstance(s, Int4Weight) for s in shards) else None
        if joined is None:
            logger.info("a projection is dequantized: its parts cannot share the 4-bit kernel")
            dense = torch.cat([s.dequantize() if isinstance(s, Int4Weight) else s.float() for s in shards])
            layer.weight = nn.Parameter(dense.to(device, dtype), requires_grad=False)
            layer.quant_method = None
            return
        from engine.kernels.triton.w4a16 import pack_w4  # Triton's modules load only where they run

        layer.register_buffer("qweight", pack_w4(joined.q).to(device))
        layer.register_buffer("scales", joined.scales.to(device, dtype))
        layer.register_buffer("zeros", joined.zeros.to(device))
        in_order = torch.equal(joined.input_order, torch.arange(joined.input_order.numel()))
        layer.input_order = None if in_order else joined.input_order.to(device)
        layer.group_size = joined.group_size
        layer.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=device), requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from engine.kernels.triton.w4a16 import w4a16_matmul

        rows = x.reshape(-1, x.shape[-1])
        if layer.input_order is not None:
            rows = rows[:, layer.input_order]
        out = w4a16_matmul(rows.contiguous(), layer.qweight, layer.scales, layer.zeros, layer.group_size)
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], out.shape[-1])
