"""The mixture-of-experts layer: the router's choice against transformers', and the experts'
weighted sum (the fused Triton kernel, the CPU's C++ operator and its PyTorch fallback)
against a per-token loop.

Without a GPU the kernel runs in Triton's interpreter (exact in float16 and float32, wrong
in bfloat16, so bfloat16 is checked on a GPU only); shapes stay tiny for it.
"""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_build
from engine.kernels import triton as triton_kernels
from engine.layers.fused_moe import FusedMoE, select_experts
from engine.layers.linear import linear_kernel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
needs_triton = pytest.mark.skipif(not triton_kernels.available(DEVICE), reason="Triton cannot run here")


def tolerance(dtype: torch.dtype) -> dict:
    """Against the float32 reference, for outputs of size ~2: float32 differs by the order
    of the sums (measured up to 1.5e-6), 16-bit by the rounded inputs and intermediates
    (float16 up to 2.5e-3, bfloat16 on the CPU path up to 1.7e-2)."""
    close = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    return dict(atol=close, rtol=close)


def reference_moe(x, w13, w2, topk_weights, topk_ids):
    """The experts' weighted sum token by token, in float32."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, expert in enumerate(topk_ids[t].tolist()):
            gate, up = (w13[expert] @ x[t]).chunk(2)
            out[t] += topk_weights[t, j].float() * (w2[expert] @ (F.silu(gate) * up))
    return out


def moe_case(tokens, experts, top_k, hidden=64, inter=48, dtype=torch.float32, seed=0, only=None):
    """x, w13, w2, topk_weights, topk_ids with outputs of size ~1; `only` restricts the
    routing to those experts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if only is not None:
        logits[:, [e for e in range(experts) if e not in only]] = float("-inf")
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return (*(t.to(DEVICE, dtype) for t in (x, w13, w2)), weights.to(DEVICE), ids.to(DEVICE))


def layer_of(w13, w2, prepacked: bool) -> FusedMoE:
    layer = FusedMoE(w13.shape[0], w13.shape[2], w2.shape[2]).to(w13.device, w13.dtype)
    layer.w13.data.copy_(w13)
    layer.w2.data.copy_(w2)
    if prepacked:
        layer.prepack()
    return layer


@needs_triton
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("tokens, experts, top_k, only, block_m", [
    (1, 8, 2, None, None),
    (5, 8, 2, None, None),
    (33, 4, 2, None, None),
    (33, 8, 2, (1, 6), None),  # six experts idle
    (33, 8, 1, (3,), None),  # every token to one expert: several blocks of it
    (33, 4, 2, None, 32),
])
def test_triton_fused_moe_matches_reference(dtype, tokens, experts, top_k, only, block_m):
    from engine.kernels.triton.fused_moe import fused_moe

    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, dtype=dtype, only=only)
    out = fused_moe(x, w13, w2, weights, ids, block_m=block_m)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), reference_moe(x, w13, w2, weights, ids), **tolerance(dtype))


@needs_triton
def test_align_gives_each_block_one_expert_and_every_slot_once():
    from engine.kernels.triton.fused_moe import align

    ids = torch.tensor([[2, 0], [2, 5], [0, 2], [2, 3], [5, 0]], device=DEVICE)
    sorted_slots, block_experts = align(ids, num_experts=8, block_m=4)
    slots = ids.numel()
    blocks = sorted_slots.view(-1, 4).cpu()
    assert block_experts.tolist() == [0, 2, 3, 5] + [8] * 6  # 10 // 4 + min(8, 10) blocks; none for 1, 4, 6, 7
    for block, expert in zip(blocks, block_experts.tolist()):
        real = block[block < slots]
        assert all(ids.view(-1)[s] == expert for s in real.tolist())
    assert sorted(blocks[blocks < slots].tolist()) == list(range(slots))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens, experts, top_k, only", [
    (33, 8, 2, (0, 2, 3, 5, 7)),
    (1, 8, 2, None),
    (40, 16, 4, None),
    (20, 4, 1, (2,)),  # every token to one expert, three idle
])
def test_grouped_experts_match_reference(cpu_path, dtype, tokens, experts, top_k, only):
    x, w13, w2, weights, ids = moe_case(tokens, experts, top_k, dtype=dtype, only=only)
    for prepacked in (True, False):
        layer = layer_of(w13, w2, prepacked)
        with torch.no_grad():
            out = layer(x, weights, ids)
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), reference_moe(x, w13, w2, weights, ids), **tolerance(dtype))


def test_no_tokens_give_an_empty_output(cpu_path):
    x, w13, w2, weights, ids = moe_case(0, 4, 2)
    with torch.no_grad():
        assert layer_of(w13, w2, prepacked=True)(x, weights, ids).shape == (0, x.shape[1])


