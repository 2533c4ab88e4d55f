"""Greedy sampling's argmax on a CPU (C++, `cpu_sampling.cpp`, built by `cpu_build`): two
vectorised passes over each row instead of PyTorch's argmax, which reads float32 rows at a few
GB/s."""

import torch

from engine.kernels import cpu_build


def argmax_rows(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's argmax of float32 logits [rows, vocab] as torch.argmax(dim=-1) gives it (the
    first of the largest; a row's first NaN where it has one), int64; None where the kernels
    are not built (the caller takes PyTorch's)."""
    kernels = cpu_build.load()
    return None if kernels is None else kernels.argmax_rows(logits)
