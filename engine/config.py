"""Engine settings (`EngineConfig`), what the model folder decides (`ModelConfig`, resolved by
`engine.model_loader.model_config`) and the names each setting allows. A leaf that every tier
may read: at import it loads neither torch nor any other engine module; the CPU and KV-cache
helpers it needs are imported where a setting is checked or resolved."""

import functools
import os
import types
import typing
from dataclasses import Field, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

    from engine.spec_decode.config import SpeculativeConfig

# Loaded without torch (the Dagster side derives its resource's fields from these settings at
# definitions load): what needs torch or the CPU is imported where a setting is checked or resolved.
DTYPES = ("float32", "bfloat16", "float16")

# Methods that quantize a 16- or 32-bit checkpoint at load -> what they need.
AT_LOAD = {"int8": "a CPU with VNNI or AMX", "fp8": "a GPU with FP8 units (compute capability 8.9 or later)"}
# Methods a checkpoint's own weights may be stored in.
CHECKPOINT_METHODS = ("awq", "gptq", "fp8", "compressed-tensors", "mxfp4")
QUANTIZATION_METHODS = tuple(sorted({*AT_LOAD, *CHECKPOINT_METHODS}))

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")

# KV cache on a CPU when kv_cache_memory is not set (a GPU's is what gpu_memory_utilization leaves).
DEFAULT_KV_CACHE_MEMORY = 4 << 30

# Default token budget of one step, by device type. On a CPU a step of 1,024 tokens measured
# 1.3-1.5x the throughput of 4,096 on prefill-heavy batches (its activations stay in cache
# between operators); on a GPU a larger step keeps the device busy.
DEFAULT_STEP_TOKENS = {"cpu": 1024, "cuda": 4096}

# Images one prompt may hold when limit_mm_per_prompt does not say.
DEFAULT_IMAGES_PER_PROMPT = 8

# How a setting bears on the rows an engine gives; every `EngineConfig` field declares one.
# A row's digest and a table's data version hold each OUTPUT setting as the engine resolved it
# and the fingerprint of the MODEL_FILES settings' folders (`LLM.output_settings`), never the
# OPERATIONAL ones, so that changing those reuses every row.
OUTPUT = "output"  # can change a row's tokens, or how its completion is split (reasoning, tool calls)
MODEL_FILES = "model files"  # a folder whose files decide the rows: it enters by their fingerprint, not its path
OPERATIONAL = "operational"  # only how fast, or where, the work runs; or which rows are refused before they run
SETTING_CLASSES = (OUTPUT, MODEL_FILES, OPERATIONAL)


def _setting(default: object, help: str, affects: str) -> object:
    """A dataclass field whose `help` is its one description (the `LLM` docs and the
    Dagster resource's fields are derived from it) and whose `affects` is its class in
    SETTING_CLASSES."""
    assert affects in SETTING_CLASSES, affects
    return field(default=default, metadata={"help": help, "affects": affects})


