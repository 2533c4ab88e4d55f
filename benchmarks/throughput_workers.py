"""One (engine, workload) measurement per process, for `benchmarks/throughput.py`.

The suite starts `python benchmarks/throughput.py --worker ENGINE --workload-file FILE ...`; the
worker loads the engine, runs a short warm-up, times the workload, and prints one line
`RESULT {json}` on stdout with the elapsed time and the process's peak RSS (VmHWM), so that
each engine's memory is its own. Timing excludes the model load and the warm-up.

Heavy imports happen inside the runners: the OpenVINO worker runs under another virtualenv's
interpreter, which has neither our engine nor this project's transformers.
"""

import argparse
import json
import os
import resource
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.workloads import Workload

RESULT_PREFIX = "RESULT "
WARMUP_TOKENS = 4


@dataclass
class WorkerOptions:
    """What every runner may need; each uses its part."""

    model: str  # our engine's model argument (a name or a folder)
    model_path: str  # the Hugging Face folder, for transformers
    threads: int
    dtype: str  # our engine's dtype
    hf_dtype: str
    hf_batch_size: int
    kv_cache_bytes: int
    openvino_model: str | None = None
    quantization: str | None = "auto"  # our engine's
    kv_cache_dtype: str = "auto"  # our engine's
    batch_invariant: bool = False  # our engine's


@dataclass
class Timed:
    """A runner's timed run: seconds for the whole workload, the dtype its weights ran in, what
    ran in words, and its KV cache's element type (None where the runner cannot tell)."""

    seconds: float
    dtype: str
    detail: str
    kv_cache_dtype: str | None = None


@dataclass
class WorkerResult:
    """One timed run: seconds for the whole workload, the process's peak RSS, what ran and how."""

    engine: str
    workload: str
    seconds: float
    prompt_tokens: int
    output_tokens: int
    peak_rss_bytes: int
    dtype: str  # the weights' dtype as the engine ran them
    detail: str
    kv_cache_dtype: str | None = None  # the KV cache's element type, where the engine tells


def peak_rss_bytes() -> int:
    """The process's peak resident set (VmHWM), or ru_maxrss where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_ours(workload: Workload, opts: WorkerOptions, prefix_caching: bool = True,
             kv_cache_dtype: str | None = None) -> Timed:
    """Our engine: `LLM.generate` on token-id prompts, one SamplingParams per prompt;
    `kv_cache_dtype` overrides the options' (a variant run beside the default)."""
    import torch

    from engine import LLM, SamplingParams

    torch.set_num_threads(opts.threads)
    with LLM(opts.model, dtype=opts.dtype, quantization=opts.quantization, enable_prefix_caching=prefix_caching,
             kv_cache_memory=opts.kv_cache_bytes, num_threads=opts.threads,
             kv_cache_dtype=kv_cache_dtype or opts.kv_cache_dtype, batch_invariant=opts.batch_invariant) as llm:
        warmup = SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in workload.warmup], warmup, use_tqdm=False)
        llm.reset_prefix_cache()
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        dtype, cache, quantization = llm.dtype, llm.llm_engine.config.kv_cache_dtype, llm.llm_engine.config.quantization
    _check_lengths([len(o.outputs[0].token_ids) for o in outputs], workload)
    weights = f" + {quantization}" if quantization else ""
    mode = ", batch-invariant" if opts.batch_invariant else ""
    return Timed(elapsed, dtype, f"{dtype}{weights}, {cache} KV, prefix caching {'on' if prefix_caching else 'off'}{mode}",
                 cache)


