"""One projection's product at each batch size, in bfloat16 against the quantized products:
where FP8 and 4-bit weights beat bfloat16 on a GPU, and what the fused FP8 row quantizing and
the 4-bit kernel's split over K are worth.

Products, for x [M, K] times a random weight [K, N] of a Llama-3.1-8B projection (q/k/v and
gate/up fused, as the engine runs them):
- bf16: `F.linear` (cuBLAS);
- fp8: `fp8_linear` with the rows quantized by the fused Triton kernel, as the engine runs it;
  fp8-torch: the same with PyTorch's operators quantizing the rows;
- w4a16: the 4-bit kernel (groups of 128), split over K as it chooses; w4a16-one-chunk: without.
Each is timed replaying a CUDA graph of `--calls` calls, as decode steps run (the GPU's time per
call), and called eagerly (what a step pays without graphs, launches included). Every product is
also checked against its own weights dequantized to float32 (the largest error over the largest
|reference|), so a fast wrong kernel shows.

    .venv/bin/python benchmarks/quantized_products.py                      # a GPU: every 8B shape
    .venv/bin/python benchmarks/quantized_products.py --shapes o,down --batches 1,16,256
    .venv/bin/python benchmarks/quantized_products.py --dry-run            # a CPU: tiny, interpreted

`--dry-run` runs the same code on the CPU at a tiny shape, the Triton kernels in their
interpreter, in float16 (which it computes exactly): the timings mean nothing there; the checks
do.
"""

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
DRY_RUN_SHAPE = (256, 96)
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
DRY_RUN_BATCHES = [1, 16, 40, 80]
GROUP_SIZE = 128
DRY_RUN_GROUP_SIZE = 32


@dataclass(frozen=True)
class Product:
    """One way to compute x @ W: `run(x)`, and `reference(x)`, the float32 product with the
    weight and activations as this product rounds them."""

    name: str
    run: Callable[[torch.Tensor], torch.Tensor]
    reference: Callable[[torch.Tensor], torch.Tensor]
    weight_bytes: int


@dataclass(frozen=True)
class Timing:
    product: str
    shape: str
    m: int
    graph_us: float | None
    eager_us: float
    weight_gbs: float | None
    error: float


