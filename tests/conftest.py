"""Shared fixtures for the engine and Dagster tests."""

import os
from pathlib import Path

import pytest

from tests.tiny_models import FAMILIES, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model folder per supported family."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {family: build_tiny_model(root / family, family) for family in FAMILIES}
