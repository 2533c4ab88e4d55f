"""OpenAI batch files as a partitioned asset (`build_openai_batch_asset`): two partitions of
chat, completion and embedding lines among bad ones, materialized in one run on the
embedded SmolLM2 and compared with what `run_batch` writes for the same lines; embedding
rows without an embedding resource; reading batch files into request tables; the
convenience columns of tool calls and reasoning; definition errors and the code version."""

import base64
import json
import struct
from pathlib import Path
from typing import Any

import dagster as dg
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest

from dagster_llm import LLMResource, ParquetIOManager, build_openai_batch_asset, partition_file, read_openai_batch_file
from dagster_llm.core.openai_batch import response_columns, table_rows
from engine import LLM, CompletionOutput, RequestOutput, SamplingParams
from engine.entrypoints.openai.batch import BatchRun, run_batch_file
from engine.entrypoints.openai.protocol import (
    CHAT_URL, COMPLETIONS_URL, DUPLICATE_CUSTOM_ID, EMBEDDINGS_URL, INVALID_JSON, INVALID_LINE, INVALID_REQUEST,
    UNSUPPORTED_FIELD, UNSUPPORTED_URL, GenerationRequest,
)
from engine.entrypoints.openai.serving import generation_response_body
from engine.outputs import FunctionCall, ToolCall

# As tests/engine/test_run_batch.py: no int8 calibration at load, a small cache.
SETTINGS = {"kv_cache_memory": 64 << 20, "max_model_len": 512, "quantization": None}
GREEDY = {"temperature": 0, "max_tokens": 8}
USER = [{"role": "user", "content": "hi"}]
PARTS = dg.StaticPartitionsDefinition(["a", "b", "c"])


def line(custom_id: str | None, url: str, body: Any) -> str:
    record = {"method": "POST", "url": url, "body": body, **({"custom_id": custom_id} if custom_id else {})}
    return json.dumps(record)


# Partition a: good lines of each kind among bad ones; b: good lines only; c: embedding lines only.
FILES = {
    "a": [line("chat-a", CHAT_URL, {"model": "gpt-4o-mini", "messages": [
              {"role": "user", "content": "What is the capital of France?"}], **GREEDY}),
          line("cmpl", COMPLETIONS_URL, {"prompt": ["The capital of France is", "1, 2, 3,"], **GREEDY}),
          line("emb-float", EMBEDDINGS_URL, {"input": ["hello", "world"]}),
          line("bad-field", CHAT_URL, {"messages": USER, "temprature": 0}),
          line("bad-echo", COMPLETIONS_URL, {"prompt": "a", "echo": True}),
          line("bad-logprobs", COMPLETIONS_URL, {"prompt": "a", "logprobs": 50}),
          line("bad-empty", EMBEDDINGS_URL, {"input": ""}),
          line("bad-url", "/v1/moderations", {"input": "a"}),
          line("chat-a", CHAT_URL, {"messages": USER}),
          line(None, CHAT_URL, {"messages": USER}),
          "not json"],
    "b": [line("chat-b", CHAT_URL, {"messages": [{"role": "system", "content": "Answer briefly."},
                                                 {"role": "user", "content": "Name a color."}], **GREEDY}),
          line("emb-b64", EMBEDDINGS_URL, {"input": "world", "encoding_format": "base64"})],
    "c": [line("emb-c", EMBEDDINGS_URL, {"input": "hello"})],
}
# Each bad line of a: its custom_id, error code, and what its message names.
BAD = [("bad-field", INVALID_REQUEST, "line 4 (custom_id 'bad-field'): temprature: not a field"),
       ("bad-echo", UNSUPPORTED_FIELD, "line 5 (custom_id 'bad-echo'): echo: true is not supported"),
       ("bad-logprobs", INVALID_REQUEST, "line 6 (custom_id 'bad-logprobs'): logprobs"),
       ("bad-empty", INVALID_REQUEST, "line 7 (custom_id 'bad-empty'): "),
       ("bad-url", UNSUPPORTED_URL, "line 8 (custom_id 'bad-url'): url: '/v1/moderations' is not supported"),
       ("chat-a", DUPLICATE_CUSTOM_ID, "line 9 (custom_id 'chat-a'): custom_id: 'chat-a' is also the id of line 1"),
       (None, INVALID_LINE, "line 10: custom_id: expected a non-empty string"),
       (None, INVALID_JSON, "line 11: body: is not JSON")]


