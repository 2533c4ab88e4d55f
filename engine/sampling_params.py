"""Per-request sampling settings, validated on construction (vLLM's `SamplingParams`)."""

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from engine.structured_output.params import StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt, with vLLM's semantics.

    Args:
        n: Completions per prompt; they share the prompt's KV cache.
        temperature: Softmax temperature; 0 means greedy decoding.
        top_p: Keep the smallest set of tokens whose probability adds up to `top_p` (1 = off).
        top_k: Keep the `top_k` most likely tokens (0 or -1 = off).
        min_p: Drop tokens less likely than `min_p` times the most likely one (0 = off).
        seed: Seed of this request's own random generators, so that its samples do not
            depend on the engine's seed or on the rest of the batch.
        presence_penalty: Subtracted from the logit of every token already generated.
        frequency_penalty: Subtracted once per earlier occurrence in the generated text.
        repetition_penalty: Divides positive (multiplies negative) logits of tokens seen in
            the prompt or the output; 1 = off.
        stop: Strings that end the generation; not part of the text unless
            `include_stop_str_in_output`.
        stop_token_ids: Token ids that end the generation besides EOS.
        include_stop_str_in_output: Keep the stop string at the end of the text.
        ignore_eos: Keep generating past the EOS token.
        max_tokens: Most tokens to generate per completion (vLLM's default is 16).
        min_tokens: EOS and `stop_token_ids` are suppressed until this many were generated.
        logprobs: Return the log-probabilities of this many most likely tokens at each
            step, plus the sampled token's.
        prompt_logprobs: The same for every prompt token after the first.
        skip_special_tokens: Leave special tokens out of the text.
        spaces_between_special_tokens: Put spaces around special tokens in the text.
        logit_bias: Token id to a value added to its logit.
        allowed_token_ids: Only these tokens may be generated.
        bad_words: Words that may not be generated (as any of their tokenizations).
        structured_outputs: What the completion must match (a JSON schema, a regex, a
            choice, a grammar); it finishes with "stop" once that is complete.

    Raises:
        ValueError: naming the field and its allowed range, on any invalid value.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalize()
        problems = self.problems()
        if problems:
            raise ValueError("Invalid SamplingParams: " + "; ".join(problems))

    @classmethod
    def problems_in(cls, values: Mapping[str, Any]) -> list[str]:
        """The problems `SamplingParams(**values)` would raise, without raising: one
        `field must be <rule>, got <value>` string per invalid or unknown field."""
        known = {f.name: f for f in fields(cls)}
        unknown = [f"{name} is not a sampling field" for name in values if name not in known]
        params = cls.__new__(cls)
        for name, spec in known.items():
            setattr(params, name, values[name] if name in values else
                    spec.default_factory() if spec.default is MISSING else spec.default)
        params._normalize()
        return unknown + params.problems()

    def _normalize(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            # A wrong type (stop=5) stays as given, for problems() to name.
            if value is None or isinstance(value, (list, tuple)):
                setattr(self, name, list(value or []))
        if isinstance(self.logit_bias, dict):
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                pass

    @staticmethod
    def rule(name: str) -> str:
        """The allowed values of a field, in words (e.g. ">= 0 (0 = greedy)")."""
        return _RULES[name][0]

    def problems(self) -> list[str]:
        """Every invalid field, as `field must be <rule>, got <value>` strings (empty when
        all are valid)."""
        return [f"{name} must be {rule}, got {getattr(self, name)!r}"
                for name, (rule, valid) in _RULES.items() if not _holds(valid, getattr(self, name), self)]

    @property
    def greedy(self) -> bool:
        """Whether this request takes the most likely (processed) token at every step."""
        return self.temperature == 0 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def token_ids(self) -> list[int]:
        """Every token id these settings name, for checking against the vocabulary."""
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or [])]


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strings(value: object, *, blank_ok: bool = True) -> bool:
    """A list of non-empty strings; `blank_ok=False` also refuses whitespace-only ones."""
    return isinstance(value, list) and all(isinstance(s, str) and (s if blank_ok else s.strip()) for s in value)


def _token_ids(value: object) -> bool:
    return isinstance(value, list) and all(_integer(t) and t >= 0 for t in value)


def _holds(valid: "Callable[[Any, SamplingParams], bool]", value: object, params: "SamplingParams") -> bool:
    try:
        return bool(valid(value, params))
    except TypeError:
        return False


# Each field's rule: words for messages and documentation, and the test of a value.
_RULES: dict[str, tuple[str, "Callable[[Any, SamplingParams], bool]"]] = {
    "n": ("a positive integer", lambda v, p: _integer(v) and v >= 1),
    "temperature": (">= 0 (0 = greedy)", lambda v, p: _number(v) and v >= 0),
    "top_p": ("in (0, 1] (1 = off)", lambda v, p: _number(v) and 0 < v <= 1),
    "top_k": ("-1, 0 (both off) or a positive integer", lambda v, p: _integer(v) and v >= -1),
    "min_p": ("in [0, 1] (0 = off)", lambda v, p: _number(v) and 0 <= v <= 1),
    "seed": ("an integer or None", lambda v, p: v is None or _integer(v)),
    "presence_penalty": ("in [-2, 2] (0 = off)", lambda v, p: _number(v) and -2 <= v <= 2),
    "frequency_penalty": ("in [-2, 2] (0 = off)", lambda v, p: _number(v) and -2 <= v <= 2),
    "repetition_penalty": ("> 0 (1 = off)", lambda v, p: _number(v) and v > 0),
    "stop": ("a list of non-empty strings", lambda v, p: _strings(v)),
    "stop_token_ids": ("a list of non-negative integers", lambda v, p: _token_ids(v)),
    "include_stop_str_in_output": ("true or false", lambda v, p: isinstance(v, bool)),
    "ignore_eos": ("true or false", lambda v, p: isinstance(v, bool)),
    "max_tokens": ("a positive integer", lambda v, p: _integer(v) and v >= 1),
    "min_tokens": ("an integer in [0, max_tokens]",
                   lambda v, p: _integer(v) and 0 <= v <= (p.max_tokens if _integer(p.max_tokens) else 0)),
    "logprobs": ("None or a non-negative integer", lambda v, p: v is None or (_integer(v) and v >= 0)),
    "prompt_logprobs": ("None or a non-negative integer", lambda v, p: v is None or (_integer(v) and v >= 0)),
    "skip_special_tokens": ("true or false", lambda v, p: isinstance(v, bool)),
    "spaces_between_special_tokens": ("true or false", lambda v, p: isinstance(v, bool)),
    "logit_bias": ("None or a mapping of token id to number",
                   lambda v, p: v is None or (isinstance(v, dict) and all(_integer(k) and _number(x) for k, x in v.items()))),
    "allowed_token_ids": ("None or a non-empty list of token ids", lambda v, p: v is None or (_token_ids(v) and len(v) > 0)),
    "bad_words": ("a list of words that are not blank", lambda v, p: _strings(v, blank_ok=False)),
    "structured_outputs": ("None or a StructuredOutputsParams",
                           lambda v, p: v is None or isinstance(v, StructuredOutputsParams)),
}
