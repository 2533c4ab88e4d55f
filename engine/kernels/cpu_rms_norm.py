"""RMSNorm with the residual add fused in, on a CPU (C++, `cpu_rms_norm.cpp`, built by
`cpu_build`): two passes over each row instead of PyTorch's six operators over the step,
in place where a residual is given (as vLLM's `fused_add_rms_norm`)."""

import torch

from engine.kernels import cpu_build


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rms_norm(x) for x [rows, hidden], computed in float32, in x's dtype; given
    `residual`, of x + residual, and that sum is returned too, in residual's dtype (the
    next residual). As `engine.kernels.triton.rms_norm`, except that given `residual` it
    works in place: the sum overwrites `residual` and the result overwrites `x` (where
    each is contiguous), so the caller must not read either afterwards."""
    outputs = cpu_build.load().rms_norm(x, weight, eps, residual)
    return outputs[0] if residual is None else (outputs[0], outputs[1])
