"""What the methods that quantize a 16- or 32-bit checkpoint at load (int8 on a CPU, FP8
on a GPU) share: the weight quantized once it is in, per output feature, and dropped."""

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.layers.linear import Linear


class QuantizedAtLoadMethod:
    """A `Linear` method that quantizes the loaded weight once, per output feature (buffers
    `qweight`, `weight_scale`), and multiplies by it: `quantize` and `product` say how."""

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    @staticmethod
    def product(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def create_weights(self, layer: "Linear") -> None:
        """The weight loads in the model's dtype and is quantized at `process_weights`."""

    def process_weights(self, layer: "Linear") -> None:
        """Quantizes the loaded weight and drops it."""
        if not layer.weight.numel():
            return
        q, scale = self.quantize(self.weight_to_quantize(layer))
        layer.register_buffer("qweight", q)
        layer.register_buffer("weight_scale", scale)
        layer.weight = nn.Parameter(torch.empty(0, dtype=layer.weight.dtype, device=q.device), requires_grad=False)

    def weight_to_quantize(self, layer: "Linear") -> torch.Tensor:
        """The matrix `quantize` rounds: the loaded weight, unless a method transforms it first."""
        return layer.weight.detach()

    def apply(self, layer: "Linear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.product(x, layer.qweight, layer.weight_scale, bias)
