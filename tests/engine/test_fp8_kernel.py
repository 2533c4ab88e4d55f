"""The FP8 row-quantizing kernel (engine/kernels/triton/fp8_quant.py) against
`engine.quantization.fp8.quantize_fp8_rows`, bit for bit.

Without a GPU it runs in Triton's interpreter on CPU tensors. The interpreter's own conversion
to e4m3 rounds ties away from zero and drops carries, but the kernel rounds in float32 first
(`round_to_e4m3`), so the interpreter writes the values a GPU writes. Its arithmetic is float32
throughout and bfloat16 widens to float32 exactly, so bfloat16 inputs are checked here too.
"""

import pytest
import torch

from engine.kernels import triton as triton_kernels
from engine.quantization.fp8 import Fp8LinearMethod, fp8_linear, quantize_fp8_rows, quantize_fp8_weight, row_quantizer

if triton_kernels.installed():
    import triton
    import triton.language as tl

    from engine.kernels.triton.fp8_quant import round_to_e4m3

    @triton.jit
    def _round_kernel(x_ptr, out_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N)
        tl.store(out_ptr + offsets, round_to_e4m3(tl.load(x_ptr + offsets)).to(out_ptr.dtype.element_ty))

pytestmark = pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E4M3 = torch.float8_e4m3fn


def fused():
    from engine.kernels.triton import fp8_quant
    return fp8_quant


def assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, scale), (q_expected, scale_expected) = got, expected
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (q.shape[0], 1)
    assert torch.equal(scale.view(torch.int32), scale_expected.view(torch.int32))
    assert torch.equal(q.view(torch.uint8), q_expected.view(torch.uint8))


def rows_across_magnitudes(rows: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random rows whose magnitudes span 1e-6..1e3 from row to row, with zeros of both signs,
    and values far below their row's largest (which land on e4m3's subnormals)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator) * torch.logspace(-6, 3, rows)[:, None]
    x[:, :4] = torch.tensor([0.0, -0.0, 1e-4, -3e-5])[: min(4, k)] * x[:, 4:5].abs()
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [5, 64, 2500])  # under one step, one step, several with a tail
def test_rows_match_pytorch_bit_for_bit(k, dtype):
    x = rows_across_magnitudes(6, k, dtype, seed=k).to(DEVICE)
    assert_same_bits(fused().quantize_fp8_rows(x), quantize_fp8_rows(x))


def test_a_row_of_zeros_and_strided_rows():
    x = rows_across_magnitudes(4, 96, torch.float16)
    x[1] = 0.0  # its scale is 1e-12 / 448, its values zeros
    x = x.to(DEVICE)
    assert_same_bits(fused().quantize_fp8_rows(x), quantize_fp8_rows(x))
    wide = torch.cat([x, x.flip(1)], 1)
    assert_same_bits(fused().quantize_fp8_rows(wide[:, 96:]), quantize_fp8_rows(x.flip(1)))  # a row stride of 192
    assert_same_bits(fused().quantize_fp8_rows(x.t().contiguous().t()), quantize_fp8_rows(x))  # column-major


def test_a_row_holding_nan_gets_a_nan_scale():
    x = rows_across_magnitudes(3, 40, torch.float32)
    x[1, 7] = float("nan")
    q, scale = fused().quantize_fp8_rows(x.to(DEVICE))
    assert scale[1].isnan().all() and not scale[[0, 2]].isnan().any()
    q_expected, scale_expected = quantize_fp8_rows(x[[0, 2]])
    assert_same_bits((q[[0, 2]], scale[[0, 2]]), (q_expected.to(DEVICE), scale_expected.to(DEVICE)))


def test_no_rows():
    q, scale = fused().quantize_fp8_rows(torch.empty(0, 32, device=DEVICE))
    assert q.shape == (0, 32) and scale.shape == (0, 1)


def test_rounding_is_to_nearest_even_at_every_e4m3_step():
    """Every finite e4m3 value, every midpoint between neighbours (ties: to the even one; at a
    power of two the carry) and the three float32 values on either side of each, subnormals
    and signed zeros included, as PyTorch converts them."""
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    values = values[~values.isnan()].unique()
    points = torch.cat([values, (values[1:] + values[:-1]) / 2])
    cases, up, down = [points, torch.tensor([-0.0])], points, points
    for _ in range(3):
        up, down = torch.nextafter(up, torch.tensor(1e9)), torch.nextafter(down, torch.tensor(-1e9))
        cases += [up, down]
    x = torch.cat(cases).clamp(-448, 448)
    size = triton.next_power_of_2(x.numel())
    x = torch.nn.functional.pad(x, (0, size - x.numel())).to(DEVICE)
    out = torch.empty(size, dtype=E4M3, device=DEVICE)
    _round_kernel[(1,)](x, out, N=size)
    assert torch.equal(out.view(torch.uint8), x.to(E4M3).view(torch.uint8))


def test_the_gpu_takes_the_kernel_and_a_cpu_pytorch():
    from engine.kernels.triton.fp8_quant import quantize_fp8_rows as kernel

    assert row_quantizer(torch.device("cuda")) is kernel
    assert row_quantizer(torch.device("cpu")) is quantize_fp8_rows
    assert Fp8LinearMethod(torch.device("cuda")).product.keywords["quantize_rows"] is kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_product_through_the_kernel_is_the_pytorch_products(dtype):
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 80, generator=generator).to(dtype)
    x = torch.randn(2, 3, 80, generator=generator).to(dtype)
    bias = torch.randn(24, generator=generator).to(dtype)
    q, scale = (t.to(DEVICE) for t in quantize_fp8_weight(weight))
    x, bias = x.to(DEVICE), bias.to(DEVICE)
    out = fp8_linear(x, q, scale, bias, quantize_rows=fused().quantize_fp8_rows)
    assert out.dtype == dtype and out.shape == (2, 3, 24)
    assert torch.equal(out, fp8_linear(x, q, scale, bias))
