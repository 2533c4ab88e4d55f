"""Choices by CPU capability: dtype, matrix-product kernel, threads.

Each path is tested on every machine by mocking the detection, in the process
(`CpuInfo`s) or for a whole engine through `DAGSTER_LLM_CPU_KIND`; `make test-cpu-kinds`
runs this module and the other `cpu_kinds` tests as each kind of CPU this machine can
stand in for.
"""

import json
import logging
import os
import platform
import shutil
import subprocess
import sys

import pytest
import torch

from engine import LLM, SamplingParams
import engine.hardware as hardware
from engine.hardware import CPU_KIND_ENV, CPU_KINDS, CpuInfo, available_cpus, cpu_dtype, default_num_threads, detect_cpu
import engine.layers.linear as linear
from tests.cpu_kinds import own_kind, stand_ins

pytestmark = pytest.mark.cpu_kinds

AVX2, AMX = CPU_KINDS["avx2"].info(), CPU_KINDS["amx"].info()
NATIVE_BF16 = {"avx2": False, "avx512": False, "avx512_bf16": True, "amx": True}
ONEDNN_BF16 = {"avx2": False, "avx512": True, "avx512_bf16": True, "amx": True}  # emulated on plain AVX-512
# AVX512-BF16 flags without the AVX-512 subsets oneDNN's bfloat16 kernels need.
ODD_X86 = CpuInfo("odd", "x86_64", "AVX2", frozenset({"avx2", "avx512_bf16"}))
GRAVITON3 = CpuInfo("Neoverse-V1", "aarch64", "SVE256", frozenset({"asimd", "sve", "bf16"}))
GRAVITON2 = CpuInfo("Neoverse-N1", "aarch64", "DEFAULT", frozenset({"asimd"}))


@pytest.fixture
def cpu_kind(monkeypatch):
    """Sets `DAGSTER_LLM_CPU_KIND` for one test, as `tests/cpu_kinds.py` does for a run."""
    def set_kind(name: str) -> None:
        monkeypatch.setenv(CPU_KIND_ENV, name)
        detect_cpu.cache_clear()

    yield set_kind
    detect_cpu.cache_clear()  # read again, from the environment as it was, by the next caller


@pytest.mark.parametrize("cpu, native, onednn", [
    *((CPU_KINDS[name].info(), NATIVE_BF16[name], ONEDNN_BF16[name]) for name in CPU_KINDS),
    (ODD_X86, False, False), (GRAVITON3, True, True), (GRAVITON2, False, False)])
def test_bf16_support_is_read_from_the_flags(cpu, native, onednn):
    assert cpu.native_bf16 is native and cpu.onednn_bf16 is onednn
    assert ("no native bf16" in cpu.describe()) is not native


@pytest.mark.parametrize("kind", CPU_KINDS)
def test_auto_dtype_follows_the_cpu(kind, caplog):
    """bfloat16 where it is native, a float32 checkpoint's too (with a line saying so);
    float32 elsewhere; an explicit float32 is kept."""
    cpu = CPU_KINDS[kind].info()
    auto = torch.bfloat16 if NATIVE_BF16[kind] else torch.float32
    assert cpu_dtype(None, torch.bfloat16, cpu) == auto
    assert cpu_dtype(None, torch.float16, cpu) == auto
    with caplog.at_level(logging.INFO, logger="engine.hardware"):
        assert cpu_dtype(None, torch.float32, cpu) == auto
    assert ("float32 checkpoint computes in bfloat16" in caplog.text) is NATIVE_BF16[kind]
    assert ("dtype='float32' keeps float32" in caplog.text) is NATIVE_BF16[kind]
    assert cpu_dtype(torch.float32, torch.float32, cpu) == torch.float32


