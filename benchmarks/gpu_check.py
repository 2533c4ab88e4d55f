"""The whole GPU picture in one command, within --budget-s seconds (8 minutes by default,
planned for an H100), ending in one table to paste into benchmarks/RESULTS.md:

(a) tests/engine/test_gpu.py in a subprocess: every family against transformers, two ranks
    over gloo on one GPU, the quantized checkpoints' products, bfloat16 against float32;
(b) nano-vllm's workload (256 prompts, input and output lengths each uniform in 100-1,024,
    random token ids, EOS ignored) on random Qwen3-0.6B- and Llama-3.2-1B-shaped models:
    output tok/s against 17,000 and 25,000;
(c) a Llama-3.1-8B shape at 1,000 tokens in and 1,000 out, bfloat16 and FP8 (quantized at
    load): against 10,000 and 15,000 output tok/s;
(d) a JSON schema against the same rows unconstrained (Llama-3.2-1B shape): ratio >= 0.9;
(e) the decode step at batch 256 (Llama-3.2-1B shape) against the HBM roofline: >= 50%;
(f) asynchronous scheduling on against off on one workload: tok/s of each, outputs equal;
(g) speculative decoding (prompt lookup, and a two-layer draft model of random weights)
    against none at batch 1 and 4 on prompts that repeat a span: tok/s ratio, acceptance,
    greedy tokens equal (in bfloat16, rows may part where the two top tokens were within
    NEAR_TIE_NATS: the rows that differ, where, and the gap are reported).

The models have random weights, built on the GPU into a temporary folder (in /dev/shm where
it has room), each with a byte-level tokenizer of the model's whole vocabulary (random
merges, `build_vocab_tokenizer`), so that detokenizing and filling grammar masks cost what a
real vocabulary costs. Nothing downloads, and Dagster is never imported.

Time: each stage gets a share of the time left in proportion to what it is planned to take
on an H100 (`STAGES`). A run takes fewer prompts where the roofline (benchmarks/roofline.py,
at the rates measured here), scaled by the fraction of it the previous run reached, says the
full count would not fit; a run still going well past its stage's share is stopped and
reported "not run (time)", as is one that cannot fit at all.

--dry-run: on a CPU, every stage at tiny size (tiny configs of the same families, a few
prompts of a few tokens), run far enough to execute steps, with no time limit and nothing
judged; stage (a) only collects test_gpu.py. CI runs it (tests/benchmarks/test_gpu_check.py).

    python3 benchmarks/gpu_check.py                      # the GPU machine: $OUT/gpu-check.md
    .venv/bin/python benchmarks/gpu_check.py --dry-run   # a CPU, in well under a minute
"""

import argparse
import contextlib
import gc
import importlib.util
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import cached_property, partial
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.comparison import best_times  # noqa: E402
from benchmarks.gpu_throughput import _replay_seconds, copy_bandwidth, model_config  # noqa: E402
from benchmarks.roofline import MachineRates, element_size, measure_rates, model_shape, roofline  # noqa: E402
from benchmarks.structured_throughput import SCHEMA  # noqa: E402
from engine import LLM, RequestOutput, SamplingParams, StructuredOutputsParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.quantization.fp8 import fp8_products_available  # noqa: E402

TEST_FILE = "tests/engine/test_gpu.py"
MAX_NUM_SEQS = EngineConfig().max_num_seqs
# Overrides that make any of the shapes below a dry run's tiny model of the same family.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
# Guesses until this run has measured them (Calibration): they only size the first runs.
FIRST_EFFICIENCY = 0.5
FIRST_START_S = 15.0
FIRST_BUILD_BYTES_PER_S = 1e9
LOAD_BYTES_PER_S = 5e9  # an engine start reading weights from the page cache to the GPU
GUARD_SLACK = 1.25  # a stage's runs are sized to end, and stopped, at this multiple of its share

PASS, BELOW, FAIL, CRASHED, DRY = "pass", "below target", "fail", "crashed", "dry run"
NOT_RUN_TIME = "not run (time)"


def qwen3_0_6b() -> transformers.PretrainedConfig:
    return transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
        rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1000000.0})


def llama_3_1_8b() -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=False, max_position_embeddings=16384,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def llama_draft() -> transformers.PretrainedConfig:
    """Llama-3.2-1B's shape with two of its sixteen layers: a draft model of its vocabulary."""
    config = model_config("llama-1b")
    config.num_hidden_layers = 2
    return config


# name: (label, full-size config)
SHAPES: dict[str, tuple[str, Callable[[], transformers.PretrainedConfig]]] = {
    "qwen3-0.6b": ("Qwen3-0.6B", qwen3_0_6b),
    "llama-3.2-1b": ("Llama-3.2-1B", partial(model_config, "llama-1b")),
    "llama-3.1-8b": ("Llama-3.1-8B", llama_3_1_8b),
    "llama-draft": ("two-layer Llama-3.2-1B draft", llama_draft),
}


def shape_config(name: str, tiny: bool) -> transformers.PretrainedConfig:
    """The shape's config, or its family's tiny one (per-layer lists rebuilt for the fewer layers)."""
    config = SHAPES[name][1]()
    if not tiny:
        return config
    settings = config.to_diff_dict()
    settings.pop("layer_types", None)
    return type(config)(**{**settings, **TINY})


