"""A value chosen per partition (its sampling, its adapter) by key or glob pattern."""

import fnmatch
from collections.abc import Mapping
from typing import Generic, TypeVar

import dagster as dg

T = TypeVar("T")


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
