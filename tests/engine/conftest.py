"""Fixtures shared by the engine's tests."""

import pytest
import torch

from engine.kernels import cpu_build


@pytest.fixture(params=["cpu_kernel", "pytorch"])
def cpu_path(request, monkeypatch):
    """The compiled CPU kernels, or PyTorch's operations that stand in for them where they
    cannot be built (`cpu_build.load` returning None)."""
    if request.param == "cpu_kernel" and (torch.cuda.is_available() or cpu_build.load() is None):
        pytest.skip("the C++ kernels run on a CPU where they can be built")
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_build, "load", lambda: None)
    return request.param
