"""Pooling models: embeddings and classifications of whole prompts (vLLM's
`runner="pooling"`, `LLM.embed`, `LLM.classify`, `LLM.score`).

A pooling request is a prompt that is only prefilled: the scheduler batches it like any
prompt (chunked, prefix-cached), and when its last token is computed the step pools its
final hidden states into one vector: the last token's (LAST), the mean over the
prompt's tokens (MEAN, summed chunk by chunk) or the first token's (CLS). An embedding
model returns that vector (L2-normalised unless the request says otherwise); a
classifier (`*ForSequenceClassification`) puts it through its `score` head and returns
the class probabilities.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")

# sentence-transformers' Pooling modes -> our pooling type: its `pooling_mode` (version 6), or
# one flag set among the older `pooling_mode_*` flags.
_SENTENCE_TRANSFORMERS_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_SENTENCE_TRANSFORMERS_FLAGS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
                                "pooling_mode_cls_token": "cls"}


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


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's per-request pooling settings: `normalize` an embedding to unit length (None:
    the model's default, which is True unless its sentence-transformers modules say
    otherwise)."""

    normalize: bool | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class EmbeddingRequestOutput:
    """vLLM's output of `LLM.embed` for one prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationRequestOutput:
    """vLLM's output of `LLM.classify` for one prompt."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringRequestOutput:
    """vLLM's output of `LLM.score` for one pair of texts."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


PoolingRequestOutput = EmbeddingRequestOutput | ClassificationRequestOutput


def pooling_architectures(causal_models: dict[str, type]) -> dict[str, tuple[type, str]]:
    """The pooling checkpoints' architectures: for each "XForCausalLM", "XModel" (the bare
    decoder, an embedding model) and "XForSequenceClassification" (a classifier), with
    the family class and the task."""
    found = {}
    for name, family in causal_models.items():
        stem = name.removesuffix("ForCausalLM")
        found[f"{stem}Model"] = (family, "embed")
        found[f"{stem}ForSequenceClassification"] = (family, "classify")
    return found


def resolve_pooler(path: Path, hf_config: PretrainedConfig, runner: str, pooling_type: str | None,
                   pooling_names: dict[str, tuple[type, str]]) -> PoolerConfig | None:
    """The pooler of the model folder, or None for a generative model.

    "auto" pools for a pooling architecture or a folder with sentence-transformers'
    modules.json; "pooling" pools any supported decoder (a causal LM's head is then
    unused, as for Qwen3-Embedding). The pooling type is `pooling_type` when set, else
    the sentence-transformers Pooling module's, else LAST.

    Raises:
        ValueError: "generate" for a checkpoint that has no language-model head.
    """
    architectures = getattr(hf_config, "architectures", None) or []
    pooling_arch = next((a for a in architectures if a in pooling_names), None)
    sentence = _sentence_transformers_pooling(path)
    if runner == "generate" and pooling_arch is not None:
        raise ValueError(f"{path}: architecture {pooling_arch} has no language-model head to generate with: "
                         "load it with runner='pooling' (or 'auto') and call embed, classify or score")
    if runner == "generate" or (runner == "auto" and pooling_arch is None and sentence is None):
        return None
    task = pooling_names[pooling_arch][1] if pooling_arch is not None else "embed"
    chosen = pooling_type or (sentence[0] if sentence else "LAST")
    normalize = sentence[1] if sentence else task == "embed"
    num_labels = getattr(hf_config, "num_labels", 0) if task == "classify" else 0
    return PoolerConfig(task, chosen, normalize, num_labels)


def _sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers folder's modules.json and
    its Pooling module's config.json, or None when the folder has none."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type = "LAST"
    for module in modules:
        if module.get("type", "").endswith(".Pooling"):
            settings = json.loads((path / module["path"] / "config.json").read_text())
            modes = settings.get("pooling_mode")
            modes = [modes] if isinstance(modes, str) else modes or [
                mode for flag, mode in _SENTENCE_TRANSFORMERS_FLAGS.items() if settings.get(flag)]
            if len(modes) != 1 or modes[0] not in _SENTENCE_TRANSFORMERS_MODES:
                raise ValueError(f"{path}: the Pooling module pools by {modes or 'no mode'}; the engine pools by "
                                 f"exactly one of {sorted(_SENTENCE_TRANSFORMERS_MODES)}")
            pooling_type = _SENTENCE_TRANSFORMERS_MODES[modes[0]]
    normalize = any(module.get("type", "").endswith(".Normalize") for module in modules)
    return pooling_type, normalize


class Pooler:
    """Pools the rows of a step into each finished prompt's output vector. A MEAN or CLS
    prompt computed over several steps keeps its partial result on its sequence
    (`Sequence.pooling_state`) between them."""

    def __init__(self, config: PoolerConfig, score: torch.nn.Module | None) -> None:
        self.config = config
        self.score = score

    def update(self, state: torch.Tensor | None, hidden: torch.Tensor, first_position: int) -> torch.Tensor | None:
        """A prompt's MEAN or CLS state after a chunk of its rows (the first at prompt
        position `first_position`): the float32 sum of its rows so far, or its first row.
        A chunk at position 0 starts afresh (a preempted prompt is computed again)."""
        if self.config.pooling_type == "MEAN":
            chunk = hidden.float().sum(0)
            return chunk if first_position == 0 or state is None else state + chunk
        if self.config.pooling_type == "CLS" and first_position == 0:
            return hidden[0].float()
        return state

    def rows_read(self, first_row: int, count: int, first_position: int, last: bool) -> range:
        """The rows of a chunk (rows [first_row, first_row + count) of a step, from prompt
        position `first_position`; `last` when it ends the prompt) that `update` and
        `vector` read: all of them (MEAN), the prompt's first (CLS) or its last (LAST)."""
        kind = self.config.pooling_type
        if kind == "MEAN":
            return range(first_row, first_row + count)
        if kind == "CLS":
            return range(first_row, first_row + (first_position == 0))
        return range(first_row + count - 1, first_row + count) if last else range(0)

    def vector(self, state: torch.Tensor | None, last_chunk: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The pooled vector of a prompt of `num_tokens` whose last chunk of rows is `last_chunk`."""
        if self.config.pooling_type == "LAST":
            return last_chunk[-1].float()
        return state / num_tokens if self.config.pooling_type == "MEAN" else state

    def finish(self, vectors: list[torch.Tensor], normalize: list[bool]) -> torch.Tensor:
        """The outputs [prompts, dim] of the pooled vectors: embeddings (each normalised
        where asked) or a classifier's class probabilities (a softmax over its labels; a
        sigmoid for one label, as vLLM and sentence-transformers' cross-encoders do)."""
        pooled = torch.stack(vectors)
        if self.config.task == "classify":
            logits = F.linear(pooled, self.score.weight.float())
            return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)
        unit = F.normalize(pooled, dim=-1)
        keep = torch.tensor(normalize, device=pooled.device)[:, None]
        return torch.where(keep, unit, pooled)