def test_the_cpu_kernel_runs_prepacked_experts(monkeypatch):
    if DEVICE.type != "cpu" or cpu_build.load() is None or linear_kernel(torch.float32, DEVICE) != "onednn":
        pytest.skip("the C++ operator runs oneDNN's prepacked products on a CPU where it can be built")
    x, w13, w2, weights, ids = moe_case(9, 4, 2)
    layer = layer_of(w13, w2, prepacked=True)
    monkeypatch.setattr(layer, "grouped", lambda *args: pytest.fail("the PyTorch fallback ran"))
    with torch.no_grad():
        torch.testing.assert_close(layer(x, weights, ids), reference_moe(x, w13, w2, weights, ids),
                                   **tolerance(x.dtype))
    with pytest.raises(RuntimeError, match=r"expert ids within \[0, 4\)"):
        layer(x, weights, ids + 3)


@pytest.mark.cpu_kinds
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_rows_do_not_depend_on_the_batch(cpu_path, dtype):
    if DEVICE.type != "cpu" or linear_kernel(dtype, DEVICE) != "onednn":
        pytest.skip("batch invariance holds through oneDNN's prepacked products")
    x, w13, w2, weights, ids = moe_case(33, 8, 2, hidden=128, inter=96, dtype=dtype, seed=1)
    layer = layer_of(w13, w2, prepacked=True)
    with torch.no_grad():
        whole = layer(x, weights, ids)
        for t in range(len(x)):
            assert torch.equal(layer(x[t : t + 1], weights[t : t + 1], ids[t : t + 1]), whole[t : t + 1]), t


def test_tensor_parallel_shards_sum_to_the_whole():
    x, w13, w2, weights, ids = moe_case(5, 4, 2)
    inter = w2.shape[2]
    reduced, shards = [], []
    for rank in range(2):
        group = SimpleNamespace(rank=rank, size=2, all_reduce=reduced.append)
        layer = FusedMoE(4, x.shape[1], inter, group).to(DEVICE)
        start, length = rank * inter // 2, inter // 2  # of each expert's gate and up rows, and down columns
        layer.w13.data.copy_(torch.cat([half.narrow(1, start, length) for half in w13.split(inter, 1)], 1))
        layer.w2.data.copy_(w2.narrow(2, start, length))
        with torch.no_grad():
            shards.append(layer(x, weights, ids))
    assert len(reduced) == 2
    torch.testing.assert_close(shards[0] + shards[1], reference_moe(x, w13, w2, weights, ids), **tolerance(x.dtype))


@needs_triton
def test_routed_experts_keep_their_weights_for_the_kernel():
    """Routed through Triton before the model is prepacked (as `load_model` does), the
    experts keep the 3-D weights the kernel reads."""
    from engine.model_loader.kernel_routing import route_through_triton

    x, w13, w2, weights, ids = moe_case(5, 4, 2)
    layer = layer_of(w13, w2, prepacked=False)
    route_through_triton(nn.ModuleList([layer]))
    layer.prepack()
    assert layer.kernel is not None and layer.packed is None
    with torch.no_grad():
        torch.testing.assert_close(layer(x, weights, ids), reference_moe(x, w13, w2, weights, ids),
                                   **tolerance(x.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family, renormalize", [("mixtral", True), ("qwen2_moe", True), ("qwen2_moe", False),
                                                 ("qwen3_moe", False)])
def test_select_experts_matches_transformers_routers(family, renormalize, dtype):
    import transformers

    sizes = dict(hidden_size=32, num_experts_per_tok=2)
    if family == "mixtral":
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
            transformers.MixtralConfig(**sizes, num_local_experts=8))
    else:
        module = getattr(transformers.models, family)
        config_class, router_class = ((module.Qwen2MoeConfig, module.modeling_qwen2_moe.Qwen2MoeTopKRouter)
                                      if family == "qwen2_moe" else
                                      (module.Qwen3MoeConfig, module.modeling_qwen3_moe.Qwen3MoeTopKRouter))
        router = router_class(config_class(**sizes, num_experts=8, norm_topk_prob=renormalize))
    torch.manual_seed(7)
    router = router.to(dtype)
    router.weight.data.normal_()
    hidden = torch.randn(17, 32).to(dtype)
    logits, expected_weights, expected_ids = router(hidden)
    weights, ids = select_experts(logits, 2, renormalize)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, expected_ids)
    # Qwen's routers round the weights to the logits' dtype; Mixtral's keep float32.
    assert torch.equal(weights.to(expected_weights.dtype), expected_weights)
