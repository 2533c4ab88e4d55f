"""A row's numbers do not depend on the rest of the batch, bit for bit (CPU, float32 and bfloat16),
in both modes: the default (every kind of CPU but one with AMX promises it) and
`batch_invariant=True` (every kind).

These are the layers a seeded request's output runs through; the end-to-end check is
`test_sampling.py::test_seeded_requests_do_not_depend_on_the_batch`.
"""

import random

import pytest
import torch

from engine.attention.backends.torch_attn import matmul_attention
from engine.attention.layer import Attention
from engine.hardware import amx_products, detect_cpu, machine_cpu
from engine.layers.linear import Linear, enforce_batch_invariance, linear_kernel, rows_kept_apart
from engine.sample.sampler import _inverse_cdf, top_k_top_p_head
from tests.processes import run_in_batch_mode

pytestmark = pytest.mark.cpu_kinds


DTYPES = [torch.float32, torch.bfloat16]
MODES = pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])


def in_mode(request: pytest.FixtureRequest, batch_invariant: bool, dtype: torch.dtype) -> bool:
    """Whether the test's body runs in this process (see `run_in_batch_mode`), after
    readying it as the engine does for `batch_invariant` in `dtype`."""
    if run_in_batch_mode(request, batch_invariant):
        return False
    if batch_invariant:
        enforce_batch_invariance(dtype)
    return True


@MODES
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (64, 320)])
def test_linear_rows_do_not_depend_on_the_batch(shape, dtype, batch_invariant, request):
    """Through whichever kernel this CPU gets: oneDNN's (float32 everywhere, bfloat16
    where native), or the plain emulated bfloat16 product."""
    if not in_mode(request, batch_invariant, dtype):
        return
    torch.manual_seed(0)
    layer = Linear(*shape, bias=False).to(dtype)
    layer.prepack()
    assert (layer.packed_weight is not None) == (linear_kernel(dtype, torch.device("cpu")) == "onednn")
    x = torch.randn(256, shape[0]).to(dtype)
    whole = layer(x)
    for rows in (1, 2, 3, 5, 8, 13, 64):
        pieces = torch.cat([layer(x[i : i + rows]) for i in range(0, len(x), rows)])
        assert torch.equal(pieces, whole), f"{rows} rows at a time"


def pad_group(queries, keys, values, context_lens):
    """Sequences (queries [n, heads, dim], keys/values [kv_heads, context, dim]) as one
    padded group, with the causal mask the model runner builds."""
    seqs, max_query, max_context = len(queries), max(len(q) for q in queries), max(context_lens)
    q = torch.zeros(seqs, max_query, *queries[0].shape[1:], dtype=queries[0].dtype)
    k = torch.zeros(keys[0].shape[0], seqs, max_context, keys[0].shape[2], dtype=keys[0].dtype)
    v = torch.zeros_like(k)
    mask = torch.zeros(seqs, 1, max_query, max_context, dtype=torch.bool)
    for i, (qi, ki, vi, context) in enumerate(zip(queries, keys, values, context_lens)):
        q[i, : len(qi)], k[:, i, :context], v[:, i, :context] = qi, ki, vi
        first_position = context - len(qi)
        for j in range(len(qi)):
            mask[i, 0, j, : first_position + j + 1] = True
    return q, k, v, mask


@MODES
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_do_not_depend_on_the_batch(dtype, batch_invariant, request):
    """Each sequence attended alone, as one query row (a decode step), or in a padded group
    of sequences with other lengths gives the same bits."""
    if not in_mode(request, batch_invariant, dtype):
        return
    rng = random.Random(0)
    torch.manual_seed(0)
    attention = Attention(num_heads=9, head_dim=64, num_kv_heads=3)
    for _ in range(8):
        new = [rng.choice([1, 3, 17, 64, 200]) for _ in range(rng.choice([2, 5, 16]))]
        contexts = [n + rng.choice([0, 5, 100, 300, 700]) for n in new]
        queries = [torch.randn(n, 9, 64).to(dtype) for n in new]
        keys = [torch.randn(3, c, 64).to(dtype) for c in contexts]
        values = [torch.randn(3, c, 64).to(dtype) for c in contexts]
        together = matmul_attention(attention, *pad_group(queries, keys, values, contexts))
        for i in range(len(new)):
            alone = matmul_attention(attention, *pad_group([queries[i]], [keys[i]], [values[i]], [contexts[i]]))
            assert torch.equal(alone[0, : new[i]], together[i, : new[i]])
            last = matmul_attention(attention, *pad_group([queries[i][-1:]], [keys[i]], [values[i]], [contexts[i]]))
            assert torch.equal(last[0, 0], together[i, new[i] - 1])


