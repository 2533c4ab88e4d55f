"""RMSNorm with the residual add fused in, computed in float32 like the reference models.

The residual stream (the running sum of the layers' outputs) stays in float32 whatever the
model's dtype: rounding it to bfloat16 after every layer flipped greedy tokens against
float32 (embedded model on an H100, 64 chat prompts x 16 tokens: 46 agreed in bfloat16,
52 with a float32 residual). It costs one row of floats per token."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """`kernel`, when set (see `engine.model_loader.kernel_routing` and `cpu_routing`), computes the
    same thing in one fused pass: kernel(x, weight, eps, residual) for x [rows, hidden].
    `weight_offset` is added to the checkpoint's weight as it loads (see `GemmaRMSNorm`)."""

    kernel: Callable | None = None
    weight_offset = 0.0

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalizes `x`; given `residual`, normalizes `x + residual` and returns the sum too.
        Given `residual`, both it and `x` are the caller's no longer: a kernel may write the
        sum and the result over them (the CPU's does, see `engine.kernels.cpu_rms_norm`)."""
        if self.kernel is not None and x.dim() == 2:
            return self.kernel(x, self.weight, self.eps, residual)
        if self.kernel is not None and residual is None:  # norms over heads: [tokens, heads, head_dim]
            return self.kernel(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        return self.torch_forward(x, residual)

    def torch_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        dtype = x.dtype
        if residual is not None:
            x = residual + x
            residual = x
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        out = self.weight * normed.to(dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + weight): the 1 is added once as the weight loads."""

    weight_offset = 1.0