@dataclass
class EngineConfig:
    """Everything `LLM(...)` accepts; the meaning of each field follows vLLM's and is in
    its `help` (`engine_settings()` lists them)."""

    model: str | None = _setting(None, "A local Hugging Face model folder, or 'smollm2-135m-instruct' (the "
                                       "default) for the embedded SmolLM2-135M-Instruct.", MODEL_FILES)
    tokenizer: str | None = _setting(None, "A folder with the tokenizer, when it is not in the model folder.", MODEL_FILES)
    dtype: str = _setting("auto", "'auto', 'float32', 'bfloat16' or 'float16'. 'auto' is the checkpoint's own on "
                                  "a GPU (bfloat16 for a float32 one); on a CPU, bfloat16 where the CPU has native "
                                  "bfloat16 (AVX512-BF16, AMX, ARM BF16), a float32 checkpoint's too, else float32.", OUTPUT)
    quantization: str | None = _setting("auto", "How the weights are quantized: 'auto' (the checkpoint's own; "
                                                "an unquantized one runs 'int8' on a CPU with VNNI when dtype is "
                                                "left 'auto' and resolves to bfloat16, but not where oneDNN runs "
                                                "AMX tiles, whose bfloat16 products are faster; else the dtype), "
                                                "None (the checkpoint's own or the dtype, as vLLM's default), the "
                                                "checkpoint's own (config.json quantization_config: 'fp8' or "
                                                "'compressed-tensors' FP8, 'awq', 'gptq', 'mxfp4' (gpt-oss's "
                                                "experts, dequantized at load)), or quantized at load: "
                                                "'int8' (a CPU with VNNI or AMX: projections and experts per "
                                                "output feature, activations per token, smoothed by input ranges "
                                                "measured at load, int8 products) or 'fp8' (a GPU with FP8 "
                                                "units). The language-model head and routers stay in dtype.", OUTPUT)
    runner: str = _setting("auto", "'generate' (text from a causal LM), 'pooling' (embeddings or classes of whole "
                                   "prompts: LLM.embed, classify, score; any supported decoder, its LM head unused) or "
                                   "'auto': pooling for an embedding or sequence-classification checkpoint "
                                   "('LlamaModel', 'Qwen2ForSequenceClassification') or a sentence-transformers "
                                   "folder, else generate.", OUTPUT)
    pooling_type: str | None = _setting(None, "How a pooling model pools a prompt's hidden states: 'LAST' (the last "
                                              "token's), 'MEAN' or 'CLS' (the first token's); None: the "
                                              "sentence-transformers Pooling module's, else 'LAST'.", OUTPUT)
    device: str = _setting("auto", "'auto' (a GPU when there is one), 'cpu' or 'cuda'.", OUTPUT)
    seed: int = _setting(0, "Seed of the random draws of requests that have no seed of their own.", OUTPUT)
    max_model_len: int | None = _setting(None, "Longest prompt plus completion, at most the model's context "
                                               "(default: the model's context).", OUTPUT)
    max_num_seqs: int = _setting(256, "Most sequences in one step.", OPERATIONAL)
    max_num_batched_tokens: int | None = _setting(None, "Most tokens computed in one step (default "
                                                        f"{DEFAULT_STEP_TOKENS['cpu']} on a CPU, "
                                                        f"{DEFAULT_STEP_TOKENS['cuda']} on a GPU).", OPERATIONAL)
    block_size: int = _setting(16, "Tokens per KV-cache block.", OPERATIONAL)
    kv_cache_memory: int | None = _setting(None, "Bytes of KV cache (vLLM's kv_cache_memory_bytes); default "
                                                 f"{DEFAULT_KV_CACHE_MEMORY >> 30} GiB on a CPU, and on a GPU what "
                                                 "gpu_memory_utilization leaves.", OPERATIONAL)
    kv_cache_dtype: str = _setting("auto", "The KV cache's element type: 'auto' (the model's dtype), 'bfloat16' or "
                                           "'float16' (a float32 model's cache at half the bytes), 'int8' (the CPU "
                                           "kernel) or 'fp8' (e4m3, the Triton kernels on a GPU), both with a float32 "
                                           "scale per token and KV head. Narrower caches hold more tokens in "
                                           "kv_cache_memory and make decode attention read fewer bytes.", OUTPUT)
    gpu_memory_utilization: float = _setting(0.9, "Fraction of GPU memory for weights, activations and KV cache, "
                                                  "planned from a measured forward pass at max_num_batched_tokens.", OPERATIONAL)
    enable_prefix_caching: bool = _setting(True, "Reuse the KV blocks of prompt prefixes already computed.", OPERATIONAL)
    enable_chunked_prefill: bool = _setting(True, "Split long prompts over several steps.", OPERATIONAL)
    scheduling_policy: str = _setting("fcfs", "'fcfs', or 'priority' (lower `priority` values run first; under "
                                              "'fcfs' a request's priority is accepted and ignored, as in vLLM).", OPERATIONAL)
    max_logprobs: int = _setting(20, "Most logprobs or prompt_logprobs a request may ask for per token; -1 allows "
                                     "the whole vocabulary.", OPERATIONAL)
    async_scheduling: bool | None = _setting(None, "Schedule each step while the previous one runs, and read its "
                                                   "sampled tokens back one step later (vLLM's async scheduling; "
                                                   "outputs are the same either way). None: on with a GPU, off on a "
                                                   "CPU, where the forward pass and the host work share the cores.", OPERATIONAL)
    enforce_eager: bool = _setting(False, "Never capture CUDA graphs (on a GPU with the Triton backend, decode "
                                          "steps otherwise replay graphs captured at start-up; off with LoRA).", OPERATIONAL)
    enable_lora: bool = _setting(False, "Accept LoRA adapters (`lora_request` in generate and chat).", OPERATIONAL)
    max_loras: int = _setting(1, "Most distinct adapters in one step (device slots).", OPERATIONAL)
    max_lora_rank: int = _setting(16, "Highest adapter rank accepted.", OPERATIONAL)
    max_cpu_loras: int | None = _setting(None, "Adapters kept in host memory (default: max_loras).", OPERATIONAL)
    num_threads: int | None = _setting(None, "CPU threads for PyTorch's operators, set for each process that runs "
                                             "a rank (default: OMP_NUM_THREADS if set, else the cores this process "
                                             "may use, divided among the ranks).", OPERATIONAL)
    tensor_parallel_size: int = _setting(1, "Ranks one model is split over, one process each (Megatron-style: "
                                            "attention by heads, the MLP by columns, the vocabulary in slices, one "
                                            "all-reduce after each row-parallel projection): GPUs over NCCL, or on a "
                                            "CPU shares of its cores over gloo.", OUTPUT)
    data_parallel_size: int = _setting(1, "Replicas of the model, each in its own process on its own devices (or "
                                          "share of CPU cores). A call's prompts are dealt out among them by "
                                          "estimated work and come back in input order; a seeded request gives the "
                                          "same tokens whatever the number of replicas.", OPERATIONAL)
    batch_invariant: bool = _setting(False, "Give a row the same bits whatever else shares its step, on every "
                                            "CPU (vLLM's VLLM_BATCH_INVARIANT): a seeded request's output then "
                                            "does not depend on its batch. Free except on a CPU with AMX, whose "
                                            "fastest bfloat16 kernels (the default there) pick their summation "
                                            "order by the batch's size; this keeps oneDNN off AMX in the "
                                            "process, at AVX512-BF16's speed. Not built on a GPU.", OUTPUT)
    limit_mm_per_prompt: dict[str, int] | None = _setting(None, "Most images one prompt may hold, as vLLM's "
                                                                "{'image': n} (default "
                                                                f"{DEFAULT_IMAGES_PER_PROMPT}); a vision-language "
                                                                "model's rows with more are errors.", OPERATIONAL)
    reasoning_parser: str | None = _setting("auto", "How to find the reasoning section of a reasoning model's "
                                                    "completions (vLLM's reasoning_parser): 'qwen3', 'deepseek_r1', "
                                                    "'mistral' or 'openai_gptoss' (harmony's analysis channel); None: "
                                                    "no parsing; 'auto': the one the tokenizer implies (its <think> "
                                                    "and </think>, or harmony's, tokens used by its chat template), "
                                                    "else none. The reasoning goes to "
                                                    "CompletionOutput.reasoning, the answer to text, and a structured "
                                                    "output's grammar starts after the reasoning.", OUTPUT)
    tool_call_parser: str | None = _setting("auto", "How to find tool calls in completions (vLLM's "
                                                    "tool_call_parser): 'hermes', 'llama3_json', 'mistral', "
                                                    "'pythonic', ...; None: no parsing; 'auto': the one the "
                                                    "tokenizer's call markers imply (<tool_call>: hermes, "
                                                    "[TOOL_CALLS]: mistral, <|python_tag|>: llama3_json), else none. "
                                                    "Calls go to CompletionOutput.tool_calls.", OUTPUT)
    speculative_config: dict[str, Any] | None = _setting(
        None, "Speculative decoding, as vLLM's: {'method': 'ngram', 'num_speculative_tokens': k, "
              "'prompt_lookup_min': a, 'prompt_lookup_max': b} proposes up to k tokens per sequence and step from "
              "its own prompt and output (the tokens after the last earlier match of its last a to b tokens); "
              "{'model': folder, 'num_speculative_tokens': k} has a smaller model of the same vocabulary propose "
              "them (its own KV cache sharing the target's blocks and memory budget). One forward pass verifies "
              "them; proposals are kept where their expected acceptance is worth their rows' measured cost (most "
              "at small batches). Outputs are the same as without it: greedy and seeded rows token for token, "
              "other sampled rows in distribution. Not with async_scheduling.", OPERATIONAL)
    attention_backend: str = _setting("auto", "'auto' (Triton kernels on a GPU; on a CPU the compiled "
                                              "paged-attention kernel where it builds, else PyTorch's products), "
                                              "'triton' (a GPU, or Triton's interpreter under TRITON_INTERPRET=1), "
                                              "'cpu' (the compiled kernel) or 'torch'.", OUTPUT)

    def __post_init__(self) -> None:
        from engine.kv_cache_dtype import KV_CACHE_DTYPES

        for setting in fields(self):  # a folder may be given as a path object
            value = getattr(self, setting.name)
            if setting.metadata.get("affects") == MODEL_FILES and isinstance(value, os.PathLike):
                setattr(self, setting.name, os.fspath(value))
        wrong = [problem for setting in fields(self)
                 if (problem := _type_problem(setting, getattr(self, setting.name)))]
        if wrong:
            raise TypeError("Invalid engine settings: " + "; ".join(wrong))
        problems = []
        if self.dtype not in ("auto", *DTYPES):
            problems.append(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.quantization not in (None, "auto", *QUANTIZATION_METHODS):
            problems.append(f"quantization must be 'auto', None or one of {sorted(QUANTIZATION_METHODS)}, "
                            f"got {self.quantization!r}")
        if self.runner not in RUNNERS:
            problems.append(f"runner must be one of {', '.join(map(repr, RUNNERS))}, got {self.runner!r}")
        if self.pooling_type not in (None, *POOLING_TYPES):
            problems.append(f"pooling_type must be None or one of {', '.join(map(repr, POOLING_TYPES))}, "
                            f"got {self.pooling_type!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            problems.append(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        # Types were checked above (`_type_problem`): what is left to check here is values.
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "data_parallel_size", "max_loras",
                     "max_lora_rank"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "kv_cache_memory", "num_threads"):
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name} must be a positive integer or None, got {value!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            problems.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            problems.append(f"max_cpu_loras must be at least max_loras={self.max_loras}, got {self.max_cpu_loras!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(f"kv_cache_dtype must be one of {', '.join(map(repr, KV_CACHE_DTYPES))}, "
                            f"got {self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            problems.append("attention_backend must be 'auto', 'torch', 'cpu' or 'triton', "
                            f"got {self.attention_backend!r}")
        if self.max_logprobs < -1:
            problems.append(f"max_logprobs must be -1 (the whole vocabulary) or a non-negative integer, "
                            f"got {self.max_logprobs!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            problems.append(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        limit = self.limit_mm_per_prompt
        if limit is not None and (set(limit) - {"image"}
                                  or any(not isinstance(n, int) or n < 0 for n in limit.values())):
            problems.append(f"limit_mm_per_prompt must be None or {{'image': n}} with n >= 0, got {limit!r}")
        problems += self._parser_problems()
        if self.speculative_config is not None:
            try:
                self.speculative
            except ValueError as exc:
                problems.append(str(exc))
            if self.async_scheduling:
                problems.append("async_scheduling=True does not combine with speculative_config: a step's accepted "
                                "tokens decide the next step's inputs; leave async_scheduling None")
        if problems:
            raise ValueError("Invalid engine settings: " + "; ".join(problems))

    def _parser_problems(self) -> list[str]:
        from engine.reasoning import REASONING_FORMATS
        from engine.tool_parsers import TOOL_CALL_PARSERS

        problems = []
        for name, known in (("reasoning_parser", REASONING_FORMATS), ("tool_call_parser", TOOL_CALL_PARSERS)):
            value = getattr(self, name)
            if value not in (None, "auto", *known):
                problems.append(f"{name} must be 'auto', None or one of {sorted(known)}, got {value!r}")
        return problems

    @functools.cached_property
    def speculative(self) -> "SpeculativeConfig | None":
        """`speculative_config` read (`SpeculativeConfig.parse`), or None without speculation:
        parsed once, when the settings are checked, and kept for the engine, the draft model's
        runner and every rank that receives the config."""
        from engine.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.parse(self.speculative_config) if self.speculative_config is not None else None

    @property
    def max_images_per_prompt(self) -> int:
        """The most images one prompt may hold (limit_mm_per_prompt's, else the default)."""
        return (self.limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)

    @property
    def world_size(self) -> int:
        """Processes the engine runs in: tensor_parallel_size x data_parallel_size."""
        return self.tensor_parallel_size * self.data_parallel_size

    def default_threads_per_rank(self) -> int:
        """CPU threads of each rank when num_threads is not set: the process's threads
        (`default_num_threads`) shared among the ranks, at least one."""
        from engine.hardware import default_num_threads

        return max(1, default_num_threads() // self.world_size)

    def resolve(self, model_config: "ModelConfig", attention_backend: str) -> "EngineConfig":
        """These settings with every default filled in for the model and the device it
        runs on: the one place defaults are decided, and what the engine, the scheduler
        and the model runner read. `self` is left as it is. `attention_backend` is what
        this field resolves to on the model's device (`engine.attention.selector.resolve_backend_name`).

        kv_cache_memory stays None on a GPU, where the model runner measures it.

        Raises:
            ValueError: without chunked prefill, a step budget below max_model_len (a long
                prompt could never run); an attention backend that cannot run here, or
                that cannot read the kv_cache_dtype; batch_invariant on a GPU.
        """
        from engine.kv_cache_dtype import resolve_kv_cache_dtype

        device, max_model_len = model_config.device, model_config.max_model_len
        on_cpu = device.type == "cpu"
        if self.batch_invariant and not on_cpu:
            raise ValueError(
                "batch_invariant=True runs on a CPU only: on a GPU the matrix products (cuBLAS) and the prefill "
                "kernel choose their tiles by the batch's shape, and batch-invariant kernels are not built here. "
                "Leave it False on a GPU (a seeded request's draws are still its own), or use device='cpu'")
        step_tokens = self.max_num_batched_tokens
        if step_tokens is None:
            step_tokens = DEFAULT_STEP_TOKENS[device.type]
            step_tokens = step_tokens if self.enable_chunked_prefill else max(step_tokens, max_model_len)
        elif not self.enable_chunked_prefill and step_tokens < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={step_tokens} is below max_model_len={max_model_len}: without chunked "
                f"prefill a long prompt could never run. Raise it, lower max_model_len, or enable_chunked_prefill=True"
            )
        pooler = model_config.pooler
        return replace(
            self,
            dtype=model_config.dtype_name,
            quantization=model_config.quantization,
            runner="generate" if pooler is None else "pooling",
            pooling_type=None if pooler is None else pooler.pooling_type,
            device=str(device),
            max_model_len=max_model_len,
            max_num_batched_tokens=step_tokens,
            kv_cache_memory=self.kv_cache_memory or (DEFAULT_KV_CACHE_MEMORY if on_cpu else None),
            async_scheduling=(device.type == "cuda" and self.speculative_config is None
                              if self.async_scheduling is None else self.async_scheduling),
            max_cpu_loras=self.max_cpu_loras or self.max_loras,
            num_threads=self.num_threads or (self.default_threads_per_rank() if on_cpu else None),
            attention_backend=attention_backend,
            kv_cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, model_config.dtype_name, attention_backend),
        )


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "True or False", dict: "a dict",
               type(None): "None"}


