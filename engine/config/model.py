"""The model's settings (`ModelSettings`: the folders, dtype, quantization, runner, context
length, seed, logprobs), the names they allow, and what the model folder decides once it is
read (`ModelConfig`, resolved by `engine.model_loader.model_config`, and a pooling model's
`PoolerConfig`), as vLLM's `config/model.py` and `config/pooler.py`."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.config.utils import MODEL_FILES, OPERATIONAL, OUTPUT, SettingsGroup, _setting, positive_problems

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

DTYPES = ("float32", "bfloat16", "float16")

# Methods that quantize a 16- or 32-bit checkpoint at load -> what they need.
AT_LOAD = {"int8": "a CPU with VNNI or AMX, or AVX2 with the compiled CPU kernels",
           "fp8": "a GPU with FP8 units (compute capability 8.9 or later)"}
# Methods a checkpoint's own weights may be stored in.
CHECKPOINT_METHODS = ("awq", "gptq", "fp8", "compressed-tensors", "mxfp4")
QUANTIZATION_METHODS = tuple(sorted({*AT_LOAD, *CHECKPOINT_METHODS}))

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")


@dataclass
class ModelSettings(SettingsGroup):
    """Which model runs, in which numbers, and how long its sequences may be."""

    model: str | None = _setting(None, "A local Hugging Face model folder, or 'smollm2-135m-instruct' (the "
                                       "default) for the embedded SmolLM2-135M-Instruct.", MODEL_FILES)
    tokenizer: str | None = _setting(None, "A folder with the tokenizer, when it is not in the model folder.", MODEL_FILES)
    dtype: str = _setting("auto", "'auto', 'float32', 'bfloat16' or 'float16'. 'auto' is the checkpoint's own on "
                                  "a GPU (bfloat16 for a float32 one); on a CPU, bfloat16 where the CPU has native "
                                  "bfloat16 (AVX512-BF16, AMX, ARM BF16), a float32 checkpoint's too, else float32.", OUTPUT)
    quantization: str | None = _setting("auto", "How the weights are quantized: 'auto' (the checkpoint's own; "
                                                "an unquantized one runs 'int8' where dtype is left 'auto' and "
                                                "int8 was measured faster: on a CPU with VNNI where the dtype "
                                                "resolves to bfloat16, but not where oneDNN runs AMX tiles, whose "
                                                "bfloat16 products are faster; and for a pooling model on an AVX2 "
                                                "CPU without VNNI; else the dtype), "
                                                "None (the checkpoint's own or the dtype, as vLLM's default), the "
                                                "checkpoint's own (config.json quantization_config: 'fp8' or "
                                                "'compressed-tensors' FP8, 'awq', 'gptq', 'mxfp4' (gpt-oss's "
                                                "experts, dequantized at load)), or quantized at load: "
                                                "'int8' (a CPU with VNNI or AMX, or AVX2 with the compiled "
                                                "kernels: projections and experts per output feature, "
                                                "activations per token, smoothed by input ranges measured at "
                                                "load, int8 products) or 'fp8' (a GPU with FP8 units). The "
                                                "language-model head and routers stay in dtype.", OUTPUT)
    runner: str = _setting("auto", "'generate' (text from a causal LM), 'pooling' (embeddings or classes of whole "
                                   "prompts: LLM.embed, classify, score; any supported decoder, its LM head unused) or "
                                   "'auto': pooling for an embedding or sequence-classification checkpoint "
                                   "('LlamaModel', 'Qwen2ForSequenceClassification') or a sentence-transformers "
                                   "folder, else generate.", OUTPUT)
    pooling_type: str | None = _setting(None, "How a pooling model pools a prompt's hidden states: 'LAST' (the last "
                                              "token's), 'MEAN' or 'CLS' (the first token's); None: the "
                                              "sentence-transformers Pooling module's, else 'LAST'.", OUTPUT)
    seed: int = _setting(0, "Seed of the random draws of requests that have no seed of their own.", OUTPUT)
    max_model_len: int | None = _setting(None, "Longest prompt plus completion, at most the model's context "
                                               "(default: the model's context).", OUTPUT)
    max_logprobs: int = _setting(20, "Most logprobs or prompt_logprobs a request may ask for per token; -1 allows "
                                     "the whole vocabulary.", OPERATIONAL)

    def problems(self) -> list[str]:
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
        problems += positive_problems(self, ["max_model_len"], optional=True)
        if self.max_logprobs < -1:
            problems.append(f"max_logprobs must be -1 (the whole vocabulary) or a non-negative integer, "
                            f"got {self.max_logprobs!r}")
        return problems

    def resolved(self, model_config: "ModelConfig", attention_backend: str) -> dict[str, Any]:
        """What the model folder decided: its dtype, quantization, runner, pooling and context."""
        pooler = model_config.pooler
        return {"dtype": model_config.dtype_name, "quantization": model_config.quantization,
                "runner": "generate" if pooler is None else "pooling",
                "pooling_type": None if pooler is None else pooler.pooling_type,
                "max_model_len": model_config.max_model_len}


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
