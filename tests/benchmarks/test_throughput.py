"""benchmarks/throughput.py and its workers: what a worker ran (its weights' and its KV cache's
element types) reaches the roofline, which reads the cache at the cache's own size."""

from benchmarks import roofline as rl
from benchmarks.throughput import Measurement, print_roofline
from benchmarks.throughput_workers import WorkerOptions, WorkerResult, run_ours
from benchmarks.workloads import Workload

WORKLOAD = Workload("t", "two prompts", [[3, 4, 5, 6] * 5, [7, 8] * 6], [8, 6], warmup=[[5, 6, 7]])


def test_our_worker_reports_the_cache_it_ran_and_the_best_round_keeps_it(tiny_models):
    folder = str(tiny_models["llama"])
    opts = WorkerOptions(folder, folder, threads=1, dtype="float32", hf_dtype="float32", hf_batch_size=1,
                         kv_cache_bytes=2**24, kv_cache_dtype="bfloat16")
    timed = run_ours(WORKLOAD, opts)
    assert (timed.dtype, timed.kv_cache_dtype) == ("float32", "bfloat16") and "bfloat16 KV" in timed.detail
    results = [WorkerResult("ours", "t", seconds, 32, 14, 1, timed.dtype, timed.detail, timed.kv_cache_dtype)
               for seconds in (2.0, 1.0)]
    best = Measurement.best_of("ours", results, [])
    assert (best.seconds, best.kv_cache_dtype) == (1.0, "bfloat16")


def test_the_roofline_reads_our_cache_at_its_element_size(capsys):
    shape = rl.ModelShape(matmul_params=1_000, layers=20, heads=8, kv_heads=8, head_dim=128)
    rates = rl.MachineRates({"float32": 1e18}, 1e6)  # memory-bound, the cache most of it
    ours = Measurement("ours", "", "float32", 1.0, 14.0, 46.0, 1, kv_cache_dtype="bfloat16")
    print_roofline(WORKLOAD, ours, shape, rates)
    bound = rl.roofline(shape, rates, [20, 12], [8, 6], 0, 4, 256, kv_element_size=2)
    assert f"memory {bound.memory_s:.2f} s" in capsys.readouterr().out
    assert rl.roofline(shape, rates, [20, 12], [8, 6], 0, 4, 256).memory_s > bound.memory_s


def test_element_sizes_of_the_engines_dtype_names():
    assert [rl.element_size(name) for name in ("float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3")] == \
        [4, 2, 2, 1, 1, 1]