def run_hf_generate(workload: Workload, opts: WorkerOptions) -> Timed:
    """transformers' static batching: `model.generate` on left-padded batches of `hf_batch_size`.

    A batch runs until its longest request is done (that is static batching's cost); only the
    tokens each prompt asked for are counted.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(opts.threads)
    model = AutoModelForCausalLM.from_pretrained(opts.model_path, dtype=getattr(torch, opts.hf_dtype)).eval()
    pad = model.generation_config.pad_token_id
    pad = model.config.eos_token_id if pad is None else pad

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        width = max(map(len, prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        # min_new_tokens = max_new_tokens keeps EOS from ending a row early.
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        assert out.shape[1] == width + new_tokens, out.shape

    size = opts.hf_batch_size
    with torch.inference_mode():
        generate(workload.warmup, WARMUP_TOKENS)
        start = time.perf_counter()
        for i in range(0, len(workload.prompts), size):
            generate(workload.prompts[i:i + size], max(workload.max_tokens[i:i + size]))
        elapsed = time.perf_counter() - start
    return Timed(elapsed, opts.hf_dtype, f"{opts.hf_dtype}, batch {size}")


def run_hf_continuous(workload: Workload, opts: WorkerOptions) -> Timed:
    """transformers' continuous batching (`generate_batch`'s manager) with a KV cache of `kv_cache_bytes`.

    `model.generate_batch` creates its manager, and allocates (zero-fills) the paged cache,
    inside the call, and takes one `max_new_tokens` for all prompts. So this drives the same
    manager through `continuous_batching_context_manager`, which `generate_batch` wraps: the
    set-up and warm-up stay outside the timing and each request gets its own length.
    """
    import psutil
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    torch.set_num_threads(opts.threads)
    model = AutoModelForCausalLM.from_pretrained(opts.model_path, dtype=getattr(torch, opts.hf_dtype)).eval()
    # eos_token_id=-1: no EOS at all, as ignore_eos elsewhere.
    generation = GenerationConfig(do_sample=False, max_new_tokens=max(workload.max_tokens), eos_token_id=-1,
                                  pad_token_id=model.config.eos_token_id)
    # On a CPU the cache is a share of the machine's free memory; this share is kv_cache_bytes.
    free = psutil.virtual_memory().total - psutil.Process().memory_info().rss
    batching = ContinuousBatchingConfig(max_memory_percent=min(0.9, opts.kv_cache_bytes / free))
    hints = WorkloadHints(max_prompt_length=max(map(len, workload.prompts)),
                          max_generated_length=max(workload.max_tokens), num_requests=len(workload.prompts))
    with model.continuous_batching_context_manager(generation_config=generation, continuous_batching_config=batching,
                                                   workload_hints=hints, block=True, timeout=5) as manager:
        _collect(manager, manager.add_requests(workload.warmup, max_new_tokens=WARMUP_TOKENS))
        start = time.perf_counter()
        if len(set(workload.max_tokens)) == 1:  # generate_batch's own path
            ids = manager.add_requests(workload.prompts, max_new_tokens=workload.max_tokens[0])
        else:
            ids = [manager.add_request(input_ids=p, max_new_tokens=n, eos_token_id=-1)
                   for p, n in zip(workload.prompts, workload.max_tokens)]
        results = _collect(manager, ids)
        elapsed = time.perf_counter() - start
    _check_lengths([len(results[i].generated_tokens) for i in ids], workload)
    return Timed(elapsed, opts.hf_dtype, f"{opts.hf_dtype}, cache {opts.kv_cache_bytes / 2**30:.1f} GiB")


def run_openvino(workload: Workload, opts: WorkerOptions) -> Timed:
    """OpenVINO GenAI's `ContinuousBatchingPipeline` on CPU with its defaults, prefix caching on."""
    import numpy as np
    import openvino as ov
    import openvino_genai

    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = max(1, round(opts.kv_cache_bytes / 2**30))  # GB
    scheduler.dynamic_split_fuse = True
    scheduler.enable_prefix_caching = True
    pipeline = openvino_genai.ContinuousBatchingPipeline(opts.openvino_model, scheduler, "CPU",
                                                         {"INFERENCE_NUM_THREADS": opts.threads})

    def generate(prompts: list[list[int]], max_tokens: list[int]) -> list:
        ids = [ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts]
        configs = [openvino_genai.GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in max_tokens]
        return pipeline.generate(ids, configs)

    generate(workload.warmup, [WARMUP_TOKENS] * len(workload.warmup))
    start = time.perf_counter()
    results = generate(workload.prompts, workload.max_tokens)
    elapsed = time.perf_counter() - start
    _check_lengths([len(r.m_generation_ids[0]) for r in results], workload)
    # The CPU plugin's default compute precision, which the pipeline runs with. Its KV cache is
    # the pipeline's own default, which the plugin's KV_CACHE_PRECISION property does not tell:
    # that reads u8 on a Zen 4 with bfloat16, where the pipeline's tokens are those of a bf16
    # cache (benchmarks/quantization_agreement.py compares the two).
    compute = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()
    dtype = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}.get(compute, compute)
    return Timed(elapsed, dtype, f"fp16 IR, {compute} compute, default KV, cache {scheduler.cache_size} GB")


RUNNERS = {
    "ours": run_ours,
    "ours-no-prefix-cache": lambda workload, opts: run_ours(workload, opts, prefix_caching=False),
    "ours-int8-kv": lambda workload, opts: run_ours(workload, opts, kv_cache_dtype="int8"),
    "ours-unquantized": lambda workload, opts: run_ours(workload, replace(opts, quantization=None)),
    "ours-batch-invariant": lambda workload, opts: run_ours(workload, replace(opts, batch_invariant=True)),
    "hf-generate": run_hf_generate,
    "hf-continuous": run_hf_continuous,
    "openvino": run_openvino,
}


def _collect(manager, request_ids: list[str]) -> dict:
    """Waits for every request in `request_ids` to finish; fails on a request's error."""
    pending, results = set(request_ids), {}
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
            continue
        if result.request_id in pending and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            results[result.request_id] = result
            pending.discard(result.request_id)
    return results


def _check_lengths(lengths: list[int], workload: Workload) -> None:
    if lengths != workload.max_tokens:
        wrong = sum(a != b for a, b in zip(lengths, workload.max_tokens))
        raise RuntimeError(f"{wrong} of {len(lengths)} requests did not generate the tokens asked for")


def worker_main(argv: list[str]) -> None:
    """`--worker ENGINE --workload-file FILE ...`: run one measurement, print `RESULT {json}`."""
    parser = argparse.ArgumentParser(prog="throughput.py --worker")
    parser.add_argument("--worker", required=True, choices=sorted(RUNNERS))
    parser.add_argument("--workload-file", required=True, type=Path)
    parser.add_argument("--options", required=True, help="WorkerOptions as JSON")
    args = parser.parse_args(argv)
    opts = WorkerOptions(**json.loads(args.options))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    workload = Workload.load(args.workload_file)
    timed = RUNNERS[args.worker](workload, opts)
    result = WorkerResult(args.worker, workload.name, timed.seconds, workload.prompt_tokens, workload.output_tokens,
                          peak_rss_bytes(), timed.dtype, timed.detail, timed.kv_cache_dtype)
    print(RESULT_PREFIX + json.dumps(asdict(result)), flush=True)
