"""The Triton kernels build for a GPU: every launch the interpreter ran in this session (after
`make test`'s workers: in theirs, left in TRITON_LAUNCHES_DIR; run alone: in the kernel tests)
compiled for sm_90 without a GPU (tests/triton_launches.py).
The interpreter runs code the GPU compiler refuses; this is where such code shows."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import TRITON_LAUNCHES
from tests.triton_launches import saved_launches

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="checks what the interpreter ran; a GPU runs the kernels themselves")]

KERNEL_TESTS = ["tests/engine/test_triton_kernels.py", "tests/engine/test_fused_moe.py",
                "tests/engine/test_sliding_window.py", "tests/engine/test_kv_cache_dtype.py",
                "tests/engine/test_w4a16_kernel.py", "tests/engine/test_fp8_kernel.py",
                "tests/engine/test_attention_features.py",
                "-k", "triton or fused_moe or w4a16 or fp8_kernel"]


@pytest.mark.long("compiles each of the ~190 launches the session ran for sm_90, about half a second each on "
                  "one core with an empty Triton cache (seconds with a warm one)")
def test_every_kernel_launched_under_the_interpreter_compiles_for_hopper(tmp_path):
    path = tmp_path / "launches.json"
    if launches := TRITON_LAUNCHES | saved_launches():
        path.write_text(json.dumps(sorted(launches)))
    else:  # run alone: the kernel tests launch them in a session of their own
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                       env=os.environ | {"TRITON_LAUNCHES_OUT": str(path)}, check=True, capture_output=True)
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tests.triton_launches", str(path)], env=environment,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
