"""benchmarks/attention_kernels.py: its paged caches hold each sequence in blocks of its own,
ours and PyTorch's prefill agree on what they time (a wrong layout would not), and a run on tiny
shapes reports every cache dtype asked for; builds compared side by side take turns."""

from types import ModuleType

import pytest
import torch

from benchmarks.attention_kernels import (AttentionShape, block_tables, compare_builds, main, measure_decode,
                                          measure_prefill)
from engine.kernels import cpu_build

TINY = AttentionShape(layers=2, heads=4, kv_heads=2, head_dim=64, block_size=16)


def test_each_sequence_gets_its_own_blocks_from_a_pool_just_large_enough():
    lengths = [33, 16, 1]
    tables, slots = block_tables(lengths, 16, torch.Generator().manual_seed(0))
    used = [tables[0, :3], tables[1, :1], tables[2, :1]]
    assert slots == 5 * 16 and sorted(torch.cat(used).tolist()) == list(range(5))


def test_ours_and_pytorchs_prefill_compute_the_same_attention():
    for dtype, bound in (("bfloat16", 0.02), ("int8", 0.08)):
        result = measure_prefill(TINY, [40, 17], dtype, rounds=1)
        assert result.largest_difference < bound, (dtype, result.largest_difference)
        assert result.ours_s > 0 and result.sdpa_s > 0
        assert result.flops == 4 * 4 * 64 * (40 * 41 // 2 + 17 * 18 // 2)


def test_a_decode_step_reads_every_layers_keys_and_values():
    result = measure_decode(TINY, [20, 33], "int8", rounds=1)
    assert result.bytes == 2 * (2 * 2 * 64 + 2 * 2 * 4) * 53  # layers x (keys and values + their scales) x tokens
    assert result.dram_s > 0 and result.hot_s > 0


def test_a_run_reports_each_cache_dtype(capsys):
    main(["--layers", "2", "--seqs", "3", "--keys", "20-40", "--prefill-lengths", "24,9", "--rounds", "1",
          "--kv-cache-dtypes", "bfloat16,float32", "--threads", str(torch.get_num_threads())])
    printed = capsys.readouterr().out
    for dtype in ("bfloat16", "float32"):
        assert f"decode, {dtype} cache" in printed and f"prefill, {dtype} cache" in printed
    assert "of the copy bandwidth" in printed and "PyTorch SDPA" in printed


def test_each_case_runs_through_each_build_in_turn_round_after_round():
    builds = {"before": ModuleType("before"), "after": ModuleType("after")}
    called = []
    best = compare_builds(builds, {"step": lambda: called.append(cpu_build.load().__name__)}, rounds=2)
    assert called == ["before", "after"] * 3  # a warm-up, then two rounds
    assert set(best["step"]) == {"before", "after"} and all(0 < s < 1 for s in best["step"].values())


def test_a_build_from_another_checkout_is_compared_with_this_one(capsys):
    this = cpu_build.load()
    if this is None:
        pytest.skip("the CPU kernels did not build here")
    main(["--layers", "2", "--seqs", "3", "--keys", "20-40", "--prefill-lengths", "24,9", "--rounds", "1",
          "--kv-cache-dtypes", "bfloat16", "--threads", str(torch.get_num_threads()),
          "--builds", f"other={this.__file__},this=this"])
    rows = {line[:34].strip(): line[34:].split() for line in capsys.readouterr().out.splitlines()}
    for case in ("decode in DRAM, bfloat16 cache", "prefill, bfloat16 cache"):
        other, this_ms, ratio = (float(x) for x in rows[case])
        assert other > 0 and this_ms > 0 and ratio == pytest.approx(this_ms / other, rel=0.02)
