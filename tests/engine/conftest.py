"""Fixtures shared by the engine's tests."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.hardware import ONEDNN_ISA_ENV
from engine.kernels import cpu_build


@pytest.fixture
def two_threads() -> Iterator[None]:
    """PyTorch's CPU threads at two or more for the test, where `make test`'s workers run one
    each (tests/conftest.py): the compiled kernels split their work across threads, and the
    split is tested too."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["cpu_kernel", "pytorch"])
def cpu_path(request, monkeypatch):
    """The compiled CPU kernels (on two threads or more), or PyTorch's operations that stand
    in for them where they cannot be built (`cpu_build.load` returning None)."""
    if request.param == "cpu_kernel" and (torch.cuda.is_available() or cpu_build.load() is None):
        pytest.skip("the C++ kernels run on a CPU where they can be built")
    if request.param == "cpu_kernel":
        request.getfixturevalue("two_threads")
    if request.param == "pytorch":
        monkeypatch.setattr(cpu_build, "load", lambda: None)
    return request.param


@pytest.fixture(scope="session")
def llama_with_biases(tmp_path_factory) -> Path:
    """A tiny Llama with q/k/v biases and weights of size ~0.15 (the quantization tests')."""
    from tests.tiny_models import build_tokenizer

    folder = tmp_path_factory.mktemp("int8_llama")
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0, attention_bias=True, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder


@pytest.fixture
def onednn_uncapped() -> Iterator[None]:
    """`ONEDNN_MAX_CPU_ISA` unset for the test, as the engine's choices read it, and back as
    it was after it, whatever the engine's batch-invariant mode set meanwhile (monkeypatch
    does not restore a variable it deleted while it was unset). oneDNN itself keeps the cap
    the process started with (tests/conftest.py runs its first product at once)."""
    before = os.environ.pop(ONEDNN_ISA_ENV, None)
    yield
    os.environ.pop(ONEDNN_ISA_ENV, None)
    if before is not None:
        os.environ[ONEDNN_ISA_ENV] = before
