"""What the benchmarks that compare two kinds of requests on one LLM share: their common
arguments, and timed runs that alternate, so that drift in the machine hits both alike."""

import argparse
import time
from collections.abc import Callable

from engine import LLM, RequestOutput, SamplingParams


def comparison_parser(description: str) -> argparse.ArgumentParser:
    """A parser with --num-prompts, --dtype and --repeats; the benchmark adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    return parser


def best_times(llm: LLM, prompts: list[dict], runs: dict[str, list[SamplingParams]], repeats: int,
               check: Callable[[list[RequestOutput]], None] = lambda outputs: None) -> dict[str, float]:
    """The shortest of `repeats` timings of each run (the prompts with that run's sampling
    params), the runs taking turns, each from an empty prefix cache. `check` sees each
    run's outputs after its timing."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, params in runs.items():
            llm.reset_prefix_cache()
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - started)
            check(outputs)
    return {name: min(values) for name, values in times.items()}
