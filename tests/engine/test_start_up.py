"""What an engine's start costs in a fresh process (every Dagster step, tensor-parallel rank
and data-parallel replica is one): the model is built on the meta device without running
PyTorch's Python reference kernels there, whose first use imports torch._dynamo (measured
here: an engine start of a tiny model 1.3 s with them, 0.4 s without)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

from engine.layers.rotary import RotaryEmbedding
from engine.model_loader.loader import SkipInitializers


def test_initializers_are_left_out_while_a_model_is_built():
    """Under `SkipInitializers` nn.init's functions change nothing (called as modules call
    them, by keyword too); the rotary tables on meta are placeholders of their shape; outside,
    both work as before."""
    weight = torch.zeros(4, 3)
    with SkipInitializers():
        assert nn.init.normal_(weight) is weight
        nn.init.kaiming_uniform_(tensor=weight, a=5 ** 0.5)
        nn.init.uniform_(weight, -1, 1)
        nn.Linear(3, 4).weight.data.copy_(weight)
    assert not weight.any()
    nn.init.normal_(weight)
    assert weight.any()
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    with torch.device("meta"):
        placeholder = RotaryEmbedding(16, 32, rope)
    built = RotaryEmbedding(16, 32, rope)
    assert placeholder.cos.is_meta and placeholder.cos.shape == built.cos.shape == (32, 16)
    assert built.cos[0].eq(1).all() and built.sin[0].eq(0).all()


@pytest.mark.parametrize("family", ["llama", "qwen2_moe", "gemma3"])
def test_an_engine_start_imports_no_torch_dynamo(tiny_models, family):
    """In a fresh process: the engine starts and generates without importing torch._dynamo."""
    code = (f"from engine import LLM, SamplingParams\nimport sys\n"
            f"llm = LLM({str(tiny_models[family])!r}, dtype='float32')\n"
            "llm.generate(['hello'], SamplingParams(max_tokens=2), use_tqdm=False)\n"
            "print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
