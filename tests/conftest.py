"""Shared fixtures for the engine and Dagster tests."""

import os
from pathlib import Path

import pytest
import torch

from tests.tiny_models import FAMILIES, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It is chosen
# when a kernel is defined, so it must be set before any engine module imports Triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model folder per supported family."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: build_tiny_model(root / family, family) for family in FAMILIES}
