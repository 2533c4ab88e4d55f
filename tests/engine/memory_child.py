"""The child process of `test_memory_release.py`: loads a model, generates, lets the LLM go
(by `close()` or by dropping it), and records its resident set size (MiB) at each point.

Run as `python -m tests.engine.memory_child MODEL --cycles close,close,drop [--without-fix]`;
prints one line, "RSS " and a JSON object (`MemoryReport`). `--without-fix` runs the engine
as it was before its memory fix: no finalizer for an LLM dropped without close(), and
weights in malloc's heap instead of mappings of their own.
"""

import argparse
import contextlib
import gc
import json
from dataclasses import asdict, dataclass, field


def rss_mib(field_name: str = "VmRSS") -> float:
    """This process's resident set size (or another /proc/self/status figure) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(field_name + " not in /proc/self/status")


@dataclass
class Cycle:
    """One LLM's life: how it ended ("close" or "drop"), the RSS at its peak (after
    generating) and after it was let go, and its weights' bytes as the engine holds them."""

    ending: str
    peak: float
    after: float
    weights: float


@dataclass
class MemoryReport:
    """RSS before the first LLM (the engine imported) and through each cycle."""

    dtype: str
    before: float
    cycles: list[Cycle] = field(default_factory=list)
    high_water_mark: float = 0.0


def disable_the_fix() -> None:
    """The engine before its fix: an LLM dropped without close() frees its tensors as the
    garbage collector finds them, and malloc keeps the freed heap."""
    import engine.llm_engine
    import engine.worker.model_runner

    engine.llm_engine._free_dropped_engine = lambda attributes: None
    engine.worker.model_runner.long_lived_allocations = contextlib.nullcontext


def run_cycle(model: str, ending: str, report: MemoryReport) -> None:
    from engine import LLM, SamplingParams
    from engine.model_loader.loader import weight_bytes

    prompts = [f"Write a short story about the number {i}." for i in range(32)]
    llm = LLM(model)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    runner = llm.llm_engine.model_runner
    report.dtype = runner.model_config.dtype_name
    weights = weight_bytes(runner.model) / 2**20
    del runner
    peak = rss_mib()
    if ending == "close":
        llm.close()
    del llm
    gc.collect()
    report.cycles.append(Cycle(ending, peak, rss_mib(), weights))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model")
    parser.add_argument("--cycles", default="close,close,drop", help="how each LLM ends: close or drop")
    parser.add_argument("--without-fix", action="store_true", help="the engine as before its memory fix")
    args = parser.parse_args()
    import engine  # noqa: F401  (the baseline includes the engine's own imports)

    if args.without_fix:
        disable_the_fix()
    report = MemoryReport(dtype="", before=rss_mib())
    for ending in args.cycles.split(","):
        run_cycle(args.model, ending, report)
    report.high_water_mark = rss_mib("VmHWM")
    print("RSS " + json.dumps(asdict(report)))


if __name__ == "__main__":
    main()
