"""RMSNorm with the residual add fused in, computed in float32 like the reference models."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`kernel`, when set (see `engine.layers.kernels`), computes the same thing in one
    fused launch: kernel(x, weight, eps, residual)."""

    kernel: Callable | None = None

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalizes `x`; given `residual`, normalizes `x + residual` and returns the sum too."""
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.weight, self.eps, residual)
        return self.torch_forward(x, residual)

    def torch_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.weight * normed.to(x.dtype)
        return out if residual is None else (out, residual)