def build_vocab_tokenizer(folder: Path, vocab_size: int, seed: int = 0) -> None:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens saved into `folder`: three
    specials (<|endoftext|>, <s> = 1, </s> = 2), the 256 byte symbols, then random byte
    strings (about 7 bytes on average), each a merge of a shorter one and a byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", "<s>", "</s>", *alphabet]
    known, stems, merges = set(tokens), list(alphabet), []
    while len(tokens) < vocab_size:
        stem, byte = rng.choice(stems), rng.choice(alphabet)
        if stem + byte in known:
            continue
        known.add(stem + byte)
        tokens.append(stem + byte)
        merges.append((stem, byte))
        if len(stem) < 11:
            stems.append(stem + byte)
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                         unk_token="<|endoftext|>", pad_token="<|endoftext|>").save_pretrained(folder)


def build_folder(folder: Path, config: transformers.PretrainedConfig, dtype: torch.dtype,
                 device: torch.device) -> int:
    """A random model of `config` in `dtype`, built on `device`, saved into `folder` with a
    tokenizer of its vocabulary; returns the bytes of its weights."""
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    if device.type == "cuda":  # its memory back before an engine measures what is free
        gc.collect()
        torch.cuda.empty_cache()
    build_vocab_tokenizer(folder, config.vocab_size)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def weight_bytes(config: transformers.PretrainedConfig, dtype: torch.dtype) -> int:
    """What `build_folder` will write, counted on a model without storage."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@dataclass
class Workload:
    """Prompts as token ids and the tokens each generates, EOS ignored, greedy; with
    `logprobs`, each token's top ones (what a comparison of two runs reads at a difference)."""

    prompts: list[list[int]]
    max_tokens: list[int]
    logprobs: int | None = None

    def head(self, count: int) -> "Workload":
        return Workload(self.prompts[:count], self.max_tokens[:count], self.logprobs)

    def inputs(self) -> list[dict]:
        return [{"prompt_token_ids": p} for p in self.prompts]

    def params(self) -> list[SamplingParams]:
        return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=self.logprobs)
                for n in self.max_tokens]

    def describe(self) -> str:
        ins, outs = [len(p) for p in self.prompts], self.max_tokens
        spread = (lambda v: f"{min(v)}" if min(v) == max(v) else f"{min(v)}-{max(v)}")
        return f"{len(ins)} prompts x {spread(ins)} in / {spread(outs)} out"


def random_workload(count: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int,
                    seed: int = 0) -> Workload:
    """`count` prompts of random token ids, lengths uniform in `inputs`, outputs uniform in `outputs`."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*inputs))] for _ in range(count)]
    return Workload(prompts, [rng.randint(*outputs) for _ in range(count)])


@dataclass(frozen=True)
class Sizes:
    """Prompt counts and lengths of every workload: the real ones, or a dry run's."""

    nano_prompts: int  # (b), nano-vllm's benchmark
    nano_lengths: tuple[int, int]
    long_prompts: int  # (c)
    long_length: int
    structured_prompts: int  # (d)
    structured_tokens: int
    decode_batch: int  # (e)
    decode_prompt: int
    decode_steps: int
    async_prompts: int  # (f)
    min_prompts: int  # fewer than this and a run is not run
    warm_prompts: int  # the warm-up of each engine
    warm_tokens: int
    spec_span: int  # (g): a prompt is a random span of this many tokens, four times
    spec_tokens: int


FULL_SIZES = Sizes(256, (100, 1024), 256, 1000, 256, 160, 256, 128, 128, 128, 32, 4, 8, 64, 256)
DRY_SIZES = Sizes(4, (8, 24), 2, 16, 3, 12, 4, 8, 4, 4, 1, 2, 2, 6, 12)


@dataclass
class Row:
    """One line of the table; `note` goes under it."""

    stage: str
    workload: str
    figure: str
    target: str
    result: str
    note: str = ""


@dataclass
class Timed:
    seconds: float
    outputs: list[RequestOutput]

    @property
    def tokens(self) -> int:
        return sum(len(o.outputs[0].token_ids) for o in self.outputs)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def token_ids(self) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in self.outputs]


@dataclass
class Calibration:
    """What this run has measured so far, for sizing the runs still to come."""

    # The best output tok/s over its roofline of a run so far: the small models' runs wait on the
    # host more than a larger model's, so their worst would size the 8B's runs far too short.
    efficiency: float | None = None
    start_s: float = FIRST_START_S  # the last engine start, warm-up included
    build_bytes_per_s: float = FIRST_BUILD_BYTES_PER_S  # the last model folder's


class TimeUp(Exception):
    """A run went past its stage's limit; the engine aborted its requests."""


class _Guard:
    """`LLM.generate`'s progress bar (use_tqdm factory), ticked every step: raises TimeUp
    once the deadline has passed."""

    def __init__(self, deadline: float, **_: object) -> None:
        self.deadline = deadline
        self.postfix = ""

    def update(self, _: int) -> None:
        if time.monotonic() > self.deadline:
            raise TimeUp("the stage's time ran out")

    def close(self) -> None:
        pass


def judge(value: float, target: float, dry_run: bool) -> str:
    return DRY if dry_run else PASS if value >= target else BELOW


