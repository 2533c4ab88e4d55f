"""The 4-bit weight kernel (engine/kernels/triton/w4a16.py) against PyTorch references.

Without a GPU it runs in Triton's interpreter on CPU tensors, exact in float16 and float32 but
wrong in bfloat16, so bfloat16 is checked only on a GPU. Shapes stay small: the interpreter is slow.
"""

import pytest
import torch

from engine.kernels import triton as triton_kernels

pytestmark = pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def w4a16():
    from engine.kernels.triton import w4a16
    return w4a16


def quantized_case(k, n, group_size, dtype, seed=0):
    """Random 4-bit values q [K, N] (int64), scales and uint8 zeros [K // group_size, N]."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=generator)
    scales = (torch.rand(k // group_size, n, generator=generator) * 0.02 + 0.005).to(dtype)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=generator).to(torch.uint8)
    return q, scales, zeros


def test_pack_round_trips_and_puts_row_8i_plus_j_in_nibble_j():
    module = w4a16()
    q = torch.randint(0, 16, (64, 24), generator=torch.Generator().manual_seed(1))
    q[:8, 0] = 15  # every nibble set: the int32 is -1
    packed = module.pack_w4(q)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24)
    assert packed[0, 0] == -1
    assert torch.equal(module.unpack_w4(packed), q.to(torch.int32))
    expected = sum(int(q[8 + j, 3]) << (4 * j) for j in range(8))
    assert int(packed[1, 3]) & 0xFFFFFFFF == expected


@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_dequantize_matches_a_float64_reference(group_size):
    module = w4a16()
    k, n = 128, 40
    q, scales, zeros = quantized_case(k, n, group_size, torch.float16)
    expected = torch.empty(k, n, dtype=torch.float64)
    for row in range(k):
        group = row // group_size
        expected[row] = (q[row].double() - zeros[group].double()) * scales[group].double()
    weight = module.dequantize_w4(module.pack_w4(q), scales, zeros, group_size)
    assert weight.dtype == torch.float32 and weight.shape == (k, n)
    assert torch.equal(weight.double(), expected)


def tolerance(dtype: torch.dtype) -> dict:
    """Float32: the sum's own rounding; 16-bit types: the output's rounding (plus the sum's)."""
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,n,group_size", [(64, 32, 32), (256, 48, 64), (256, 48, 32)])
@pytest.mark.parametrize("m", [1, 5, 40, 70])
def test_matmul_matches_the_dequantized_product(m, k, n, group_size, dtype):
    module = w4a16()
    q, scales, zeros = quantized_case(k, n, group_size, dtype, seed=m + k + n)
    qweight, scales, zeros = (t.to(DEVICE) for t in (module.pack_w4(q), scales, zeros))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = module.w4a16_matmul(x, qweight, scales, zeros, group_size)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = x.float() @ module.dequantize_w4(qweight, scales, zeros, group_size)
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    if dtype != torch.float32:  # rounded once, at the end: within half a unit in the last place
        half_ulp = expected.abs() * torch.finfo(dtype).eps / 2
        assert ((out.float() - expected).abs() <= half_ulp + 1e-5).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_does_not_depend_on_the_rest_of_the_batch(dtype):
    """Block sizes follow M, but a row's result is the same bits alone or in a batch of up to
    64 rows (the K step, which orders the sum, changes only above that)."""
    module = w4a16()
    k, n, group_size = 256, 48, 128
    q, scales, zeros = quantized_case(k, n, group_size, dtype)
    qweight, scales, zeros = (t.to(DEVICE) for t in (module.pack_w4(q), scales, zeros))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    batch = module.w4a16_matmul(x, qweight, scales, zeros, group_size)
    for rows in (1, 5, 40):
        assert torch.equal(module.w4a16_matmul(x[:rows], qweight, scales, zeros, group_size), batch[:rows])


def test_bad_shapes_are_refused():
    module = w4a16()
    q, scales, zeros = quantized_case(64, 32, 32, torch.float32)
    qweight = module.pack_w4(q)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError):
        module.w4a16_matmul(x, qweight, scales, zeros, 24)
    with pytest.raises(ValueError):
        module.w4a16_matmul(x, qweight, scales.half(), zeros, 32)
    with pytest.raises(ValueError):
        module.w4a16_matmul(torch.randn(2, 72), qweight, scales, zeros, 32)