def test_explicit_bfloat16_without_native_support_warns_once_and_is_kept(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.hardware"):
        assert cpu_dtype(torch.bfloat16, torch.bfloat16, AVX2) == torch.bfloat16
        assert cpu_dtype(torch.bfloat16, torch.bfloat16, AMX) == torch.bfloat16
    [record] = caplog.records
    assert "no native bfloat16" in record.getMessage() and "AMD EPYC" in record.getMessage()


@pytest.mark.parametrize("cap, amx", [(None, True), ("AVX512_CORE_AMX", True), ("avx512_core_amx_fp16", True),
                                      ("ALL", True), ("AVX512_CORE_BF16", False), ("AVX2", False)])
def test_amx_products_follow_the_cpu_the_mode_and_onednns_cap(onednn_uncapped, monkeypatch, cap, amx):
    if cap is not None:
        monkeypatch.setenv(hardware.ONEDNN_ISA_ENV, cap)
    assert hardware.amx_products(AMX, batch_invariant=False) is amx
    assert hardware.amx_products(AMX, batch_invariant=True) is False
    for kind in ("avx2", "avx512", "avx512_bf16"):
        assert hardware.amx_products(CPU_KINDS[kind].info(), batch_invariant=False) is False


def test_onednn_is_kept_off_amx_only_on_an_amx_cpu_and_only_when_unset(onednn_uncapped, monkeypatch):
    assert hardware.keep_onednn_off_amx(CPU_KINDS["avx512_bf16"].info()) is False
    assert hardware.ONEDNN_ISA_ENV not in os.environ
    assert hardware.keep_onednn_off_amx(AMX) is True
    assert os.environ[hardware.ONEDNN_ISA_ENV] == hardware.BATCH_INVARIANT_ONEDNN_ISA == "AVX512_CORE_BF16"
    monkeypatch.setenv(hardware.ONEDNN_ISA_ENV, "AVX512_CORE_AMX")  # the user's own setting stays
    assert hardware.keep_onednn_off_amx(AMX) is False
    assert os.environ[hardware.ONEDNN_ISA_ENV] == "AVX512_CORE_AMX"


def test_batch_invariance_is_enforced_on_amx_and_refused_where_onednn_started_on_it(onednn_uncapped, monkeypatch):
    """On an AMX CPU (mocked: the check itself runs on this CPU's kernels) the mode caps
    oneDNN and checks a product; where the rows still depend on the batch it raises,
    naming the fix. Elsewhere it changes nothing."""
    monkeypatch.setattr(linear, "detect_cpu", lambda: CPU_KINDS["avx512_bf16"].info())
    linear.enforce_batch_invariance(torch.bfloat16)
    assert hardware.ONEDNN_ISA_ENV not in os.environ
    monkeypatch.setattr(linear, "detect_cpu", lambda: AMX)
    linear.enforce_batch_invariance(torch.float32)  # float32's kernels keep rows apart on AMX too
    assert hardware.ONEDNN_ISA_ENV not in os.environ
    if linear.rows_kept_apart(torch.bfloat16):  # not where this process's oneDNN started on AMX
        linear.enforce_batch_invariance(torch.bfloat16)
        assert os.environ[hardware.ONEDNN_ISA_ENV] == "AVX512_CORE_BF16"
    monkeypatch.setattr(linear, "rows_kept_apart", lambda dtype: False)
    with pytest.raises(RuntimeError, match=r"batch_invariant=True: oneDNN in this process runs AMX kernels.*"
                                           r"fresh process.*ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16"):
        linear.enforce_batch_invariance(torch.bfloat16)


def test_linear_kernel_by_capability(monkeypatch):
    cpu = torch.device("cpu")
    for kind, onednn in ONEDNN_BF16.items():
        monkeypatch.setattr(linear, "detect_cpu", lambda kind=kind: CPU_KINDS[kind].info())
        bf16_kernel = "onednn" if onednn else "aten"
        assert linear.linear_kernel(torch.float32, cpu) == "onednn"
        assert linear.linear_kernel(torch.bfloat16, cpu) == bf16_kernel
        assert linear.linear_kernel(torch.float16, cpu) == "aten"
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert linear.linear_kernel(torch.float32, cpu) == "aten"


def test_a_refused_prepack_falls_back_to_the_plain_product(monkeypatch, caplog):
    def refuse(weight, _):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx512bw")

    monkeypatch.setattr(linear, "detect_cpu", lambda: AMX)
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


# The quantization "auto" picks for an unquantized checkpoint, by kind and mode: int8 where
# the CPU has VNNI and native bfloat16, except where oneDNN runs AMX tiles (bfloat16 faster).
AUTO_QUANTIZATION = {("avx2", False): None, ("avx512", False): None, ("avx512_bf16", False): "int8",
                     ("amx", False): None, ("avx2", True): None, ("avx512", True): None,
                     ("avx512_bf16", True): "int8", ("amx", True): "int8"}


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["default", "batch_invariant"])
@pytest.mark.parametrize("kind", CPU_KINDS)
def test_engine_defaults_by_cpu_kind(bf16_checkpoint, tiny_models, cpu_kind, onednn_uncapped, kind, batch_invariant):
    """`LLM()` on a bfloat16 checkpoint and on a float32 one computes in float32 on a CPU
    without native bfloat16 and in bfloat16 with it, over a bfloat16 KV cache either way,
    int8 or not by `AUTO_QUANTIZATION`
    (the detection set by DAGSTER_LLM_CPU_KIND; the kernels stay those of the real CPU).
    Batch-invariant mode as AMX refuses to start where this process's bfloat16 products
    depend on the batch after all (its oneDNN started on AMX, or runs none)."""
    cpu_kind(kind)
    if kind == "amx" and batch_invariant and not linear.rows_kept_apart(torch.bfloat16):
        with pytest.raises(RuntimeError, match="batch_invariant=True: oneDNN in this process"):
            LLM(str(bf16_checkpoint), batch_invariant=True)
        return
    for folder in (bf16_checkpoint, tiny_models["llama"]):
        with LLM(str(folder), batch_invariant=batch_invariant) as llm:
            config = llm.llm_engine.model_config
            assert config.dtype == (torch.bfloat16 if NATIVE_BF16[kind] else torch.float32)
            assert config.quantization == AUTO_QUANTIZATION[kind, batch_invariant]
            assert llm.output_settings["kv_cache_dtype"] == "bfloat16"  # a float32 model's too
            out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
    assert (os.environ.get(hardware.ONEDNN_ISA_ENV) == "AVX512_CORE_BF16") is (kind == "amx" and batch_invariant)
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:  # an explicit dtype keeps float32
        assert llm.llm_engine.model_config.dtype == torch.float32 and llm.llm_engine.model_config.quantization is None
        assert llm.output_settings["kv_cache_dtype"] == "float32"


