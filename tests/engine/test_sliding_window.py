"""Sliding-window attention and attention-logit soft-capping (Gemma 2/3, Mistral) in every
attention backend, against a dense PyTorch reference.

Each case fills a paged cache through the backend's own layout and `write_kv`, with a
shuffled block table, then runs one step through `Attention`: a decode row with a long
context, a prefill chunk after cached context and a fresh prefill, all longer than the
window; 4 query heads over 2 KV heads; head size 64 (the CPU kernel's AVX2 path) and 48
(its portable path). Shapes stay tiny: without a GPU the Triton kernels run in Triton's
interpreter.
"""

import dataclasses
import itertools
import random

import pytest
import torch

from engine.attention.layer import Attention, AttentionMetadata
from engine.attention.selector import make_backend
from engine.kernels import cpu_build
from engine.kernels import triton as triton_kernels
from engine.kernels.kv_cache_quant import is_scaled
from tests.engine.test_triton_kernels import DEVICE as TRITON_DEVICE
from tests.engine.test_triton_kernels import reference_attention, tolerance

BACKENDS = ["torch"]
if cpu_build.load() is not None:
    BACKENDS.append("cpu")
if triton_kernels.installed():
    BACKENDS.append("triton")
    import triton
    import triton.language as tl

    from engine.kernels.triton.paged_attention import _tanh

    @triton.jit
    def _tanh_kernel(x_ptr, out_ptr, N: tl.constexpr):
        """out = the attention kernels' tanh of x, N elements."""
        offsets = tl.arange(0, N)
        tl.store(out_ptr + offsets, _tanh(tl.load(x_ptr + offsets)))

# (new tokens, cached tokens before them): a decode row, a chunk after cached context, a fresh prompt.
MIXED = [(1, 120), (20, 50), (45, 0)]


