"""Quality checks of a generation table: error rows, empty completions, truncation, ids,
and the parse rate of a structured output; their thresholds and descriptions."""

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field


class CheckThresholds(BaseModel):
    """Highest acceptable share of rows (0 to 1) for each check before it fails, and the
    lowest acceptable parse rate of a structured output."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_error_rate: float = Field(default=0.0, ge=0, le=1, description="Error rows above this share fail the check.")
    max_empty_rate: float = Field(default=0.0, ge=0, le=1, description="Empty generations above this share fail.")
    max_truncation_rate: float = Field(default=0.5, ge=0, le=1, description="Truncated rows above this share fail.")
    min_parse_rate: float = Field(default=1.0, ge=0, le=1, description="Structured outputs parsed below this share "
                                                                       "fail the parse_rate check.")


DESCRIPTIONS = {
    "no_error_rows": "Rows that could not be generated (bad prompt, too long, bad override or adapter); "
                     "structured outputs that did not parse count in parse_rate instead.",
    "no_empty_generations": "Completions that are empty or only whitespace.",
    "truncation_rate": "Completions cut off by max_tokens (finish_reason 'length').",
    "unique_ids": "Rows whose id repeats an earlier row's id in the partition.",
}
PARSE_RATE = "parse_rate"
PARSE_RATE_DESCRIPTION = ("Share of generated rows whose structured output parsed and matched its schema "
                          "(or choices); the others have the reason in their error column.")


@dataclass(frozen=True)
class CheckOutcome:
    """One check's verdict on one partition's table."""

    passed: bool
    metadata: dict


def evaluate(table: pa.Table, thresholds: CheckThresholds, structured: bool | None = None,
             allow_duplicate_ids: bool = False) -> dict[str, CheckOutcome]:
    """Each check's outcome for one partition's generation table. `structured`: None where
    the asset has no structured output (no parse_rate check), else whether this partition
    has. `allow_duplicate_ids` (`duplicate_ids='keep'`) lets repeated ids pass."""
    rows = table.num_rows
    ran = pc.is_valid(table["generated_text"])
    errors = rows - (pc.sum(ran.cast(pa.int64())).as_py() or 0) if rows else 0
    generated = table.filter(ran)
    empty = pc.sum(pc.equal(pc.utf8_trim_whitespace(generated["generated_text"]), "").cast(pa.int64())).as_py() or 0
    truncated = pc.sum(pc.equal(generated["finish_reason"], "length").cast(pa.int64())).as_py() or 0
    repeated = rows - len(pc.unique(table["id"])) if rows else 0
    outcomes = {}
    for name, count, denominator, limit in (
        ("no_error_rows", errors, rows, thresholds.max_error_rate),
        ("no_empty_generations", empty, generated.num_rows, thresholds.max_empty_rate),
        ("truncation_rate", truncated, generated.num_rows, thresholds.max_truncation_rate),
        ("unique_ids", repeated, rows, 1.0 if allow_duplicate_ids else 0.0),
    ):
        rate = count / denominator if denominator else 0.0
        outcomes[name] = CheckOutcome(rate <= limit, {"rows": count, "rate": round(rate, 4), "max_rate": limit})
    if structured is not None:
        outcomes[PARSE_RATE] = _parse_rate(generated, thresholds.min_parse_rate, structured)
    return outcomes


def _parse_rate(generated: pa.Table, min_rate: float, structured: bool) -> CheckOutcome:
    """Generated rows whose output parsed: a generated row with an error is one that did not."""
    if not structured:
        return CheckOutcome(True, {"structured_output": "none for this partition"})
    failed = pc.sum(pc.is_valid(generated["error"]).cast(pa.int64())).as_py() or 0
    parsed = generated.num_rows - failed
    rate = parsed / generated.num_rows if generated.num_rows else 1.0
    return CheckOutcome(rate >= min_rate, {"parse_rate": round(rate, 4), "parsed_rows": parsed,
                                           "failed_rows": failed, "min_parse_rate": min_rate})
