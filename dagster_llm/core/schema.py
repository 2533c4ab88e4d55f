"""The generation table: its columns (sampling columns from `SAMPLING_FIELDS`, typed
output columns from a `StructuredOutput`, the image digests of a table with images), their
descriptions, and the table built from finished rows."""

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from dagster_llm.core.prompts import PromptRow
from dagster_llm.core.sampling import SAMPLING_FIELDS, used_values
from dagster_llm.core.structured import OutputColumn, StructuredOutput
from dagster_llm.core.table_store import POSITION_COLUMN
from engine import RequestOutput

_RESULT_COLUMNS: tuple[tuple[str, pa.DataType, str], ...] = (
    ("id", pa.string(), "The prompt row's id, from the upstream table."),
    ("prompt", pa.string(), "The prompt as given: text, or chat messages as JSON (null when it was null)."),
    ("generated_text", pa.string(), "The completion (null when the row could not run); with a structured "
                                    "output, the raw JSON or the chosen label."),
    ("finish_reason", pa.string(), "'stop' (EOS or a stop string) or 'length' (max_tokens reached)."),
    ("prompt_tokens", pa.int32(), "Tokens in the rendered prompt."),
    ("completion_tokens", pa.int32(), "Tokens generated."),
    ("model", pa.string(), "The model id."),
    ("adapter", pa.string(), "The LoRA adapter used, or null for the base model."),
    ("beam_width", pa.int64(), "Beams of the beam search whose best beam is the completion; null for a sampled "
                               "row (the sampling columns then say how)."),
)
_ERROR_COLUMN = ("error", pa.string(), "Why the row was not generated, or why its structured output did not "
                                       "parse; null otherwise.")
# Only in the table of an asset with an image_column, after the error.
_IMAGE_DIGESTS_COLUMN = ("image_digests", pa.list_(pa.string()),
                         "sha256 (hex) of each of the row's images as read from the image column, in order; null "
                         "when they could not be read.")

COLUMN_DESCRIPTIONS: dict[str, str] = {
    **{name: text for name, _, text in (*_RESULT_COLUMNS, _ERROR_COLUMN, _IMAGE_DIGESTS_COLUMN)},
    **{f.name: f"Sampling setting used. {f.description}" for f in SAMPLING_FIELDS},
}
GENERATION_SCHEMA = pa.schema(
    [pa.field(name, kind) for name, kind, _ in _RESULT_COLUMNS]
    + [pa.field(f.name, f.arrow_type) for f in SAMPLING_FIELDS]
    + [pa.field(_ERROR_COLUMN[0], _ERROR_COLUMN[1])]
)


def output_columns_problem(output: StructuredOutput) -> str | None:
    """Why `output`'s columns cannot join the generation table (a name it already has), or None."""
    names = generation_schema(None, images=True).names
    clashes = [column.name for column in output.columns if column.name in {*names, POSITION_COLUMN}]
    if not clashes:
        return None
    return (f"output field(s) {clashes} would replace the generation table's column(s) of the same name; rename "
            f"them in the schema (the table's columns: {', '.join(names)})")


def output_columns(output: StructuredOutput | None) -> tuple[OutputColumn, ...]:
    return output.columns if output is not None else ()


def generation_schema(output: StructuredOutput | None, images: bool = False) -> pa.Schema:
    """The generation table's schema; after `error`, the image digests where the prompts
    have images, then a structured output's columns."""
    schema = GENERATION_SCHEMA
    if images:
        schema = schema.append(pa.field(_IMAGE_DIGESTS_COLUMN[0], _IMAGE_DIGESTS_COLUMN[1]))
    for column in output_columns(output):
        schema = schema.append(pa.field(column.name, column.arrow_type))
    return schema


def column_descriptions(output: StructuredOutput | None) -> dict[str, str]:
    return {**COLUMN_DESCRIPTIONS, **{column.name: column.description for column in output_columns(output)}}


def result_record(row: PromptRow, output: RequestOutput | None, model_id: str) -> dict[str, Any]:
    """One row of the generation table; `output` is None where the row has an error. With a
    structured output, the completion is parsed into its columns, or the row gets the error."""
    completion = output.outputs[0] if output is not None else None
    record = {
        "id": row.id,
        "prompt": row.prompt_text,
        "generated_text": completion.text if completion else None,
        "finish_reason": completion.finish_reason if completion else None,
        "prompt_tokens": len(output.prompt_token_ids) if output else None,
        "completion_tokens": len(completion.token_ids) if completion else None,
        "model": model_id,
        "adapter": row.adapter,
        "beam_width": row.beam.beam_width if row.beam is not None else None,
        **used_values(row.params),
        "error": row.error,
        "image_digests": row.image_digests,  # dropped by a table without images
    }
    if row.output is not None:
        parsed = row.output.parse(record["generated_text"], record["finish_reason"], row.params.max_tokens)
        record.update(parsed.values)
        record["error"] = record["error"] or parsed.error
    return record


def records_table(records: Sequence[Mapping[str, Any]], output: StructuredOutput | None = None,
                  extra: Mapping[str, pa.Array] | None = None, images: bool = False) -> pa.Table:
    """The generation table of `records` (plus `extra` columns, such as shard positions;
    `images`: with the image digests column)."""
    table = pa.Table.from_pylist(list(records), schema=generation_schema(output, images))
    for name, values in (extra or {}).items():
        table = table.append_column(name, values)
    return table