@dataclasses.dataclass
class PagedCase:
    """A layer whose paged cache holds `keys` and `values` [context, kv_heads, dim] of each
    sequence, in blocks `tables`; `queries` [context, heads, dim] are each token's query."""

    layer: Attention
    tables: list[list[int]]
    queries: list[torch.Tensor]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    block: int

    def metadata(self, step: list[tuple[int, int, int]]) -> AttentionMetadata:
        """A step where sequence s computes its tokens [end - new, end), for each (s, end, new)."""
        device = self.queries[0].device
        positions = [torch.arange(end - new, end) for _, end, new in step]
        slots = [torch.tensor(self.tables[s])[p // self.block] * self.block + p % self.block
                 for (s, _, _), p in zip(step, positions)]
        width = max(len(self.tables[s]) for s, _, _ in step)
        tables = [self.tables[s] + [0] * (width - len(self.tables[s])) for s, _, _ in step]
        query_lens, context_lens = [new for _, _, new in step], [end for _, end, _ in step]
        return AttentionMetadata(
            slot_mapping=torch.cat(slots).to(device),
            query_start_loc=torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            positions=torch.cat(positions).to(device), query_lens=query_lens, context_lens=context_lens,
            block_size=self.block)

    def rows(self, tensors: list[torch.Tensor], step: list[tuple[int, int, int]]) -> torch.Tensor:
        """The step's tokens' rows of a per-sequence tensor, in step order."""
        return torch.cat([tensors[s][end - new : end] for s, end, new in step])

    def run(self, step: list[tuple[int, int, int]]) -> torch.Tensor:
        """The step through `Attention` (which writes its tokens' keys and values again)."""
        meta = self.metadata(step)
        self.layer.backend.prepare(meta)
        return self.layer(self.rows(self.queries, step), self.rows(self.keys, step), self.rows(self.values, step),
                          meta)

    def expected(self, step: list[tuple[int, int, int]]) -> torch.Tensor:
        """The step's output by the dense reference, with the layer's scale, window and cap."""
        layer = self.layer
        return torch.cat([
            reference_attention(self.queries[s][end - new : end], self.keys[s][:end], self.values[s][:end],
                                end - new, layer.scale, layer.sliding_window, layer.logit_softcap)
            for s, end, new in step])


def paged_case(backend: str, contexts: list[int], head_dim: int, block: int, dtype: torch.dtype,
               seed: int = 0, cache_dtype: torch.dtype | None = None, **options) -> PagedCase:
    """Sequences of these context lengths, every key and value written into a fresh cache
    of `cache_dtype` (default: `dtype`, the queries')."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    device = TRITON_DEVICE if backend == "triton" else torch.device("cpu")
    num_blocks = sum(-(-c // block) for c in contexts) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // block))] for c in contexts]
    num_slots = (num_blocks + 1) * block  # the last block is the null block: zeros
    layer = Attention(4, head_dim, 2, **options)
    layer.backend = make_backend(backend, null_slot=num_blocks * block)
    shape = layer.backend.cache_shape(num_slots, block, 2, head_dim)
    cache_dtype = cache_dtype or dtype
    layer.k_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    layer.v_cache = torch.zeros(shape, dtype=cache_dtype, device=device)
    if is_scaled(cache_dtype):
        layer.k_scale = torch.zeros(shape[:-1], device=device)
        layer.v_scale = torch.zeros(shape[:-1], device=device)

    def randn(*size: int) -> list[torch.Tensor]:
        return [torch.randn(c, *size, device=device).to(dtype) for c in contexts]

    case = PagedCase(layer, tables, randn(4, head_dim), randn(2, head_dim), randn(2, head_dim), block)
    whole = [(s, c, c) for s, c in enumerate(contexts)]
    layer.backend.write_kv(layer, case.rows(case.keys, whole), case.rows(case.values, whole), case.metadata(whole))
    return case


def mixed_step(shapes: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """A step computing each (new, cached) sequence's new tokens."""
    return [(s, new + cached, new) for s, (new, cached) in enumerate(shapes)]


# Head sizes 64 and 48 on every backend (the C++ kernel's vector and portable paths), and
# Gemma's 256 on the C++ kernel's vector path.
BACKEND_HEAD_DIMS = [(b, d) for b in BACKENDS for d in (64, 48)] + [("cpu", 256)] * ("cpu" in BACKENDS)


@pytest.mark.parametrize(("backend", "head_dim"), BACKEND_HEAD_DIMS)
@pytest.mark.parametrize("window", [None, 7, 16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_backend_matches_dense_reference(backend, head_dim, window, softcap):
    block = 16 if head_dim == 64 else 8
    options = {"sliding_window": window, "logit_softcap": softcap, "scale": 0.3 if softcap else None}
    case = paged_case(backend, [new + cached for new, cached in MIXED], head_dim, block, torch.float32, **options)
    step = mixed_step(MIXED)
    torch.testing.assert_close(case.run(step), case.expected(step), **tolerance(torch.float32))


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_float16_window_and_softcap():
    case = paged_case("triton", [new + cached for new, cached in MIXED], 64, 16, torch.float16,
                      sliding_window=16, logit_softcap=5.0, scale=0.3)
    step = mixed_step(MIXED)
    torch.testing.assert_close(case.run(step).float(), case.expected(step), **tolerance(torch.float16))


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
@pytest.mark.parametrize("window", [20, 40])
def test_triton_decode_splits_only_the_window(window, monkeypatch):
    """Split-K decode with partitions of 32 keys: contexts inside one window, and spanning
    up to five partitions of which the window covers one or two; one split more than
    needed, as a CUDA graph pads."""
    from engine.attention.backends import triton_attn as attention_triton
    from engine.kernels.triton import paged_attention

    monkeypatch.setattr(paged_attention, "DECODE_PARTITION", 32)
    monkeypatch.setattr(attention_triton, "decode_splits", lambda length: paged_attention.decode_splits(length) + 1)
    contexts = [1, 19, 20, 41, 70, 130]
    case = paged_case("triton", contexts, 32, 8, torch.float32, seed=1, sliding_window=window, logit_softcap=5.0)
    step = [(s, c, 1) for s, c in enumerate(contexts)]
    torch.testing.assert_close(case.run(step), case.expected(step), **tolerance(torch.float32))


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
def test_triton_tanh_matches_torch():
    """The kernels' tanh (Triton has none) over small, large and extreme arguments."""
    x = torch.cat([torch.linspace(-12, 12, 1001), torch.tensor([0.0, 1e-6, -1e-6, 80.0, -80.0, 1e30, -1e30])])
    x = torch.nn.functional.pad(x, (0, 1024 - len(x))).to(TRITON_DEVICE)
    out = torch.empty_like(x)
    _tanh_kernel[(1,)](x, out, N=1024)
    torch.testing.assert_close(out, torch.tanh(x), atol=2e-7, rtol=1e-6)


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
def test_windowed_rows_do_not_depend_on_the_batch(backend):
    """Each token of the mixed step, recomputed alone as a decode step, gets the same bits:
    a window starting mid-context must not change how a row's keys are summed."""
    case = paged_case(backend, [new + cached for new, cached in MIXED], 64, 16, torch.float32, seed=2,
                      sliding_window=16, logit_softcap=5.0)
    step = mixed_step(MIXED)
    together = case.run(step)
    alone = torch.cat([case.run([(s, end - new + i + 1, 1)]) for s, end, new in step for i in range(new)])
    assert torch.equal(alone, together)


def test_torch_backend_gathers_only_the_window():
    """A decode row at position 299 with a window of 16 reads the key chunk holding keys
    284-299 (256-319), not the 320 keys of its context."""
    case = paged_case("torch", [300], 32, 16, torch.float32, sliding_window=16)
    meta = case.metadata([(0, 300, 1)])
    case.layer.backend.prepare(meta)
    slots, mask = meta.backend_data[0].keys(0, 1, 0, 1, window=16)
    assert slots.shape == (1, 64) and int(mask.sum()) == 16
