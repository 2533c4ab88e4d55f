"""What this machine's CPU can do, and the choices that follow from it.

CPUs differ in ways that decide both speed and whether a path runs at all: oneDNN's
bfloat16 kernels need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT and refuse to prepack a
weight elsewhere, and bfloat16 arithmetic without AVX512-BF16, AMX or ARM's BF16 is
emulated and several times slower than float32. Everything hardware-specific asks
here instead of assuming an instruction set.

`DAGSTER_LLM_CPU_KIND` (one of `CPU_KINDS`) makes the engine choose as it would on
that kind of CPU: the dtype "auto" picks and the matrix-product kernel. It is how the
test suite runs each CPU's path on one machine, and a way out where a virtual
machine hides flags the CPU has.

On a CPU with AMX, oneDNN picks AMX tiles or AVX512-BF16 code for a bfloat16 product
by its row count, and the two sum a row in different orders: a row's bits then depend
on how many rows share its step. The engine's `batch_invariant` mode keeps oneDNN at
`BATCH_INVARIANT_ONEDNN_ISA` there (`amx_products`); every other kind's fastest kernels
keep a row's bits apart from its batch already.
"""

import contextlib
import ctypes
import ctypes.util
import functools
import logging
import math
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# x86 flags (/proc/cpuinfo "flags") of native bfloat16 matrix arithmetic, and those that
# oneDNN's bfloat16 kernels need at the least (its own check, as its error message says).
_X86_NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16"})
_X86_ONEDNN_BF16 = (frozenset({"avx512bw", "avx512vl", "avx512dq"}), frozenset({"avx_ne_convert"}))
_X86 = ("x86_64", "AMD64", "i686")
_X86_INT8_DOT = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})

# oneDNN's cap on the instruction sets it dispatches to, read once, before its first kernel
# runs in a process; and the cap that leaves AMX out (AVX-512 with bfloat16 dot products),
# under which a Sapphire Rapids' bfloat16 rows were the same bits at every row count.
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"
BATCH_INVARIANT_ONEDNN_ISA = "AVX512_CORE_BF16"


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's name, PyTorch's vector capability ("AVX2", "AVX512", ...) and feature flags."""

    model_name: str
    architecture: str
    capability: str
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        """Whether bfloat16 matrix products run in hardware (AVX512-BF16 or AMX on x86,
        the BF16 extension on ARM) and through oneDNN's fast kernels."""
        return self.onednn_bf16 and (self.architecture not in _X86 or bool(self.flags & _X86_NATIVE_BF16))

    @property
    def onednn_bf16(self) -> bool:
        """Whether oneDNN's bfloat16 kernels run here: natively, or on x86 emulated in
        AVX-512 (an AVX-512 CPU without AVX512-BF16)."""
        if self.architecture in _X86:
            return any(need <= self.flags for need in _X86_ONEDNN_BF16)
        if self.architecture in ("aarch64", "arm64"):
            return "bf16" in self.flags
        return False

    @property
    def int8_vnni(self) -> bool:
        """Whether int8 products sum exactly in hardware: VNNI (AVX512-VNNI, AVX-VNNI) or
        AMX on x86, which multiply-add 8-bit pairs into 32 bits. Without them oneDNN's int8
        kernels add pairs in 16 bits first, which saturate (measured on AVX2: wrong sums)."""
        return self.architecture in _X86 and bool(self.flags & _X86_INT8_DOT)

    @property
    def int16_pair_products(self) -> bool:
        """Whether the compiled kernels take int8 products as int16 pairs (`vpmaddwd`, exact
        int32 sums, twice float32's multiply-adds a cycle on a Zen 3): x86 with AVX2 and no
        VNNI, where oneDNN's int8 kernels would saturate."""
        return self.architecture in _X86 and "avx2" in self.flags and not self.int8_vnni

    @property
    def int8_products(self) -> bool:
        """Whether the engine takes int8 products here: VNNI or AMX (oneDNN's kernels), or
        AVX2 (int16 pairs, in the compiled kernels, which must build)."""
        return self.int8_vnni or self.int16_pair_products

    @property
    def amx(self) -> bool:
        """Whether the CPU has AMX tiles for bfloat16 (Intel since Sapphire Rapids)."""
        return self.architecture in _X86 and "amx_bf16" in self.flags

    def describe(self) -> str:
        """One line for logs and benchmark headers."""
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        extras = sorted(self.flags & {"avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni", "avx_vnni"})
        return f"{self.model_name} ({self.architecture}, {self.capability}, {bf16}" + (
            f"; {' '.join(extras)})" if extras else ")")


# The x86 flags each kind below shares: what an AVX2 machine of the last decade has.
_AVX2_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
_AVX512_FLAGS = _AVX2_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}


