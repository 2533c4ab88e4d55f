"""Attention sinks (gpt-oss) and chunked local attention (Llama 4's `attention_chunk_size`)
in every attention backend, against a dense PyTorch reference: a masked softmax with each
head's sink appended as one more column, whose weight is then dropped.

The cases reuse `test_sliding_window`'s paged caches (written through the backend's own
layout and `write_kv`, shuffled block tables, 4 query heads over 2 KV heads): one step that
mixes a decode row, a prefill chunk after cached context and a fresh prompt, crossing chunk
boundaries; and a decode-only step (the Triton backend's split-K kernel, with partitions of
32 keys so that contexts span several). Shapes stay tiny, and the Triton backend's heads
smaller (32, blocks of 8): without a GPU its kernels run in Triton's interpreter.
"""

import pytest
import torch

from engine.attention.layer import Attention
from engine.kernels import triton as triton_kernels
from tests.engine.test_sliding_window import BACKENDS, PagedCase, mixed_step, paged_case
from tests.engine.test_triton_kernels import DEVICE as TRITON_DEVICE
from tests.engine.test_triton_kernels import tolerance

CHUNK = 20  # not a multiple of the blocks (16, 8) nor of the kernels' key tiles (64)
# (new tokens, cached tokens before them): a decode row at position 130, whose chunk starts
# past the first key tiles and blocks; a prefill chunk after cached context and a fresh
# prompt, both crossing chunk boundaries.
MIXED = [(1, 130), (12, 30), (25, 0)]
# Contexts of a decode-only step: chunk boundaries before, at and after the last key.
DECODE_CONTEXTS = [1, 20, 21, 41, 70]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int, scale: float,
                        window: int | None = None, chunk: int | None = None, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [new, heads, dim] at positions first_position.., k/v [context, kv_heads, dim]: a
    query at p sees keys k <= p, p - window < k where `window` is set, k // chunk == p //
    chunk where `chunk` is set; `sinks` [heads] join each head's softmax as a column of
    their own, without a value."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    positions = first_position + torch.arange(q.shape[0], device=q.device)[:, None]
    keys = torch.arange(k.shape[0], device=q.device)[None, :]
    mask = keys <= positions
    if window is not None:
        mask &= keys > positions - window
    if chunk is not None:
        mask &= keys // chunk == positions // chunk
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.float().view(heads, 1, 1).expand(heads, q.shape[0], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, v)


def expected(case: PagedCase, step: list[tuple[int, int, int]], **changes) -> torch.Tensor:
    """The step's output by the dense reference, with the layer's options (or `changes` to them)."""
    layer = case.layer
    options = dict(scale=layer.scale, window=layer.sliding_window, chunk=layer.attention_chunk_size,
                   softcap=layer.logit_softcap, sinks=layer.sinks) | changes
    return torch.cat([reference_attention(case.queries[s][end - new : end], case.keys[s][:end],
                                          case.values[s][:end], end - new, **options)
                      for s, end, new in step])


def features_case(backend: str, contexts: list[int], dtype: torch.dtype = torch.float32, head_dim: int | None = None,
                  sinks: bool = False, seed: int = 0, **options) -> PagedCase:
    """`test_sliding_window.paged_case` for a layer with random sinks (when `sinks`) and
    `options`; heads of 64 (32 on the Triton backend) by default."""
    head_dim = head_dim or (32 if backend == "triton" else 64)
    block = 16 if head_dim == 64 else 8
    generator = torch.Generator().manual_seed(100 + seed)
    values = 2 * torch.randn(4, generator=generator) if sinks else False
    case = paged_case(backend, contexts, head_dim, block, dtype, seed=seed, sinks=values, **options)
    case.layer.to(case.queries[0].device)
    return case


