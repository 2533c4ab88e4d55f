"""RMSNorm with the residual add fused in, computed in float32 like the reference models."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalizes `x`; given `residual`, normalizes `x + residual` and returns the sum too."""
        if residual is not None:
            x = x + residual
            residual = x
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.weight * normed.to(x.dtype)
        return out if residual is None else (out, residual)
