"""Sampling configuration as Dagster config, and its choice per partition."""

import fnmatch
from collections.abc import Mapping
from typing import Generic, TypeVar

import dagster as dg
from pydantic import Field

from engine import SamplingParams

T = TypeVar("T")


class SamplingConfig(dg.Config):
    """How to sample one partition's completions (the engine's `SamplingParams`).

    Dagster checks field names and types when a run is launched; the value bounds below
    are checked when the generation step builds its config, before the model loads.
    """

    temperature: float = Field(default=0.0, ge=0.0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (1 = off).")
    top_k: int = Field(default=0, ge=-1, description="Keep the k most likely tokens (0 or -1 = off).")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0,
                         description="Drop tokens less likely than min_p times the most likely one (0 = off).")
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                    description="Subtracted from tokens already generated (0 = off).")
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0,
                                     description="Subtracted per earlier occurrence in the completion (0 = off).")
    repetition_penalty: float = Field(default=1.0, gt=0.0,
                                      description="Divides logits of tokens in the prompt or completion (1 = off).")
    max_tokens: int = Field(default=128, ge=1, description="Most tokens to generate per row.")
    min_tokens: int = Field(default=0, ge=0, description="Tokens to generate before EOS or a stop may end a row.")
    seed: int | None = Field(default=None, description="Per-row random seed; fixed seeds give repeatable samples.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion.")
    ignore_eos: bool = Field(default=False, description="Keep generating past the end-of-sequence token.")

    def to_sampling_params(self, **overrides: object) -> SamplingParams:
        return SamplingParams(**{**self.model_dump(), **overrides})


class SamplingOverrides(dg.Config):
    """Per-run overrides from the Launchpad or `--config-json`: set fields win over the
    partition's configured sampling, unset (null) fields leave it as it is."""

    temperature: float | None = Field(default=None, ge=0.0, description="Overrides temperature.")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="Overrides top_p.")
    top_k: int | None = Field(default=None, ge=-1, description="Overrides top_k.")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0, description="Overrides min_p.")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="Overrides presence_penalty.")
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, description="Overrides frequency_penalty.")
    repetition_penalty: float | None = Field(default=None, gt=0.0, description="Overrides repetition_penalty.")
    max_tokens: int | None = Field(default=None, ge=1, description="Overrides max_tokens.")
    min_tokens: int | None = Field(default=None, ge=0, description="Overrides min_tokens.")
    seed: int | None = Field(default=None, description="Overrides seed.")
    stop: list[str] | None = Field(default=None, description="Overrides stop.")
    ignore_eos: bool | None = Field(default=None, description="Overrides ignore_eos.")

    def apply(self, base: SamplingConfig) -> SamplingConfig:
        changes = {k: v for k, v in self.model_dump().items() if v is not None}
        return SamplingConfig(**{**base.model_dump(), **changes})


class GenerationRunConfig(dg.Config):
    """Run config of a generation asset."""

    sampling: SamplingOverrides = Field(
        default_factory=SamplingOverrides,
        description="Sampling fields to override for every partition of this run.",
    )


class PartitionChoice(Generic[T]):
    """Chooses a partition's value (its sampling, its adapter): its exact key, else the
    first matching glob pattern (in the mapping's order), else the default.

    Multi-dimensional keys are matched in their string form, "dim1value|dim2value".
    Mapping keys that name no partition (and patterns that match none) are definition
    errors, reported when the definitions load.
    """

    def __init__(
        self,
        default: T,
        by_partition: Mapping[str, T] | None,
        partitions_def: dg.PartitionsDefinition | None,
        asset_name: str,
        argument: str,
    ) -> None:
        self.default = default
        self.by_partition = dict(by_partition or {})
        if self.by_partition and partitions_def is None:
            raise dg.DagsterInvalidDefinitionError(
                f"{asset_name}: {argument} needs a partitions_def; an unpartitioned asset takes one value for all rows"
            )
        if self.by_partition and not isinstance(partitions_def, dg.DynamicPartitionsDefinition):
            keys = partitions_def.get_partition_keys()
            unknown = [k for k in self.by_partition if not any(fnmatch.fnmatchcase(p, k) for p in keys)]
            if unknown:
                shown = ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else "")
                raise dg.DagsterInvalidDefinitionError(
                    f"{asset_name}: {argument} names {unknown}, which match no partition key "
                    f"(keys: {shown}). Use an existing key or a glob pattern such as '2024-*'."
                )

    def for_partition(self, key: str | None) -> T:
        if key is None:
            return self.default
        if key in self.by_partition:
            return self.by_partition[key]
        for pattern, value in self.by_partition.items():
            if fnmatch.fnmatchcase(key, pattern):
                return value
        return self.default
