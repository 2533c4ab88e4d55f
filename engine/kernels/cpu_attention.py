"""The CPU paged-attention kernel (C++, `cpu_paged_attention.cpp`), built once per machine.

PyTorch's batched products need each sequence's keys gathered into a padded copy first,
and run decode's tiny products (a few query rows per sequence) at a fraction of the
machine's speed. The kernel reads keys and values straight from the paged cache through
the block table, one (row, KV head) task at a time in a fixed order, so a row's result
does not depend on the rest of the step. A sliding window limits a row to its last keys
(only those are read); a soft-cap bounds the scores before the softmax.

It is compiled with the machine's own instruction set on first use (about a minute; then
cached by PyTorch under ~/.cache/torch_extensions, keyed by the source, the CPU's flags and
the PyTorch version). Where it cannot be built (no C++ compiler, no ninja), `load()` says
so once and returns None, and attention runs on PyTorch's products.
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

_SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernel module, or None where it cannot be built."""
    # Built for this machine's flags (-march=native), whatever kind the engine chooses its path for.
    key = "\n".join([_SOURCE.read_text(), " ".join(sorted(machine_cpu().flags)), torch.__version__])
    name = f"engine_cpu_attention_{hashlib.sha256(key.encode()).hexdigest()[:12]}"
    flags = ["-O3", "-fopenmp", "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"]
    start = time.monotonic()
    try:
        from torch.utils.cpp_extension import load as build

        module = build(name=name, sources=[str(_SOURCE)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                       verbose=False)
    except Exception as error:  # a missing compiler or ninja shows up as various exceptions
        logger.warning("the CPU attention kernel could not be built (%s); attention runs on PyTorch's "
                       "batched products, which are slower", str(error).strip().splitlines()[-1][:300])
        return None
    logger.info("CPU attention kernel ready in %.1f s (%s)", time.monotonic() - start, name)
    return module


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    row_seq: torch.Tensor, row_keys: torch.Tensor, block_size: int, scale: float,
                    sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Each row of `q` [rows, heads, dim] attends over the first `row_keys[row]` keys of
    sequence `row_seq[row]` (only the last `sliding_window` of them, where given), whose
    cache slots `block_tables` [seqs, max_blocks] gives; scores are scale * (q . k),
    soft-capped to softcap * tanh(score / softcap) where given. The caches are
    [kv_heads, slots, dim]. Returns [rows, heads, dim]."""
    return load().paged_attention(q.contiguous(), k_cache, v_cache, block_tables, row_seq, row_keys,
                                  block_size, scale, sliding_window or 0, softcap or 0.0)
