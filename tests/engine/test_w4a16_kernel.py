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


def check_product(m, k, n, group_size, dtype, chunks=None):
    """The kernel's product against x @ the dequantized weight, in float32."""
    module = w4a16()
    q, scales, zeros = quantized_case(k, n, group_size, dtype, seed=m + k + n)
    qweight, scales, zeros = (t.to(DEVICE) for t in (module.pack_w4(q), scales, zeros))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = module.w4a16_matmul(x, qweight, scales, zeros, group_size, chunks)
    assert out.dtype == dtype and out.shape == (m, n)
    expected = x.float() @ module.dequantize_w4(qweight, scales, zeros, group_size)
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype))
    if dtype != torch.float32:  # rounded once, at the end: within half a unit in the last place
        half_ulp = expected.abs() * torch.finfo(dtype).eps / 2
        assert ((out.float() - expected).abs() <= half_ulp + 1e-5).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,n,group_size", [(64, 32, 32), (256, 48, 64), (256, 48, 32)])
@pytest.mark.parametrize("m", [1, 5, 40, 70])
def test_matmul_matches_the_dequantized_product(m, k, n, group_size, dtype):
    check_product(m, k, n, group_size, dtype)


class SumLaunches:
    """Stands in for the kernel that adds the chunks' sums, counting its launches."""

    def __init__(self, kernel):
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.kernel[grid]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunks", [2, 3, 8])
@pytest.mark.parametrize("m", [1, 16, 40, 70])
def test_a_sum_cut_into_chunks_matches_the_dequantized_product(m, chunks, dtype, monkeypatch):
    """K = 256 in 8 groups of 32, cut into 2, 3 (3, 3 and 2 groups) or 8 chunks: at decode
    sizes a program per chunk and a launch adding their sums, above them one program in turn."""
    module = w4a16()
    launches = SumLaunches(module._sum_chunks_kernel)
    monkeypatch.setattr(module, "_sum_chunks_kernel", launches)
    check_product(m, 256, 48, 32, dtype, chunks)
    assert launches.count == (m <= module.DECODE_ROWS)


@pytest.fixture
def row_independent_dots(monkeypatch):
    """Under the interpreter `tl.dot` is NumPy's matmul, whose float32 BLAS kernels may sum a row
    in another order when its block has another number of rows (OpenBLAS on an AVX2 Zen 3: a row
    alone came out other bits than the same row in a batch), where a GPU's products sum a row
    alone. What the test checks is the kernel's own order (its blocks, K steps and chunks), so
    there the interpreter's dot sums each block in float64 (exact products, a sum far below
    float32's rounding) and rounds it once to the accumulator's type."""
    if DEVICE.type == "cuda":
        return
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(builder, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype not in (np.float16, np.float32) or d.data.dtype != np.float32:
            return original(builder, a, b, d, input_precision, max_num_imprecise_acc)
        block = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64)).astype(np.float32)
        return interpreter.TensorHandle(block + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.mark.usefixtures("row_independent_dots")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group_size,chunks", [(128, None), (32, None), (32, 3)])
def test_a_row_does_not_depend_on_the_rest_of_the_batch(group_size, chunks, dtype):
    """Block sizes follow M, but a row's result is the same bits alone or in a batch of up to
    64 rows (the K step and the chunks, which order the sum, change only above that), whether
    its chunks are summed by a program each (up to 16 rows) or by one program in turn."""
    module = w4a16()
    k, n = 256, 48
    if (group_size, chunks) == (32, None):  # a shape the choice splits
        assert module.split_chunks(n, k, group_size, DEVICE) == 2
    q, scales, zeros = quantized_case(k, n, group_size, dtype)
    qweight, scales, zeros = (t.to(DEVICE) for t in (module.pack_w4(q), scales, zeros))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    batch = module.w4a16_matmul(x, qweight, scales, zeros, group_size, chunks)
    for rows in (1, 5, 16, 40):
        assert torch.equal(module.w4a16_matmul(x[:rows], qweight, scales, zeros, group_size, chunks), batch[:rows])


DECODE_SHAPES = {  # (K, N) of each projection at decode, q/k/v and gate/up fused
    "8B q/k/v": (4096, 6144), "8B o": (4096, 4096), "8B gate/up": (4096, 28672), "8B up alone": (4096, 14336),
    "8B down": (14336, 4096), "1B q/k/v": (2048, 3072), "1B o": (2048, 2048), "1B gate/up": (2048, 16384),
    "1B down": (8192, 2048),
}


@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_decode_shapes_get_enough_programs(shape):
    """Llama-3.1-8B's and Llama-3.2-1B's projections at decode, in groups of 128, as on an
    H100's 132 multiprocessors (what the interpreter takes): chunks of whole groups, enough
    for four programs per multiprocessor unless a chunk would fall under four K steps."""
    module = w4a16()
    k, n = DECODE_SHAPES[shape]
    group_size, multiprocessors = 128, 132
    chunks = module.split_chunks(n, k, group_size, torch.device("cpu"))
    chunk_groups = -(-(k // group_size) // chunks)
    assert -(-(k // group_size) // chunk_groups) == chunks  # no chunk left empty
    programs = -(-n // module.DECODE_BLOCK_N) * chunks
    assert chunk_groups >= module.MIN_CHUNK_STEPS
    assert programs >= module.PROGRAMS_PER_MULTIPROCESSOR * multiprocessors \
        or k // group_size // (2 * chunks) < module.MIN_CHUNK_STEPS


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
    with pytest.raises(ValueError):
        module.w4a16_matmul(x, qweight, scales, zeros, 32, chunks=3)  # two groups
