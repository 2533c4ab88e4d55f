"""The attention backends end to end: the same greedy tokens from each, and the choice
between them. Without a GPU the Triton backend runs in Triton's interpreter (slow: tiny
model, few tokens)."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
import engine.attention.selector as selector
from engine.kernels import cpu_build
from engine.kernels import triton as triton_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKENDS = ["torch"]
if DEVICE == "cpu" and cpu_build.load() is not None:
    BACKENDS.append("cpu")
if triton_kernels.installed():
    BACKENDS.append("triton")


def greedy_tokens(model_path: str, backend: str, dtype: str) -> list[list[int]]:
    # 5, 28 and 97 tokens: the last is prefilled over three steps and reaches past a key
    # tile of the Triton kernels (64). (Prompts of 51 and 74 tokens between them cost the
    # interpreter 8 s and covered nothing these do not.)
    prompts = [{"prompt_token_ids": [random.Random(i).randrange(3, 300) for _ in range(5 + 23 * i)]}
               for i in (0, 1, 4)]
    prompts += prompts[:2]  # prefix-cache hits
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(model_path, dtype=dtype, attention_backend=backend, max_num_batched_tokens=48) as llm:
        assert llm.llm_engine.model_runner.attention_backend == backend
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_backends_give_the_same_greedy_tokens(tiny_models, backend):
    """Chunked prefill (48-token steps), prefix-cache hits, decode steps; on the Triton
    backend also its fused RMSNorm, rotary and SiLU kernels."""
    model = str(tiny_models["llama"])
    assert greedy_tokens(model, backend, "float32") == greedy_tokens(model, "torch", "float32")


def test_auto_picks_by_device(monkeypatch):
    monkeypatch.setattr(selector.cpu_build, "load", lambda: object())
    assert selector.resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    monkeypatch.setattr(selector.triton_kernels, "installed", lambda: True)
    assert selector.resolve_backend_name("auto", torch.device("cuda")) == "triton"
    monkeypatch.setattr(selector.triton_kernels, "installed", lambda: False)
    assert selector.resolve_backend_name("auto", torch.device("cuda")) == "torch"


def test_impossible_choices_say_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(selector.triton_kernels, "installed", lambda: True)
    with pytest.raises(RuntimeError, match="interpreter"):
        selector.resolve_backend_name("triton", torch.device("cpu"))
    with pytest.raises(ValueError, match="compiled CPU kernel"):
        selector.resolve_backend_name("cpu", torch.device("cuda"))


def test_cuda_graph_buckets():
    from engine.worker.cuda_graphs import decode_buckets

    assert decode_buckets(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(1) == [1]
