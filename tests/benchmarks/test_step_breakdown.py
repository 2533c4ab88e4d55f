"""benchmarks/step_breakdown.py: its timer charges each call to its innermost timed part, and a
run on a tiny model wraps the engine's methods it names (a renamed one would fail here, not on
the machine a breakdown is taken on), with parts that add up to the wall time."""

import time

from benchmarks import roofline as rl
from benchmarks.step_breakdown import (
    DECODE_ATTENTION, HOST, OUTSIDE, PARTS, PREFILL_ATTENTION, PRODUCTS, SAMPLING, PartTimes, measure, report,
)
from benchmarks.workloads import Workload
from engine.kernels import cpu_build
from engine.model_loader import cpu_decoder_stack


def test_a_call_is_charged_its_time_less_its_timed_calls():
    times = PartTimes()
    inner = times.timed(lambda: time.sleep(0.02), "inner")
    by_argument = times.timed(lambda part: time.sleep(0.01), lambda part: part)

    def outer_body():
        time.sleep(0.03)
        inner()
        by_argument("named by its argument")

    times.timed(outer_body, "outer")()
    assert times.calls == {"outer": 1, "inner": 1, "named by its argument": 1}
    assert 0.03 <= times.seconds["outer"] < 0.058  # with its timed calls' 0.03 s it would be at least 0.06
    assert times.seconds["inner"] >= 0.02 and times.seconds["named by its argument"] >= 0.01


def test_what_a_call_times_inside_itself_is_charged_apart():
    """A compiled decoder stack's products and attention: charged to their parts, not to the
    part of the call they ran in."""
    times = PartTimes()

    def stack():
        time.sleep(0.03)
        times.charge("products inside", 0.02, 3)

    times.timed(stack, "rest")()
    assert times.calls == {"rest": 1, "products inside": 3}
    assert times.seconds["products inside"] == 0.02 and 0.01 <= times.seconds["rest"] < 0.028


def test_a_run_on_a_tiny_model_times_every_part_and_adds_up(make_llm, tiny_models, capsys):
    llm = make_llm("llama", dtype="float32", max_num_batched_tokens=64)
    prompts = [[(7 * i + j) % 200 + 3 for j in range(length)] for i, length in enumerate([90, 12, 40])]
    workload = Workload("t", "three prompts, one longer than a step", prompts, [6, 9, 4], warmup=[[5, 6, 7]])
    run = measure(llm, workload)
    if cpu_build.load() is not None:  # the stack's own timing is charged too
        assert cpu_decoder_stack._plans[llm.llm_engine.model_runner.workers.local.model.model].stack is not None
    assert set(run.parts) == set(PARTS)
    assert all(run.parts[part] > 0 for part in (PRODUCTS, PREFILL_ATTENTION, DECODE_ATTENTION, SAMPLING, HOST))
    assert abs(sum(run.parts.values()) - run.seconds) < 1e-9 and 0 <= run.parts[OUTSIDE] < run.seconds
    report(run, rl.model_shape(tiny_models["llama"]), rl.MachineRates({"float32": 1e11}, 1e10), 3.6)
    printed = capsys.readouterr().out
    assert "not a matrix product" in printed and "of that CPU's roofline" in printed


def test_the_cache_is_read_at_its_own_element_size_not_the_weights():
    """A float32 model over a bfloat16 cache (an AVX2 CPU's default) reads two bytes an element
    of its cache: its roofline's memory time is the float32 weights plus that cache."""
    shape = rl.ModelShape(matmul_params=1_000_000, layers=2, heads=4, kv_heads=2, head_dim=8)
    rates = rl.MachineRates({"float32": 1e18}, 1e9)  # memory-bound
    prompts, outputs = [10, 20], [5, 3]
    weights_s = max(outputs) * shape.matmul_params * 4 / rates.bandwidth
    cache_bytes = rl.decode_kv_bytes(shape, prompts, outputs, 2)
    assert cache_bytes * 2 == rl.decode_kv_bytes(shape, prompts, outputs, 4)
    narrow = rl.roofline(shape, rates, prompts, outputs, 0, 4, 256, kv_element_size=2)
    assert narrow.bound == "memory" and abs(narrow.memory_s - (weights_s + cache_bytes / rates.bandwidth)) < 1e-12
    assert rl.roofline(shape, rates, prompts, outputs, 0, 4, 256).memory_s > narrow.memory_s


def test_a_run_reports_its_caches_read_rate_at_the_caches_element_size(make_llm, tiny_models, capsys):
    llm = make_llm("llama", dtype="float32", kv_cache_dtype="bfloat16", max_num_batched_tokens=64)
    workload = Workload("t", "two prompts", [[3, 4, 5, 6] * 5, [7, 8] * 6], [8, 6], warmup=[[5, 6, 7]])
    run = measure(llm, workload)
    assert (run.dtype, run.kv_cache_dtype) == ("float32", "bfloat16")
    shape = rl.model_shape(tiny_models["llama"])
    run.parts[DECODE_ATTENTION] = rl.decode_kv_bytes(shape, [20, 12], [8, 6], 2) / 10e9  # 10 GB/s at two bytes
    report(run, shape, rl.MachineRates({"float32": 1e11}, 1e10), 3.6)
    assert "at most 10.0 GB/s of cache read" in capsys.readouterr().out
