"""Sampling settings of a generation table, read from the engine's own declarations.

`SamplingParams` declares each field once, with its meaning and its rule; this module only
picks the fields a table carries and how each is stored in Parquet (`TABLE_FIELDS`). The
pydantic `SamplingConfig`, the Dagster run config (`dagster_llm.run_config`), the per-row
override columns and the output columns are all derived from that.

Unset fields stay unset: what the model's generation config says (as `LLM.generate`
without sampling params uses it) applies to them, and the table records the values used.
"""

from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from dagster_llm.core.engine_surface import BeamSearchParams, SamplingParams, StructuredOutputsParams

# The sampling fields a generation table carries, as override columns and as output
# columns, with their Parquet types (the Python types follow from them).
TABLE_FIELDS: dict[str, pa.DataType] = {
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "top_k": pa.int64(),
    "min_p": pa.float64(),
    "presence_penalty": pa.float64(),
    "frequency_penalty": pa.float64(),
    "repetition_penalty": pa.float64(),
    "max_tokens": pa.int64(),
    "min_tokens": pa.int64(),
    "seed": pa.int64(),
    "stop": pa.list_(pa.string()),
    "ignore_eos": pa.bool_(),
}
_PYTHON_TYPES = {pa.float64(): float, pa.int64(): int, pa.bool_(): bool, pa.list_(pa.string()): list[str]}


@dataclass(frozen=True)
class SamplingField:
    """One sampling field of a generation table: its engine name, Python and Parquet types,
    and the engine's description of it (meaning and rule)."""

    name: str
    type: Any
    arrow_type: pa.DataType
    description: str


SAMPLING_FIELDS: tuple[SamplingField, ...] = tuple(
    SamplingField(name, _PYTHON_TYPES[arrow], arrow, SamplingParams.describe(name))
    for name, arrow in TABLE_FIELDS.items()
)
SAMPLING_FIELD_NAMES = tuple(TABLE_FIELDS)


def optional_fields(describe: str = "{description}") -> dict[str, Any]:
    """pydantic field definitions of every table sampling field, each optional (None: unset),
    described by `describe` formatted with the field's `name` and `description`."""
    return {f.name: (f.type | None, Field(default=None, description=describe.format(name=f.name,
                                                                                      description=f.description)))
            for f in SAMPLING_FIELDS}


def set_values(config: BaseModel) -> dict[str, Any]:
    """The fields of a sampling config or override that are set (not None)."""
    return {name: value for name, value in config.model_dump().items() if value is not None}


def field_problems(values: dict[str, Any]) -> list[str]:
    """The engine's problems with these set fields alone, as "field must be ..., got ..."
    lines. An unset max_tokens is taken as no limit here: the model's default is only
    known when it loads (`effective_params` checks the whole again then)."""
    return SamplingParams.problems_in({"max_tokens": None, **values})


class _Checked(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="after")
    def _check_rules(self) -> "_Checked":
        problems = field_problems(set_values(self))
        if problems:
            # One per line: a value's repr never holds a raw newline, so the lines split back.
            raise ValueError("\n".join(problems))
        return self


class SamplingConfig(create_model("_SamplingFields", __base__=_Checked, **optional_fields())):
    """How to sample one partition's completions: temperature, top_p, top_k, min_p,
    presence_penalty, frequency_penalty, repetition_penalty, max_tokens, min_tokens, seed,
    stop and ignore_eos, with the engine's meaning and rules (`SamplingParams`). Unset
    fields take the model's defaults (its generation config, else vLLM's).

    Values out of range raise when the config is built (at definition time for
    `build_generation_asset(sampling=...)`).
    """

    def merged(self, changes: dict[str, Any], where: str) -> "SamplingConfig":
        """This config with `changes` set, checked by the engine's rules.

        Raises:
            ValueError: naming each bad field as `<where><field>` with its rule.
        """
        if not changes:
            return self
        try:
            return SamplingConfig(**{**set_values(self), **changes})
        except ValidationError as exc:
            raise ValueError("; ".join(_validation_problems(exc, where))) from None

    def effective_params(self, defaults: SamplingParams,
                         structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """The engine's params: `defaults` (the model's) with the set fields and the output
        constraint.

        Raises:
            ValueError: the set fields clash with the model's defaults (for instance
                min_tokens above the default max_tokens), naming both.
        """
        base = {name: getattr(defaults, name) for name in SAMPLING_FIELD_NAMES}
        problems = SamplingParams.problems_in({**base, **set_values(self)})
        if problems:
            raise ValueError(f"{'; '.join(problems)} (unset fields take the model's defaults: "
                             f"{base}); set the field explicitly")
        return SamplingParams(**{**base, **set_values(self)}, structured_outputs=structured_outputs)


class BeamSearchConfig(BaseModel):
    """Beam search instead of sampling for a partition: its `beam_width` best beams are kept
    at each step and the best one is the row's completion (`LLM.beam_search`, chosen as
    transformers' greedy beam search chooses). `max_tokens` and `ignore_eos` come from the
    partition's sampling; its other sampling fields do not apply."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    beam_width: int = Field(description="Beams kept at each step (at least 1).")
    length_penalty: float = Field(default=1.0, description="Finished beams are ranked by their log-probability "
                                                           "divided by (generated tokens) ** length_penalty: above "
                                                           "0 favours longer outputs, below 0 shorter ones.")

    @field_validator("beam_width")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError("beam_width must be at least 1")
        return value

    def params(self, sampling: SamplingParams, max_tokens: int) -> BeamSearchParams:
        """The engine's params for a row whose sampling is `sampling` and that may generate
        `max_tokens` tokens."""
        return BeamSearchParams(beam_width=self.beam_width, max_tokens=max_tokens, ignore_eos=sampling.ignore_eos,
                                length_penalty=self.length_penalty)


def used_values(params: SamplingParams) -> dict[str, Any]:
    """The table's sampling columns: the values a row was generated with."""
    return {name: getattr(params, name) for name in SAMPLING_FIELD_NAMES}


def _validation_problems(exc: ValidationError, where: str) -> list[str]:
    """pydantic's errors as `<where><field>: problem` (type errors) or the engine's rule lines."""
    problems = []
    for error in exc.errors():
        if error["loc"]:
            problems.append(f"{where}{error['loc'][0]}: {error['msg'].lower()}, got {error['input']!r}")
        else:  # the rules check: one "field must be ..., got ..." per line
            problems += [f"{where}{line}" for line in str(error["ctx"]["error"]).splitlines()]
    return problems
