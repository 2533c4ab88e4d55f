"""Property-based test of the Dagster side of OpenAI batch files (tests/openai_batch_fuzz.py
draws the files): `read_openai_batch_file` reads any file into a request table that Parquet
stores, and `table_rows` checks each row without raising, as `run_batch` checks lines: every
bad row's error names its line and a field, every good line is a row to run unless an
earlier row holds its custom_id. HYPOTHESIS_PROFILE=thorough runs 10,000 files."""

import io

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings

from dagster_llm.core.openai_batch import OUTPUT_SCHEMA, error_record, read_openai_batch_file, table_rows
from tests.fuzzing import examples
from tests.openai_batch_fuzz import BatchFile, batch_files, check_line_error

FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("batch_table_fuzz")


@settings(max_examples=examples(200), **FUZZ)
@given(file=batch_files())
def test_a_batch_file_reads_into_a_request_table_whose_every_row_is_checked(folder, file: BatchFile):
    path = folder / "requests.jsonl"
    path.write_bytes(file.data)
    frame = read_openai_batch_file(str(path))
    pq.write_table(pa.Table.from_pandas(frame), io.BytesIO())  # the upstream asset stores it so
    rows = table_rows(frame)
    assert [row.where for row in rows] == [f"line {n}" for n in file.numbers]
    errors = []
    for row in rows:
        assert (row.line is None) != (row.error is None), row
        if row.error is not None:
            check_line_error(f"{row.where}", row.error, row.message(row.error))
            errors.append(error_record(row, row.error))
    pa.Table.from_pylist(errors, schema=OUTPUT_SCHEMA)
    for row in rows:
        custom_id = file.good.get(int(row.where.split()[1]))
        owner = next((r for r in rows if r.custom_id == custom_id), None) if custom_id else None
        if custom_id is not None and owner is row:
            assert row.error is None and row.line.custom_id == custom_id, row
        elif custom_id is not None:
            assert row.error.message.startswith(f"custom_id: '{custom_id}' is also the id of {owner.where}:"), row


def test_cells_that_are_no_json_value_are_their_rows_errors():
    """A table built in Python may hold what no batch file can: a key that is not text, a
    cycle, nesting past Python's recursion, an infinite line number. Each is its row's error
    naming the cell; the row beside them runs."""
    deep: list = []
    for _ in range(3000):
        deep = [deep]
    cycle: dict = {}
    cycle["self"] = cycle
    frame = pd.DataFrame({"custom_id": ["tuple", "deep", {(1, 2): 3}, "cycle", "good"],
                          "url": ["/v1/completions"] * 5,
                          "body": [{(1, 2): 3}, {"prompt": deep}, {"prompt": "x"}, cycle, {"prompt": "ok"}],
                          "line": [1, float("inf"), 3, 4, 5]})
    rows = table_rows(frame)
    assert [(row.where, row.error and row.error.message.split(" (")[0]) for row in rows] == [
        ("line 1", "body: cannot be written as JSON"),
        ("row 1", "body.prompt: is nested more than 100 levels deep: flatten it"),
        ("line 3", "custom_id: cannot be written as JSON"),
        ("line 4", "body.self: is nested more than 100 levels deep: flatten it"),
        ("line 5", None)]
