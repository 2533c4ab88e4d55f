"""Picks the attention backend for a device and the `attention_backend` setting."""

import torch

from engine.attention.layer import AttentionBackend
from engine.kernels import cpu_build
from engine.kernels import triton as triton_kernels


def resolve_backend_name(setting: str, device: torch.device) -> str:
    """"auto" is triton on a GPU and the compiled kernel on a CPU where each can run, else
    torch; an explicit choice that cannot run here raises, saying why."""
    if setting == "auto":
        if device.type == "cuda":
            return "triton" if triton_kernels.installed() else "torch"
        return "cpu" if cpu_build.load() is not None else "torch"
    if setting == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend='cpu' is the compiled CPU kernel; this engine runs on "
                             f"{device}: use 'auto', 'triton' or 'torch'")
        if cpu_build.load() is None:
            raise RuntimeError("attention_backend='cpu': the CPU attention kernel could not be built (see the "
                               "warning above: it needs a C++ compiler and ninja); use 'auto' or 'torch'")
    if setting == "triton" and not triton_kernels.available(device):
        why = ("triton is not installed" if not triton_kernels.installed() else
               "on a CPU its kernels run only under Triton's interpreter (TRITON_INTERPRET=1), for tests")
        raise RuntimeError(f"attention_backend='triton' cannot run on {device}: {why}; use 'auto' or 'torch'")
    return setting


def make_backend(name: str, null_slot: int) -> AttentionBackend:
    """The backend called `name` (as `resolve_backend_name` returns it)."""
    if name == "triton":
        from engine.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        from engine.attention.backends.cpu_attn import CpuAttentionBackend

        return CpuAttentionBackend(null_slot)
    from engine.attention.backends.torch_attn import TorchAttentionBackend

    return TorchAttentionBackend(null_slot)
