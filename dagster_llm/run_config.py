"""Run config of a generation asset: per-run sampling overrides from the Launchpad or
`--config-json`, and whether to resume. The override fields are derived from the engine's
sampling declarations (`dagster_llm.core.sampling`)."""

from pydantic import Field, create_model

import dagster as dg
from dagster_llm.core.sampling import SamplingConfig, optional_fields, set_values


class SamplingOverrides(create_model("_OverrideFields", __base__=dg.Config,
                                     **optional_fields("Overrides {name}. {description}"))):
    """Per-run overrides: set fields win over the partition's configured sampling, unset
    (null) fields leave it as it is.

    Dagster checks names and types at launch; its config system has no ranges, so `apply`
    checks them, naming every bad field, before the model loads.
    """

    def apply(self, base: SamplingConfig, op_name: str) -> SamplingConfig:
        """`base` with the set fields replaced.

        Raises:
            ValueError: per field out of range, its run-config path and rule, e.g.
                "ops.answers.config.sampling.temperature must be in [0, 2] (0 = greedy), got -1.0".
        """
        return base.merged(set_values(self), f"ops.{op_name}.config.sampling.")


class GenerationRunConfig(dg.Config):
    """Run config of a generation asset."""

    sampling: SamplingOverrides = Field(
        default_factory=SamplingOverrides,
        description="Sampling fields to override for every partition of this run.",
    )
    resume: bool = Field(
        default=True,
        description="Reuse rows already generated for a partition's current data version (committed "
                    "or in shards of an interrupted run) and committed rows of the same row digest; false "
                    "regenerates every row.",
    )