def products(k: int, n: int, group_size: int, dtype: torch.dtype, device: torch.device) -> list[Product]:
    """The products of one random [K, N] weight, each in its own form."""
    from engine.kernels.triton.fp8_quant import quantize_fp8_rows as fused_rows
    from engine.kernels.triton.w4a16 import dequantize_w4, pack_w4, w4a16_matmul
    from engine.quantization.fp8 import fp8_linear, quantize_fp8_rows, quantize_fp8_weight

    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, k, generator=generator) * k**-0.5).to(dtype).to(device)
    q, scale = quantize_fp8_weight(weight)
    fp8_weight = q.float() * scale.t()

    def fp8_reference(x: torch.Tensor) -> torch.Tensor:
        rows, x_scale = quantize_fp8_rows(x)
        return (rows.float() * x_scale) @ fp8_weight.t()

    ints = torch.randint(0, 16, (k, n), generator=generator)
    scales = (torch.rand(k // group_size, n, generator=generator) * 0.004 + 0.001).to(dtype).to(device)
    zeros = torch.randint(0, 16, (k // group_size, n), generator=generator).to(torch.uint8).to(device)
    qweight = pack_w4(ints).to(device)
    w4 = dequantize_w4(qweight, scales, zeros, group_size)
    w4_bytes = qweight.numel() * 4 + scales.numel() * scales.element_size() + zeros.numel()
    return [
        Product("bf16" if dtype == torch.bfloat16 else str(dtype).removeprefix("torch."),
                lambda x: torch.nn.functional.linear(x, weight), lambda x: x.float() @ weight.float().t(),
                weight.numel() * weight.element_size()),
        Product("fp8", lambda x: fp8_linear(x, q, scale, quantize_rows=fused_rows), fp8_reference, q.numel()),
        Product("fp8-torch", lambda x: fp8_linear(x, q, scale), fp8_reference, q.numel()),
        Product("w4a16", lambda x: w4a16_matmul(x, qweight, scales, zeros, group_size), lambda x: x.float() @ w4,
                w4_bytes),
        Product("w4a16-one-chunk", lambda x: w4a16_matmul(x, qweight, scales, zeros, group_size, chunks=1),
                lambda x: x.float() @ w4, w4_bytes),
    ]


def eager_seconds(run: Callable[[], torch.Tensor], calls: int, device: torch.device) -> float:
    """Seconds per call, called `calls` times in a row (best of three)."""
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        started = time.perf_counter()
        for _ in range(calls):
            run()
        synchronize(device)
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def graph_seconds(run: Callable[[], torch.Tensor], calls: int) -> float:
    """GPU seconds per call, replaying a CUDA graph of `calls` calls (median of five replays)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up (Triton compiles, cuBLAS picks) off the capture
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(product: Product, shape: str, m: int, k: int, calls: int, device: torch.device,
            dtype: torch.dtype) -> Timing:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(device)
    out = product.run(x)
    expected = product.reference(x)
    error = ((out.float() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()
    graph = graph_seconds(lambda: product.run(x), calls) if device.type == "cuda" else None
    eager = eager_seconds(lambda: product.run(x), calls, device)
    return Timing(product.name, shape, m, None if graph is None else graph * 1e6, eager * 1e6,
                  None if graph is None else product.weight_bytes / graph / 1e9, error)


def report(timings: list[Timing]) -> str:
    """A table per shape: each product's time per call at each M."""
    lines = [f"{'shape':8} {'M':>4} {'product':16} {'graph us':>9} {'eager us':>9} {'weight GB/s':>11} "
             f"{'rel. error':>10}"]
    for t in timings:
        graph = "-" if t.graph_us is None else f"{t.graph_us:.1f}"
        bandwidth = "-" if t.weight_gbs is None else f"{t.weight_gbs:.0f}"
        lines.append(f"{t.shape:8} {t.m:>4} {t.product:16} {graph:>9} {t.eager_us:>9.1f} {bandwidth:>11} "
                     f"{t.error:>10.2e}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--batches", default=None, help="rows M, comma-separated (default: "
                        f"{','.join(map(str, BATCHES))}; dry run: {','.join(map(str, DRY_RUN_BATCHES))})")
    parser.add_argument("--calls", type=int, default=20, help="calls per timing")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny, the Triton kernels interpreted")
    parser.add_argument("--max-error", type=float, default=0.02,
                        help="exit 1 if a product's largest error over its largest |reference| exceeds this")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton
        device, dtype, group_size, calls = torch.device("cpu"), torch.float16, DRY_RUN_GROUP_SIZE, 1
        shapes = {"tiny": DRY_RUN_SHAPE}
        batches = DRY_RUN_BATCHES
    else:
        if not torch.cuda.is_available():
            sys.exit("no GPU: run with --dry-run to check this benchmark on a CPU")
        device, dtype, group_size, calls = torch.device("cuda"), torch.bfloat16, GROUP_SIZE, args.calls
        shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
        batches = BATCHES
    if args.batches:
        batches = [int(m) for m in args.batches.split(",")]
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU (dry run)'}; "
          f"{dtype}; groups of {group_size}")
    timings = []
    for shape, (k, n) in shapes.items():
        built = products(k, n, group_size, dtype, device)
        for m in batches:
            timings += [measure(product, shape, m, k, calls, device, dtype) for product in built]
        del built
    print(report(timings))
    worst = max(timings, key=lambda t: t.error)
    if worst.error > args.max_error:
        sys.exit(f"{worst.product} at {worst.shape}, M={worst.m}: error {worst.error:.2e} > {args.max_error}")


if __name__ == "__main__":
    main()
