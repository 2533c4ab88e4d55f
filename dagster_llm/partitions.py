"""Partitions of a generation asset: a value chosen per partition (its sampling, its
adapter, its structured output) by key or glob pattern, and the row shards that split one
upstream partition's rows over several runs."""

import fnmatch
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import dagster as dg

from dagster_llm.core.sampling import BeamSearchConfig
from dagster_llm.core.schema import output_columns_problem
from dagster_llm.core.structured import OutputSpecError, StructuredOutput
from dagster_llm.spec import GenerationSpec

T = TypeVar("T")

# The dimensions of a sharded asset's partitions: the upstream partition, and the shard.
PARTITION_DIMENSION = "partition"
SHARD_DIMENSION = "shard"


def sharded_partitions(asset_name: str, partitions_def: dg.PartitionsDefinition | None, shards: int
                       ) -> dg.MultiPartitionsDefinition:
    """Each upstream partition split into `shards` static shards "0".."N-1" (a second dimension).

    Raises:
        DagsterInvalidDefinitionError: the upstream is not partitioned, or already has two dimensions.
    """
    if partitions_def is None or isinstance(partitions_def, dg.MultiPartitionsDefinition):
        kind = "not partitioned" if partitions_def is None else "partitioned in two dimensions"
        raise dg.DagsterInvalidDefinitionError(
            f"{asset_name}: row_shards splits each upstream partition's rows, but the upstream asset is {kind}; "
            "give the prompt table one partition dimension (e.g. daily, or a StaticPartitionsDefinition of one key)")
    shard_keys = dg.StaticPartitionsDefinition([str(i) for i in range(shards)])
    return dg.MultiPartitionsDefinition({PARTITION_DIMENSION: partitions_def, SHARD_DIMENSION: shard_keys})


def upstream_partition(key: str | None) -> str | None:
    """The upstream partition a key of the asset reads: the key itself, or a row shard's partition."""
    dimensions = getattr(key, "keys_by_dimension", None)
    if dimensions and set(dimensions) == {PARTITION_DIMENSION, SHARD_DIMENSION}:
        return dimensions[PARTITION_DIMENSION]
    return key


@dataclass(frozen=True)
class RowShard:
    """Shard `index` of `count` of one upstream partition: the rows whose id hashes to it, so a
    row stays in its shard however the partition's other rows change."""

    index: int
    count: int

    @classmethod
    def of(cls, key: dg.MultiPartitionKey, count: int) -> "RowShard":
        return cls(int(key.keys_by_dimension[SHARD_DIMENSION]), count)

    def holds(self, row_id: object) -> bool:
        digest = hashlib.blake2b(str(row_id).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") % self.count == self.index


class PartitionChoice(Generic[T]):
    """Chooses a partition's value (its sampling, its adapter): its exact key, else the
    first matching glob pattern (in the mapping's order), else the default.

    Multi-dimensional keys are matched in their string form, "dim1value|dim2value"; a row
    shard takes its upstream partition's value.
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
        entry = self.entry_for(key)
        return self.by_partition[entry] if entry is not None else self.default

    def entry_for(self, key: str | None) -> str | None:
        """The mapping key that names partition `key` (its own key, else the first matching
        pattern), or None where the default applies."""
        key = upstream_partition(key)
        if key is None:
            return None
        if key in self.by_partition:
            return key
        return next((pattern for pattern in self.by_partition if fnmatch.fnmatchcase(key, pattern)), None)


def output_choice(spec: GenerationSpec, partitions_def: dg.PartitionsDefinition | None
                  ) -> PartitionChoice[StructuredOutput | None]:
    """Each partition's structured output: its entry in `output_schema_by_partition` or
    `choices_by_partition` (None: free text), else the default schema or choices.

    Raises:
        DagsterInvalidDefinitionError: a bad schema or choices (naming the argument and the
            partition), columns that clash with the generation table's, or a partition named
            by both mappings.
    """
    asset_name = spec.name
    default = _structured(asset_name, "output_schema/choices", spec.output_schema, spec.choices)
    by_schema = {key: _structured(asset_name, f"output_schema_by_partition[{key!r}]", value, None)
                 for key, value in spec.output_schema_by_partition.items()}
    by_choices = {key: _structured(asset_name, f"choices_by_partition[{key!r}]", None, value)
                  for key, value in spec.choices_by_partition.items()}
    schemas = PartitionChoice(default, by_schema, partitions_def, asset_name, "output_schema_by_partition")
    labels = PartitionChoice(default, by_choices, partitions_def, asset_name, "choices_by_partition")
    enumerable = partitions_def is not None and not isinstance(partitions_def, dg.DynamicPartitionsDefinition)
    keys = [*by_schema, *(partitions_def.get_partition_keys() if enumerable and by_schema and by_choices else [])]
    for key in keys:
        if schemas.entry_for(key) is not None and labels.entry_for(key) is not None:
            raise dg.DagsterInvalidDefinitionError(
                f"{asset_name}: partition {key!r} is named by output_schema_by_partition "
                f"({schemas.entry_for(key)!r}) and by choices_by_partition ({labels.entry_for(key)!r}); "
                "a partition takes a schema or choices: remove one of the two entries")
    return PartitionChoice(default, {**by_schema, **by_choices}, partitions_def, asset_name,
                           "output_schema_by_partition/choices_by_partition")


def _structured(asset_name: str, argument: str, schema: Mapping[str, Any] | type | None,
                choices: Sequence[str] | None) -> StructuredOutput | None:
    if schema is None and choices is None:
        return None
    try:
        output = StructuredOutput(schema, choices)
    except OutputSpecError as exc:
        raise dg.DagsterInvalidDefinitionError(f"{asset_name}: {argument}: {exc}") from None
    problem = output_columns_problem(output)
    if problem is not None:
        raise dg.DagsterInvalidDefinitionError(f"{asset_name}: {argument}: {problem}")
    return output


def beam_choice(spec: GenerationSpec, partitions_def: dg.PartitionsDefinition | None,
                output: PartitionChoice[StructuredOutput | None]) -> PartitionChoice[BeamSearchConfig | None]:
    """Each partition's beam search (None: sampling).

    Raises:
        DagsterInvalidDefinitionError: a partition with both a beam search and a structured
            output (beams are not constrained by a grammar).
    """
    beams = PartitionChoice(spec.beam_search, spec.beam_search_by_partition, partitions_def, spec.name,
                            "beam_search_by_partition")
    enumerable = partitions_def is not None and not isinstance(partitions_def, dg.DynamicPartitionsDefinition)
    keys = partitions_def.get_partition_keys() if enumerable else [*spec.beam_search_by_partition, None]
    for key in keys:
        if beams.for_partition(key) is not None and output.for_partition(key) is not None:
            where = f"partition {key!r}" if key is not None else "the asset"
            raise dg.DagsterInvalidDefinitionError(
                f"{spec.name}: {where} has a beam search and a structured output; beams are not constrained by "
                "a grammar: drop one of the two for it")
    return beams
