"""The MLPs' gated activations on a CPU (C++, `cpu_activation.cpp`, built by `cpu_build`):
act(gate) times up from the fused gate/up output in one pass instead of PyTorch's three
operators over the step."""

import torch

from engine.kernels import cpu_build


def act_and_mul(x: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up for x [rows, 2 * width] = [gate | up], act "silu" or "gelu_tanh".
    Returns [rows, width]. As `engine.kernels.triton.activation.act_and_mul`."""
    return cpu_build.load().act_and_mul(x, activation == "gelu_tanh")
