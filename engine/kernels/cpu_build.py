"""The CPU kernels (C++: paged attention, `cpu_paged_attention.cpp`; routed experts,
`cpu_fused_moe.cpp`; RMSNorm with its residual add, `cpu_rms_norm.cpp`; rotary embedding,
`cpu_rotary.cpp`; the MLPs' gated activations, `cpu_activation.cpp`; int8 products,
`cpu_int8.cpp` and `cpu_int8_product.cpp`; greedy sampling's argmax, `cpu_sampling.cpp`; a
Llama-style model's decoder layers in one call, `cpu_decoder.cpp`), built
once per machine into one module.

They are compiled with the machine's own instruction set on first use (about 3 minutes on 2
cores, announced in the log before it starts; then cached by PyTorch under
~/.cache/torch_extensions, keyed by the sources, the folder they are installed in, the CPU's
flags and the PyTorch version: PyTorch's build records the sources' paths, so two installs on
one machine sharing a key would rebuild over each other on every load). Where they cannot be
built (no C++ compiler, no ninja), `load()` says so once and returns None, and the layers run on
PyTorch's operations instead.
"""

import functools
import hashlib
import logging
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

from engine.hardware import machine_cpu

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
_SOURCES = [_HERE / name for name in ("cpu_paged_attention.cpp", "cpu_fused_moe.cpp", "cpu_rms_norm.cpp",
                                           "cpu_rotary.cpp", "cpu_activation.cpp", "cpu_int8.cpp",
                                           "cpu_int8_product.cpp", "cpu_sampling.cpp", "cpu_decoder.cpp",
                                           "cpu_bindings.cpp")]
_HEADERS = [_HERE / "cpu_vector.h", _HERE / "cpu_int8.h", _HERE / "cpu_activation.h", _HERE / "cpu_rotary.h",
            _HERE / "cpu_linear.h", _HERE / "cpu_kernels.h"]


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel module, or None where it cannot be built."""
    # Built for this machine's flags (-march=native), whatever kind the engine chooses its path for.
    # No fused multiply-adds the sources do not ask for: the kernels round as PyTorch's operators do.
    flags = ["-O3", "-fopenmp", "-ffp-contract=off",
             "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"]
    texts = [path.read_text() for path in _SOURCES + _HEADERS]
    key = "\n".join([*texts, str(_HERE), " ".join(flags), " ".join(sorted(machine_cpu().flags)), torch.__version__])
    name = f"engine_cpu_kernels_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    start = time.monotonic()
    try:
        from torch.utils.cpp_extension import _get_build_directory, load as build

        folder = Path(_get_build_directory(name, verbose=False))
        if not (folder / f"{name}.so").exists():
            logger.info("building the CPU kernels for this machine into %s: the first run with these sources, this "
                        "CPU's instruction set and PyTorch %s (about 3 minutes on 2 cores; later runs load them)",
                        folder, torch.__version__)
        module = build(name=name, sources=[str(path) for path in _SOURCES], extra_cflags=flags,
                       extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as error:  # a missing compiler or ninja shows up as various exceptions
        logger.warning("the CPU kernels could not be built (%s); attention, norms, rotary embeddings, int8 "
                       "products and the experts of mixture-of-experts models run on PyTorch's operations, "
                       "which are slower",
                       str(error).strip().splitlines()[-1][:300])
        return None
    logger.info("CPU kernels ready in %.1f s (%s)", time.monotonic() - start, name)
    return module
