"""Per-request sampling settings, validated on construction (vLLM's `SamplingParams`), and the
allowed values of each (`Rule`), declared beside its field."""

import copy
import logging
import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, InitVar, dataclass, field, fields
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


# The allowed values of each field, as words and as tests: what `SamplingParams` declares
# beside each field (`_setting`'s `rule`), and what its errors quote.

# A test of a value, given the whole settings object (some rules depend on another field).
Test = Callable[[Any, Any], bool]


@dataclass(frozen=True)
class Rule:
    """A field's allowed values: in words, as a type test and as a value test (run only
    on a value of the right type). NaN fails every comparison, so ranges refuse it too."""

    words: str
    type_ok: Test
    value_ok: Test = lambda v, p: True

    def holds_type(self, value: object, params: object) -> bool:
        return _holds(self.type_ok, value, params)

    def holds_value(self, value: object, params: object) -> bool:
        return _holds(self.value_ok, value, params)


def _holds(test: Test, value: object, params: object) -> bool:
    """The test's verdict; a test that meets a value it cannot compare says no."""
    try:
        return bool(test(value, params))
    except TypeError:
        return False


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: object) -> bool:
    return _number(value) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag() -> Rule:
    return Rule("true or false", lambda v, p: isinstance(v, bool))


def _list_of(test: Callable[[object], bool]) -> Test:
    return lambda v, p: isinstance(v, list) and all(test(x) for x in v)


def _optional(test: Test) -> Test:
    return lambda v, p: v is None or test(v, p)


def _number_in(low: float, high: float, note: str = "") -> Rule:
    words = f"in [{low:g}, {high:g}]" + (f" ({note})" if note else "")
    return Rule(words, lambda v, p: _number(v), lambda v, p: low <= v <= high)


def _logprobs() -> Rule:
    return Rule("None, -1 (the whole vocabulary) or a non-negative integer",
                _optional(lambda v, p: _integer(v)), lambda v, p: v is None or v >= -1)


def _min_tokens() -> Rule:
    """At most max_tokens (any number when max_tokens is None)."""
    def within(v: int, p: Any) -> bool:
        limit = p.max_tokens if _integer(p.max_tokens) else math.inf if p.max_tokens is None else 0
        return 0 <= v <= limit
    return Rule("an integer in [0, max_tokens]", lambda v, p: _integer(v), within)


def _token_bias() -> Rule:
    return Rule("None or a mapping of token id to a finite number",
                _optional(lambda v, p: isinstance(v, dict) and all(_integer(k) and _number(x) for k, x in v.items())),
                lambda v, p: v is None or all(math.isfinite(x) for x in v.values()))


def _setting(default: object, help: str, rule: Rule) -> Any:
    """A field with its meaning and its allowed values, read by `sampling_settings()`."""
    return field(default=default, metadata={"help": help, "rule": rule})


