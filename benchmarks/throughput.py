"""Offline throughput suite: our engine against its peers, on the same prompts, in one run.

Peers: transformers' static batched `model.generate`, transformers' continuous batching (the
manager behind `model.generate_batch`) and, with `--openvino-python`, OpenVINO GenAI's
`ContinuousBatchingPipeline`. Workloads (see benchmarks/workloads.py), all with EOS ignored:
(a) 256 chat prompts x 128 new tokens, (b) 64 prompts of 100-1,024 tokens x 64-256 new tokens,
(c) 128 prompts sharing a ~600-token prefix x 32 new tokens, where our engine also runs with
prefix caching off. Each (engine, workload, round) runs in its own process, so peak RSS is the
engine's own; timing excludes the model load and a short warm-up. Engines alternate within each
round (the order rotates between rounds) and the best round counts.

Per workload it prints output and total (prompt + output) tokens/s, peak RSS, our ratio to each
peer, and a roofline estimate from the machine's measured matmul rate and memory bandwidth.

    .venv/bin/python benchmarks/throughput.py                         # everything, full size
    .venv/bin/python benchmarks/throughput.py --workloads a --scale 0.05
    .venv/bin/python benchmarks/throughput.py --openvino-python .venv-openvino/bin/python

A float32 checkpoint (what save_pretrained writes after a float32 fine-tune) against
transformers' static generate in both dtypes; and our batch-invariant mode beside the default:

    .venv/bin/python benchmarks/throughput.py --checkpoint-dtype float32 --hf-dtype both --engines ours,hf-generate
    .venv/bin/python benchmarks/throughput.py --engines ours,ours-batch-invariant --scale 0.5 --rounds 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__" and "--worker" in sys.argv:
    # A measurement process, maybe under another virtualenv: nothing heavy imported up here.
    from benchmarks.throughput_workers import worker_main

    worker_main(sys.argv[1:])
    sys.exit(0)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402

import torch  # noqa: E402

from benchmarks import roofline as rl  # noqa: E402
from benchmarks.throughput_workers import RESULT_PREFIX, WorkerOptions, WorkerResult  # noqa: E402
from benchmarks.workloads import Workload, build_workloads  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.model_loader.model_config import resolve_model_config  # noqa: E402

LABELS = {
    "ours": "ours",
    "ours-no-prefix-cache": "ours, no prefix cache",
    "ours-int8-kv": "ours, int8 KV cache",
    "ours-unquantized": "ours, unquantized",
    "ours-batch-invariant": "ours, batch-invariant",
    "hf-generate": "transformers generate",
    "hf-generate-float32": "transformers gen. fp32",
    "hf-generate-bfloat16": "transformers gen. bf16",
    "hf-continuous": "transformers CB",
    "openvino": "OpenVINO GenAI CB",
}
PEERS = ["hf-generate", "hf-continuous"]
# transformers' static generate in one dtype each, whatever --hf-dtype says (`--hf-dtype both`).
HF_GENERATE_IN = {"hf-generate-float32": "float32", "hf-generate-bfloat16": "bfloat16"}
ENGINE_MAX_NUM_SEQS = 256  # our engine's default, for the roofline's decode steps


@dataclass
class Measurement:
    """The best of an engine's rounds on one workload; peak RSS is the highest of the rounds."""

    engine: str
    detail: str
    dtype: str
    seconds: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    peak_rss_bytes: int
    error: str | None = None
    kv_cache_dtype: str | None = None

    @classmethod
    def best_of(cls, engine: str, results: list[WorkerResult], errors: list[str]) -> "Measurement":
        if not results:
            return cls(engine, "", "", float("nan"), float("nan"), float("nan"), 0, errors[-1] if errors else "no run")
        best = min(results, key=lambda r: r.seconds)
        return cls(engine, best.detail, best.dtype, best.seconds, best.output_tokens / best.seconds,
                   (best.prompt_tokens + best.output_tokens) / best.seconds, max(r.peak_rss_bytes for r in results),
                   kv_cache_dtype=best.kv_cache_dtype)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--model", default="smollm2-135m-instruct", help="a model name or Hugging Face folder")
    parser.add_argument("--workloads", default="a,b,c", help="comma-separated subset of a,b,c")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrinks prompt counts and token counts proportionally (e.g. 0.25 for a quick run)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds per workload; the best round counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads for every engine (default: torch's default here, %(default)s)")
    parser.add_argument("--engines", default=",".join(["ours", *PEERS]),
                        help="comma-separated engines (openvino is added by --openvino-python)")
    parser.add_argument("--dtype", default="auto", help="our engine's dtype (default: its own 'auto')")
    parser.add_argument("--quantization", default="auto", type=lambda v: None if v == "none" else v,
                        help="our engine's quantization: its default 'auto' (int8 where that is the default), "
                             "'none' (the dtype's products), or a method")
    parser.add_argument("--kv-cache-dtype", default="auto", help="our engine's kv_cache_dtype (default: 'auto')")
    parser.add_argument("--hf-dtype", default="auto", choices=["auto", "probe", "both", "float32", "bfloat16"],
                        help="transformers' dtype; auto: what our engine's dtype='auto' picks on this CPU (float32 "
                             "without native bf16); probe: the faster of both in a short run; both: its static "
                             "generate in each dtype, side by side")
    parser.add_argument("--checkpoint-dtype", choices=["as-is", "float32"], default="as-is",
                        help="float32: every engine loads a float32 copy of the model, as save_pretrained writes "
                             "after a float32 fine-tune (our dtype='auto' then picks what it picks for one)")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="batch size of transformers' static generate")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0,
                        help="KV cache budget for every engine that takes one (ours, transformers CB, OpenVINO)")
    parser.add_argument("--openvino-python", type=Path,
                        help="interpreter of a virtualenv with openvino-genai: adds OpenVINO GenAI as a peer")
    parser.add_argument("--openvino-model", type=Path,
                        help="the OpenVINO export (default: the one benchmarks/openvino_export.py makes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of workload (b)'s lengths and text order")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from engine.model_loader.folder import resolve_model_path

    model_path = resolve_model_path(args.model)
    engines = select_engines(args, model_path)
    rates, shape = print_header(args, model_path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    workloads = build_workloads(args.workloads.split(","), tokenizer, args.scale, args.seed)
    with tempfile.TemporaryDirectory(prefix="throughput-") as tmp:
        if args.checkpoint_dtype == "float32":
            model_path = float32_copy(model_path, Path(tmp) / "float32-checkpoint")
            args.model = str(model_path)
        opts = WorkerOptions(args.model, str(model_path), args.threads, args.dtype, "float32", args.hf_batch_size,
                             int(args.kv_cache_gib * 2**30), str(args.openvino_model) if args.openvino_model else None,
                             args.quantization, args.kv_cache_dtype)
        opts.hf_dtype = choose_hf_dtype(args, model_path, tokenizer, opts, Path(tmp))
        print(f"transformers dtype: {opts.hf_dtype} | scale {args.scale} | best of {args.rounds} round(s) | "
              f"KV cache budget {args.kv_cache_gib:g} GiB\n")
        for workload in workloads:
            file = Path(tmp) / f"workload-{workload.name}.json"
            workload.save(file)
            names = engines + (["ours-no-prefix-cache"] if workload.shared_prefix_len and "ours" in engines else [])
            measurements = measure(workload, file, names, args, opts)
            print_table(workload, measurements, args.rounds)
            print_roofline(workload, measurements.get("ours"), shape, rates)
            print()


def float32_copy(model_path: Path, folder: Path) -> Path:
    """The model saved again in float32 (weights and config.json's dtype), with its tokenizer
    and generation config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(folder)
    print(f"checkpoint: a float32 copy of {model_path.name}", flush=True)
    return folder


def select_engines(args: argparse.Namespace, model_path: Path) -> list[str]:
    """--engines, plus OpenVINO (and its export's folder) with --openvino-python, and
    transformers' generate in each dtype for --hf-dtype both; exits on an unknown name."""
    engines = [e for e in args.engines.split(",") if e]
    if args.hf_dtype == "both" and "hf-generate" in engines:
        at = engines.index("hf-generate")
        engines[at : at + 1] = list(HF_GENERATE_IN)
    if args.openvino_python:
        engines.append("openvino")
        args.openvino_model = args.openvino_model or _default_openvino_export(model_path)
    unknown = [e for e in engines if e not in LABELS]
    if unknown:
        sys.exit(f"unknown engines {unknown}; choose from {sorted(LABELS)}")
    return engines


def print_header(args: argparse.Namespace, model_path: Path) -> tuple[rl.MachineRates, rl.ModelShape]:
    """Prints the CPU, its measured rates and the model's size; returns them for the rooflines."""
    cpu = detect_cpu()
    print(f"CPU: {cpu.describe()} | threads: {args.threads}")
    rates = rl.measure_rates(cpu.native_bf16)
    print(rates.describe())
    shape = rl.model_shape(model_path)
    print(f"model: {model_path.name}: {shape.matmul_params / 1e6:.1f}M parameters in matrix products (lm_head "
          f"included), {2 * shape.matmul_params / 1e9:.2f} GFLOP/token + attention")
    return rates, shape


def choose_hf_dtype(args: argparse.Namespace, model_path: Path, tokenizer, opts: WorkerOptions, tmp: Path) -> str:
    """--hf-dtype resolved: as given; auto as our engine's dtype='auto' on this CPU; probe by a
    short timed run of each; both as auto for the peers other than `HF_GENERATE_IN`'s."""
    if args.hf_dtype in ("float32", "bfloat16"):
        return args.hf_dtype
    if args.hf_dtype in ("auto", "both"):
        dtype = resolve_model_config(model_path, EngineConfig(model=str(model_path)), None).dtype
        return str(dtype).removeprefix("torch.")
    probe = build_workloads(["a"], tokenizer, scale=8 / 256)[0]  # 8 chat prompts x 4 new tokens
    file = tmp / "probe.json"
    probe.save(file)
    seconds = {}
    for dtype in ("float32", "bfloat16"):
        result = run_worker("hf-generate", file, WorkerOptions(**{**asdict(opts), "hf_dtype": dtype}), args)
        seconds[dtype] = result.seconds if isinstance(result, WorkerResult) else float("inf")
        print(f"probe: transformers generate in {dtype}: {seconds[dtype]:.2f} s", file=sys.stderr)
    return min(seconds, key=seconds.get)


def measure(workload: Workload, file: Path, engines: list[str], args: argparse.Namespace,
            opts: WorkerOptions) -> dict[str, Measurement]:
    """Every engine on `workload` for `args.rounds` rounds, the order rotating each round."""
    results = {e: [] for e in engines}
    errors = {e: [] for e in engines}
    for round_index in range(args.rounds):
        shift = round_index % len(engines)
        for engine in engines[shift:] + engines[:shift]:
            print(f"[{workload.name}] round {round_index + 1}/{args.rounds}: {LABELS[engine]} ...",
                  file=sys.stderr, flush=True)
            result = run_worker(engine, file, opts, args)
            (results if isinstance(result, WorkerResult) else errors)[engine].append(result)
    return {e: Measurement.best_of(e, results[e], errors[e]) for e in engines}


def run_worker(engine: str, workload_file: Path, opts: WorkerOptions,
               args: argparse.Namespace) -> WorkerResult | str:
    """One measurement in a fresh process; the result, or the error's last lines."""
    python = str(args.openvino_python) if engine == "openvino" else sys.executable
    runner = engine
    if engine in HF_GENERATE_IN:
        runner, opts = "hf-generate", WorkerOptions(**{**asdict(opts), "hf_dtype": HF_GENERATE_IN[engine]})
    command = [python, str(Path(__file__).resolve()), "--worker", runner, "--workload-file", str(workload_file),
               "--options", json.dumps(asdict(opts))]
    threads = str(opts.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false",
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return WorkerResult(**json.loads(line.removeprefix(RESULT_PREFIX)))
    lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip(" ^~")]
    print(f"  {LABELS[engine]} failed (exit {done.returncode}):\n    " + "\n    ".join(lines[-8:]), file=sys.stderr)
    return f"exit {done.returncode}: {lines[-1] if lines else 'no output'}"


def print_table(workload: Workload, measurements: dict[str, Measurement], rounds: int) -> None:
    """One row per engine; `ours/peer` is our output tokens/s over the peer's."""
    print(f"== ({workload.name}) {workload.description}: {workload.summary()}, EOS ignored, "
          f"best of {rounds} round(s)")
    print(f"{'engine':<24}{'setup':<44}{'out tok/s':>11}{'total tok/s':>13}{'peak RSS':>11}{'ours/peer':>11}")
    ours = measurements.get("ours")
    for engine, m in measurements.items():
        if m.error:
            print(f"{LABELS[engine]:<24}failed: {m.error[:200]}")
            continue
        ratio = ("-" if engine == "ours" or ours is None or ours.error
                 else f"{ours.output_tokens_per_s / m.output_tokens_per_s:.2f}x")
        print(f"{LABELS[engine]:<24}{m.detail[:43]:<44}{m.output_tokens_per_s:>11.1f}{m.total_tokens_per_s:>13.1f}"
              f"{m.peak_rss_bytes / 2**20:>8.0f} MiB{ratio:>11}")
    off = measurements.get("ours-no-prefix-cache")
    if ours and off and not ours.error and not off.error:
        print(f"prefix caching on/off (ours): {ours.output_tokens_per_s / off.output_tokens_per_s:.2f}x")


def print_roofline(workload: Workload, ours: Measurement | None, shape: rl.ModelShape,
                   rates: rl.MachineRates) -> None:
    """The workload's roofline at our engine's weight and KV cache dtypes, and our fraction of it."""
    ran = ours is not None and not ours.error
    dtype = ours.dtype if ran else "float32"
    cache = ours.kv_cache_dtype if ran and ours.kv_cache_dtype else dtype
    bound = rl.roofline(shape, rates, [len(p) for p in workload.prompts], workload.max_tokens,
                        workload.shared_prefix_len, rl.element_size(dtype), ENGINE_MAX_NUM_SEQS,
                        rl.element_size(cache))
    line = (f"roofline ({dtype} weights, {cache} KV): {bound.output_tokens_per_s:.0f} output tok/s, {bound.bound}-bound "
            f"(compute {bound.compute_s:.2f} s, memory {bound.memory_s:.2f} s)")
    if ran:
        line += f"; ours at {ours.output_tokens_per_s / bound.output_tokens_per_s:.1%} of it"
    print(line)


def _default_openvino_export(model_path: Path) -> Path:
    from benchmarks.openvino_export import MARKER, export_dir

    path = export_dir(model_path)
    if not (path / MARKER).exists():
        sys.exit(f"no OpenVINO export at {path}; run `make bench-openvino` or "
                 f"`.venv/bin/python benchmarks/openvino_export.py` first")
    return path


if __name__ == "__main__":
    main()