FEATURES = {"sinks": dict(sinks=True), "chunk": dict(attention_chunk_size=CHUNK),
            "sinks+chunk": dict(sinks=True, attention_chunk_size=CHUNK),
            "sinks+window": dict(sinks=True, sliding_window=7),
            "sinks+chunk+window+softcap": dict(sinks=True, attention_chunk_size=CHUNK, sliding_window=13,
                                               logit_softcap=5.0)}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_mixed_step_matches_dense_reference(backend, feature):
    """`MIXED`: a decode row, a prefill chunk after cached context, a fresh prompt."""
    case = features_case(backend, [new + cached for new, cached in MIXED], **FEATURES[feature])
    step = mixed_step(MIXED)
    torch.testing.assert_close(case.run(step), expected(case, step), **tolerance(torch.float32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", ["sinks+chunk", "sinks+window"])
def test_decode_step_matches_dense_reference(backend, feature, monkeypatch):
    """One new token per sequence; on the Triton backend split-K decode over partitions of
    32 keys, one split more than needed (as a CUDA graph pads): the sink joins once, in the
    merge."""
    from engine.attention.backends import triton_attn
    from engine.kernels.triton import paged_attention

    monkeypatch.setattr(paged_attention, "DECODE_PARTITION", 32)
    monkeypatch.setattr(triton_attn, "decode_splits", lambda length: paged_attention.decode_splits(length) + 1)
    options = dict(FEATURES[feature])
    if "sliding_window" in options:
        options["sliding_window"] = 40  # two partitions
    case = features_case(backend, DECODE_CONTEXTS, seed=1, **options)
    step = [(s, c, 1) for s, c in enumerate(DECODE_CONTEXTS)]
    torch.testing.assert_close(case.run(step), expected(case, step), **tolerance(torch.float32))


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_decode_padding_rows_stay_zero_with_sinks():
    """A CUDA graph's padding rows (context 0) attend to nothing: zeros, the sink notwithstanding."""
    from engine.kernels.triton.paged_attention import decode_attention

    device = TRITON_DEVICE
    k_cache = torch.randn(2, 8, 2, 32, device=device)
    q = torch.randn(2, 4, 32, device=device)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32, device=device)
    tables = torch.tensor([[1], [0]], dtype=torch.int32, device=device)
    out = decode_attention(q, k_cache, torch.randn_like(k_cache), seq_lens, tables, 2, 0.2,
                           sinks=torch.randn(4, device=device), chunk_size=4)
    assert out[0].abs().sum() > 0 and torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_longer_than_the_sequences_is_causal(backend):
    """Chunks of 1000 keys over contexts of at most 131: every query sees its whole
    causal context, with the sinks as well."""
    case = features_case(backend, [new + cached for new, cached in MIXED], sinks=True, attention_chunk_size=1000)
    step = mixed_step(MIXED)
    got = case.run(step)
    torch.testing.assert_close(got, expected(case, step, chunk=None), **tolerance(torch.float32))


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_bfloat16(backend, head_dim):
    """bfloat16 queries and cache (the CPU kernel's bfloat16 dot products where the CPU has
    them; head size 48: its portable path), sinks and chunks together."""
    case = features_case(backend, [new + cached for new, cached in MIXED], torch.bfloat16, head_dim, sinks=True,
                         attention_chunk_size=CHUNK)
    step = mixed_step(MIXED)
    torch.testing.assert_close(case.run(step).float(), expected(case, step), atol=3e-2, rtol=3e-2)


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_rows_do_not_depend_on_the_batch(backend):
    """Each token of the mixed step, recomputed alone as a decode step, gets the same bits
    with sinks and chunks."""
    case = features_case(backend, [new + cached for new, cached in MIXED], seed=2, sinks=True,
                         attention_chunk_size=CHUNK)
    step = mixed_step(MIXED)
    together = case.run(step)
    alone = torch.cat([case.run([(s, end - new + i + 1, 1)]) for s, end, new in step for i in range(new)])
    assert torch.equal(alone, together)


def test_torch_backend_gathers_only_the_chunk():
    """A decode row at position 299 with chunks of 64 reads the key chunk holding keys
    256-299, not the 320 keys of its context."""
    case = features_case("torch", [300], head_dim=32, attention_chunk_size=64)
    meta = case.metadata([(0, 300, 1)])
    case.layer.backend.prepare(meta)
    slots, mask = meta.backend_data[0].keys(0, 1, 0, 1, None, 64)
    assert slots.shape == (1, 64) and int(mask.sum()) == 44


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_float16_sinks_and_chunks():
    case = features_case("triton", [new + cached for new, cached in MIXED], torch.float16, 64, sinks=True,
                         attention_chunk_size=CHUNK)
    step = mixed_step(MIXED)
    torch.testing.assert_close(case.run(step).float(), expected(case, step), **tolerance(torch.float16))


def test_layer_options():
    """Sinks are a float32 parameter [heads] (zeros to load into, or given values) that a
    cast of the model leaves float32; bad options are refused, naming the option."""
    layer = Attention(4, 64, 2, sinks=True, attention_chunk_size=8192)
    assert layer.sinks.dtype == torch.float32 and torch.equal(layer.sinks, torch.zeros(4))
    assert dict(layer.named_parameters())["sinks"] is layer.sinks
    layer.to(torch.bfloat16)
    assert layer.sinks.dtype == torch.float32
    given = Attention(4, 64, 2, sinks=torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16))
    assert given.sinks.dtype == torch.float32 and given.sinks.tolist() == [1.0, 2.0, 3.0, 4.0]
    with torch.device("meta"):
        meta_layer = Attention(4, 64, 2, sinks=True)
    meta_layer.to_empty(device="cpu")
    meta_layer.to(torch.float16)
    assert meta_layer.sinks.device.type == "cpu" and meta_layer.sinks.dtype == torch.float32
    assert Attention(4, 64, 2).sinks is None
    with pytest.raises(ValueError, match="sinks"):
        Attention(4, 64, 2, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="attention_chunk_size"):
        Attention(4, 64, 2, attention_chunk_size=0)
