"""Choices by CPU capability: dtype, matrix-product kernel, threads.

Each path is tested on every machine by mocking the detection; the test that runs the
native bfloat16 kernels for real says so and runs only where the CPU has them.
"""

import json
import logging
import shutil

import pytest
import torch

import engine.hardware as hardware
import engine.layers.linear as linear
from engine import LLM, SamplingParams
from engine.hardware import CpuInfo, available_cpus, cpu_dtype, default_num_threads, detect_cpu

AVX2_EPYC = CpuInfo("AMD EPYC", "x86_64", "AVX2", frozenset({"avx", "avx2", "fma", "f16c"}))
SAPPHIRE_RAPIDS = CpuInfo(
    "Intel Xeon Platinum 8480", "x86_64", "AVX512",
    frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16", "amx_tile"}),
)
# AVX512-BF16 flags without the AVX-512 subsets oneDNN's bfloat16 kernels need.
ODD_X86 = CpuInfo("odd", "x86_64", "AVX2", frozenset({"avx2", "avx512_bf16"}))
GRAVITON3 = CpuInfo("Neoverse-V1", "aarch64", "SVE256", frozenset({"asimd", "sve", "bf16"}))
GRAVITON2 = CpuInfo("Neoverse-N1", "aarch64", "DEFAULT", frozenset({"asimd"}))


@pytest.mark.parametrize("cpu, native", [(AVX2_EPYC, False), (SAPPHIRE_RAPIDS, True), (ODD_X86, False),
                                         (GRAVITON3, True), (GRAVITON2, False)])
def test_native_bf16_is_read_from_the_flags(cpu, native):
    assert cpu.native_bf16 is native
    assert ("no native bf16" in cpu.describe()) is not native


def test_auto_dtype_follows_the_cpu():
    assert cpu_dtype(None, torch.bfloat16, AVX2_EPYC) == torch.float32
    assert cpu_dtype(None, torch.float16, AVX2_EPYC) == torch.float32
    assert cpu_dtype(None, torch.bfloat16, SAPPHIRE_RAPIDS) == torch.bfloat16
    assert cpu_dtype(None, torch.float16, SAPPHIRE_RAPIDS) == torch.bfloat16
    assert cpu_dtype(None, torch.float32, SAPPHIRE_RAPIDS) == torch.float32  # a float32 checkpoint stays so


def test_explicit_bfloat16_without_native_support_warns_once_and_is_kept(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.hardware"):
        assert cpu_dtype(torch.bfloat16, torch.bfloat16, AVX2_EPYC) == torch.bfloat16
        assert cpu_dtype(torch.bfloat16, torch.bfloat16, SAPPHIRE_RAPIDS) == torch.bfloat16
    [record] = caplog.records
    assert "no native bfloat16" in record.getMessage() and "AMD EPYC" in record.getMessage()


def test_linear_kernel_by_capability(monkeypatch):
    cpu = torch.device("cpu")
    for info, bf16_kernel in ((AVX2_EPYC, "aten"), (SAPPHIRE_RAPIDS, "onednn")):
        monkeypatch.setattr(linear, "detect_cpu", lambda info=info: info)
        assert linear.linear_kernel(torch.float32, cpu) == "onednn"
        assert linear.linear_kernel(torch.bfloat16, cpu) == bf16_kernel
        assert linear.linear_kernel(torch.float16, cpu) == "aten"
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert linear.linear_kernel(torch.float32, cpu) == "aten"


def test_a_refused_prepack_falls_back_to_the_plain_product(monkeypatch, caplog):
    def refuse(weight, _):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(linear, "detect_cpu", lambda: SAPPHIRE_RAPIDS)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", refuse)
    layer = linear.Linear(16, 8, bias=False).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="engine.layers.linear"):
        layer.prepack()
    assert layer.packed_weight is None and "F.linear" in caplog.text
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))


@pytest.fixture(scope="module")
def bf16_checkpoint(tiny_models, tmp_path_factory):
    """The tiny Llama, declared a bfloat16 checkpoint as most published models are."""
    folder = tmp_path_factory.mktemp("bf16") / "llama"
    shutil.copytree(tiny_models["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    return folder


@pytest.mark.parametrize("cpu, expected", [(AVX2_EPYC, torch.float32), (SAPPHIRE_RAPIDS, torch.bfloat16)])
def test_engine_default_dtype_by_mocked_cpu(bf16_checkpoint, monkeypatch, cpu, expected):
    """`LLM()` on a bfloat16 checkpoint computes in float32 on a CPU without native
    bfloat16 and in bfloat16 with it (mocked here; the kernels stay those of the real CPU)."""
    monkeypatch.setattr("engine.config.detect_cpu", lambda: cpu)
    with LLM(str(bf16_checkpoint)) as llm:
        assert llm.llm_engine.model_config.dtype == expected
        out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_bfloat16_runs_on_any_cpu(tiny_models):
    """An explicit bfloat16 works on every CPU: oneDNN's kernels where it has native
    bfloat16, the plain (emulated) product elsewhere, never a crash."""
    with LLM(str(tiny_models["llama"]), dtype="bfloat16") as llm:
        linears = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, linear.Linear)]
        assert all((m.packed_weight is not None) == detect_cpu().native_bf16 for m in linears)
        out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4


def test_threads_default_to_the_usable_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_num_threads() == available_cpus() >= 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert default_num_threads() == available_cpus()


def test_cgroup_quota_caps_the_cores(monkeypatch):
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda _: set(range(8)))
    monkeypatch.setattr(hardware, "_cgroup_cpu_quota", lambda: 1.5)
    assert available_cpus() == 2
    monkeypatch.setattr(hardware, "_cgroup_cpu_quota", lambda: None)
    assert available_cpus() == 8


def test_engine_sets_the_threads(tiny_models):
    before = torch.get_num_threads()
    try:
        with LLM(str(tiny_models["llama"]), dtype="float32", num_threads=1):
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_freed_memory_is_kept_for_reuse_where_malloc_is_glibc(monkeypatch):
    if hardware._glibc() is None:
        pytest.skip("this process's malloc is not glibc's")
    assert hardware.keep_freed_memory() is True
    hardware.release_freed_memory()
    monkeypatch.setattr(hardware, "_glibc", lambda: None)
    assert hardware.keep_freed_memory() is False
    hardware.release_freed_memory()  # a no-op without glibc


class _FakeLibc:
    """Records mallopt calls, standing in for glibc."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 1


def test_long_lived_allocations_set_and_restore_the_mmap_threshold_only_on_glibc(monkeypatch):
    libc = _FakeLibc()
    monkeypatch.setattr(hardware, "_glibc", lambda: libc)
    monkeypatch.setattr(hardware, "_mmap_threshold", None)
    with hardware.long_lived_allocations(threshold=1 << 20):
        assert libc.calls == [(hardware._M_MMAP_THRESHOLD, 1 << 20)]
    # Back to glibc's starting threshold, or to the one keep_freed_memory set.
    assert libc.calls[-1] == (hardware._M_MMAP_THRESHOLD, hardware._GLIBC_MMAP_THRESHOLD)
    monkeypatch.setattr(hardware, "_mmap_threshold", hardware._KEPT_MMAP_THRESHOLD)
    with hardware.long_lived_allocations():
        pass
    assert libc.calls[-1] == (hardware._M_MMAP_THRESHOLD, hardware._KEPT_MMAP_THRESHOLD)
    # Where malloc is not glibc's it does nothing and still runs the block.
    monkeypatch.setattr(hardware, "_glibc", lambda: None)
    ran = []
    with hardware.long_lived_allocations():
        ran.append(True)
    assert ran == [True]
