"""Property-based tests of the OpenAI batch file boundary (tests/openai_batch_fuzz.py draws
the files): whatever a line holds, it never raises out of the runner, every bad line gets an
error naming its line and field, and every good line beside it is answered. The line and
body checks run without an engine; a smaller run goes through `run_batch_file` on tiny models.

HYPOTHESIS_PROFILE=thorough runs 10,000 files through the checks (tests/conftest.py):

    HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest -q tests/engine/test_openai_batch_fuzz.py -k checks
"""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from transformers import AutoTokenizer

from engine import LLM
from engine.entrypoints.openai import batch as openai_batch
from engine.entrypoints.openai.protocol import (
    DUPLICATE_CUSTOM_ID, EMBEDDINGS_URL, BadLine, BatchLine, LineError, error_line, parse_lines,
)
from engine.entrypoints.openai.serving import embedding_request, generation_request
from tests.fuzzing import examples
from tests.openai_batch_fuzz import BatchFile, batch_files, check_line_error
from tests.tiny_models import build_tiny_model

FUZZ = dict(deadline=None, derandomize=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
CHATML = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
          "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
HIDDEN_SIZE = 64  # the tiny models'


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer has a chat template."""
    folder = build_tiny_model(tmp_path_factory.mktemp("batch_fuzz") / "llama", "llama")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(chat_model):
    return AutoTokenizer.from_pretrained(chat_model)


def first_owner(parsed: list[BatchLine | BadLine], number: int, custom_id: str) -> int | None:
    """The number of the line before `number` that owns `custom_id` (the first with it), or None."""
    return next((line.number for line in parsed if line.number < number and line.custom_id == custom_id), None)


def checked_lines(file: BatchFile, tokenizer) -> Iterator[tuple[BatchLine | BadLine, LineError | None]]:
    """Each line of the file with its error (None: it runs), as run_batch checks it before
    the engine: the envelope, repeats, then the body against the model's tokenizer."""
    parsed = parse_lines(file.lines)
    assert [line.number for line in parsed] == file.numbers
    for line in parsed:
        if isinstance(line, BadLine):
            yield line, line.error
            continue
        request = (embedding_request(line.body, HIDDEN_SIZE) if line.url == EMBEDDINGS_URL
                   else generation_request(line.url, line.body, tokenizer, {}))
        yield line, request if isinstance(request, LineError) else None


@settings(max_examples=examples(300), **FUZZ)
@given(file=batch_files())
def test_the_line_and_body_checks_answer_every_line(tokenizer, file):
    """No line raises; each bad one's error (as run_batch writes it) names its line and a
    field; each good line runs unless an earlier line holds its custom_id, and then its
    error names that line."""
    checked = list(checked_lines(file, tokenizer))
    parsed = [line for line, _ in checked]
    for line, error in checked:
        if error is not None:
            record = error_line(line.number, line.custom_id, error)
            json.dumps(record, ensure_ascii=False).encode("utf-8")
            check_line_error(f"line {line.number}: ", error, record["error"]["message"])
        if line.number not in file.good:
            continue
        owner = first_owner(parsed, line.number, file.good[line.number])
        if owner is None:
            assert isinstance(line, BatchLine) and error is None, (line, error)
        else:
            assert error.code == DUPLICATE_CUSTOM_ID and f"also the id of line {owner}:" in error.message, error


# --- through run_batch_file on tiny models ------------------------------------------------------


@pytest.fixture(scope="module")
def engines(chat_model) -> Iterator[dict[str, LLM]]:
    """The tiny model generating and embedding (run_batch loads one of each), kept open
    across examples."""
    settings_ = dict(dtype="float32", max_model_len=128, kv_cache_memory=16 << 20, quantization=None)
    with LLM(str(chat_model), **settings_) as generate, LLM(str(chat_model), runner="pooling", **settings_) as embed:
        yield {"generate": generate, "embed": embed}


@pytest.fixture(scope="module")
def patch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@settings(max_examples=examples(30, thorough=2000), **FUZZ)
@given(file=batch_files(max_lines=6))
def test_run_batch_file_writes_one_line_per_input_line(engines, patch_module, tmp_path_factory, file):
    """The whole runner on the tiny models: it finishes, every non-blank line has exactly
    one output line, each error names its line, and every good line whose custom_id is its
    own has a response."""
    folder = tmp_path_factory.mktemp("run")
    source, out = folder / "in.jsonl", folder / "out.jsonl"
    source.write_bytes(file.data)
    patch_module.setattr(openai_batch, "_load", lambda model, settings: contextlib.nullcontext(
        engines["embed" if settings.get("runner") == "pooling" else "generate"]))
    summary = openai_batch.run_batch_file(str(source), str(out), openai_batch.BatchRun("tiny"))
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert summary.ok + summary.errors == len(records) == len(file.numbers) and summary.skipped == 0
    errors = [r["error"] for r in records if r["error"] is not None]
    assert sorted(e["line"] for e in errors) == sorted(set(e["line"] for e in errors))
    for error in errors:
        check_line_error(f"line {error['line']}: ", LineError(error["code"], error["message"].split(": ", 1)[1]),
                         error["message"])
    answered = {r["custom_id"] for r in records if r["response"] is not None}
    parsed = parse_lines(file.lines)
    for number, custom_id in file.good.items():
        assert first_owner(parsed, number, custom_id) is not None or custom_id in answered, (number, records)
    for record in records:
        assert record["response"] is None or record["response"]["body"]["model"] == "tiny"