@dataclass(frozen=True)
class CpuKind:
    """A kind of x86 CPU the engine meets, with the settings that make PyTorch's own
    kernels run as they do on it (`torch_env`, for tests that simulate it)."""

    name: str
    example: str
    capability: str
    flags: frozenset[str]
    onednn_max_isa: str

    def info(self, model_name: str | None = None) -> CpuInfo:
        """This kind as `detect_cpu` reports it."""
        return CpuInfo(model_name or self.example, "x86_64", self.capability, self.flags)

    @property
    def torch_env(self) -> dict[str, str]:
        """Environment that caps oneDNN's and ATen's instruction sets at this kind's, read
        when a process first runs those kernels (a cap above the CPU changes nothing)."""
        return {"ONEDNN_MAX_CPU_ISA": self.onednn_max_isa, "ATEN_CPU_CAPABILITY": self.capability.lower()}


CPU_KINDS: dict[str, CpuKind] = {kind.name: kind for kind in (
    CpuKind("avx2", "AMD EPYC (Zen 3)", "AVX2", _AVX2_FLAGS, "AVX2"),
    CpuKind("avx512", "Intel Xeon (Ice Lake)", "AVX512", _AVX512_FLAGS, "AVX512_CORE_VNNI"),
    CpuKind("avx512_bf16", "AMD EPYC (Zen 5)", "AVX512", _AVX512_FLAGS | {"avx512_bf16"}, "AVX512_CORE_BF16"),
    CpuKind("amx", "Intel Xeon (Sapphire Rapids)", "AVX512",
            _AVX512_FLAGS | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}, "AVX512_CORE_AMX"),
)}
CPU_KIND_ENV = "DAGSTER_LLM_CPU_KIND"


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; empty where there is none (macOS, Windows)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU", frozenset()
    name, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "cpu model") and not name:
            name = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return name or platform.processor() or "unknown CPU", flags


def machine_cpu() -> CpuInfo:
    """This machine's CPU as /proc/cpuinfo and PyTorch report it."""
    name, flags = _read_cpuinfo()
    return CpuInfo(name, platform.machine(), torch.backends.cpu.get_cpu_capability(), flags)


def chosen_cpu_kind() -> CpuKind | None:
    """The kind `DAGSTER_LLM_CPU_KIND` names, or None where it is unset; a name that is
    not a kind raises, naming the choices."""
    name = os.environ.get(CPU_KIND_ENV, "").strip()
    if not name:
        return None
    if name not in CPU_KINDS:
        raise ValueError(f"{CPU_KIND_ENV}={name!r} is not a CPU kind: set one of {sorted(CPU_KINDS)}, or unset it "
                         "to detect this machine's")
    return CPU_KINDS[name]


@functools.cache
def detect_cpu() -> CpuInfo:
    """The CPU the engine chooses its path for, once per process: this machine's, or
    the kind `DAGSTER_LLM_CPU_KIND` names."""
    machine = machine_cpu()
    kind = chosen_cpu_kind()
    if kind is None:
        return machine
    chosen = kind.info(f"{machine.model_name} as {kind.name}")
    logger.warning("%s=%s: the engine chooses its path as on %s", CPU_KIND_ENV, kind.name, chosen.describe())
    return chosen


def available_cpus() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup CPU quota."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(count, math.ceil(quota))) if quota else count


def _cgroup_cpu_quota() -> float | None:
    """The cgroup's CPU limit in cores (cgroup v2 cpu.max, or v1 cfs quota), if one is set."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 else None
    except (OSError, ValueError):
        return None


def default_num_threads() -> int:
    """`OMP_NUM_THREADS` when it is set to a positive number, else the cores this process may use."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return available_cpus()


def set_num_threads(count: int) -> None:
    """Sets the threads of PyTorch's CPU operators for this process (the engine's
    num_threads, `default_num_threads()` unless set)."""
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


