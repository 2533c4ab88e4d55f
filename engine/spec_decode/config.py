"""`SpeculativeConfig`: vLLM's `speculative_config`, read and checked once."""

from dataclasses import dataclass, fields
from typing import Any

# vLLM's method names -> ours (a list-style "[ngram]" is vLLM's older spelling).
_METHODS = {"ngram": "ngram", "[ngram]": "ngram", "draft_model": "draft_model"}


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes tokens for one forward pass of the model to verify.

    method "ngram" (vLLM's prompt lookup): the tokens that followed the last earlier
    occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) in its prompt and output. method "draft_model" (given `model`, a
    model folder): a smaller model sharing the target's tokenizer proposes them, its own
    greedy choices one forward pass each. `num_speculative_tokens` is the most tokens
    proposed per sequence and step.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    model: str | None = None

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
        method = _METHODS.get(value.get("method", "ngram" if value.get("model") is None else "draft_model"))
        if method is None:
            problems.append(f"speculative_config['method']: {value['method']!r} is not supported; 'ngram' "
                            f"(prompt lookup) and 'draft_model' (with 'model': a folder) are")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            problems.append(f"speculative_config['num_speculative_tokens']: give the most tokens proposed per step, "
                            f"a positive integer, got {k!r}")
        model = value.get("model")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                problems.append(f"speculative_config['model']: method 'draft_model' needs the draft model's "
                                f"folder, got {model!r}")
            problems += [f"speculative_config[{key!r}]: prompt lookup's, not the draft model's; drop it"
                         for key in ("prompt_lookup_min", "prompt_lookup_max") if key in value]
            return cls._checked(problems, "draft_model", k, model=model)
        if model is not None:
            problems.append("speculative_config['model']: a draft model's folder, not with method 'ngram'; "
                            "drop 'method' or the model")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (low if low is not None else high,
                                                                   high if high is not None else low)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (low, high)) or low > high:
            problems.append(f"speculative_config['prompt_lookup_min'] and ['prompt_lookup_max']: positive integers, "
                            f"min <= max, got {low!r} and {high!r}")
        return cls._checked(problems, "ngram", k, low, high)

    @classmethod
    def _checked(cls, problems: list[str], *args: Any, **kwargs: Any) -> "SpeculativeConfig":
        if problems:
            raise ValueError("; ".join(problems))
        return cls(*args, **kwargs)