def test_batch_invariant_mode_is_refused_on_a_gpu_before_anything_loads(tiny_models):
    from transformers import LlamaConfig

    from engine.config import EngineConfig, ModelConfig

    on_gpu = ModelConfig(tiny_models["llama"], LlamaConfig(), torch.bfloat16, torch.device("cuda"), 128)
    with pytest.raises(ValueError, match="batch_invariant=True runs on a CPU only.*device='cpu'"):
        EngineConfig(batch_invariant=True).resolve(on_gpu, "triton")
    with pytest.raises(TypeError, match="batch_invariant must be True or False, got str 'yes'"):
        EngineConfig(batch_invariant="yes")


def test_the_cpu_kind_setting_names_itself_and_refuses_a_wrong_name(cpu_kind, caplog):
    cpu_kind("avx2")
    with caplog.at_level(logging.WARNING, logger="engine.hardware"):
        cpu = detect_cpu()
    assert cpu.flags == CPU_KINDS["avx2"].flags and not cpu.native_bf16
    assert " as avx2 (" in cpu.describe() and f"{CPU_KIND_ENV}=avx2" in caplog.text
    cpu_kind("avx512-bf16")
    with pytest.raises(ValueError, match=r"DAGSTER_LLM_CPU_KIND='avx512-bf16' is not a CPU kind: set one of "
                                         r"\['amx', 'avx2', 'avx512', 'avx512_bf16'\], or unset it"):
        detect_cpu()


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the kinds are x86 CPUs")
def test_a_kinds_torch_settings_cap_pytorchs_kernels():
    """What tests/conftest.py sets for a run as AVX2: PyTorch's own kernels take AVX2 and
    oneDNN refuses bfloat16, as on a real AVX2 CPU (on an AVX2 CPU, trivially)."""
    probe = ("import torch; print(torch.backends.cpu.get_cpu_capability())\n"
             "try:\n    torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 16, dtype=torch.bfloat16), None)\n"
             "except RuntimeError as error:\n    print('refused:', error)")
    env = {**os.environ, **CPU_KINDS["avx2"].torch_env}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.startswith("AVX2\n") and "refused: " in out, out


def test_a_machine_stands_in_for_the_kinds_whose_flags_it_has():
    runnable, missing = stand_ins(CPU_KINDS["avx512_bf16"].flags | {"clzero"})
    assert [kind.name for kind in runnable] == ["avx2", "avx512", "avx512_bf16"]
    assert missing == {"amx": {"amx_bf16", "amx_tile", "amx_int8"}}
    runnable, missing = stand_ins(frozenset({"asimd", "bf16"}))  # no x86 kind on ARM
    assert runnable == [] and set(missing) == set(CPU_KINDS)


def test_ci_leaves_out_the_kind_the_suite_just_ran_as():
    """After `make test`, CI runs the lower kinds only: the suite ran the machine's own kind's
    path and kernels, except on AMX, where the suite keeps oneDNN off AMX."""
    assert own_kind(stand_ins(CPU_KINDS["avx512_bf16"].flags)[0], amx=False) is CPU_KINDS["avx512_bf16"]
    assert own_kind(stand_ins(CPU_KINDS["avx2"].flags)[0], amx=False) is CPU_KINDS["avx2"]
    assert own_kind(stand_ins(CPU_KINDS["amx"].flags)[0], amx=True) is None
    assert own_kind([], amx=False) is None


def test_bfloat16_runs_on_any_cpu(tiny_models):
    """An explicit bfloat16 works on every CPU: oneDNN's kernels where they run it (with
    AVX-512), the plain (emulated) product elsewhere, never a crash."""
    with LLM(str(tiny_models["llama"]), dtype="bfloat16") as llm:
        linears = [m for m in llm.llm_engine.model_runner.model.modules() if isinstance(m, linear.Linear)]
        assert all((m.packed_weight is not None) == detect_cpu().onednn_bf16 for m in linears)
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
