"""Per-request sampling settings, validated on construction (vLLM's `SamplingParams`)."""

import copy
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, InitVar, dataclass, fields
from typing import Any

from engine.exceptions import ParameterTypeError, VLLMValidationError
from engine.structured_output.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# vLLM's thresholds: a temperature below GREEDY_TEMPERATURE is greedy decoding, and a
# positive one below MIN_TEMPERATURE is raised to it (smaller ones overflow the logits).
GREEDY_TEMPERATURE = 1e-5
MIN_TEMPERATURE = 1e-2
# OpenAI's range for a logit bias; `from_optional` clips to it, as vLLM's does.
LOGIT_BIAS_LIMIT = 100.0


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt, with vLLM's semantics.

    Args:
        n: Completions per prompt; they share the prompt's KV cache. Must be 1 when
            decoding greedily (the completions would be identical).
        temperature: Softmax temperature in [0, 2]; 0 means greedy decoding (and then
            top_p, top_k and min_p are reset to off). Positive values below 0.01 are
            raised to 0.01.
        top_p: Keep the smallest set of tokens whose probability adds up to `top_p` (1 = off).
        top_k: Keep the `top_k` most likely tokens (0 or -1 = off).
        min_p: Drop tokens less likely than `min_p` times the most likely one (0 = off).
        seed: Seed of this request's own random generators, so that its samples do not
            depend on the engine's seed or on the rest of the batch (-1 = None).
        presence_penalty: Subtracted from the logit of every token already generated.
        frequency_penalty: Subtracted once per earlier occurrence in the generated text.
        repetition_penalty: Divides positive (multiplies negative) logits of tokens seen in
            the prompt or the output; 1 = off.
        stop: Strings that end the generation; not part of the text unless
            `include_stop_str_in_output`.
        stop_token_ids: Token ids that end the generation besides EOS (duplicates dropped).
        include_stop_str_in_output: Keep the stop string at the end of the text.
        ignore_eos: Keep generating past the EOS token.
        max_tokens: Most tokens to generate per completion (vLLM's default is 16); None
            generates until EOS, a stop or the model's context length.
        min_tokens: EOS and `stop_token_ids` are suppressed until this many were generated.
        logprobs: Return the log-probabilities of this many most likely tokens at each
            step, plus the sampled token's; -1 returns the whole vocabulary. Capped by
            the engine's `max_logprobs`.
        prompt_logprobs: The same for every prompt token after the first.
        detokenize: Turn the tokens into text; False leaves `text` empty and the
            logprobs' `decoded_token` None (and allows no stop strings).
        skip_special_tokens: Leave special tokens out of the text.
        spaces_between_special_tokens: Put spaces around special tokens in the text.
        logit_bias: Token id to a finite value added to its logit.
        allowed_token_ids: Only these tokens may be generated.
        bad_words: Words that may not be generated (as any of their tokenizations;
            duplicates dropped).
        structured_outputs: What the completion must match (a JSON schema, a regex, a
            choice, a grammar); it finishes with "stop" once that is complete.
        extra_args: Free-form values carried with the request for custom code; the
            engine does not read them.
        best_of: Refused, with the way to get the same result (vLLM's V1 engine refused
            it and vLLM 0.33 dropped it).
        logits_processors: Refused, with the settings that replace them (vLLM's V1
            engine takes no per-request logits processors).

    Raises:
        VLLMValidationError: a `ValueError` naming every invalid field and its allowed
            values; a `ParameterTypeError` (also a `TypeError`) when a field has the
            wrong type or is one vLLM no longer takes.
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
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    best_of: InitVar[int | None] = None
    logits_processors: InitVar[list | None] = None

    def __post_init__(self, best_of: int | None, logits_processors: list | None) -> None:
        self._normalize()
        problems = _refused(best_of, logits_processors) + self._problems()
        if problems:
            raise _error(problems)
        if self.temperature < GREEDY_TEMPERATURE:
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @classmethod
    def from_optional(cls, **values: Any) -> "SamplingParams":
        """vLLM's constructor for API layers where an unset setting arrives as None: None
        takes the field's default wherever None is not a value of its own (`seed`,
        `max_tokens`, `logprobs`, ...); `logit_bias` may key by id strings, and its values
        are clipped to [-100, 100] as in OpenAI's API."""
        defaults = {f.name: f.default for f in fields(cls)}
        resolved = {name: defaults[name] if value is None and name in defaults and not _takes_none(name) else value
                    for name, value in values.items()}
        bias = resolved.get("logit_bias")
        if isinstance(bias, Mapping):
            resolved["logit_bias"] = {_bias_key(k): _clip_bias(v) for k, v in bias.items()}
        return cls(**resolved)

    def update_from_generation_config(self, generation_config: Mapping[str, Any],
                                      eos_token_id: int | None = None) -> None:
        """vLLM's merge of a model's generation config: its end-of-sequence ids other than
        the tokenizer's `eos_token_id` become stop token ids (unless `ignore_eos`). Our
        engine already stops on every one of them; this is for code that calls it."""
        eos = generation_config.get("eos_token_id")
        if eos is None or self.ignore_eos:
            return
        extra = [t for t in ([eos] if isinstance(eos, int) else eos) if t != eos_token_id]
        self.stop_token_ids = list(dict.fromkeys([*self.stop_token_ids, *extra]))

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's `clone`)."""
        return copy.deepcopy(self)

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
        """vLLM's conversions, before validation: a single stop string, -1 for no seed,
        True for one logprob, duplicate ids and words dropped, a tiny temperature raised."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            # A wrong type (stop=5) stays as given, for problems() to name.
            if value is None or isinstance(value, (list, tuple)):
                setattr(self, name, _without_duplicates(value or []) if name != "stop" else list(value or []))
        if _integer(self.seed) and self.seed == -1:
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                setattr(self, name, int(getattr(self, name)))
        if _number(self.temperature) and 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is below %s, where the logits overflow; using %s (as vLLM does)",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if isinstance(self.logit_bias, dict):
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                pass

    @staticmethod
    def rule(name: str) -> str:
        """The allowed values of a field, in words (e.g. "in [0, 2] (0 = greedy)")."""
        return _RULES[name].words

    def problems(self) -> list[str]:
        """Every invalid field, as `field must be <rule>, got <value>` strings (empty when
        all are valid)."""
        return [p.text for p in self._problems()]

    def _problems(self) -> list["_Problem"]:
        found = []
        for name, rule in _RULES.items():
            value = getattr(self, name)
            wrong_type = not _holds(rule.type_ok, value, self)
            if wrong_type or not _holds(rule.value_ok, value, self):
                found.append(_Problem(name, value, f"{name} must be {rule.words}, got {value!r}", wrong_type))
        return found or _conflicts(self)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the most likely (processed) token at every step."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def token_ids(self) -> list[int]:
        """Every token id these settings name, for checking against the vocabulary."""
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    def max_output_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """The most tokens a completion of this prompt can generate: `max_tokens`, or what
        the model's context leaves when it is None."""
        room = max_model_len - num_prompt_tokens
        return room if self.max_tokens is None else min(self.max_tokens, room)


def logprobs_count(setting: int | None, vocab_size: int) -> int | None:
    """A `logprobs`, `prompt_logprobs` or `max_logprobs` setting as a number of tokens:
    -1 is the whole vocabulary."""
    return vocab_size if setting == -1 else setting


@dataclass(frozen=True)
class _Rule:
    """A field's allowed values: in words, as a type test and as a value test (run only
    on a value of the right type)."""

    words: str
    type_ok: "Callable[[Any, SamplingParams], bool]"
    value_ok: "Callable[[Any, SamplingParams], bool]" = lambda v, p: True


@dataclass(frozen=True)
class _Problem:
    name: str
    value: Any
    text: str
    wrong_type: bool


def _error(problems: list[_Problem]) -> VLLMValidationError:
    kind = ParameterTypeError if any(p.wrong_type for p in problems) else VLLMValidationError
    return kind("Invalid SamplingParams: " + "; ".join(p.text for p in problems),
                parameter=problems[0].name, value=problems[0].value)


def _refused(best_of: object, logits_processors: object) -> list[_Problem]:
    """The arguments vLLM no longer takes, each with what to do instead."""
    found = []
    if best_of is not None:
        found.append(_Problem("best_of", best_of, (
            f"best_of={best_of!r} is not supported (vLLM's V1 engine refused it and vLLM 0.33 removed it): "
            "sample n completions with logprobs=0 and keep the one with the highest cumulative_logprob"), True))
    if logits_processors:
        found.append(_Problem("logits_processors", logits_processors, (
            "per-request logits_processors are not supported (as in vLLM's V1 engine): use logit_bias, "
            "allowed_token_ids, bad_words or structured_outputs"), True))
    return found


def _conflicts(params: SamplingParams) -> list[_Problem]:
    """Fields that are valid alone but not together."""
    found = []
    if params.n > 1 and params.temperature < GREEDY_TEMPERATURE:
        found.append(_Problem("n", params.n, (
            f"n must be 1 when temperature is 0 (greedy), got {params.n}: the completions would be identical; "
            "set temperature > 0 to sample different ones"), False))
    if params.stop and not params.detokenize:
        found.append(_Problem("stop", params.stop, (
            "stop strings need detokenize=True (they are found in the text): set detokenize=True "
            "or stop on token ids with stop_token_ids"), False))
    return found


def _takes_none(name: str) -> bool:
    """Whether None is a value of the field's own rather than "unset"."""
    return _holds(_RULES[name].type_ok, None, None) if name in _RULES else True


def _bias_key(key: object) -> object:
    try:
        return int(key)
    except (TypeError, ValueError):
        return key  # left for validation to name


def _clip_bias(value: object) -> object:
    return min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, value)) if _finite(value) else value


