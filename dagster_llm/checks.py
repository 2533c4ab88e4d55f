"""Quality checks of a generation table: error rows, empty completions, truncation, ids."""

from dataclasses import dataclass

import dagster as dg
import pyarrow as pa
import pyarrow.compute as pc


@dataclass(frozen=True)
class CheckThresholds:
    """Highest acceptable share of rows (0 to 1) for each check before it fails, and
    whether repeated ids pass (`duplicate_ids='keep'` sets it)."""

    max_error_rate: float = 0.0
    max_empty_rate: float = 0.0
    max_truncation_rate: float = 0.5
    allow_duplicate_ids: bool = False


DESCRIPTIONS = {
    "no_error_rows": "Rows that could not be generated (bad prompt, too long, bad override or adapter).",
    "no_empty_generations": "Completions that are empty or only whitespace.",
    "truncation_rate": "Completions cut off by max_tokens (finish_reason 'length').",
    "unique_ids": "Rows whose id repeats an earlier row's id in the partition.",
}


@dataclass(frozen=True)
class CheckOutcome:
    """One check's verdict on one partition's table."""

    passed: bool
    metadata: dict


def evaluate(table: pa.Table, thresholds: CheckThresholds) -> dict[str, CheckOutcome]:
    """Each check's outcome for one partition's generation table."""
    rows = table.num_rows
    ok = pc.is_null(table["error"])
    errors = rows - (pc.sum(ok.cast(pa.int64())).as_py() or 0) if rows else 0
    generated = table.filter(ok)
    empty = pc.sum(pc.equal(pc.utf8_trim_whitespace(generated["generated_text"]), "").cast(pa.int64())).as_py() or 0
    truncated = pc.sum(pc.equal(generated["finish_reason"], "length").cast(pa.int64())).as_py() or 0
    repeated = rows - len(pc.unique(table["id"])) if rows else 0
    outcomes = {}
    for name, count, denominator, limit in (
        ("no_error_rows", errors, rows, thresholds.max_error_rate),
        ("no_empty_generations", empty, generated.num_rows, thresholds.max_empty_rate),
        ("truncation_rate", truncated, generated.num_rows, thresholds.max_truncation_rate),
        ("unique_ids", repeated, rows, 1.0 if thresholds.allow_duplicate_ids else 0.0),
    ):
        rate = count / denominator if denominator else 0.0
        outcomes[name] = CheckOutcome(rate <= limit, {"rows": count, "rate": round(rate, 4), "max_rate": limit})
    return outcomes


def check_specs(asset_key: dg.AssetKey, partitions_def: dg.PartitionsDefinition | None) -> list[dg.AssetCheckSpec]:
    return [
        dg.AssetCheckSpec(name, asset=asset_key, description=description, partitions_def=partitions_def)
        for name, description in DESCRIPTIONS.items()
    ]