def test_the_check_of_batch_invariant_mode_tells_amx_kernels_apart():
    """`rows_kept_apart`, which batch-invariant mode runs after keeping oneDNN off AMX,
    finds the rows apart wherever oneDNN's kernels keep them so, and (on a real AMX CPU
    whose oneDNN runs AMX here: the `amx` run of tests/cpu_kinds.py) finds AMX's rows
    depend on the batch, as they did on a Sapphire Rapids."""
    assert rows_kept_apart(torch.float32)
    if detect_cpu().onednn_bf16:
        on_amx = machine_cpu().amx and amx_products(detect_cpu(), batch_invariant=False)
        assert rows_kept_apart(torch.bfloat16) is not on_amx


def test_draws_depend_on_the_row_alone():
    """A row's kept set and drawn token are the same alone and beside rows whose settings
    make the sorted window far wider or narrower; the whole-vocabulary draw likewise."""
    torch.manual_seed(0)
    logits = torch.randn(12, 5000) * 4
    top_ks = torch.tensor([0, 5, 50, 0, 2000, 0, 1, 40, 0, 300, 0, 7])
    top_ps = torch.tensor([0.9, 1.0, 0.95, 0.5, 1.0, 0.999, 1.0, 0.3, 0.99, 0.8, 0.7, 0.6])
    uniform = torch.rand(12)
    head = top_k_top_p_head(logits, top_ks, top_ps)
    tokens = head.draw(uniform)
    plain = _inverse_cdf(logits, uniform)
    for i in range(len(logits)):
        alone = top_k_top_p_head(logits[i : i + 1], top_ks[i : i + 1], top_ps[i : i + 1])
        kept = alone.keep[0].sum()
        assert kept == head.keep[i].sum() and torch.equal(alone.values[0, :kept], head.values[i, :kept])
        assert set(alone.ids[0, alone.keep[0]].tolist()) == set(head.ids[i, head.keep[i]].tolist())
        assert alone.draw(uniform[i : i + 1]) == tokens[i], f"row {i}"
        assert _inverse_cdf(logits[i : i + 1], uniform[i : i + 1]) == plain[i]
    assert 1 < head.keep[0].sum() < 5000


def test_lora_deltas_do_not_depend_on_the_grouping():
    """A row's LoRA delta is the same bits whether its group is a view of the step's rows
    (even groups back to back), a padded gather (uneven groups), or alone."""
    from engine.lora.adapter import ModuleLoRA
    from engine.lora.slots import LoRABatch, LoRARange, LoRASlots

    torch.manual_seed(0)
    dtype = torch.bfloat16
    layer = Linear(64, 96, bias=False).to(dtype)
    layer.prepack()
    batch = LoRABatch(num_slots=3)
    slots = LoRASlots(layer, [64, 32], num_slots=3, max_rank=8, batch=batch, dtype=dtype, device=torch.device("cpu"))
    for slot in range(3):
        slots.load(slot, [ModuleLoRA(torch.randn(8, 64).to(dtype), torch.randn(64, 8).to(dtype)),
                          ModuleLoRA(torch.randn(4, 64).to(dtype), torch.randn(32, 4).to(dtype))])
    x = torch.randn(40, 64).to(dtype)

    def deltas(ranges, rows):
        batch.set([LoRARange(*r) for r in ranges], rows, torch.device("cpu"))
        return slots.add_deltas(x[:rows], torch.zeros(rows, 96, dtype=dtype))

    even = deltas([(2, 0, 16), (0, 16, 32)], 32)
    assert batch.block == (0, 16)
    uneven = deltas([(2, 0, 16), (0, 16, 31), (1, 31, 40)], 40)
    assert batch.block is None
    alone = deltas([(0, 16, 31)], 31)
    assert torch.equal(even[:31], uneven[:31]) and torch.equal(alone[16:31], even[16:31])
    assert not torch.equal(even[:16], torch.zeros_like(even[:16]))
