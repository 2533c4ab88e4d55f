"""The compiled CPU RMSNorm (with its residual add), rotary embedding and gated activation
against the layers' PyTorch paths, and their routing: every norm, rotary table and MLP of a
model on a CPU, where the kernels can be built."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch import nn

from engine.distributed.communicator import TensorParallelGroup
from engine.kernels import cpu_build
from engine.layers.layernorm import GemmaRMSNorm, RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.model_loader.kernel_routing import route_through_cpu_kernels
from engine.models.llama import LlamaMLP

# On two threads or more: the kernels' split of the work across threads is tested too.
pytestmark = [pytest.mark.cpu_kinds, pytest.mark.usefixtures("two_threads")]


@pytest.fixture(scope="module")
def built():
    if cpu_build.load() is None:
        pytest.skip("the CPU kernels cannot be built on this machine (no C++ compiler or ninja)")


@pytest.fixture(scope="module")
def rms_norm(built):
    from engine.kernels.cpu_rms_norm import rms_norm

    return rms_norm


def tolerance(dtype: torch.dtype) -> dict:
    """The sums of squares add in another order than PyTorch's: float32 differs in the last
    bits, 16-bit outputs by at most a rounding step."""
    close = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    return dict(atol=close, rtol=close)


def norm_case(dtype: torch.dtype, hidden: int, rows: int = 7, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layer = RMSNorm(hidden, 1e-6).to(dtype)
    layer.weight.data.copy_(torch.randn(hidden, generator=gen))
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen) * 5
    return layer, x, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [512, 52])  # 52: a tail past the last eight
@pytest.mark.parametrize("residual_dtype", [None, torch.float32, "x"])
def test_matches_the_layer(rms_norm, dtype, hidden, residual_dtype):
    layer, x, residual = norm_case(dtype, hidden)
    with torch.no_grad():
        if residual_dtype is None:
            before = x.clone()
            out, expected = rms_norm(x, layer.weight, layer.eps), layer.torch_forward(x)
            assert torch.equal(x, before), "without a residual, x is left as it was"
        else:
            residual = residual.to(dtype if residual_dtype == "x" else residual_dtype)
            expected, expected_sum = layer.torch_forward(x.clone(), residual.clone())
            out, summed = rms_norm(x, layer.weight, layer.eps, residual)
            assert summed.dtype == residual.dtype and torch.equal(summed, expected_sum)
            assert summed.data_ptr() == residual.data_ptr() and out.data_ptr() == x.data_ptr(), "in place"
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.float16])
def test_a_weight_in_another_dtype_is_read_as_its_values(rms_norm, weight_dtype):
    """A bfloat16 model's norm whose weight stayed float32 (read as it is) or is float16
    (widened first) gives what the weight's values rounded to bfloat16 give."""
    layer, x, residual = norm_case(torch.bfloat16, 200, seed=5)
    weight = layer.weight.detach().to(weight_dtype)
    with torch.no_grad():
        expected = rms_norm(x, weight.float(), layer.eps)
        assert torch.equal(rms_norm(x, weight, layer.eps), expected)
        expected, expected_sum = rms_norm(x.clone(), weight.float(), layer.eps, residual.clone())
        out, summed = rms_norm(x, weight, layer.eps, residual)
    assert torch.equal(out, expected) and torch.equal(summed, expected_sum)


def test_strided_inputs_are_read_through_copies(rms_norm):
    """x and a residual that are views across a wider tensor give the contiguous result,
    and the rows around them are not written."""
    layer, x, residual = norm_case(torch.float32, 64, rows=6, seed=4)
    wide_x, wide_residual = torch.cat([x, x], dim=1), torch.cat([residual, residual], dim=1)
    expected, expected_sum = rms_norm(x.clone(), layer.weight, layer.eps, residual.clone())
    with torch.no_grad():
        out, summed = rms_norm(wide_x[:, :64], layer.weight, layer.eps, wide_residual[:, 64:])
    assert torch.equal(out, expected) and torch.equal(summed, expected_sum)
    assert torch.equal(wide_x[:, 64:], x) and torch.equal(wide_residual[:, :64], residual)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_does_not_depend_on_the_batch(rms_norm, dtype):
    layer, x, residual = norm_case(dtype, 200, rows=37, seed=3)
    with torch.no_grad():
        whole, whole_sum = rms_norm(x.clone(), layer.weight, layer.eps, residual.clone())
        for r in range(len(x)):
            alone, alone_sum = rms_norm(x[r : r + 1].clone(), layer.weight, layer.eps, residual[r : r + 1].clone())
            assert torch.equal(alone, whole[r : r + 1]) and torch.equal(alone_sum, whole_sum[r : r + 1]), r


