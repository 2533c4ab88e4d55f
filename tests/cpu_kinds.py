"""Runs the tests whose path depends on the CPU (marked `cpu_kinds`) once per kind of CPU in
`engine.hardware.CPU_KINDS` that this machine can stand in for: one with no flag this CPU
lacks. Each run sets `DAGSTER_LLM_CPU_KIND`, so the engine chooses its dtype and kernels as
on that kind (in every process the tests start), and the root conftest caps oneDNN and ATen
at that kind's instruction set, so PyTorch's own kernels run as they do there.

`make test-cpu-kinds`, or `python -m tests.cpu_kinds [--except-own] [pytest arguments]`. With
`--except-own` (CI, after `make test`) the kind this CPU is itself is left out: the suite has
just run its tests on this CPU as it is, which is that kind's path with that kind's kernels
(except on an AMX CPU, where the suite keeps oneDNN off AMX and the `amx` run is the only one
on its kernels).
"""

import os
import subprocess
import sys

from engine.hardware import CPU_KIND_ENV, CPU_KINDS, CpuKind, machine_cpu


def stand_ins(flags: frozenset[str]) -> tuple[list[CpuKind], dict[str, frozenset[str]]]:
    """The kinds a CPU with `flags` can run as, and for the others the flags it lacks."""
    runnable = [kind for kind in CPU_KINDS.values() if kind.flags <= flags]
    missing = {kind.name: kind.flags - flags for kind in CPU_KINDS.values() if not kind.flags <= flags}
    return runnable, missing


def own_kind(runnable: list[CpuKind], amx: bool) -> CpuKind | None:
    """The kind whose tests a plain run of the suite on this CPU already ran: the highest it
    stands in for, where the suite runs as it would there (not on an AMX CPU)."""
    return runnable[-1] if runnable and not amx else None


def main(pytest_args: list[str]) -> int:
    machine = machine_cpu()
    runnable, missing = stand_ins(machine.flags)
    print(f"This CPU: {machine.describe()}")
    skipped = None
    if pytest_args[:1] == ["--except-own"]:
        pytest_args, skipped = pytest_args[1:], own_kind(runnable, machine.amx)
        runnable = [kind for kind in runnable if kind is not skipped]
    # A CPU that stands in for no kind (an ARM one) runs the tests once, as itself.
    runs = {kind.name: {CPU_KIND_ENV: kind.name} for kind in runnable} or ({} if skipped else {"this CPU": {}})
    results = {}
    for name, setting in runs.items():
        print(f"\n=== as {name} ===", flush=True)
        results[name] = subprocess.run([sys.executable, "-m", "pytest", "-m", "cpu_kinds", *pytest_args], check=False,
                                       env={**os.environ, **setting}).returncode
    print("\nCPU kinds:")
    for name, code in results.items():
        print(f"  {name:12} {'passed' if code == 0 else f'FAILED (pytest exit {code})'}")
    if skipped is not None:
        print(f"  {skipped.name:12} not run again: the suite's own run on this CPU ran it")
    for name, lacking in missing.items():
        print(f"  {name:12} not run: this CPU lacks {' '.join(sorted(lacking))}")
    return 0 if all(code == 0 for code in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
