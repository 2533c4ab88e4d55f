"""`LLM.close()` gives the engine's memory back to the OS (resident set size, in a child process).

The child loads the embedded model (what users get from `LLM()`), generates, closes, and
does it again; then once more, dropping the LLM without close(). It prints its RSS in MiB
at each point. The first cycle also pays one-time costs that no close() can return: the
modules transformers imports to read a model config (torch.distributed, dynamo, sympy,
triton: about 90 MiB of library pages and 90 MiB of Python objects), the CPU attention
kernel's library, oneDNN's code. The second cycle, with those paid, shows what the engine
itself keeps.

Measured on a 2-core AVX2 EPYC (MiB, 1 or 2 threads alike):

                      before load  peak  after 1st close  after 2nd close  dropped, no close
    this version              248  1160              431              433                434
    before the fix            248  1209              431              434                961

(The fix: weights and KV cache in mappings of their own, `hardware.long_lived_allocations`,
and an engine dropped without close() frees itself and trims malloc's heap.)
"""

import gc
import json
import os
import subprocess
import sys
import textwrap
import weakref

import pytest

from engine import LLM, SamplingParams
from engine.embedded_model import EMBEDDED_MODEL_NAME

_CHILD = textwrap.dedent('''
    import gc
    import json

    def rss_mib(field="VmRSS"):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(field + " not in /proc/self/status")

    from engine import LLM, SamplingParams

    prompts = [f"Write a short story about the number {i}." for i in range(32)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    numbers = {"before": rss_mib()}

    def cycle(name, close):
        llm = LLM(%(model)r)
        llm.generate(prompts, params, use_tqdm=False)
        numbers[name + "_peak"] = rss_mib()
        if close:
            llm.close()
        del llm
        gc.collect()
        numbers[name + "_after"] = rss_mib()

    cycle("first", close=True)
    cycle("second", close=True)
    cycle("dropped", close=False)
    numbers["high_water_mark"] = rss_mib("VmHWM")
    print("RSS " + json.dumps(numbers))
''')


def measure_rss(model: str) -> dict[str, float]:
    """RSS (MiB) of a child process that runs `_CHILD` for `model`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _CHILD % {"model": model}], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RSS "))
    return json.loads(line.removeprefix("RSS "))


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_close_gives_the_engines_memory_back():
    rss = measure_rss(EMBEDDED_MODEL_NAME)
    print(rss)
    growth = rss["first_peak"] - rss["before"]
    assert growth > 500, rss  # the weights alone are 540 MB in float32
    # First cycle: what stays is the one-time import cost (about 180 MiB measured).
    assert rss["first_after"] - rss["before"] <= 0.3 * growth, rss
    # Second cycle: the engine itself keeps next to nothing (measured 0-5 MiB).
    second_growth = rss["second_peak"] - rss["first_after"]
    assert rss["second_after"] - rss["first_after"] <= 0.05 * second_growth, rss
    # Dropped without close(): everything goes back all the same (measured 1 MiB; 527 before).
    dropped_growth = rss["dropped_peak"] - rss["second_after"]
    assert rss["dropped_after"] - rss["second_after"] <= 0.1 * dropped_growth, rss


@pytest.mark.parametrize("enable_lora", [False, True])
def test_an_llm_dropped_without_close_frees_its_engine(tiny_models, enable_lora):
    """The engine's finalizer holds the engine's attributes (to free them, then trim
    malloc's heap), so nothing among them may point back at the engine: it would never
    be freed."""
    llm = LLM(str(tiny_models["llama"]), dtype="float32", max_model_len=64, kv_cache_memory=1 << 20,
              enable_lora=enable_lora)
    llm.generate(["a b c"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    engine = weakref.ref(llm.llm_engine)
    weights = weakref.ref(llm.llm_engine.model_runner.model.model.embed_tokens.weight)
    del llm
    gc.collect()
    assert engine() is None and weights() is None