@dataclass
class SamplingParams:
    """How to sample the completions of one prompt, with vLLM's semantics.

    Every field is declared once, with its meaning (`metadata["help"]`) and its allowed
    values (`metadata["rule"]`); the Args below, the errors, and the Dagster side's
    config fields and descriptions are derived from them (`sampling_settings()`).

    Raises:
        VLLMValidationError: a `ValueError` naming every invalid field and its allowed
            values; a `ParameterTypeError` (also a `TypeError`) when a field has the
            wrong type or is one vLLM no longer takes.
    """

    n: int = _setting(1, "Completions per prompt; they share the prompt's KV cache. Must be 1 when decoding "
                         "greedily (the completions would be identical).",
                      Rule("a positive integer", lambda v, p: _integer(v), lambda v, p: v >= 1))
    temperature: float = _setting(1.0, "Softmax temperature; 0 means greedy decoding (and then top_p, top_k and "
                                       "min_p are reset to off). Positive values below 0.01 are raised to 0.01.",
                                  _number_in(0, 2, "0 = greedy"))
    top_p: float = _setting(1.0, "Keep the smallest set of tokens whose probability adds up to top_p.",
                            Rule("in (0, 1] (1 = off)", lambda v, p: _number(v), lambda v, p: 0 < v <= 1))
    top_k: int = _setting(0, "Keep the top_k most likely tokens.",
                          Rule("-1, 0 (both off) or a positive integer", lambda v, p: _integer(v),
                               lambda v, p: v >= -1))
    min_p: float = _setting(0.0, "Drop tokens less likely than min_p times the most likely one.",
                            _number_in(0, 1, "0 = off"))
    seed: int | None = _setting(None, "Seed of this request's own random generators, so that its samples do not "
                                      "depend on the engine's seed or on the rest of the batch (-1 = None).",
                                Rule("an integer or None", _optional(lambda v, p: _integer(v))))
    presence_penalty: float = _setting(0.0, "Subtracted from the logit of every token already generated.",
                                       _number_in(-2, 2))
    frequency_penalty: float = _setting(0.0, "Subtracted once per earlier occurrence in the generated text.",
                                        _number_in(-2, 2))
    repetition_penalty: float = _setting(1.0, "Divides positive (multiplies negative) logits of tokens seen in "
                                              "the prompt or the output.",
                                         Rule("a finite number > 0 (1 = off)", lambda v, p: _number(v),
                                              lambda v, p: 0 < v < math.inf))
    stop: str | list[str] | None = _setting(None, "Strings that end the generation; not part of the text unless "
                                                  "include_stop_str_in_output.",
                                            Rule("a list of non-empty strings",
                                                 _list_of(lambda s: isinstance(s, str)),
                                                 lambda v, p: all(v)))
    stop_token_ids: list[int] | None = _setting(None, "Token ids that end the generation besides EOS (duplicates "
                                                      "dropped).",
                                                Rule("a list of non-negative integers",
                                                     _list_of(_integer),
                                                     lambda v, p: min(v, default=0) >= 0))
    include_stop_str_in_output: bool = _setting(False, "Keep the stop string at the end of the text.", _flag())
    ignore_eos: bool = _setting(False, "Keep generating past the EOS token.", _flag())
    max_tokens: int | None = _setting(16, "Most tokens to generate per completion (vLLM's default is 16); None "
                                          "generates until EOS, a stop or the model's context length.",
                                      Rule("a positive integer", _optional(lambda v, p: _integer(v)),
                                           lambda v, p: v is None or v >= 1))
    min_tokens: int = _setting(0, "EOS and stop_token_ids are suppressed until this many were generated.",
                               _min_tokens())
    logprobs: int | None = _setting(None, "Return the log-probabilities of this many most likely tokens at each "
                                          "step, plus the sampled token's; -1 returns the whole vocabulary. "
                                          "Capped by the engine's max_logprobs.", _logprobs())
    prompt_logprobs: int | None = _setting(None, "The same as logprobs for every prompt token after the first.",
                                           _logprobs())
    detokenize: bool = _setting(True, "Turn the tokens into text; False leaves text empty and the logprobs' "
                                      "decoded_token None (and allows no stop strings).", _flag())
    skip_special_tokens: bool = _setting(True, "Leave special tokens out of the text.", _flag())
    spaces_between_special_tokens: bool = _setting(True, "Put spaces around special tokens in the text.",
                                                   _flag())
    logit_bias: dict[int, float] | None = _setting(None, "Token id to a finite value added to its logit.",
                                                   _token_bias())
    allowed_token_ids: list[int] | None = _setting(None, "Only these tokens may be generated.",
                                                   Rule("None or a non-empty list of non-negative token ids",
                                                        _optional(_list_of(_integer)),
                                                        lambda v, p: v is None or (v and min(v) >= 0)))
    bad_words: list[str] | None = _setting(None, "Words that may not be generated (as any of their tokenizations; "
                                                 "duplicates dropped).",
                                           Rule("a list of words that are not blank",
                                                _list_of(lambda s: isinstance(s, str)),
                                                lambda v, p: all(s.strip() for s in v)))
    structured_outputs: StructuredOutputsParams | None = _setting(
        None, "What the completion must match (a JSON schema, a regex, a choice, a grammar); it finishes with "
              "'stop' once that is complete.",
        Rule("None or a StructuredOutputsParams",
             _optional(lambda v, p: isinstance(v, StructuredOutputsParams))))
    extra_args: dict[str, Any] | None = _setting(None, "Free-form values carried with the request for custom "
                                                       "code; the engine does not read them.",
                                                 Rule("None or a dict",
                                                      _optional(lambda v, p: isinstance(v, dict))))
    # Refused with the way to get the same result (vLLM's V1 engine refused best_of and
    # vLLM 0.33 dropped it; it takes no per-request logits processors).
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
        return _SETTINGS[name].metadata["rule"].words

    @staticmethod
    def describe(name: str) -> str:
        """A field's meaning and allowed values in one text, as docs and UIs show it."""
        return f"{_SETTINGS[name].metadata['help']} Must be {SamplingParams.rule(name)}."

    def problems(self) -> list[str]:
        """Every invalid field, as `field must be <rule>, got <value>` strings (empty when
        all are valid)."""
        return [p.text for p in self._problems()]

    def _problems(self) -> list["_Problem"]:
        found = []
        for name, setting in _SETTINGS.items():
            rule, value = setting.metadata["rule"], getattr(self, name)
            wrong_type = not rule.holds_type(value, self)
            if wrong_type or not rule.holds_value(value, self):
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
    return _SETTINGS[name].metadata["rule"].holds_type(None, None) if name in _SETTINGS else True


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


def sampling_settings() -> tuple[Field, ...]:
    """The fields of `SamplingParams`, each with its type, default, `metadata["help"]` and
    `metadata["rule"]`."""
    return fields(SamplingParams)


_SETTINGS: dict[str, Field] = {f.name: f for f in sampling_settings()}


def _args_doc() -> str:
    """The Args section of `SamplingParams`' docstring, from the fields' own declarations."""
    lines = ["", "    Args:"]
    for setting in sampling_settings():
        text = f"{setting.name} (default {setting.default!r}): {SamplingParams.describe(setting.name)}"
        lines.append(textwrap.fill(text, 100, initial_indent=" " * 8, subsequent_indent=" " * 12))
    lines += ["        best_of, logits_processors: Refused, each with the settings that give the same",
              "            result (as in vLLM's V1 engine).", ""]
    return "\n".join(lines)


SamplingParams.__doc__ = SamplingParams.__doc__.replace("\n    Raises:", _args_doc() + "\n    Raises:", 1)
