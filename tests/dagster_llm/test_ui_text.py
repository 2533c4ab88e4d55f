"""What the Dagster UI shows besides tables: descriptions of resources and config, the preview."""

import dagster as dg
import pyarrow as pa
import pytest

from dagster_llm import GenerationRunConfig, LLMResource, ParquetIOManager
from dagster_llm.metadata import PREVIEW_ROWS, preview_markdown
from engine import SamplingParams

RST_MARKERS = (".. code-block", "::\n", ":class:", ":func:", ".. note")


def config_descriptions(config_type) -> list[str]:
    """Every description in a config schema, recursively (what the Launchpad shows)."""
    found = []
    for field in getattr(config_type, "fields", {}).values():
        if field.description:
            found.append(field.description)
        found += config_descriptions(field.config_type)
    inner = getattr(config_type, "inner_type", None)
    return found + (config_descriptions(inner) if inner is not None else [])


@pytest.mark.parametrize("resource", [LLMResource(), ParquetIOManager()], ids=["LLMResource", "ParquetIOManager"])
def test_resource_descriptions_are_plain_prose(resource):
    definition = resource.get_resource_definition()
    texts = [definition.description, *config_descriptions(definition.config_schema.config_type)]
    assert definition.description and len(definition.description) < 600
    for text in texts:
        assert not any(marker in text for marker in RST_MARKERS), text


def test_run_config_descriptions_name_the_rules():
    schema = dg.Field(GenerationRunConfig.to_config_schema().as_field().config_type)
    texts = config_descriptions(schema.config_type)
    assert not [t for t in texts if any(marker in t for marker in RST_MARKERS)]
    temperature = GenerationRunConfig.to_config_schema().as_field().config_type.fields["sampling"]
    description = temperature.config_type.fields["temperature"].description
    assert description == f"Overrides temperature. {SamplingParams.describe('temperature')}"
    assert SamplingParams.rule("temperature") in description


def table(rows: int, **columns) -> pa.Table:
    base = {"id": [f"T-{i}" for i in range(rows)], "prompt": ["Summarize: ticket"] * rows,
            "generated_text": ["ok"] * rows, "error": [None] * rows, "finish_reason": ["stop"] * rows}
    return pa.table({**base, **columns})


def test_preview_is_one_markdown_row_per_table_row_with_the_rest_counted():
    text = preview_markdown(table(PREVIEW_ROWS + 3))
    lines = text.splitlines()
    assert lines[0] == "| id | prompt | generated text | finish |"
    assert len([line for line in lines if line.startswith("| T-")]) == PREVIEW_ROWS
    assert lines[-1] == "3 more rows in the table."
    assert preview_markdown(table(0)) == "(no rows)"
    assert "more row" not in preview_markdown(table(2))


def test_preview_cells_stay_in_their_column():
    long_prompt = "Summarize this ticket. " * 10 + "Ticket: the export | button fails"
    text = preview_markdown(table(
        2, prompt=[long_prompt, "short"], generated_text=["line one\nline | two", None],
        error=[None, "prompt: null; give every row a prompt"], finish_reason=["length", None]))
    rows = [line for line in text.splitlines() if line.startswith("| T-")]
    assert [row.count(" | ") for row in rows] == [3, 3]  # escaped pipes are not separators
    first, second = rows
    assert "line one line \\| two" in first and first.endswith("| length |")
    assert "| Summarize this ticket. Summarize this ti … icket. Ticket: " in first and "the export \\| button fails" in first
    assert "error: prompt: null; give every row a prompt" in second
    assert first.startswith("| T-\u20600 |")  # no line break inside the id