def test_bad_shapes_are_refused(rms_norm):
    layer, x, residual = norm_case(torch.float32, 64)
    with pytest.raises(RuntimeError, match=r"weight \[hidden\]"):
        rms_norm(x[:, :32], layer.weight, layer.eps)
    with pytest.raises(RuntimeError, match="residual"):
        rms_norm(x, layer.weight, layer.eps, residual[:3])


@pytest.fixture(scope="module")
def rotary(built):
    from engine.kernels.cpu_rotary import rotary

    return rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim, partial", [(64, 1.0), (64, 0.75), (20, 1.0)])  # 0.75: Phi-4-mini; 20: a tail
def test_rotary_matches_the_layer(rotary, dtype, head_dim, partial):
    layer = RotaryEmbedding(head_dim, 300, {"rope_theta": 10000.0, "partial_rotary_factor": partial})
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 7 * head_dim, generator=gen).to(dtype)
    qk = qkv[:, : 5 * head_dim].view(9, 5, head_dim)  # strided, as the model's queries and keys
    positions = torch.randint(0, 300, (9,), generator=gen)
    out = rotary(positions, qk, layer.cos, layer.sin)
    assert out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out, layer.torch_forward(positions, qk))
    with pytest.raises(RuntimeError, match="beyond the rotary table"):
        rotary(torch.full((9,), 300), qk, layer.cos, layer.sin)


@pytest.fixture(scope="module")
def act_and_mul(built):
    from engine.kernels.cpu_activation import act_and_mul

    return act_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("width", [96, 52])  # 52: a tail past the last eight
def test_gated_activation_matches_pytorch(act_and_mul, dtype, activation, width):
    """act(gate) * up as LlamaMLP computes it in PyTorch, from strided rows; gates from -100
    to 100 (exp's range ends). Another exp than PyTorch's: float32 differs in the last bits,
    16-bit outputs by at most a rounding step of the activation."""
    gen = torch.Generator().manual_seed(2)
    gate_up = torch.randn(9, 2 * width + 8, generator=gen) * 4
    gate_up[0, :6] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 100.0])
    x = gate_up.to(dtype)[:, : 2 * width]
    gate, up = x.chunk(2, dim=-1)
    act = F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")
    out = act_and_mul(x, activation)
    assert out.dtype == dtype and out.shape == (9, width)
    torch.testing.assert_close(out, act * up, **tolerance(dtype))


def test_every_norm_rotary_table_and_mlp_is_routed(rms_norm, rotary, act_and_mul):
    config = transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2)
    model = nn.ModuleList([RMSNorm(8, 1e-6), GemmaRMSNorm(8, 1e-6), nn.Linear(8, 8),
                           RotaryEmbedding(8, 16, {"rope_theta": 10000.0}), LlamaMLP(config, TensorParallelGroup())])
    route_through_cpu_kernels(model)
    assert model[0].kernel is rms_norm and model[1].kernel is rms_norm and model[3].kernel is rotary
    assert model[4].kernel is act_and_mul
    with torch.no_grad():
        mlp_input = torch.randn(3, 8)
        routed = model[4](mlp_input)
        model[4].kernel = None
        torch.testing.assert_close(routed, model[4](mlp_input), **tolerance(torch.float32))
    x = torch.randn(3, 8)
    torch.testing.assert_close(model[0](x), model[0].torch_forward(x), **tolerance(torch.float32))
    heads = torch.randn(3, 2, 8)  # q/k norms see [tokens, heads, head_dim]
    torch.testing.assert_close(model[0](heads), model[0].torch_forward(heads), **tolerance(torch.float32))
    positions = torch.tensor([0, 5, 15])
    assert torch.equal(model[3](positions, heads), model[3].torch_forward(positions, heads))


def test_no_routing_where_the_kernels_cannot_build(monkeypatch):
    monkeypatch.setattr(cpu_build, "load", lambda: None)
    model = nn.ModuleList([RMSNorm(8, 1e-6), RotaryEmbedding(8, 16, {"rope_theta": 10000.0})])
    route_through_cpu_kernels(model)
    assert model[0].kernel is None and model[1].kernel is None
