"""`SpeculativeConfig`: vLLM's `speculative_config`, read and checked once."""

from dataclasses import dataclass, fields
from typing import Any

@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine proposes tokens for one forward pass of the model to verify.

    method "ngram" (vLLM's prompt lookup): the tokens that followed the last earlier
    occurrence of the sequence's last n tokens (n from prompt_lookup_max down to
    prompt_lookup_min) in its prompt and output. `num_speculative_tokens` is the most
    tokens proposed per sequence and step.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int

    @classmethod
    def parse(cls, value: "dict[str, Any] | SpeculativeConfig") -> "SpeculativeConfig":
        """vLLM's dict (`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}`), with vLLM's defaults: both lookup bounds 5 when neither is
        given, else the one given for both.

        Raises:
            ValueError: naming each key that is unknown, missing or out of range.
        """
        if isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}}, got {value!r}")
        known = {f.name for f in fields(cls)}
        problems = [f"speculative_config[{key!r}]: not a key; the keys are {', '.join(sorted(known))}"
                    for key in value if key not in known]
        method = value.get("method", "ngram" if "model" not in value else None)
        if method not in ("ngram", "[ngram]"):
            problems.append(f"speculative_config['method']: {method!r} is not supported; 'ngram' (prompt lookup) is")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            problems.append(f"speculative_config['num_speculative_tokens']: give the most tokens proposed per step, "
                            f"a positive integer, got {k!r}")
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        low, high = (5, 5) if low is None and high is None else (low if low is not None else high,
                                                                   high if high is not None else low)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in (low, high)) or low > high:
            problems.append(f"speculative_config['prompt_lookup_min'] and ['prompt_lookup_max']: positive integers, "
                            f"min <= max, got {low!r} and {high!r}")
        if problems:
            raise ValueError("; ".join(problems))
        return cls("ngram", k, low, high)
