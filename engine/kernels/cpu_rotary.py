"""Rotary position embedding on a CPU (C++, `cpu_rotary.cpp`, built by `cpu_build`): one
pass over the strided queries and keys instead of PyTorch's five operators over the step."""

import torch

from engine.kernels import cpu_build


def rotary(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by rows `positions` of the cos/sin tables
    [positions, rotary_dim] (`RotaryEmbedding`'s); features past rotary_dim pass through. As
    `engine.kernels.triton.rotary`."""
    return cpu_build.load().rotary(positions, x, cos, sin)
