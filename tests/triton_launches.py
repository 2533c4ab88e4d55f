"""Compiles the Triton kernels the tests launch for a Hopper GPU, without one.

Triton's interpreter, which runs the kernels on a CPU, accepts code that its GPU compiler
refuses (an `if` on a float constant, say), so kernel tests passing under the interpreter
do not show that the kernels build for a GPU. This module closes that gap: the test session
records every kernel launch the interpreter runs (the kernel, each argument's Triton type,
the compile-time constants), and `python -m tests.triton_launches <file>`, run without
TRITON_INTERPRET, compiles each recorded launch for sm_90 down to PTX and names those that
fail (tests/engine/test_triton_compile.py).
"""

import importlib
import inspect
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

TARGET_ARCH = 90
# A folder where each test session (each pytest-xdist worker) leaves the launches it ran, for a
# later session's compile check: `make test` runs the suite on several workers, then the check.
LAUNCHES_DIR_ENV = "TRITON_LAUNCHES_DIR"
POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int8: "*i8",
                 torch.int16: "*i16", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8",
                 torch.bool: "*i1", torch.float8_e4m3fn: "*fp8e4nv"}


def _argument_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"a kernel argument of type {type(value).__name__} is not recorded")


def launch_record(fn, args: tuple, kwargs: dict) -> dict:
    """One launch as JSON: the kernel's module and name, each runtime argument's type, and
    each compile-time constant's value."""
    parameters = list(inspect.signature(fn).parameters.values())
    values = dict(zip([p.name for p in parameters], args)) | kwargs
    signature, constants = {}, {}
    for parameter in parameters:
        value = values.get(parameter.name, parameter.default)
        if "constexpr" in str(parameter.annotation):
            constants[parameter.name] = value
        else:
            signature[parameter.name] = _argument_type(value)
    return {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constants": constants}


def record_launches() -> set[str]:
    """Records every kernel launch Triton's interpreter runs from now on in this process:
    returns the set that fills with them (JSON, one per distinct launch)."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: set[str] = set()
    original = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        launches.add(json.dumps(launch_record(self.fn, args, kwargs), sort_keys=True))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    return launches


def save_launches(launches: set[str]) -> None:
    """Leaves this session's launches in the folder `TRITON_LAUNCHES_DIR` names."""
    folder = Path(os.environ[LAUNCHES_DIR_ENV])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{os.environ.get('PYTEST_XDIST_WORKER', 'session')}-{os.getpid()}.json").write_text(
        json.dumps(sorted(launches)))


def saved_launches() -> set[str]:
    """Every launch the sessions before this one left in the folder `TRITON_LAUNCHES_DIR`
    names (none when it is not set)."""
    folder = os.environ.get(LAUNCHES_DIR_ENV)
    files = sorted(Path(folder).glob("*.json")) if folder else []
    return {launch for file in files for launch in json.loads(file.read_text())}


def compile_for_gpu(record: dict) -> None:
    """Compiles one recorded launch for sm_90 (TTIR, TTGIR, LLVM IR, PTX); raises the
    compiler's error where Triton refuses it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(record["module"]), record["kernel"])
    while not isinstance(kernel, triton.JITFunction):  # autotuners and heuristics wrap the kernel
        kernel = kernel.fn
    names = list(inspect.signature(kernel.fn).parameters)
    signature = record["signature"] | {name: "constexpr" for name in record["constants"]}
    constants = {(names.index(name),): value for name, value in record["constants"].items()}
    source = ASTSource(fn=kernel, signature={name: signature[name] for name in names}, constexprs=constants)
    triton.compile(source, target=GPUTarget("cuda", TARGET_ARCH, 32), options={"num_warps": 4})


def compile_failure(record: dict) -> str | None:
    """Why one recorded launch does not compile for sm_90, or None where it does."""
    try:
        compile_for_gpu(record)
    except Exception as error:  # the compiler's own message says what it refused
        cause = error.__cause__ or error
        return f"{record['module']}.{record['kernel']} {record['constants']}: {type(cause).__name__}: {cause}"
    return None


def main(path: str) -> int:
    """Compiles the launches in the JSON file at `path`, one process per core: exit status 1
    if any failed."""
    assert "TRITON_INTERPRET" not in os.environ, "compile without the interpreter"
    records = [json.loads(line) for line in json.loads(Path(path).read_text())]
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        failures = [failure for failure in pool.map(compile_failure, records) if failure is not None]
    print(f"{len(records)} launches compiled for sm_{TARGET_ARCH}, {len(failures)} failed")
    print("\n\n".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