def request_asset(folder: Path) -> dg.AssetsDefinition:
    """The request table of each partition: its batch file, read as it is."""
    @dg.asset(partitions_def=PARTS, backfill_policy=dg.BackfillPolicy.single_run())
    def requests(context: dg.AssetExecutionContext):
        tables = {key: read_openai_batch_file(str(folder / f"{key}.jsonl")) for key in context.partition_keys}
        return tables if len(tables) > 1 else tables[context.partition_key]

    return requests


def without_ids(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def vectors(body: dict) -> list[list[float]]:
    """An embeddings body's vectors, base64 ones decoded."""
    return [list(struct.unpack(f"<{len(base64.b64decode(d['embedding'])) // 4}f", base64.b64decode(d["embedding"])))
            if isinstance(d["embedding"], str) else d["embedding"] for d in body["data"]]


@pytest.fixture(scope="module")
def batch(tmp_path_factory) -> dict[str, Any]:
    """Partitions a and b materialized in one run, and run_batch's output lines for the same lines."""
    root = tmp_path_factory.mktemp("openai_batch")
    for key, lines in FILES.items():
        (root / f"{key}.jsonl").write_text("\n".join(lines) + "\n")
    requests = request_asset(root)
    responses = build_openai_batch_asset("responses", upstream=requests, embedding_resource_key="embedder")
    resources = {"llm": LLMResource(**SETTINGS), "embedder": LLMResource(runner="pooling", **SETTINGS),
                 "io_manager": ParquetIOManager(base_path=str(root / "tables"))}
    tags = {"dagster/asset_partition_range_start": "a", "dagster/asset_partition_range_end": "b"}
    instance = dg.DagsterInstance.ephemeral()
    engines: list[str] = []  # loads and closes, in order
    with pytest.MonkeyPatch.context() as patch:
        for method, event in (("__init__", "load {runner}"), ("close", "close")):
            original = getattr(LLM, method)

            def recorded(self, *args, _original=original, _event=event, **kwargs):
                engines.append(_event.format(runner=kwargs.get("runner")))
                return _original(self, *args, **kwargs)

            patch.setattr(LLM, method, recorded)
        result = dg.materialize([requests, responses], tags=tags, resources=resources, instance=instance)
    tables = {key: pq.read_table(partition_file(root / "tables", responses.key, key)).to_pylist() for key in "ab"}

    both = root / "a_and_b.jsonl"
    both.write_text((root / "a.jsonl").read_text() + (root / "b.jsonl").read_text())
    run_batch_file(str(both), str(root / "out.jsonl"), BatchRun(settings=SETTINGS))
    written = [json.loads(text) for text in (root / "out.jsonl").read_text().splitlines()]
    return {"root": root, "requests": requests, "result": result, "instance": instance, "tables": tables,
            "written": written, "key": responses.key, "engines": engines}


def test_each_row_is_what_run_batch_writes(batch):
    """Every good row's response is run_batch's body (ids and timestamps aside; greedy text
    equal), its columns are read from it, and rows keep the input order."""
    tables = batch["tables"]
    bodies = {r["custom_id"]: r["response"]["body"] for r in batch["written"] if r["response"] is not None}
    rows = {r["custom_id"]: r for key in "ab" for r in tables[key] if r["status_code"] == 200}
    assert set(rows) == set(bodies) == {"chat-a", "cmpl", "emb-float", "chat-b", "emb-b64"}
    assert [r["custom_id"] for r in tables["b"]] == ["chat-b", "emb-b64"]
    assert [r["custom_id"] for r in tables["a"]][:3] == ["chat-a", "cmpl", "emb-float"]
    for custom_id, row in rows.items():
        mine = json.loads(row["response"])
        assert row["error_code"] is None and row["error_message"] is None and row["model"] == "smollm2-135m-instruct"
        assert row["prompt_tokens"] == mine["usage"]["prompt_tokens"] > 0
        if mine["object"] == "list":
            assert without_ids(mine) | {"data": None} == without_ids(bodies[custom_id]) | {"data": None}
            np.testing.assert_allclose(vectors(mine), vectors(bodies[custom_id]), atol=1e-5)
            np.testing.assert_allclose(row["embedding"], vectors(mine)[0], atol=1e-6)
            assert row["content"] is None and row["completion_tokens"] is None
        else:
            assert without_ids(mine) == without_ids(bodies[custom_id])
            first = mine["choices"][0]
            assert row["content"] == (first["message"]["content"] if "message" in first else first["text"])
            assert row["finish_reason"] == first["finish_reason"] and row["embedding"] is None
            assert row["completion_tokens"] == mine["usage"]["completion_tokens"] > 0
            assert row["reasoning"] is None and row["tool_calls"] is None
    world = vectors(json.loads(rows["emb-float"]["response"]))[1]  # emb-b64's input, decoded from base64
    np.testing.assert_allclose(rows["emb-b64"]["embedding"], world, atol=1e-5)
    assert len(rows["emb-b64"]["embedding"]) == 576


def test_the_generating_model_is_freed_before_the_embedding_model_loads(batch):
    """As run_batch: one GPU need not hold both (each leases the GPU while it lives)."""
    assert batch["engines"][:3] == ["load auto", "close", "load pooling"]


def test_bad_rows_are_error_rows_with_run_batchs_codes(batch):
    errors = [r for r in batch["tables"]["a"] if r["status_code"] is None]
    assert [(r["custom_id"], r["error_code"]) for r in errors] == [(cid, code) for cid, code, _ in BAD]
    for row, (_, _, message) in zip(errors, BAD):
        assert row["error_message"].startswith(message), row["error_message"]
        assert row["response"] is None and row["content"] is None and row["model"] is None
    by_line = {r["error"]["line"]: r["error"]["code"] for r in batch["written"] if r["error"] is not None}
    assert by_line == {int(message.split()[1].rstrip(":")): code for _, code, message in BAD}


def test_the_check_fails_on_bad_rows_and_the_metadata_counts_them(batch):
    result = batch["result"]
    assert result.success
    checks = {e.partition: e for e in result.get_asset_check_evaluations()}
    assert {key: e.passed for key, e in checks.items()} == {"a": False, "b": True}
    failed = checks["a"].metadata
    assert failed["error_rows"].value == len(BAD) and failed["max_error_fraction"].value == 0.0
    first = failed["first_errors"].value
    assert [(e["custom_id"], e["code"]) for e in first] == [(cid, code) for cid, code, _ in BAD[:5]]
    record = batch["instance"].fetch_materializations(
        dg.AssetRecordsFilter(asset_key=batch["key"], asset_partitions=["a"]), limit=1).records[0]
    meta = {k: v.value for k, v in record.asset_materialization.metadata.items()}
    assert (meta["ok_rows"], meta["error_rows"], meta["dagster/row_count"]) == (3, len(BAD), 3 + len(BAD))
    assert meta["model"] == meta["embedding_model"] == "smollm2-135m-instruct"
    settings = meta["engine_output_settings"]  # each model's, as the engine resolved them: its parsers too
    assert set(settings) == {"generate", "embed"} and settings["embed"]["runner"] == "pooling"
    assert {"reasoning_parser", "tool_call_parser"} <= set(settings["generate"])
    assert meta["prompt_tokens"] > 0 and meta["completion_tokens"] > 0 and meta["error_codes"][INVALID_REQUEST] == 3
    assert [c.name for c in meta["dagster/column_schema"].columns][:6] == [
        "custom_id", "url", "status_code", "response", "error_code", "error_message"]
    assert "temprature" in meta["preview"]


def test_embedding_rows_without_an_embedding_resource_say_how_to_set_one(batch):
    """No model loads for a partition of embedding rows only when the asset has no embedding resource."""
    plain = build_openai_batch_asset("plain_responses", upstream=batch["requests"], max_error_fraction=0.5)
    resources = {"llm": LLMResource(**SETTINGS), "io_manager": ParquetIOManager(base_path=str(batch["root"] / "t2"))}
    result = dg.materialize([batch["requests"], plain], partition_key="c", resources=resources)
    [row] = result.asset_value(plain.key).to_pylist()
    assert (row["custom_id"], row["error_code"]) == ("emb-c", UNSUPPORTED_URL)
    assert "embedding_resource_key=" in row["error_message"] and "runner='pooling'" in row["error_message"]
    [check] = result.get_asset_check_evaluations()
    assert not check.passed and check.metadata["error_fraction"].value == 1.0


def test_a_batch_file_reads_into_a_request_table_whose_rows_are_checked():
    import fsspec

    with fsspec.open("memory://openai_batch/requests.jsonl", "w") as stream:
        stream.write("\n".join([line("x", CHAT_URL, {"messages": USER}), "", "[1, 2]",
                                json.dumps({"custom_id": 7, "url": COMPLETIONS_URL, "body": {"prompt": "a"}}),
                                json.dumps({"custom_id": "y", "method": "GET", "url": 5, "body": {}})]) + "\n")
    frame = read_openai_batch_file("memory://openai_batch/requests.jsonl")
    assert list(frame.columns) == ["custom_id", "method", "url", "body", "line"]
    assert frame["line"].tolist() == [1, 3, 4, 5] and json.loads(frame["body"][0]) == {"messages": USER}
    assert frame["body"][1] == "[1, 2]" and frame["custom_id"][2] is None and frame["url"][3] == "5"
    rows = table_rows(frame)
    assert rows[0].line.body == {"messages": USER} and rows[0].where == "line 1"
    assert [(r.custom_id, r.error.code) for r in rows[1:]] == [(None, INVALID_LINE), (None, INVALID_LINE),
                                                              ("y", INVALID_LINE)]
    with pytest.raises(OSError, match="missing.jsonl: cannot be read"):
        read_openai_batch_file("memory://openai_batch/missing.jsonl")


def test_a_table_without_url_column_posts_chats_and_takes_bodies_as_dicts():
    frame = pd.DataFrame({"custom_id": ["a", "b", "c"],
                          "body": [{"messages": np.array(USER)}, '{"messages": []', None]})
    rows = table_rows(frame)
    assert rows[0].line.url == CHAT_URL and rows[0].line.body == {"messages": USER} and rows[0].where == "row 0"
    assert rows[1].error.code == INVALID_JSON and rows[1].message(rows[1].error).startswith(
        "row 1 (custom_id 'b'): body: is not JSON")
    assert rows[2].error.code == INVALID_LINE and "body: expected the request as a JSON object" in rows[2].error.message
    with pytest.raises(ValueError, match="has no column 'body'.*read_openai_batch_file"):
        table_rows(pd.DataFrame({"custom_id": ["a"], "request": ["{}"]}))


def test_tool_calls_and_reasoning_become_columns():
    call = ToolCall("call_1", FunctionCall("weather", '{"city": "Paris"}'))
    output = RequestOutput("0", "p", [5, 6], [CompletionOutput(0, "", [1, 2, 3], finish_reason="stop",
                                                               tool_calls=[call], reasoning="think",
                                                               num_reasoning_tokens=2)], finished=True)
    body = generation_response_body(GenerationRequest(CHAT_URL, [{}], SamplingParams()), [output], "m")
    columns = response_columns(body)
    assert columns == {"content": None, "reasoning": "think", "finish_reason": "tool_calls", "model": "m",
                       "tool_calls": [{"id": "call_1", "name": "weather", "arguments": '{"city": "Paris"}'}],
                       "prompt_tokens": 2, "completion_tokens": 3}
    message = body["choices"][0]["message"]
    assert message["reasoning"] == "think" and "reasoning_content" not in message  # vLLM's field
    message["reasoning_content"] = message.pop("reasoning")  # as earlier versions and other tools write it
    assert response_columns(body)["reasoning"] == "think"


def test_definition_errors_and_the_code_version_follows_the_settings():
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="max_error_fraction: .*less than or equal to 1"):
        build_openai_batch_asset("r", upstream="requests", max_error_fraction=2)
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="embeding_resource_key: Extra inputs"):
        build_openai_batch_asset("r", upstream="requests", embeding_resource_key="e")
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="'llm' is also resource_key"):
        build_openai_batch_asset("r", upstream="requests", embedding_resource_key="llm")

    def version(**options: Any) -> str:
        asset = build_openai_batch_asset("r", upstream="requests", **options)
        return asset.code_versions_by_key[asset.key]

    assert version() == version(max_error_fraction=0.1, group_name="g")  # they judge or show the table
    assert len({version(), version(embedding_resource_key="e"), version(code_version="2")}) == 3
    asset = build_openai_batch_asset("r", upstream="requests", embedding_resource_key="e")
    assert asset.required_resource_keys == {"llm", "e", "io_manager"}
    assert [c.name for c in asset.check_specs] == ["no_error_rows"]
