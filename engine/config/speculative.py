"""Speculative decoding's setting (`SpeculativeSettings`: vLLM's `speculative_config` dict)
and what it is read into, once (`SpeculativeConfig`), as vLLM's `config/speculative.py`."""

import functools
from dataclasses import dataclass, fields
from typing import Any

from engine.config.utils import OPERATIONAL, SettingsGroup, _setting

# vLLM's method names -> ours (a list-style "[ngram]" is vLLM's older spelling).
_METHODS = {"ngram": "ngram", "[ngram]": "ngram", "draft_model": "draft_model"}
# The keys of one method only.
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_DRAFT_KEYS = ("model", "quantization", "draft_tensor_parallel_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes tokens for one forward pass of the model to verify.

    method "ngram" (vLLM's prompt lookup): the tokens that followed the last earlier
    occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) in its prompt and output. method "draft_model" (given `model`, a
    model folder): a smaller model sharing the target's tokenizer proposes them, its own
    greedy choices one forward pass each, quantized with `quantization` where given (else
    as its checkpoint is, or as the target is at load); `draft_tensor_parallel_size` may
    only be 1 (it runs on the target's first rank). `num_speculative_tokens` is the most
    tokens proposed per sequence and step; with `disable_by_batch_size`, none while more
    sequences than that are running (on top of the engine's own measure of their worth).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None
    quantization: str | None = None
    draft_tensor_parallel_size: int = 1
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """vLLM's dict: `{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}` with vLLM's defaults (both lookup bounds 5 when neither is
        given, else the one given for both), or `{"model": folder, "num_speculative_tokens": 4}`
        (method "draft_model", which may be given).

        Raises:
            ValueError: naming each key that is unknown, missing, out of range or not of the method.
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {value!r}")
        known = {f.name for f in fields(cls)}
        problems = [f"speculative_config[{key!r}]: not a key; the keys are {', '.join(sorted(known))}"
                    for key in value if key not in known]
        name = value.get("method", "ngram" if value.get("model") is None else "draft_model")
        method = _METHODS.get(name) if isinstance(name, str) else None
        if method is None:
            problems.append(f"speculative_config['method']: {value['method']!r} is not supported; 'ngram' "
                            f"(prompt lookup) and 'draft_model' (with 'model': a folder) are")
        k = value.get("num_speculative_tokens")
        if not _positive(k):
            problems.append(f"speculative_config['num_speculative_tokens']: give the most tokens proposed per step, "
                            f"a positive integer, got {k!r}")
        limit = value.get("disable_by_batch_size")
        if limit is not None and not _positive(limit):
            problems.append(f"speculative_config['disable_by_batch_size']: a positive integer (no proposals while "
                            f"more sequences run) or None, got {limit!r}")
        common = dict(num_speculative_tokens=k, disable_by_batch_size=limit)
        if method == "draft_model":
            return cls._checked(problems + _draft_problems(value), method="draft_model", model=value.get("model"),
                                quantization=value.get("quantization"), **common)
        problems += [f"speculative_config[{key!r}]: a draft model's, not with method 'ngram'; drop it"
                     for key in _DRAFT_KEYS if key in value]
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (low if low is not None else high,
                                                                   high if high is not None else low)
        if not (_positive(low) and _positive(high)) or low > high:
            problems.append(f"speculative_config['prompt_lookup_min'] and ['prompt_lookup_max']: positive integers, "
                            f"min <= max, got {low!r} and {high!r}")
        return cls._checked(problems, method="ngram", prompt_lookup_min=low, prompt_lookup_max=high, **common)

    @classmethod
    def _checked(cls, problems: list[str], **values: Any) -> "SpeculativeConfig":
        if problems:
            raise ValueError("; ".join(problems))
        return cls(**values)


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _draft_problems(value: dict[str, Any]) -> list[str]:
    """What is wrong with a draft model's keys."""
    problems = [f"speculative_config[{key!r}]: prompt lookup's, not the draft model's; drop it"
                for key in _NGRAM_KEYS if key in value]
    model, quantization = value.get("model"), value.get("quantization")
    if not isinstance(model, str) or not model:
        problems.append(f"speculative_config['model']: method 'draft_model' needs the draft model's folder, "
                        f"got {model!r}")
    if quantization is not None and not isinstance(quantization, str):
        problems.append(f"speculative_config['quantization']: a method name such as 'int8' or 'fp8', or None, "
                        f"got {quantization!r}")
    if value.get("draft_tensor_parallel_size", 1) != 1:
        problems.append(f"speculative_config['draft_tensor_parallel_size']: the draft runs whole on the target's "
                        f"first rank; give 1 or leave it out, got {value['draft_tensor_parallel_size']!r}")
    return problems


@dataclass
class SpeculativeSettings(SettingsGroup):
    """Whether and how tokens are proposed for the model to verify."""

    speculative_config: dict[str, Any] | None = _setting(
        None, "Speculative decoding, as vLLM's: {'method': 'ngram', 'num_speculative_tokens': k, "
              "'prompt_lookup_min': a, 'prompt_lookup_max': b} proposes up to k tokens per sequence and step from "
              "its own prompt and output (the tokens after the last earlier match of its last a to b tokens); "
              "{'model': folder, 'num_speculative_tokens': k} has a smaller model of the same vocabulary propose "
              "them (its own KV cache sharing the target's blocks and memory budget). One forward pass verifies "
              "them; proposals are kept where their expected acceptance is worth their rows' measured cost (most "
              "at small batches). Outputs are the same as without it: greedy and seeded rows token for token, "
              "other sampled rows in distribution. Not with async_scheduling.", OPERATIONAL)

    def problems(self) -> list[str]:
        """What `SpeculativeConfig.parse` names in speculative_config (reading it here keeps
        the parsed record: `speculative`)."""
        if self.speculative_config is None:
            return []
        try:
            self.speculative
        except ValueError as exc:
            return [str(exc)]
        return []

    @functools.cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` read (`SpeculativeConfig.parse`), or None without speculation:
        parsed once, when the settings are checked, and kept for the engine, the draft model's
        runner and every rank that receives the config."""
        return SpeculativeConfig.parse(self.speculative_config) if self.speculative_config is not None else None
