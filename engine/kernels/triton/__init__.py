"""Triton kernels for the GPU path, one module per job.

They run on CUDA tensors, and on CPU tensors under Triton's interpreter (`TRITON_INTERPRET=1`,
exact in float16 and float32), which is how the tests check them on machines without a GPU.
Import this package's modules only where `available()` holds.
"""

import functools
import importlib.util
import os

import torch


@functools.cache
def installed() -> bool:
    """Whether the triton package can be imported here."""
    return importlib.util.find_spec("triton") is not None


def interpreted() -> bool:
    """Whether Triton kernels run in its interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`."""
    return installed() and (device.type == "cuda" or (device.type == "cpu" and interpreted()))
