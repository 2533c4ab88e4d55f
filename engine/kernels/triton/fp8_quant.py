"""Activation rows quantized to FP8 (e4m3) in one launch, for the FP8 products
(`engine.quantization.fp8`): each row's largest magnitude, its scale (that, at least 1e-12,
times float32's 1 / 448) and the row divided by the scale, clamped to +-448 and rounded to the
nearest e4m3 value, ties to even. These are the bits of `engine.quantization.fp8.quantize_fp8_rows`
(PyTorch's seven operators), scales included: the input widens to float32 exactly, and the
division is IEEE's (`div_rn`: Triton's `/` is an approximation on a GPU).

The rounding to e4m3 is done in float32 (`round_to_e4m3`) before the conversion, which then
only re-encodes. On a GPU the conversion would round the same way itself, but Triton's
interpreter, where the tests run, rounds ties away from zero and drops the carry to the next
power of two (124.7 -> 64), so without it the tests could not check the values a GPU writes.
"""

import torch
import triton
import triton.language as tl

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Elements of a row per step: two passes over it (its largest magnitude, then the values), the
# second reading it again from the cache.
BLOCK_K = 1024


@triton.jit
def round_to_e4m3(x):
    """x (float32, |x| <= 448) rounded to the nearest e4m3 value, ties to even, as float32
    (the sign kept, -0 included).

    e4m3 keeps 3 mantissa bits: at |x| in [2^e, 2^(e+1)) its step is 2^(e-3), and below 2^-6
    (subnormal) 2^-9. Adding 2^(e+20), with e at least -6, leaves float32 that same step, so the
    sum rounds |x| onto e4m3's grid, ties to even, carry included; subtracting it back is exact."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    shift = ((tl.maximum(magnitude >> 23, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
    rounded = (magnitude.to(tl.float32, bitcast=True) + shift) - shift
    return (rounded.to(tl.int32, bitcast=True) | (bits ^ magnitude)).to(tl.float32, bitcast=True)


@triton.jit
def _max_keeping_nan(a, b):
    """The larger of a and b, NaN where either is (as PyTorch's amax and clamp): a row holding
    a NaN gets a NaN scale, so its products are NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, x_stride, q_stride, BLOCK_K: tl.constexpr,
                          FP8_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    q_row = q_ptr + row * q_stride
    ks = tl.arange(0, BLOCK_K)
    largest = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
        largest = _max_keeping_nan(largest, tl.abs(x))
    scale = _max_keeping_nan(tl.reduce(largest, 0, _max_keeping_nan), 1e-12) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + ks < K
        x = tl.load(x_row + k0 + ks, mask=ok, other=0.0).to(tl.float32)
        q = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX))
        tl.store(q_row + k0 + ks, q.to(q_ptr.dtype.element_ty), mask=ok)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] (float16, bfloat16 or float32) -> (q [rows, in] e4m3, scale [rows, 1]
    float32), one scale per row: `engine.quantization.fp8.quantize_fp8_rows` in one launch."""
    rows, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0),
                                       BLOCK_K=min(BLOCK_K, triton.next_power_of_2(k)), FP8_MAX=FP8_MAX)
    return q, scale
