"""The compiled CPU paged-attention kernel against PyTorch's attention, and the choice
between them.

The kernel is built on first use (about a minute, then cached); where this machine
cannot build it the kernel tests skip and say why, and the fallback tests still run.
"""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.backends.torch_attn import matmul_attention
from engine.attention.layer import Attention
from engine.hardware import machine_cpu
import engine.attention.selector as attention_selector
from engine.kernels import cpu_attention, cpu_build
from engine.kernels.cpu_rotary import rotary as cpu_rotary

# On two threads or more: the kernels' split of the work across threads is tested too.
pytestmark = [pytest.mark.cpu_kinds, pytest.mark.usefixtures("two_threads")]

BLOCK = 16


@pytest.fixture(scope="module")
def kernel():
    if cpu_build.load() is None:
        pytest.skip("the CPU attention kernel cannot be built on this machine (no C++ compiler or ninja)")
    return cpu_attention


def paged_case(rng: random.Random, dtype: torch.dtype, num_blocks: int = 64, kv_heads: int = 3, head_dim: int = 64):
    """A random paged cache and a step of sequences with random new and cached tokens."""
    k_cache = torch.randn(kv_heads, num_blocks * BLOCK, head_dim).to(dtype)
    v_cache = torch.randn(kv_heads, num_blocks * BLOCK, head_dim).to(dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = []
    for _ in range(rng.choice([1, 3, 7])):
        new = rng.choice([1, 1, 2, 17, 40])
        context = new + rng.choice([0, 5, 33, 90])
        blocks = [free.pop() for _ in range(-(-context // BLOCK))]
        seqs.append((new, context, blocks))
    return k_cache, v_cache, seqs


def torch_reference(attention, q, k_cache, v_cache, seqs):
    """Each sequence attended by the PyTorch path (padded, masked), rows in step order."""
    outs, row = [], 0
    for new, context, blocks in seqs:
        positions = torch.arange(context)
        slots = torch.tensor(blocks)[positions // BLOCK] * BLOCK + positions % BLOCK
        keys = k_cache[:, slots].unsqueeze(1)
        values = v_cache[:, slots].unsqueeze(1)
        mask = positions.view(1, -1) <= (context - new + torch.arange(new)).view(-1, 1)
        outs.append(matmul_attention(attention, q[row : row + new].unsqueeze(0), keys, values,
                                                mask.view(1, 1, new, context))[0])
        row += new
    return torch.cat(outs)


def kernel_rows(seqs):
    width = max(len(blocks) for _, _, blocks in seqs)
    tables = torch.tensor([blocks + [0] * (width - len(blocks)) for _, _, blocks in seqs])
    row_seq = torch.cat([torch.full((new,), i) for i, (new, _, _) in enumerate(seqs)])
    row_keys = torch.cat([torch.arange(context - new + 1, context + 1) for new, context, _ in seqs])
    return tables, row_seq, row_keys


# Three and five query heads per KV head: the kernel sums up to four heads' values together.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (10, 2)])
def test_kernel_matches_pytorch_attention(kernel, dtype, heads, kv_heads):
    rng = random.Random(0)
    torch.manual_seed(0)
    attention = Attention(num_heads=heads, head_dim=64, num_kv_heads=kv_heads)
    for _ in range(6):
        k_cache, v_cache, seqs = paged_case(rng, dtype, kv_heads=kv_heads)
        q = torch.randn(sum(new for new, _, _ in seqs), heads, 64).to(dtype)
        got = kernel.paged_attention(q, k_cache, v_cache, *kernel_rows(seqs), BLOCK, attention.scale)
        expected = torch_reference(attention, q, k_cache, v_cache, seqs)
        tolerance = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got, expected, **tolerance)


# A float32 model over a bfloat16 cache is a CPU's default where bfloat16 is not native.
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("head_dim,window", [(64, None), (128, None), (64, 21)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (10, 2)])
def test_kernel_rows_do_not_depend_on_the_batch(kernel, dtype, cache_dtype, head_dim, window, heads, kv_heads):
    """A row computed alone, as a decode step, or inside any batch gives the same bits (in
    bfloat16 too, where this CPU's bfloat16 dot products compute the scores; a prefill's rows
    score keys packed or transposed once for many queries, and sum values many queries at a time,
    while a decode row reads them alone). Five heads a KV head leave groups of queries short of
    the tile's."""
    rng = random.Random(1)
    torch.manual_seed(1)
    k_cache, v_cache, seqs = paged_case(rng, cache_dtype, kv_heads=kv_heads, head_dim=head_dim)
    q = torch.randn(sum(new for new, _, _ in seqs), heads, head_dim).to(dtype)
    tables, row_seq, row_keys = kernel_rows(seqs)
    window = {"sliding_window": window}
    together = kernel.paged_attention(q, k_cache, v_cache, tables, row_seq, row_keys, BLOCK, 0.125, **window)
    order = list(range(len(q)))
    rng.shuffle(order)
    shuffled = kernel.paged_attention(q[order], k_cache, v_cache, tables, row_seq[order], row_keys[order], BLOCK, 0.125,
                                      **window)
    assert torch.equal(shuffled, together[order])
    for row in range(len(q)):
        alone = kernel.paged_attention(q[row : row + 1], k_cache, v_cache, tables[row_seq[row]].unsqueeze(0),
                                       torch.zeros(1, dtype=torch.long), row_keys[row : row + 1], BLOCK, 0.125,
                                       **window)
        assert torch.equal(alone[0], together[row])


def test_an_int8_cache_is_read_through_queries_rounded_to_int16(kernel):
    """Over an int8 cache the kernel (AVX2 and AVX512-VNNI alike) rounds each query to int16 with
    a scale of its own, its largest magnitude / 32767, for exact integer dot products with the
    keys: a query whose one large component meets no key leaves its small ones rounded to zero,
    so every key scores zero and the output is the values' mean, where float queries would weigh
    the keys unevenly."""
    if not {"avx2", "fma"} <= machine_cpu().flags:
        pytest.skip("the kernel's int16 products need AVX2 (this CPU widens an int8 cache to floats)")
    torch.manual_seed(0)
    keys, dim = BLOCK, 64
    k_cache = torch.randint(-127, 128, (1, keys, dim), dtype=torch.int8)
    k_cache[..., 0] = 0
    v_cache = torch.randint(-127, 128, (1, keys, dim), dtype=torch.int8)
    k_scale, v_scale = torch.ones(1, keys), torch.full((1, keys), 0.01)
    q = torch.randn(1, 1, dim) * 1e-3
    q[0, 0, 0] = 1000.0  # the small components are well under half of 1000 / 32767
    table, seq, seen = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.tensor([keys])
    out = kernel.paged_attention(q, k_cache, v_cache, table, seq, seen, BLOCK, 4.0, k_scale=k_scale, v_scale=v_scale)
    float_scores = (4.0 * q[0] @ k_cache[0].float().T).softmax(-1)
    assert float_scores.max() > 2 / keys  # float queries would not weigh the keys evenly
    torch.testing.assert_close(out[0, 0], (v_cache[0].float() * 0.01).mean(0), atol=1e-4, rtol=1e-4)


def test_auto_falls_back_to_pytorch_where_the_kernel_cannot_build(tiny_models, monkeypatch):
    monkeypatch.setattr(attention_selector.cpu_build, "load", lambda: None)
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        assert llm.llm_engine.model_runner.attention_backend == "torch"
        out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    with pytest.raises(RuntimeError, match="attention_backend='cpu'"):
        LLM(str(tiny_models["llama"]), dtype="float32", attention_backend="cpu")


def test_a_failed_build_is_reported_and_not_raised(monkeypatch, caplog):
    def broken_build(**kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr("torch.utils.cpp_extension.load", broken_build)
    cpu_build.load.cache_clear()
    try:
        assert cpu_build.load() is None
        assert "could not be built" in caplog.text and "Ninja is required" in caplog.text
    finally:
        cpu_build.load.cache_clear()


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(attention_backend="flash")


def rotary_tables(rot: int, positions: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float32 cos and sin tables [positions, rot] (the kernels take any values)."""
    return torch.randn(positions, rot), torch.randn(positions, rot)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("rot,window,softcap,sinks", [(64, None, None, False), (32, 7, 30.0, True)])
def test_one_call_rotates_caches_and_attends_as_the_three_calls(kernel, dtype, cache_dtype, rot, window, softcap,
                                                                sinks):
    """`rotary_cache_attention` over a fused projection's output: the same bits, in the output
    and in the caches (and an int8 cache's scales), as rotary, two cache writes and paged
    attention one after the other; a partial rotation, a window, a soft-cap and sinks pass through."""
    rng = random.Random(2)
    torch.manual_seed(2)
    heads, kv_heads = 9, 3
    k_cache, v_cache, seqs = paged_case(rng, torch.float32)
    tables, row_seq, row_keys = kernel_rows(seqs)
    positions = row_keys - 1
    slots = torch.cat([torch.tensor(blocks)[torch.arange(context - new, context) // BLOCK] * BLOCK
                       + torch.arange(context - new, context) % BLOCK for new, context, blocks in seqs])
    qkv = torch.randn(len(positions), (heads + 2 * kv_heads) * 64).to(dtype)
    cos, sin = rotary_tables(rot)
    head_sinks = torch.randn(heads) if sinks else None
    scaled = cache_dtype == torch.int8
    caches = [[c.to(cache_dtype) for c in (k_cache, v_cache)]
              + [torch.ones(kv_heads, k_cache.shape[1]) if scaled else None for _ in range(2)] for _ in range(2)]

    ks, vs, k_scale, v_scale = caches[0]
    rotated = cpu_rotary(positions, qkv[:, : (heads + kv_heads) * 64].view(-1, heads + kv_heads, 64), cos, sin)
    q, k = rotated.split([heads, kv_heads], dim=1)
    none = torch.empty(0)
    kernel.store_kv(k, ks, none if k_scale is None else k_scale, slots)
    kernel.store_kv(qkv[:, (heads + kv_heads) * 64:].view(-1, kv_heads, 64), vs, none if v_scale is None else v_scale,
                    slots)
    expected = kernel.paged_attention(q, ks, vs, tables, row_seq, row_keys, BLOCK, 0.125, window, softcap, k_scale,
                                      v_scale, head_sinks).view(len(qkv), -1)

    ks2, vs2, k_scale2, v_scale2 = caches[1]
    got = kernel.rotary_cache_attention(qkv, heads, kv_heads, positions, cos, sin, ks2, vs2, slots, tables, row_seq,
                                        row_keys, BLOCK, 0.125, window, softcap, k_scale2, v_scale2, head_sinks)
    assert torch.equal(got, expected)
    assert torch.equal(ks2, ks) and torch.equal(vs2, vs)
    if scaled:
        assert torch.equal(k_scale2, k_scale) and torch.equal(v_scale2, v_scale)


def test_the_cpu_backend_takes_a_table_rotation_in_one_call_and_any_other_in_steps(kernel, monkeypatch):
    """`CpuAttentionBackend.rotate_and_attend`: a `RotaryEmbedding` (which has tables) goes to
    the one compiled call, a rotation without tables (Qwen3's normed one, M-RoPE) through the
    steps; both give the bits of the steps."""
    from engine.attention.backends.cpu_attn import CpuAttentionBackend
    from engine.attention.layer import AttentionMetadata
    from engine.layers.rotary import RotaryEmbedding

    rng = random.Random(3)
    torch.manual_seed(3)
    k_cache, v_cache, seqs = paged_case(rng, torch.bfloat16)
    tables, row_seq, row_keys = kernel_rows(seqs)
    lengths = [new for new, _, _ in seqs]
    slots = torch.cat([torch.tensor(blocks)[torch.arange(context - new, context) // BLOCK] * BLOCK
                       + torch.arange(context - new, context) % BLOCK for new, context, blocks in seqs])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.tensor([0, *torch.tensor(lengths).cumsum(0)]),
                             seq_lens=torch.tensor([c for _, c, _ in seqs]), block_tables=tables,
                             positions=row_keys - 1, query_lens=lengths, context_lens=[c for _, c, _ in seqs],
                             block_size=BLOCK)
    backend = CpuAttentionBackend(null_slot=0)
    backend.prepare(meta)
    rotary = RotaryEmbedding(64, 256, {"rope_theta": 10000.0})
    rotary.kernel = cpu_rotary
    calls, fused = [], kernel.rotary_cache_attention
    monkeypatch.setattr(cpu_attention, "rotary_cache_attention",
                        lambda *args, **kwargs: calls.append(1) or fused(*args, **kwargs))
    qkv = torch.randn(len(slots), 15 * 64).to(torch.bfloat16)
    outputs = []
    for rotation in (rotary, lambda positions, x: rotary(positions, x)):
        layer = Attention(num_heads=9, head_dim=64, num_kv_heads=3)
        layer.k_cache, layer.v_cache = k_cache.clone(), v_cache.clone()
        layer.k_scale = layer.v_scale = torch.empty(0)
        layer.backend = backend
        outputs.append((layer.rotate_and_attend(qkv, meta.positions, rotation, meta), layer.k_cache, layer.v_cache))
    assert calls == [1]
    assert all(torch.equal(a, b) for a, b in zip(*outputs))
