"""Quality checks of a generation table: error rows, empty completions, truncation, ids,
reasoning that never ended, and the parse rate of a structured output; their thresholds
and descriptions."""

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
    max_unfinished_reasoning_rate: float = Field(
        default=0.0, ge=0, le=1, description="Completions that stopped inside the model's reasoning (no answer) "
                                             "above this share fail the unfinished_reasoning check.")


DESCRIPTIONS = {
    "no_error_rows": "Rows that could not be generated (bad prompt, too long, bad override or adapter); "
                     "structured outputs that did not parse count in parse_rate instead.",
    "no_empty_generations": "Completions whose answer is empty or only whitespace and that made no tool call "
                            "(a reasoning that never ended counts in unfinished_reasoning instead).",
    "truncation_rate": "Completions cut off by max_tokens (finish_reason 'length').",
    "unique_ids": "Rows whose id repeats an earlier row's id in the partition.",
    "unfinished_reasoning": "Completions that stopped inside the model's reasoning (max_tokens, EOS or a stop "
                            "before its end), so without an answer; their error says which.",
}
PARSE_RATE = "parse_rate"
PARSE_RATE_DESCRIPTION = ("Share of generated rows whose structured output parsed and matched its schema "
                          "(or choices), of those whose reasoning (if any) ended; the others have the reason in "
                          "their error column.")
# How the error of a row whose reasoning never ended begins (`schema.result_record`): the
# unfinished_reasoning check counts the rows by it.
REASONING_NOT_ENDED = "the reasoning did not end"


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
    unfinished = pc.fill_null(pc.starts_with(generated["error"], REASONING_NOT_ENDED), False)
    answered = generated.filter(pc.invert(unfinished))
    blank = pc.equal(pc.utf8_trim_whitespace(answered["generated_text"]), "")
    empty = _count(pc.and_(blank, pc.is_null(answered["tool_calls"])))
    truncated = _count(pc.equal(generated["finish_reason"], "length"))
    repeated = rows - len(pc.unique(table["id"])) if rows else 0
    outcomes = {}
    for name, count, denominator, limit in (
        ("no_error_rows", errors, rows, thresholds.max_error_rate),
        ("no_empty_generations", empty, answered.num_rows, thresholds.max_empty_rate),
        ("truncation_rate", truncated, generated.num_rows, thresholds.max_truncation_rate),
        ("unique_ids", repeated, rows, 1.0 if allow_duplicate_ids else 0.0),
        ("unfinished_reasoning", _count(unfinished), generated.num_rows, thresholds.max_unfinished_reasoning_rate),
    ):
        rate = count / denominator if denominator else 0.0
        outcomes[name] = CheckOutcome(rate <= limit, {"rows": count, "rate": round(rate, 4), "max_rate": limit})
    if structured is not None:
        outcomes[PARSE_RATE] = _parse_rate(answered, thresholds.min_parse_rate, structured)
    return outcomes


def _count(mask: pa.ChunkedArray) -> int:
    """How many values of a boolean column are true."""
    return pc.sum(mask.cast(pa.int64())).as_py() or 0


def _parse_rate(answered: pa.Table, min_rate: float, structured: bool) -> CheckOutcome:
    """Answered rows (generated, their reasoning ended) whose output parsed: such a row with
    an error is one that did not."""
    if not structured:
        return CheckOutcome(True, {"structured_output": "none for this partition"})
    failed = _count(pc.is_valid(answered["error"]))
    parsed = answered.num_rows - failed
    rate = parsed / answered.num_rows if answered.num_rows else 1.0
    return CheckOutcome(rate >= min_rate, {"parse_rate": round(rate, 4), "parsed_rows": parsed,
                                           "failed_rows": failed, "min_parse_rate": min_rate})