def _type_problem(setting: Field, value: object) -> str | None:
    """What is wrong with the type of `value` for `setting`, read from its annotation (None
    when nothing is): checked before any value is compared, so that a wrong-typed setting is
    named rather than failing a comparison. True is not an integer here, an integer is a number."""
    kinds = typing.get_args(setting.type) if isinstance(setting.type, types.UnionType) else (setting.type,)
    kinds = [typing.get_origin(kind) or kind for kind in kinds]
    if any(_is_a(value, kind) for kind in kinds):
        return None
    return (f"{setting.name} must be {' or '.join(_TYPE_NAMES[kind] for kind in kinds)}, "
            f"got {type(value).__name__} {value!r:.80}")


def _is_a(value: object, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


@dataclass(frozen=True)
class PoolerConfig:
    """How a pooling model turns a prompt into its output: `task` "embed" or "classify",
    the pooling type, whether embeddings are normalised by default, and a classifier's
    number of labels."""

    task: str
    pooling_type: str
    normalize: bool
    num_labels: int = 0

    @property
    def needs_every_row(self) -> bool:
        """Whether the pooled vector reads rows other than the last: then no prompt
        position may come from the prefix cache."""
        return self.pooling_type != "LAST"


@dataclass
class ModelConfig:
    """The model folder's facts resolved against the engine settings."""

    path: Path
    hf_config: "PretrainedConfig"
    dtype: "torch.dtype"
    device: "torch.device"
    max_model_len: int
    eos_token_ids: set[int] = field(default_factory=set)
    sampling_defaults: dict = field(default_factory=dict)
    quantization: str | None = None
    pooler: PoolerConfig | None = None  # a pooling model's; None for a generative one
    # A vision-language checkpoint's whole config (`hf_config` is then its text part); None for text models.
    multimodal_config: "PretrainedConfig | None" = None

    @property
    def dtype_name(self) -> str:
        """The compute dtype as `LLM(dtype=...)` names it ("bfloat16")."""
        return str(self.dtype).removeprefix("torch.")

def engine_settings() -> list[Field]:
    """The fields of `EngineConfig`, each with its type, default and `metadata["help"]`."""
    return list(fields(EngineConfig))
