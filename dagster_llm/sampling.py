"""Sampling settings, declared once: the table of fields behind the asset's sampling
config, its run-config overrides, per-row override columns and the output columns.

The rules (ranges) are the engine's (`SamplingParams.rule`); only the Dagster defaults,
types, Parquet types and descriptions live here.
"""

from dataclasses import dataclass
from typing import Any

import dagster as dg
import pyarrow as pa
from pydantic import Field, ValidationError, create_model, model_validator

from engine import SamplingParams, StructuredOutputsParams


@dataclass(frozen=True)
class SamplingField:
    """One sampling setting as the Dagster side sees it."""

    name: str
    type: Any
    default: Any
    arrow_type: pa.DataType
    description: str

    @property
    def documented(self) -> str:
        """The description with the engine's rule, e.g. "Softmax temperature: in [0, 2] (0 = greedy)."."""
        return f"{self.description}: {SamplingParams.rule(self.name)}."


SAMPLING_FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", float, 0.0, pa.float64(), "Softmax temperature"),
    SamplingField("top_p", float, 1.0, pa.float64(), "Nucleus sampling mass"),
    SamplingField("top_k", int, 0, pa.int32(), "Keep the k most likely tokens"),
    SamplingField("min_p", float, 0.0, pa.float64(), "Drop tokens less likely than min_p times the most likely one"),
    SamplingField("presence_penalty", float, 0.0, pa.float64(), "Subtracted from tokens already generated"),
    SamplingField("frequency_penalty", float, 0.0, pa.float64(),
                  "Subtracted per earlier occurrence in the completion"),
    SamplingField("repetition_penalty", float, 1.0, pa.float64(),
                  "Divides logits of tokens in the prompt or completion"),
    SamplingField("max_tokens", int, 128, pa.int32(), "Most tokens to generate per row"),
    SamplingField("min_tokens", int, 0, pa.int32(), "Tokens to generate before EOS or a stop may end a row"),
    SamplingField("seed", int | None, None, pa.int64(),
                  "Per-row random seed (null: the resource's seed); fixed seeds give repeatable samples"),
    SamplingField("stop", list[str], [], pa.list_(pa.string()), "Strings that end a completion"),
    SamplingField("ignore_eos", bool, False, pa.bool_(), "Keep generating past the end-of-sequence token"),
)
SAMPLING_FIELD_NAMES = tuple(f.name for f in SAMPLING_FIELDS)


def _sampling_fields() -> dict[str, Any]:
    return {
        f.name: (f.type, Field(default_factory=list, description=f.documented) if isinstance(f.default, list)
                 else Field(default=f.default, description=f.documented))
        for f in SAMPLING_FIELDS
    }


class _SamplingChecks(dg.Config):
    @model_validator(mode="after")
    def _check_rules(self) -> "_SamplingChecks":
        problems = SamplingParams.problems_in(self.model_dump())
        if problems:
            # One per line: a value's repr never holds a raw newline, so the lines split back.
            raise ValueError("\n".join(problems))
        return self


_SamplingFields = create_model("_SamplingFields", __base__=_SamplingChecks, **_sampling_fields())


class SamplingConfig(_SamplingFields):
    """How to sample one partition's completions: temperature, top_p, top_k, min_p,
    presence_penalty, frequency_penalty, repetition_penalty, max_tokens, min_tokens, seed,
    stop and ignore_eos, with the engine's meaning and ranges (see `SAMPLING_FIELDS`).

    Values out of range raise when the config is built (at definition time for
    `build_generation_asset(sampling=...)`).
    """

    def to_sampling_params(self, structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        return SamplingParams(**self.model_dump(), structured_outputs=structured_outputs)


_OverrideFields = create_model(
    "_OverrideFields", __base__=dg.Config,
    **{f.name: (f.type | None, Field(default=None, description=f"Overrides {f.name}. {f.documented}"))
       for f in SAMPLING_FIELDS},
)


class SamplingOverrides(_OverrideFields):
    """Per-run overrides from the Launchpad or `--config-json`: set fields win over the
    partition's configured sampling, unset (null) fields leave it as it is.

    Dagster checks names and types at launch; its config system has no ranges, so `apply`
    checks them, naming every bad field, before the model loads.
    """

    def apply(self, base: SamplingConfig, op_name: str) -> SamplingConfig:
        """`base` with the set fields replaced.

        Raises:
            ValueError: per field out of range, its run-config path and rule, e.g.
                "ops.answers.config.sampling.temperature must be in [0, 2] (0 = greedy), got -1.0".
        """
        changes = {k: v for k, v in self.model_dump().items() if v is not None}
        return merge_sampling(base, changes, f"ops.{op_name}.config.sampling.")


def merge_sampling(base: SamplingConfig, changes: dict[str, Any], where: str) -> SamplingConfig:
    """`base` with `changes` applied, checked by the engine's rules.

    Raises:
        ValueError: naming each bad field as `<where><field>` with its rule.
    """
    if not changes:
        return base
    try:
        return SamplingConfig(**{**base.model_dump(), **changes})
    except ValidationError as exc:
        raise ValueError("; ".join(_validation_problems(exc, where))) from None


def _validation_problems(exc: ValidationError, where: str) -> list[str]:
    """pydantic's errors as `<where><field>: problem` (type errors) or the engine's rule lines."""
    problems = []
    for error in exc.errors():
        if error["loc"]:
            problems.append(f"{where}{error['loc'][0]}: {error['msg'].lower()}, got {error['input']!r}")
        else:  # the rules check: one "field must be ..., got ..." per line
            problems += [f"{where}{line}" for line in str(error["ctx"]["error"]).splitlines()]
    return problems


class GenerationRunConfig(dg.Config):
    """Run config of a generation asset."""

    sampling: SamplingOverrides = Field(
        default_factory=SamplingOverrides,
        description="Sampling fields to override for every partition of this run.",
    )
    resume: bool = Field(
        default=True,
        description="Reuse rows already generated for a partition's current data version (committed "
                    "or in shards of an interrupted run); false regenerates every row.",
    )