# glibc's mallopt parameters.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# glibc's own starting mmap threshold, and the one `keep_freed_memory` sets.
_GLIBC_MMAP_THRESHOLD = 128 << 10
_KEPT_MMAP_THRESHOLD = 32 << 20
# The mmap threshold this module last set for good (None: glibc's own, adjusted by glibc).
_mmap_threshold: int | None = None


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Makes glibc's malloc keep freed memory for reuse instead of returning it to the OS.

    A step's activations are tensors of a few MB, allocated and freed every step. By
    default glibc serves such sizes with fresh mmap pages and gives them back on free,
    so every step pays page faults to touch zeroed memory again: measured on a 2-core
    AVX2 EPYC, gathering a step's keys took 30 ms into fresh memory and 8.5 ms into
    reused memory, and generation ran 1.15-1.2x faster with this. Allocations above 32 MB
    (the KV cache, weights) still get their own mapping. `release_freed_memory` hands the
    kept memory back when the engine closes. Returns False where malloc is not glibc's.
    """
    global _mmap_threshold
    libc = _glibc()
    if libc is None:
        return False
    _mmap_threshold = _KEPT_MMAP_THRESHOLD
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_MMAP_THRESHOLD, _KEPT_MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 64 << 20)))


@contextlib.contextmanager
def long_lived_allocations(threshold: int = 1 << 20) -> Iterator[None]:
    """Makes allocations of at least `threshold` bytes made inside get mappings of their
    own (those that malloc's free lists cannot already serve).

    For the weights and the KV cache, which live as long as the engine. With
    `keep_freed_memory` in effect glibc serves anything under 32 MB from its heap, and
    heap memory freed under a trim threshold of 1 GiB stays in the process until
    malloc_trim runs, which only close() calls: an LLM with the embedded model (weights
    of a few MB per tensor) dropped without close() left 961 MiB resident, against 434
    after close(). In mappings of their own they go back to the OS the moment they are
    freed (535 MiB with this alone), and the load's temporary copies do not pile up in
    the heap (the peak fell by about 50 MiB). Step activations, allocated after this,
    still reuse the heap. Does nothing where malloc is not glibc's.
    """
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        # glibc's adaptive threshold cannot be switched back on: its starting value it is.
        libc.mallopt(_M_MMAP_THRESHOLD, _mmap_threshold or _GLIBC_MMAP_THRESHOLD)


def release_freed_memory() -> None:
    """Returns the memory malloc kept for reuse to the OS (glibc's malloc_trim)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def amx_products(cpu: CpuInfo, batch_invariant: bool) -> bool:
    """Whether oneDNN computes the engine's products on AMX tiles: a CPU with AMX, outside
    batch-invariant mode, with `ONEDNN_MAX_CPU_ISA` unset or naming an AMX instruction set.

    Where it does, a bfloat16 row's bits depend on how many rows share the product (oneDNN
    switches between AMX and AVX512-BF16 kernels by shape), and bfloat16 products run
    faster than int8's (`engine.quantization.int8_by_default`)."""
    if not cpu.amx or batch_invariant:
        return False
    cap = os.environ.get(ONEDNN_ISA_ENV, "").strip().upper()
    return cap in ("", "ALL", "DEFAULT") or "AMX" in cap


# oneDNN's instruction sets without int8 dot products (`ONEDNN_MAX_CPU_ISA` values).
_ONEDNN_ISAS_WITHOUT_VNNI = ("SSE41", "AVX", "AVX2", "AVX512_CORE")


def onednn_sums_int8_exactly() -> bool:
    """Whether oneDNN's int8 kernels sum int8 pairs exactly in this process: this machine
    has VNNI or AMX and `ONEDNN_MAX_CPU_ISA` does not cap oneDNN at a set without them
    (there its kernels add pairs in 16 bits, which saturate). Elsewhere the compiled
    kernels take int8 products as int16 pairs (`engine/kernels/cpu_int8_product.cpp`,
    which reads the same rule)."""
    cap = os.environ.get(ONEDNN_ISA_ENV, "").upper()
    return machine_cpu().int8_vnni and cap not in _ONEDNN_ISAS_WITHOUT_VNNI


def keep_onednn_off_amx(cpu: CpuInfo) -> bool:
    """Caps oneDNN below AMX for this process (`BATCH_INVARIANT_ONEDNN_ISA`), where the CPU
    has AMX and `ONEDNN_MAX_CPU_ISA` is unset; returns whether it set the cap. oneDNN reads
    the cap before its first kernel, so the cap takes only in a process that has not run
    one yet (`engine.layers.linear.rows_kept_apart` tells)."""
    if not cpu.amx or os.environ.get(ONEDNN_ISA_ENV):
        return False
    os.environ[ONEDNN_ISA_ENV] = BATCH_INVARIANT_ONEDNN_ISA
    logger.info("batch_invariant=True on a CPU with AMX: oneDNN capped at %s (AVX-512 bfloat16 kernels, no AMX "
                "tiles), whose rows do not depend on the batch", BATCH_INVARIANT_ONEDNN_ISA)
    return True


def cpu_dtype(requested: torch.dtype | None, checkpoint: torch.dtype, cpu: CpuInfo) -> torch.dtype:
    """The dtype to compute in on this CPU.

    `requested` None means "auto": bfloat16 where the CPU has native bfloat16, whatever
    the checkpoint's dtype (a float32 checkpoint too, as on a GPU: its matrix units run
    bfloat16 several times faster than float32), float32 otherwise (float16 products are
    slow on CPUs, and emulated bfloat16 is several times slower than float32). An
    explicit bfloat16 on a CPU without native support is honoured, with a warning.
    """
    if requested is None:
        if not cpu.native_bf16:
            return torch.float32
        if checkpoint == torch.float32:
            logger.info("dtype='auto': the float32 checkpoint computes in bfloat16 on this CPU, whose bfloat16 "
                        "matrix instructions are several times faster than float32's; dtype='float32' keeps float32")
        return torch.bfloat16
    if requested == torch.bfloat16 and not cpu.native_bf16:
        logger.warning(
            "dtype='bfloat16' on %s: this CPU has no native bfloat16 matrix instructions (AVX512-BF16 or "
            "AMX), so bfloat16 runs on a slower emulated path; dtype='auto' picks float32 here, which is faster",
            cpu.describe(),
        )
    return requested


def resolve_device(setting: str) -> torch.device:
    """The device a `device` setting names: "auto" is a GPU when there is one, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)
