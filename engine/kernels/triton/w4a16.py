"""Products with 4-bit weights and 16-bit (or float32) activations, as AWQ and GPTQ checkpoints
store them ("w4a16"): the weight stays packed in memory and is unpacked tile by tile inside the
GEMM, so a decode step reads a quarter of the bytes a float16 weight would take.

Layout. `qweight` int32 [K // 8, N] holds 8 consecutive rows of a column per int32: row
8 * i + j of column n in bits 4 * j .. 4 * j + 3 of qweight[i, n] (lowest nibble first), unsigned
0..15. Rows come in groups of `group_size`; group g of column n has a scale scales[g, n] (x's
dtype) and a zero point zeros[g, n] (uint8, 0..15): w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n].

Kernel. One program per (BLOCK_M, BLOCK_N) tile of the output, looping over K in BLOCK_K steps
with BLOCK_K dividing the group size, so that every K tile lies in one group. Each step loads
the packed tile with one row per unpacked row (row k reads int32 row k // 8: the eight rows that
share an int32 hit the cache), shifts the nibble down and masks it, subtracts the group's zeros
and takes tl.dot of x's tile with these small integers (exact in float16 and bfloat16). The
group's scales multiply that float32 partial product per column before it joins the float32
accumulator: the weight itself is never rounded, and the result is rounded once, to x's dtype.

Split over K. A row's sum over K is cut into chunks of whole groups, each summed from zero in
BLOCK_K steps, and the chunks' sums are added in order, from zero: the same bits whether one
program adds them as it goes or, at decode sizes, one program per chunk writes its sum to a
float32 workspace [chunks, M, N] and a second launch adds them up in that order (no atomics).
At decode M the output has too few column tiles (N / BLOCK_N) to fill the GPU while each streams
all of K; a program per chunk multiplies them. The number of chunks depends on N, K and the
GPU's multiprocessor count, never on M: enough programs for each multiprocessor, each chunk at
least a few K steps long.

Block sizes come from M in Python (no autotuning, so a launch is deterministic): decode steps
(M <= 16) take BLOCK_M 16 with narrow column tiles and a program per chunk, for enough programs
to cover the GPU while they stream the weight; larger M take taller tiles, which reuse each
unpacked weight tile across more rows, and add the chunks in one program. BLOCK_K and the
chunks, which set the order in which a row's products are summed, are the same for every M up
to 64, so a row's result has the same bits alone or in any batch of up to 64 rows (on one GPU:
the chunks follow its multiprocessor count); above that the K step halves (twice as fast there)
and a row's last bits may differ.

`dequantize_w4` is the same arithmetic in PyTorch (the tests' reference); `pack_w4`
packs unsigned 4-bit values into the int32 layout.
"""

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.int4_layout import unpack_int4


