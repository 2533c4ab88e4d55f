"""The Triton kernels against PyTorch references.

Without a GPU they run in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1), which computes float16 and float32 exactly but bfloat16 wrongly, so
bfloat16 is checked only on a GPU. Shapes stay small: the interpreter is slow.
"""

import random

import pytest
import torch

from engine.kernels import triton as triton_kernels

pytestmark = pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
BLOCK = 16


def tolerance(dtype: torch.dtype) -> dict:
    return dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def reference_attention(q, k, v, first_position, scale=None, window=None, softcap=None):
    """q [new, heads, dim] at positions first_position.., k/v [context, kv_heads, dim].
    Scores scaled by `scale` (default dim**-0.5), then soft-capped at `softcap`; a query
    at position p sees keys p - window < k <= p (all k <= p without a window)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    positions = first_position + torch.arange(q.shape[0], device=q.device)
    keys = torch.arange(k.shape[0], device=q.device)
    mask = keys[None, :] <= positions[:, None]
    if window is not None:
        mask &= keys[None, :] > positions[:, None] - window
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_case(rng, dtype, seq_shapes, heads=6, kv_heads=2, dim=32, num_blocks=48, block=BLOCK):
    """A paged cache holding each sequence's context and the step's queries.
    `seq_shapes` are (new tokens, cached tokens before them) per sequence."""
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, device=DEVICE).to(dtype)
    v_cache = torch.randn_like(k_cache)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, seq_lens, starts = [], [], [0]
    for new, cached in seq_shapes:
        context = new + cached
        tables.append([free.pop() for _ in range(-(-context // block))])
        seq_lens.append(context)
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    q = torch.randn(starts[-1], heads, dim, device=DEVICE).to(dtype)
    return q, k_cache, v_cache, block_tables, seq_lens, starts, tables


def gathered(cache, table, context):
    block = cache.shape[1]
    positions = torch.arange(context)
    slots = torch.tensor(table)[positions // block] * block + positions % block
    return cache.view(-1, *cache.shape[2:])[slots.to(cache.device)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [16, 8])
def test_prefill_attention_matches_reference(dtype, block):
    from engine.kernels.triton.paged_attention import prefill_attention

    rng = random.Random(0)
    torch.manual_seed(0)
    shapes = [(1, 0), (17, 0), (5, 40), (33, 3), (1, 70)]  # new prompts, prefix hits, chunks, a decode row
    q, k_cache, v_cache, tables_t, seq_lens, starts, tables = paged_case(rng, dtype, shapes, num_blocks=96,
                                                                         block=block)
    out = prefill_attention(q, k_cache, v_cache, torch.tensor(starts, dtype=torch.int32, device=DEVICE),
                            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), tables_t,
                            max(n for n, _ in shapes), q.shape[-1] ** -0.5)
    for i, (new, cached) in enumerate(shapes):
        context = new + cached
        expected = reference_attention(q[starts[i] : starts[i + 1]], gathered(k_cache, tables[i], context),
                                       gathered(v_cache, tables[i], context), cached)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]].float(), expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_splits_long_contexts(dtype, monkeypatch):
    from engine.kernels.triton import paged_attention

    monkeypatch.setattr(paged_attention, "DECODE_PARTITION", 32)  # several splits at test sizes
    rng = random.Random(1)
    torch.manual_seed(1)
    shapes = [(1, 0), (1, 31), (1, 32), (1, 100), (1, 190)]
    q, k_cache, v_cache, tables_t, seq_lens, _, tables = paged_case(rng, dtype, shapes, heads=8, kv_heads=2,
                                                                    num_blocks=64)
    splits = paged_attention.decode_splits(max(seq_lens)) + 1  # one more than needed, as a graph would pad
    lens = torch.tensor(seq_lens + [0], dtype=torch.int32, device=DEVICE)  # a padding row
    q = torch.cat([q, torch.randn_like(q[:1])])
    tables_t = torch.cat([tables_t, torch.zeros_like(tables_t[:1])])
    out = paged_attention.decode_attention(q, k_cache, v_cache, lens, tables_t, splits, q.shape[-1] ** -0.5)
    for i, (_, cached) in enumerate(shapes):
        context = cached + 1
        expected = reference_attention(q[i : i + 1], gathered(k_cache, tables[i], context),
                                       gathered(v_cache, tables[i], context), cached)
        torch.testing.assert_close(out[i : i + 1].float(), expected, **tolerance(dtype))
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_slots_and_skips_padding(dtype):
    from engine.kernels.triton.kv_store import store_kv

    k_cache = torch.zeros(4, BLOCK, 2, 8, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qkv = torch.randn(3, 40, device=DEVICE).to(dtype)  # k and v as strided views, as the model has them
    k, v = qkv[:, 8:24].view(3, 2, 8), qkv[:, 24:40].view(3, 2, 8)
    slots = torch.tensor([5, -1, 49], device=DEVICE)
    none = torch.empty(0, device=DEVICE)
    store_kv(k, v, k_cache, v_cache, none, none, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    assert torch.equal(flat_k[5], k[0]) and torch.equal(flat_k[49], k[2]) and torch.equal(flat_v[49], v[2])
    assert int((flat_k != 0).any(dim=(1, 2)).sum()) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_layer(dtype, with_residual):
    from engine.kernels.triton.rms_norm import rms_norm
    from engine.layers.layernorm import RMSNorm

    torch.manual_seed(2)
    layer = RMSNorm(48, 1e-5).to(DEVICE, dtype)
    layer.weight.data.normal_()
    x, residual = torch.randn(5, 48, device=DEVICE).to(dtype), torch.randn(5, 48, device=DEVICE).to(dtype)
    if with_residual:
        out, new_residual = rms_norm(x, layer.weight, 1e-5, residual)
        expected, expected_residual = layer.torch_forward(x, residual)
        torch.testing.assert_close(new_residual, expected_residual, **tolerance(dtype))
    else:
        out, expected = rms_norm(x, layer.weight, 1e-5), layer.torch_forward(x)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [{"rope_theta": 10000.0},
                                  {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64},
                                  {"rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                                  {"rope_theta": 10000.0, "rope_type": "longrope", "short_factor": [1.0] * 16,
                                   "long_factor": [1.0 + i / 4 for i in range(16)],
                                   "original_max_position_embeddings": 64, "max_position_embeddings": 256}],
                         ids=["default", "llama3", "partial", "longrope"])
def test_rotary_matches_the_layer(dtype, rope):
    from engine.kernels.triton.rotary import rotary
    from engine.layers.rotary import RotaryEmbedding

    torch.manual_seed(3)
    layer = RotaryEmbedding(32, 256, rope).to(DEVICE)
    qkv = torch.randn(7, 4 * 32 + 32, device=DEVICE).to(dtype)
    x = qkv[:, : 4 * 32].view(7, 4, 32)  # strided, as q and k come out of the fused projection
    positions = torch.tensor([0, 1, 2, 100, 3, 255, 17], device=DEVICE)
    torch.testing.assert_close(rotary(positions, x, layer.cos, layer.sin), layer.torch_forward(positions, x),
                               **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_activation_matches_reference(dtype, activation):
    from engine.kernels.triton.activation import act_and_mul

    torch.manual_seed(4)
    x = torch.randn(6, 2 * 40, device=DEVICE).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
    torch.testing.assert_close(act_and_mul(x, activation), act * up, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sgmv_shrink_and_expand_match_per_group_products(dtype):
    from engine.kernels.triton.lora import sgmv

    torch.manual_seed(5)
    x = torch.randn(23, 40, device=DEVICE).to(dtype)
    a = torch.randn(3, 40, 24, device=DEVICE).to(dtype)  # 3 slots, in 40, width 24
    b = torch.randn(3, 24, 48, device=DEVICE).to(dtype)
    groups = [(0, 5, 2), (5, 17, 0), (22, 1, 1)]  # (first row, rows, slot); an odd group of one row
    segments = torch.tensor([[g[0] for g in groups], [g[1] for g in groups], [g[2] for g in groups]],
                            dtype=torch.int32, device=DEVICE)
    base = torch.randn(23, 48, device=DEVICE).to(dtype)
    shrunk = sgmv(x, a, segments, max_rows=17)
    out = sgmv(shrunk, b, segments, max_rows=17, out=base.clone())
    expected_shrunk = torch.cat([x[s : s + n].float() @ a[slot].float() for s, n, slot in groups])
    torch.testing.assert_close(shrunk.float(), expected_shrunk, **tolerance(dtype))
    expected = base.float() + torch.cat([shrunk[s : s + n].float() @ b[slot].float() for s, n, slot in groups])
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