def say(message: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Check:
    """What the stages share: sizes and device, the model folders (built once), the one
    engine open at a time, the calibration and the running stage's time limits."""

    def __init__(self, sizes: Sizes, device: torch.device, root: Path, tests_log: Path, fp8_kv_cache: bool) -> None:
        self.sizes, self.device, self.root, self.tests_log = sizes, device, root, tests_log
        self.fp8_kv_cache = fp8_kv_cache
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.calibration = Calibration()
        self.guard = math.inf  # where the running stage's time ends: its runs are sized to it and stopped there
        self.folders: dict[str, Path] = {}
        self._configs: dict[str, transformers.PretrainedConfig] = {}
        self._bytes: dict[str, int] = {}
        self._open: tuple[tuple, LLM] | None = None

    @cached_property
    def rates(self) -> MachineRates:
        """Measured when a stage first needs them: after the tests, which have the GPU to themselves."""
        return machine_rates(self.device)

    @property
    def dry_run(self) -> bool:
        return self.device.type != "cuda"

    def time_left(self) -> float:
        return self.guard - time.monotonic()

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def config(self, name: str) -> transformers.PretrainedConfig:
        if name not in self._configs:
            self._configs[name] = shape_config(name, tiny=self.dry_run)
        return self._configs[name]

    def weight_bytes(self, name: str) -> int:
        if name not in self._bytes:
            self._bytes[name] = weight_bytes(self.config(name), self.dtype)
        return self._bytes[name]

    def folder(self, name: str) -> Path:
        """The shape's model folder, built the first time (after closing the open engine,
        whose KV cache holds most of the GPU)."""
        if name not in self.folders:
            self.close_llm()
            started = time.perf_counter()
            folder = self.root / name
            size = build_folder(folder, self.config(name), self.dtype, self.device)
            seconds = time.perf_counter() - started
            self.calibration.build_bytes_per_s = size / seconds
            say(f"{name}: {size / 1e9:.2f} GB of weights built and saved in {seconds:.1f} s")
            self.folders[name] = folder
        return self.folders[name]

    def start_estimate(self, name: str) -> float:
        """Seconds an engine start of the shape should take, warm-up included."""
        return self.calibration.start_s + self.weight_bytes(name) / LOAD_BYTES_PER_S

    def build_estimate(self, name: str) -> float:
        if name in self.folders:
            return 0.0
        return self.weight_bytes(name) / self.calibration.build_bytes_per_s

    def llm(self, name: str, **settings: object) -> LLM:
        """The engine of the shape with these settings: the open one if it is that, else a
        new one (the open one closed first), warmed up."""
        settings = {"dtype": self.dtype_name,
                    "async_scheduling": self.device.type == "cuda", **settings}
        if self.dry_run:  # a tiny model: a small cache, and one thread (less to lose on a busy CI machine)
            settings = {"kv_cache_memory": 64 << 20, "num_threads": 1, **settings}
        key = (name, tuple(sorted(settings.items())))
        if self._open is not None and self._open[0] == key:
            return self._open[1]
        folder = self.folder(name)
        self.close_llm()
        started = time.perf_counter()
        llm = LLM(str(folder), **settings)
        self._open = (key, llm)
        warm = random_workload(self.sizes.warm_prompts, (8, 64), (self.sizes.warm_tokens,) * 2, 256, seed=7)
        self.generate(llm, warm.inputs(), warm.params())
        self.calibration.start_s = time.perf_counter() - started
        say(f"{name} {settings}: engine started and warmed up in {self.calibration.start_s:.1f} s")
        return llm

    def close_llm(self) -> None:
        if self._open is not None:
            self._open[1].close()
            self._open = None
            if self.device.type == "cuda":  # what close() left cached goes back before the next engine plans its cache
                gc.collect()
                torch.cuda.empty_cache()

    def generate(self, llm: LLM, inputs: list[dict], params: list[SamplingParams]) -> list[RequestOutput]:
        """`llm.generate`, stopped (TimeUp, the engine closed) past the stage's guard."""
        try:
            return llm.generate(inputs, params, use_tqdm=partial(_Guard, self.guard))
        except TimeUp:
            self.close_llm()
            raise

    def timed(self, llm: LLM, workload: Workload) -> Timed:
        """One timed run of the workload from an empty prefix cache."""
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = self.generate(llm, workload.inputs(), workload.params())
        return Timed(time.perf_counter() - started, outputs)

    def ceiling(self, name: str, workload: Workload, fp8: bool = False) -> float:
        """The workload's roofline in output tok/s on this machine. roofline() takes one
        element size, so FP8 weights (and an FP8 KV cache where asked) are counted as a
        16-bit shape with half the parameters (and KV heads): the same bytes, and the same
        products at FP8's doubled rate."""
        shape = model_shape(self.folder(name))
        if fp8:
            shape = replace(shape, matmul_params=shape.matmul_params // 2,
                            kv_heads=max(1, shape.kv_heads // 2) if self.fp8_kv_cache else shape.kv_heads)
        return roofline(shape, self.rates, [len(p) for p in workload.prompts], workload.max_tokens,
                        0, self.dtype.itemsize, MAX_NUM_SEQS).output_tokens_per_s

    def estimate_s(self, name: str, workload: Workload) -> float:
        """Seconds the workload should take: its roofline at the calibrated efficiency."""
        efficiency = self.calibration.efficiency or FIRST_EFFICIENCY
        return sum(workload.max_tokens) / (self.ceiling(name, workload) * efficiency)

    def fit(self, name: str, workload: Workload, seconds: float, slowdown: float = 1.0) -> Workload | None:
        """The longest head of the workload (all, 3/4, 1/2, 1/4 or the minimum of its
        prompts) expected to run in `seconds` when it takes `slowdown` times `estimate_s`;
        None if even the minimum would not."""
        full = len(workload.prompts)
        for count in dict.fromkeys([full, full * 3 // 4, full // 2, full // 4, self.sizes.min_prompts]):
            head = workload.head(count)
            if 0 < count <= full and slowdown * self.estimate_s(name, head) <= seconds:
                return head
        return None

    def measured(self, name: str, workload: Workload, run: Timed, fp8: bool, calibrate: bool) -> float:
        """The run's fraction of its roofline, counted in the calibration with `calibrate`."""
        fraction = run.rate / self.ceiling(name, workload, fp8)
        if calibrate:
            self.calibration.efficiency = max(fraction, self.calibration.efficiency or 0.0)
        return fraction


# ---------------------------------------------------------------- the stages


def stage_tests(check: Check, rows: list[Row]) -> None:
    """(a) test_gpu.py in a subprocess (collected only in a dry run), its log beside the table."""
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", TEST_FILE]
    command += ["--collect-only", "-q"] if check.dry_run else ["-v", "-rfEsx", "--durations=15"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    timeout = None if math.isinf(check.guard) else max(1.0, check.time_left())
    try:
        output, timed_out = process.communicate(timeout=timeout)[0], False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the test's own processes (ranks) too
        output, timed_out = process.communicate()[0], True
    check.tests_log.write_text(output)
    workload = f"{TEST_FILE} (log: {check.tests_log.name})"
    if check.dry_run:
        collected = re.search(r"(\d+) tests? collected", output)
        rows.append(Row("a", workload, f"{collected.group(1)} tests collected" if collected else "collection failed",
                        "all pass", DRY if process.returncode == 0 and collected else CRASHED))
        return
    counts = outcome_counts(output)
    figure = ", ".join(f"{n} {outcome}" for outcome, n in counts.items() if n) or "no test ran"
    bad = counts["failed"] + counts["error"]
    result = FAIL if bad or (process.returncode not in (0, None) and not timed_out) else (
        "not finished (time)" if timed_out else PASS)
    rows.append(Row("a", workload, figure, "all pass", result,
                    "stopped at the stage's time limit" if timed_out else ""))


def outcome_counts(verbose_output: str) -> dict[str, int]:
    """Outcomes of a `pytest -v` run, counted from its per-test lines (a run cut short too)."""
    words = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "XFAIL": "xfailed", "XPASS": "xpassed",
             "SKIPPED": "skipped"}
    counts = dict.fromkeys(words.values(), 0)
    for word in re.findall(r"^\S+::\S+ (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b", verbose_output, re.MULTILINE):
        counts[words[word]] += 1
    return counts


def throughput_row(check: Check, stage: str, name: str, llm: LLM, workload: Workload, target: float, label: str,
                   fp8: bool = False, calibrate: bool = True) -> tuple[Row, Timed]:
    """The engine's output tok/s on the workload, as a row, and the run (which sizes the
    runs after it unless `calibrate` is False: a setting meant to be slower)."""
    run = check.timed(llm, workload)
    fraction = check.measured(name, workload, run, fp8, calibrate)
    note = (f"{SHAPES[name][0]} {label}: {workload.describe()}, {run.tokens:,} output tokens in {run.seconds:.1f} s, "
            f"{fraction:.0%} of its roofline here ({check.ceiling(name, workload, fp8):,.0f} tok/s)")
    return Row(stage, f"{SHAPES[name][0]} {label}, {workload.describe()}", f"{run.rate:,.0f} out tok/s",
               f">= {target:,.0f}", judge(run.rate, target, check.dry_run), note), run


def stage_nano(check: Check, rows: list[Row]) -> None:
    """(b) nano-vllm's workload on the Qwen3-0.6B and Llama-3.2-1B shapes."""
    s = check.sizes
    models = [("qwen3-0.6b", 17_000), ("llama-3.2-1b", 25_000)]
    fulls = {name: random_workload(s.nano_prompts, s.nano_lengths, s.nano_lengths, check.config(name).vocab_size)
             for name, _ in models}
    for name, _ in models:  # both folders first: a folder is built with no engine open
        check.folder(name)
    for i, (name, target) in enumerate(models):
        full = fulls[name]
        llm = check.llm(name)
        later = sum(check.start_estimate(n) + check.estimate_s(n, fulls[n]) for n, _ in models[i + 1:])
        workload = check.fit(name, full, check.time_left() - later)
        if workload is None:
            rows.append(Row("b", f"{SHAPES[name][0]} {check.dtype_name}, {full.describe()}", "-", f">= {target:,}",
                            NOT_RUN_TIME))
            continue
        rows.append(throughput_row(check, "b", name, llm, workload, target, check.dtype_name)[0])


def stage_8b(check: Check, rows: list[Row]) -> None:
    """(c) the Llama-3.1-8B shape at 1,000 in / 1,000 out, in bfloat16 and FP8 quantized at load."""
    s, name = check.sizes, "llama-3.1-8b"
    full = random_workload(s.long_prompts, (s.long_length,) * 2, (s.long_length,) * 2, check.config(name).vocab_size)
    fp8_settings = {"quantization": "fp8", **({"kv_cache_dtype": "fp8"} if check.fp8_kv_cache else {})}
    variants = [(check.dtype_name, {}, 10_000, False), ("FP8", fp8_settings, 15_000, True)]
    if check.dry_run:  # no FP8 units on a CPU: the variant's run goes through unquantized
        variants[1] = ("FP8 (dry run: unquantized)", {}, 15_000, False)
    elif not fp8_products_available(check.device):
        rows.append(Row("c", f"{SHAPES[name][0]} FP8", "-", ">= 15,000", "not run (no FP8 units)"))
        variants.pop()
    starts = sum(check.start_estimate(name) for _ in variants)
    if check.build_estimate(name) + starts > check.time_left():
        rows += [Row("c", f"{SHAPES[name][0]} {v[0]}, {full.describe()}", "-", f">= {v[2]:,}", NOT_RUN_TIME)
                 for v in variants]
        return
    for i, (label, settings, target, fp8) in enumerate(variants):
        llm = check.llm(name, **settings)
        if i == 0:  # one size for both, fitted once the first engine has started
            later_starts = (len(variants) - 1) * check.start_estimate(name)
            workload = check.fit(name, full, (check.time_left() - later_starts) / len(variants))
        if workload is None:
            rows += [Row("c", f"{SHAPES[name][0]} {v[0]}, {full.describe()}", "-", f">= {v[2]:,}", NOT_RUN_TIME)
                     for v in variants[i:]]
            return
        rows.append(throughput_row(check, "c", name, llm, workload, target, label, fp8)[0])
        check.close_llm()


def stage_structured(check: Check, rows: list[Row]) -> None:
    """(d) the same rows with structured_throughput's JSON schema and without, each row
    generating as many tokens in both (the constrained run fixes them): the ratio of tok/s."""
    s, name = check.sizes, "llama-3.2-1b"
    what = f"{SHAPES[name][0]}, {s.structured_prompts} rows, JSON schema / unconstrained"
    if importlib.util.find_spec("xgrammar") is None:
        rows.append(Row("d", what, "-", ">= 0.90", "not run (xgrammar is not installed)"))
        return
    prompts = random_workload(s.structured_prompts, s.nano_lengths, s.nano_lengths,
                              check.config(name).vocab_size).prompts
    llm = check.llm(name)
    # Three runs (the first compiles the schema), the constrained ones at about a third of the plain rate.
    nano = check.fit(name, Workload(prompts, [s.structured_tokens] * len(prompts)), check.time_left(), slowdown=7.0)
    if nano is None:
        rows.append(Row("d", what, "-", ">= 0.90", NOT_RUN_TIME))
        return
    what = what.replace(f"{s.structured_prompts} rows", f"{len(nano.prompts)} rows")
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    constrained = [SamplingParams(temperature=0, max_tokens=s.structured_tokens, structured_outputs=constraint)]
    first = check.generate(llm, nano.inputs(), constrained * len(nano.prompts))
    lengths = [len(o.outputs[0].token_ids) for o in first]
    plain = Workload(nano.prompts, lengths).params()

    def same_lengths(outputs: list[RequestOutput]) -> None:
        assert [len(o.outputs[0].token_ids) for o in outputs] == lengths, "the two runs' workloads differ"

    times = best_times(llm, nano.inputs(), {"plain": plain, "json": constrained * len(lengths)}, 1, same_lengths)
    ratio = times["plain"] / times["json"]
    complete = sum(o.outputs[0].finish_reason == "stop" for o in first)
    rows.append(Row("d", what, f"{ratio:.2f} ({sum(lengths) / times['json']:,.0f} / {sum(lengths) / times['plain']:,.0f}"
                    " tok/s)", ">= 0.90", judge(ratio, 0.9, check.dry_run),
                    f"structured: {sum(lengths):,} tokens per run, {complete} of {len(lengths)} rows complete JSON"))


def stage_decode_roofline(check: Check, rows: list[Row]) -> None:
    """(e) the decode step at a full batch: (time of steps+1 tokens - time of 1) / steps,
    against the bytes a step must read (weights, the batch's KV cache) at the measured copy
    bandwidth (roofline()'s memory time, the same difference)."""
    s, name = check.sizes, "llama-3.2-1b"
    batch, steps = s.decode_batch, s.decode_steps
    rng = random.Random(1)
    prompts = [[rng.randrange(3, check.config(name).vocab_size) for _ in range(s.decode_prompt)]
               for _ in range(batch)]
    llm = check.llm(name)
    cache_size = element_size(llm.llm_engine.config.kv_cache_dtype)  # a CPU's default cache may be narrower
    seconds, memory = {}, {}
    for tokens in (1, steps + 1):
        workload = Workload(prompts, [tokens] * batch)
        check.timed(llm, workload)  # warm
        seconds[tokens] = check.timed(llm, workload).seconds
        memory[tokens] = roofline(model_shape(check.folder(name)), check.rates, [s.decode_prompt] * batch,
                                  workload.max_tokens, 0, check.dtype.itemsize, MAX_NUM_SEQS, cache_size).memory_s
    step = (seconds[steps + 1] - seconds[1]) / steps
    floor = (memory[steps + 1] - memory[1]) / steps
    try:  # a side figure: the stage's own stands without it
        replay = _replay_seconds(llm.llm_engine.model_runner, batch)  # nan without CUDA graphs
        forward = ("no CUDA graphs here" if math.isnan(replay) else
                   f"the forward alone (CUDA graph replay) {replay * 1e3:.2f} ms, {floor / replay:.0%} of the roofline")
    except Exception as exc:  # noqa: BLE001
        forward = f"the CUDA graph replay not timed ({type(exc).__name__}: {exc})"
    fraction = floor / step
    rows.append(Row("e", f"{SHAPES[name][0]} decode step, batch {batch}, {s.decode_prompt}-token prompts",
                    f"{fraction:.0%} of HBM roofline ({step * 1e3:.2f} ms/step)", ">= 50%",
                    judge(fraction, 0.5, check.dry_run),
                    f"floor {floor * 1e3:.2f} ms at {check.rates.bandwidth / 1e12:.2f} TB/s copy bandwidth; {forward}"))


def stage_async(check: Check, rows: list[Row]) -> None:
    """(f) asynchronous scheduling on, then off, on the same workload: tok/s of each, and
    the same greedy tokens."""
    s, name = check.sizes, "llama-3.2-1b"
    full = random_workload(s.async_prompts, s.nano_lengths, s.nano_lengths, check.config(name).vocab_size, seed=3)
    check.llm(name, async_scheduling=True)
    # Two runs (the second synchronous, slower) and a second engine start.
    workload = check.fit(name, full, check.time_left() - check.start_estimate(name), slowdown=2.5)
    if workload is None:
        rows.append(Row("f", f"{SHAPES[name][0]}, async scheduling on / off", "-", "outputs equal", NOT_RUN_TIME))
        return
    runs = {}
    for mode in (True, False):
        label = f"async scheduling {'on' if mode else 'off'}"
        row, runs[mode] = throughput_row(check, "f", name, check.llm(name, async_scheduling=mode), workload, 0, label,
                                         calibrate=mode)
        rows.append(replace(row, target="-", result="-" if not check.dry_run else DRY))
    equal = sum(a == b for a, b in zip(runs[True].token_ids(), runs[False].token_ids()))
    rows.append(Row("f", f"{SHAPES[name][0]}, greedy tokens of on against off", f"{equal} of {len(workload.prompts)}"
                    f" equal (on/off {runs[True].rate / runs[False].rate:.2f}x)", "all equal",
                    DRY if check.dry_run else PASS if equal == len(workload.prompts) else FAIL))


def repeating_workload(count: int, span: int, tokens: int, vocab: int, seed: int = 0) -> Workload:
    """`count` prompts, each a random span of `span` token ids four times over: a random
    model's greedy continuation of such a prompt tends to go on repeating it, which is what
    prompt lookup proposes (the copying of summaries and extractions, in miniature). Each
    token comes with its top two logprobs, for `compare_greedy`."""
    rng = random.Random(seed)
    spans = [[rng.randrange(3, vocab) for _ in range(span)] for _ in range(count)]
    return Workload([piece * 4 for piece in spans], [tokens] * count, logprobs=2)


# Where two greedy runs of the same rows may part in a 16-bit dtype: their first different token
# was within this many nats of the reference's choice. A bfloat16 product keeps 8 bits of its
# operands (2^-8 of a value, 0.04 of a logit of 10), and on a GPU its tiles follow the batch's shape
# (docs/gpu.md: rows are not batch-invariant there), so a near tie can go either way; float32 rows
# of the same batch must agree to the token.
NEAR_TIE_NATS = {torch.float32: 0.0, torch.bfloat16: 0.1, torch.float16: 0.05}


@dataclass(frozen=True)
class Divergence:
    """Where one row of two greedy runs first differs: its output position, and the gap in
    the reference's logprobs between its own token and the other run's (None: the other's
    token was not among the reference's top ones there, a clear difference)."""

    row: int
    position: int
    gap: float | None


@dataclass(frozen=True)
class Agreement:
    """How two greedy runs of the same rows compare: the rows that differ and where, and
    the gap within which a difference is a near tie (0: none may differ)."""

    rows: int
    divergences: list[Divergence]
    tolerance: float

    @property
    def clear(self) -> list[Divergence]:
        """The differences that are not near ties: the runs disagree where they must agree."""
        return [d for d in self.divergences if d.gap is None or d.gap > self.tolerance]

    @property
    def ok(self) -> bool:
        return not self.clear

    def describe(self) -> str:
        """"4 of 4 rows identical", or how many differ, how many of those clearly, and where
        the first ones part with the gap there ("-": the other token was not a top one)."""
        if not self.divergences:
            return f"{self.rows} of {self.rows} rows identical"
        where = ", ".join(f"row {d.row} at token {d.position} (gap {'-' if d.gap is None else f'{d.gap:.3f}'})"
                          for d in self.divergences[:4])
        kind = (f"{len(self.clear)} clearly (gap over {self.tolerance:g} nats)" if self.clear
                else f"each at a near tie (gap at most {self.tolerance:g} nats)")
        return f"{len(self.divergences)} of {self.rows} rows differ, {kind}: {where}"


def compare_greedy(reference: list[RequestOutput], other: list[RequestOutput], dtype: torch.dtype) -> Agreement:
    """Two greedy runs of the same rows: identical rows agree; a row that differs agrees
    only where, at its first different token, the reference had the other run's token
    within `NEAR_TIE_NATS[dtype]` of its own (read from the reference's logprobs)."""
    divergences = []
    for row, (ref, oth) in enumerate(zip(reference, other, strict=True)):
        ref_ids, other_ids = list(ref.outputs[0].token_ids), list(oth.outputs[0].token_ids)
        if ref_ids == other_ids:
            continue
        position = next((i for i, (a, b) in enumerate(zip(ref_ids, other_ids)) if a != b),
                        min(len(ref_ids), len(other_ids)))
        divergences.append(Divergence(row, position, _gap(ref.outputs[0].logprobs, ref_ids, other_ids, position)))
    return Agreement(len(reference), divergences, NEAR_TIE_NATS.get(dtype, 0.0))


def _gap(logprobs: list[dict] | None, ref_ids: list[int], other_ids: list[int], position: int) -> float | None:
    """The reference's logprob of its token less that of the other run's token at `position`;
    None where either is unknown (no logprobs, a row cut short, the token not among its top ones)."""
    if not logprobs or position >= min(len(ref_ids), len(other_ids), len(logprobs)):
        return None
    step = logprobs[position]
    mine, theirs = step.get(ref_ids[position]), step.get(other_ids[position])
    return None if mine is None or theirs is None else mine.logprob - theirs.logprob


def stage_speculative(check: Check, rows: list[Row]) -> None:
    """(g) speculative decoding against none on the Llama-3.2-1B shape, at batch 1 and 4 (that
    many prompts at once): prompt lookup, and a two-layer draft model of its vocabulary and
    random weights (what a draft costs, and how often such a draft is right). Engines without
    speculation run
    with asynchronous scheduling (the GPU's default), those with it without (they refuse it)."""
    s, name = check.sizes, "llama-3.2-1b"
    vocab = check.config(name).vocab_size
    workloads = {batch: repeating_workload(batch, s.spec_span, s.spec_tokens, vocab, seed=11) for batch in (1, 4)}
    draft = check.folder("llama-draft")
    engines = [("off", {}), ("ngram", {"async_scheduling": False, "speculative_config": {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}}),
               ("draft model", {"async_scheduling": False, "speculative_config": {
                   "model": str(draft), "num_speculative_tokens": 4}})]
    runs: dict[tuple[str, int], Timed] = {}
    acceptance: dict[tuple[str, int], str] = {}
    for label, settings in engines:
        llm = check.llm(name, **settings)
        for batch, workload in workloads.items():
            before = llm.get_stats()
            runs[label, batch] = check.timed(llm, workload)
            after = llm.get_stats()
            drafted = after.num_draft_tokens - before.num_draft_tokens
            accepted = after.num_accepted_tokens - before.num_accepted_tokens
            acceptance[label, batch] = f"{accepted / drafted:.2f} accepted" if drafted else "none proposed"
    target = "tokens equal" if NEAR_TIE_NATS.get(check.dtype, 0.0) == 0 else "tokens equal, or part at a near tie"
    for label, _ in engines[1:]:
        for batch, workload in workloads.items():
            off, on = runs["off", batch], runs[label, batch]
            agreement = compare_greedy(off.outputs, on.outputs, check.dtype)
            rows.append(Row("g", f"{SHAPES[name][0]} {label} against none, batch {batch}, {workload.describe()}",
                            f"{on.rate / off.rate:.2f}x ({on.rate:,.0f} / {off.rate:,.0f} out tok/s), "
                            f"{acceptance[label, batch]}", target,
                            DRY if check.dry_run else PASS if agreement.ok else FAIL,
                            f"{label}, batch {batch}: {agreement.describe()}"))


@dataclass(frozen=True)
class Stage:
    title: str
    planned_s: float  # on an H100; a stage's share of the time left is in proportion to it
    run: Callable[[Check, list[Row]], None]


STAGES = {
    "a": Stage("tests/engine/test_gpu.py", 150, stage_tests),
    "b": Stage("nano-vllm's workload", 70, stage_nano),
    "c": Stage("Llama-3.1-8B shape, bf16 and FP8", 140, stage_8b),
    "d": Stage("structured outputs", 30, stage_structured),
    "e": Stage("decode step against the HBM roofline", 10, stage_decode_roofline),
    "f": Stage("asynchronous scheduling on / off", 30, stage_async),
    "g": Stage("speculative decoding on / off", 40, stage_speculative),
}
# The order they run in: the tests alone on the GPU first, then the stages that share the
# Llama-3.2-1B engine one after another, the 8B (the largest, most able to shrink) last.
RUN_ORDER = "abedfgc"


# ---------------------------------------------------------------- the run and its table


def machine_rates(device: torch.device) -> MachineRates:
    """Peak rates the roofline needs: on a GPU a bfloat16 8192^3 product and a 1 GiB copy
    (gpu_throughput.copy_bandwidth); on a CPU roofline.measure_rates."""
    if device.type != "cuda":
        return measure_rates(native_bf16=False, repeats=3)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    product = torch.empty_like(a)
    for _ in range(3):
        torch.mm(a, a, out=product)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        torch.mm(a, a, out=product)
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 10 / (time.perf_counter() - started)
    del a, product
    rates = MachineRates({"bfloat16": flops}, copy_bandwidth())
    torch.cuda.empty_cache()
    return rates


def header(device: torch.device, commit: str, command: str) -> list[str]:
    """Lines naming the machine, the software, the commit and the command."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        machine = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    else:
        from engine.hardware import detect_cpu

        machine = f"no GPU: a CPU dry run ({detect_cpu().describe()}), targets not judged"
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if importlib.util.find_spec("triton"):
        import triton

        versions += f", triton {triton.__version__}"
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [f"{date}, commit {commit}, {machine}; {versions}.", "", f"    {command}"]


def git_commit() -> str:
    try:
        found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return found.stdout.strip() if found.returncode == 0 else "unknown (no git)"


def markdown(lines: list[str], rows: list[Row], stage_seconds: dict[str, float], total_s: float) -> str:
    order = sorted(rows, key=lambda r: r.stage)
    table = ["| stage | workload | figure | target | result |", "|---|---|---|---|---|"]
    table += [f"| {r.stage} | {r.workload} | {r.figure} | {r.target} | {r.result} |" for r in order]
    notes = [f"- ({r.stage}) {r.note}" for r in order if r.note]
    times = ", ".join(f"({k}) {v:.0f} s" for k, v in stage_seconds.items())
    return "\n".join(["## GPU check: `benchmarks/gpu_check.py`", "", *lines, "", *table, "", *notes, "",
                      f"Stage times: {times}; {total_s:.0f} s in all.", ""])


def default_output(dry_run: bool) -> Path:
    name = "gpu-check-dry-run.md" if dry_run else "gpu-check.md"
    return Path(os.environ["OUT"]) / name if os.environ.get("OUT") else ROOT / "benchmarks" / name


def model_root(dry_run: bool) -> tempfile.TemporaryDirectory:
    """A temporary folder for the model folders: in /dev/shm (memory, so that 16 GB of
    weights write and read fast) where it has room for them, else the default."""
    needed = 0 if dry_run else sum(weight_bytes(SHAPES[n][1](), torch.bfloat16) for n in SHAPES)
    shm = Path("/dev/shm")
    if not dry_run and shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * needed:
        return tempfile.TemporaryDirectory(prefix="gpu-check-", dir=shm)
    return tempfile.TemporaryDirectory(prefix="gpu-check-")


def run_stages(check: Check, letters: str, budget_s: float, started: float,
               write: Callable[[list[Row], dict[str, float]], None]) -> list[Row]:
    """Each stage in RUN_ORDER that `letters` names, with its share of the time left; a
    crash is that stage's row, and the table is rewritten after every stage."""
    rows: list[Row] = []
    seconds: dict[str, float] = {}
    todo = [k for k in RUN_ORDER if k in letters]
    for i, letter in enumerate(todo):
        stage, stage_started = STAGES[letter], time.monotonic()
        left = started + budget_s - stage_started
        share = left * stage.planned_s / sum(STAGES[k].planned_s for k in todo[i:])
        check.guard = min(stage_started + GUARD_SLACK * share, started + budget_s)
        say(f"({letter}) {stage.title}: {share:.0f} s of the {left:.0f} s left")
        count = len(rows)
        try:
            stage.run(check, rows)
        except TimeUp:
            rows.append(Row(letter, stage.title, "-", "-", NOT_RUN_TIME, "stopped at the stage's time limit"))
        except Exception as exc:  # noqa: BLE001 - a crash is reported as the stage's row
            traceback.print_exc()
            check.close_llm()
            rows.append(Row(letter, stage.title, "-", "-", CRASHED, f"{type(exc).__name__}: {str(exc)[:300]}"))
        if len(rows) == count:
            rows.append(Row(letter, stage.title, "-", "-", CRASHED, "the stage gave no row"))
        seconds[letter] = time.monotonic() - stage_started
        write(rows, seconds)
    check.close_llm()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time (default 480)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every stage at tiny size on a CPU, without a time limit; nothing judged")
    parser.add_argument("--stages", default="".join(STAGES), help="which stages run, e.g. 'bcdefg' (default all)")
    parser.add_argument("--output", type=Path, default=None,
                        help="the markdown table (default $OUT/gpu-check.md where OUT is set, else benchmarks/)")
    parser.add_argument("--commit", default=None, help="the commit to name (default: git's, where there is one)")
    parser.add_argument("--fp8-kv-cache", action="store_true", help="(c)'s FP8 row also keeps its KV cache in FP8")
    args = parser.parse_args()
    if unknown := set(args.stages) - set(STAGES):
        parser.error(f"no stage {', '.join(sorted(unknown))}: the stages are {', '.join(STAGES)}")
    started = time.monotonic()
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry-run")
    device = torch.device("cpu" if args.dry_run else "cuda")
    output = args.output or default_output(args.dry_run)
    output.parent.mkdir(parents=True, exist_ok=True)
    lines = header(device, args.commit or git_commit(), "python3 " + " ".join(["benchmarks/gpu_check.py", *sys.argv[1:]]))
    with model_root(args.dry_run) as tmp:
        check = Check(DRY_SIZES if args.dry_run else FULL_SIZES, device, Path(tmp), output.with_name(output.stem + "-tests.log"),
                      args.fp8_kv_cache)

        def write(rows: list[Row], seconds: dict[str, float]) -> None:
            output.write_text(markdown(lines, rows, seconds, time.monotonic() - started))

        # A dry run checks that every stage runs, whatever it takes (a first build of the CPU kernels, say).
        rows = run_stages(check, args.stages, math.inf if args.dry_run else args.budget_s, started, write)
    text = output.read_text()
    print(text)
    say(f"written to {output}")
    return 1 if any(r.result in (FAIL, CRASHED) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