@triton.jit
def _w4a16_kernel(x_ptr, qweight_ptr, scales_ptr, zeros_ptr, out_ptr, M, N, K, CHUNK_K, SPAN_K, x_stride,
                  out_stride, split_stride, GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_stride
    ks = tl.arange(0, BLOCK_K)
    shifts = (ks % 8) * 4  # row k's nibble in its int32
    # This program's span of K: all of it, or one chunk (its sum to the workspace's slice)
    k_begin = tl.program_id(2) * SPAN_K
    k_end = tl.minimum(k_begin + SPAN_K, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for c0 in range(k_begin, k_end, CHUNK_K):
        chunk = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(c0, tl.minimum(c0 + CHUNK_K, K), BLOCK_K):  # chunks are whole groups
            a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
            packed = tl.load(qweight_ptr + ((k0 + ks) // 8)[:, None] * N + cols[None, :], mask=col_ok[None, :],
                             other=0)
            q = (packed >> shifts[:, None]) & 0xF
            group = k0 // GROUP_SIZE
            zeros = tl.load(zeros_ptr + group * N + cols, mask=col_ok, other=0).to(tl.int32)
            scales = tl.load(scales_ptr + group * N + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = (q - zeros[None, :]).to(a.dtype)  # -15..15: exact in every float type
            chunk += tl.dot(a, w, input_precision=PRECISION) * scales[None, :]
        acc += chunk
    out = out_ptr + tl.program_id(2) * split_stride + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_chunks_kernel(parts_ptr, out_ptr, size, chunks, BLOCK: tl.constexpr):
    """out (size elements) = the chunks' sums parts [chunks, size] added in order, from zero, as
    one program adds them in `_w4a16_kernel`; rounded once to out's dtype."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < size
    acc = tl.zeros([BLOCK], tl.float32)
    for chunk in range(0, chunks):
        acc += tl.load(parts_ptr + chunk * size + offsets, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=ok)


DECODE_ROWS = 16  # M up to this runs a program per chunk
DECODE_BLOCK_N = 32
PROGRAMS_PER_MULTIPROCESSOR = 4  # what the chunks aim for at decode, to keep the weight streaming
MIN_CHUNK_STEPS = 4  # K steps per chunk at least: a program's set-up and its partial sum's write stay small
SUM_BLOCK = 1024
H100_MULTIPROCESSORS = 132  # what the interpreter (no GPU) takes: its launches are an H100's


def _blocks(m: int, group_size: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a product with m rows (measured on an H100)."""
    if m <= DECODE_ROWS:  # decode: bound by reading the weight; narrow column tiles make enough programs
        return 16, DECODE_BLOCK_N, min(group_size, 128), 4
    if m <= 64:
        return 64, DECODE_BLOCK_N, min(group_size, 128), 4
    return 128, 64, min(group_size, 64), 4  # a K step of 128 here runs at half the speed


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return H100_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_chunks(n: int, k: int, group_size: int, device: torch.device) -> int:
    """How many chunks (of whole groups; the last may be shorter) a row's sum over K is cut
    into: doubled until the decode launch (DECODE_BLOCK_N-wide column tiles times chunks) has
    PROGRAMS_PER_MULTIPROCESSOR programs per multiprocessor of `device`, while each chunk keeps
    MIN_CHUNK_STEPS K steps. Not a function of M, which would change a row's bits with its batch."""
    groups = k // group_size
    steps_per_group = group_size // min(group_size, 128)
    tiles = triton.cdiv(n, DECODE_BLOCK_N)
    target = PROGRAMS_PER_MULTIPROCESSOR * _multiprocessors(device)
    chunks = 1
    while tiles * chunks < target and groups // (2 * chunks) * steps_per_group >= MIN_CHUNK_STEPS:
        chunks *= 2
    return triton.cdiv(groups, triton.cdiv(groups, chunks))  # chunks of equal whole groups, the last shorter


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, chunks: int | None = None) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) times the 4-bit weight [K, N] that `qweight`
    (int32 [K // 8, N]), `scales` ([K // group_size, N], x's dtype) and `zeros` (uint8, same
    shape) describe (see the module docstring); returns [M, N] in x's dtype, summed in float32
    and rounded once. The weight is unpacked inside the kernel and never materialised, which is
    the point: a decode step's product reads the packed weight, a quarter of a float16 one.
    `chunks` cuts the sum over K into that many chunks of whole groups (at most K / group_size;
    None: `split_chunks`'s choice for this GPU)."""
    m, k = x.shape
    n = qweight.shape[1]
    if qweight.dtype != torch.int32 or qweight.shape[0] * 8 != k:
        raise ValueError(f"qweight must be int32 [{k // 8}, N], got {qweight.dtype} {tuple(qweight.shape)}")
    if group_size < 16 or group_size & (group_size - 1) or k % group_size:
        raise ValueError(f"group_size {group_size} must be a power of two >= 16 dividing K = {k}")
    groups = (k // group_size, n)
    if tuple(scales.shape) != groups or scales.dtype != x.dtype or tuple(zeros.shape) != groups \
            or zeros.dtype != torch.uint8:
        raise ValueError(f"scales ({x.dtype}) and zeros (uint8) must be {groups}, got {scales.dtype} "
                         f"{tuple(scales.shape)} and {zeros.dtype} {tuple(zeros.shape)}")
    if chunks is not None and not 1 <= chunks <= groups[0]:
        raise ValueError(f"chunks {chunks} must be 1 to K / group_size = {groups[0]}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    x = x.contiguous()
    chunk_k = triton.cdiv(groups[0], chunks or split_chunks(n, k, group_size, x.device)) * group_size
    spread = m <= DECODE_ROWS and chunk_k < k  # a program per chunk
    target = torch.empty(triton.cdiv(k, chunk_k), m, n, dtype=torch.float32, device=x.device) if spread else out
    block_m, block_n, block_k, num_warps = _blocks(m, group_size)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), target.shape[0] if spread else 1)
    _w4a16_kernel[grid](x, qweight.contiguous(), scales.contiguous(), zeros.contiguous(), target, m, n, k, chunk_k,
                        chunk_k if spread else k, x.stride(0), n, m * n, GROUP_SIZE=group_size, BLOCK_M=block_m,
                        BLOCK_N=block_n, BLOCK_K=block_k, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                        num_warps=num_warps)
    if spread:
        _sum_chunks_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](target, out, m * n, target.shape[0], BLOCK=SUM_BLOCK)
    return out


_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # row 8 * i + j at bits 4 * j ..


def unpack_w4(qweight: torch.Tensor) -> torch.Tensor:
    """The unsigned 4-bit values [K, N] (int32, 0..15) that int32 `qweight` [K // 8, N] packs
    (GPTQ's packing, which the checkpoint reader unpacks too)."""
    return unpack_int4(qweight, 0)


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """Packs q [K, N] of unsigned 4-bit values (any integer dtype, 0..15; K a multiple of 8)
    into int32 [K // 8, N]: rows 8 * i .. 8 * i + 7 of a column into one int32, lowest nibble
    first. The inverse of `unpack_w4`."""
    k, n = q.shape
    if k % 8:
        raise ValueError(f"K = {k} is not a multiple of 8")
    shifts = _NIBBLE_SHIFTS.to(device=q.device, dtype=torch.int64)
    packed = ((q.to(torch.int64) & 0xF).reshape(k // 8, 8, n) << shifts[None, :, None]).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # bit 31 is the sign


def dequantize_w4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weight [K, N] in float32 that `qweight`, `scales` and `zeros` describe (layout in the
    module docstring): (q - zeros) * scales per group of `group_size` rows, exact in float32.
    The reference the kernel's tests check it against."""
    q = unpack_w4(qweight)
    k, n = q.shape
    q = q.reshape(k // group_size, group_size, n)
    w = (q - zeros.to(torch.int32)[:, None, :]).float() * scales.float()[:, None, :]
    return w.reshape(k, n)