def _without_duplicates(values: list | tuple) -> list:
    try:
        return list(dict.fromkeys(values))
    except TypeError:  # unhashable items: left for validation to name
        return list(values)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return _number(value) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(value: object, params: object = None) -> bool:
    return isinstance(value, bool)


def _list_of(test: Callable[[object], bool]) -> "Callable[[Any, SamplingParams], bool]":
    return lambda v, p: isinstance(v, list) and all(test(x) for x in v)


def _optional(test: "Callable[[Any, SamplingParams], bool]") -> "Callable[[Any, SamplingParams], bool]":
    return lambda v, p: v is None or test(v, p)


def _holds(test: "Callable[[Any, SamplingParams], bool]", value: object, params: "SamplingParams | None") -> bool:
    try:
        return bool(test(value, params))
    except TypeError:
        return False


def _number_in(low: float, high: float) -> _Rule:
    return _Rule(f"in [{low:g}, {high:g}]", lambda v, p: _number(v), lambda v, p: low <= v <= high)


def _logprobs_rule() -> _Rule:
    return _Rule("None, -1 (the whole vocabulary) or a non-negative integer",
                 _optional(lambda v, p: _integer(v)), lambda v, p: v is None or v >= -1)


# Each field's rule. NaN fails every comparison, so the ranges refuse it too.
_RULES: dict[str, _Rule] = {
    "n": _Rule("a positive integer", lambda v, p: _integer(v), lambda v, p: v >= 1),
    "temperature": _Rule("in [0, 2] (0 = greedy)", lambda v, p: _number(v),
                         lambda v, p: 0 <= v <= 2),
    "top_p": _Rule("in (0, 1] (1 = off)", lambda v, p: _number(v), lambda v, p: 0 < v <= 1),
    "top_k": _Rule("-1, 0 (both off) or a positive integer", lambda v, p: _integer(v), lambda v, p: v >= -1),
    "min_p": _Rule("in [0, 1] (0 = off)", lambda v, p: _number(v), lambda v, p: 0 <= v <= 1),
    "seed": _Rule("an integer or None", _optional(lambda v, p: _integer(v))),
    "presence_penalty": _number_in(-2, 2),
    "frequency_penalty": _number_in(-2, 2),
    "repetition_penalty": _Rule("a finite number > 0 (1 = off)", lambda v, p: _number(v),
                                lambda v, p: 0 < v < math.inf),
    "stop": _Rule("a list of non-empty strings", _list_of(lambda s: isinstance(s, str)), lambda v, p: all(v)),
    "stop_token_ids": _Rule("a list of non-negative integers", _list_of(_integer), lambda v, p: min(v, default=0) >= 0),
    "include_stop_str_in_output": _Rule("true or false", _flag),
    "ignore_eos": _Rule("true or false", _flag),
    "max_tokens": _Rule("a positive integer",
                        _optional(lambda v, p: _integer(v)), lambda v, p: v is None or v >= 1),
    "min_tokens": _Rule("an integer in [0, max_tokens]", lambda v, p: _integer(v),
                        lambda v, p: 0 <= v <= (p.max_tokens if _integer(p.max_tokens) else
                                                math.inf if p.max_tokens is None else 0)),
    "logprobs": _logprobs_rule(),
    "prompt_logprobs": _logprobs_rule(),
    "detokenize": _Rule("true or false", _flag),
    "skip_special_tokens": _Rule("true or false", _flag),
    "spaces_between_special_tokens": _Rule("true or false", _flag),
    "logit_bias": _Rule("None or a mapping of token id to a finite number",
                        _optional(lambda v, p: isinstance(v, dict) and all(_integer(k) and _number(x)
                                                                           for k, x in v.items())),
                        lambda v, p: v is None or all(math.isfinite(x) for x in v.values())),
    "allowed_token_ids": _Rule("None or a non-empty list of non-negative token ids",
                               _optional(_list_of(_integer)), lambda v, p: v is None or (v and min(v) >= 0)),
    "bad_words": _Rule("a list of words that are not blank", _list_of(lambda s: isinstance(s, str)),
                       lambda v, p: all(s.strip() for s in v)),
    "structured_outputs": _Rule("None or a StructuredOutputsParams",
                                _optional(lambda v, p: isinstance(v, StructuredOutputsParams))),
    "extra_args": _Rule("None or a dict", _optional(lambda v, p: isinstance(v, dict))),
}
