"""Embedding assets: the example pipeline (ticket texts -> vectors -> similar tickets) with
the embedded model read as an embedding model, a SIGKILL in the middle of a partition and
its resumed rerun, and the errors a user can make."""

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from upath import UPath

from dagster_llm import LLMResource, ParquetIOManager, build_embedding_asset, partition_file
from dagster_llm.components import EmbeddingComponent, GenerationComponent
from dagster_llm.core.embedding import evaluate_embeddings, text_rows
from engine import LLM
from example_pipelines.defs.daily_tickets import raw_support_tickets
from example_pipelines.defs.ticket_embeddings import similar_tickets, ticket_embeddings, ticket_texts
from tests.dagster_llm.embedding_crash_defs import ROWS, texts
from tests.dagster_llm.test_crash_resume import kill_launcher_and_wait_for_worker, shard_rows, wait_for

REPO = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
DAYS = {"2024-06-01": ["T-1001", "T-1002", "T-1003"], "2024-06-02": ["T-1005", "T-1006", "T-1007"]}


def latest(instance: dg.DagsterInstance, key: str, partition: str | None = None) -> dict:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(key), asset_partitions=[partition] if partition else None),
        limit=1).records
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()} if records else {}


@pytest.mark.slow
def test_the_ticket_example_embeds_and_a_downstream_asset_reads_the_vectors(tmp_path):
    """The export's five days in one run: each day's table holds one float32 vector of the model's width
    per ticket, equal to `LLM.embed` of the ticket's text; the checks pass; the unpartitioned
    `similar_tickets` reads every day's vectors through the IO manager."""
    root = tmp_path / "tables"
    resources = {"embedder": LLMResource(runner="pooling"), "io_manager": ParquetIOManager(base_path=str(root))}
    tags = {"dagster/asset_partition_range_start": "2024-06-01", "dagster/asset_partition_range_end": "2024-06-05"}
    with dg.instance_for_test() as instance:
        result = dg.materialize([raw_support_tickets, ticket_texts, ticket_embeddings], tags=tags,
                                resources=resources, instance=instance)
        assert result.success
        assert all(c.passed for c in result.get_asset_check_evaluations())
        assert len(result.get_asset_check_evaluations()) == 5 * 4
        meta = latest(instance, "ticket_embeddings", "2024-06-02")
        assert meta["dagster/row_count"] == 3 and meta["embedded_rows"] == 3 and meta["dimension"] == 576
        lineage = meta["dagster/column_lineage"].deps_by_column
        assert [d.column_name for d in lineage["embedding"]] == ["text"] and meta["upstream_data_version"]
        texts_by_id = {}
        for day in DAYS:
            frame = pd.read_parquet(partition_file(root, dg.AssetKey("ticket_texts"), day))
            texts_by_id |= dict(zip(frame["id"], frame["text"]))
        tables = {day: pq.read_table(partition_file(root, dg.AssetKey("ticket_embeddings"), day)) for day in DAYS}
        for day, ids in DAYS.items():
            assert tables[day].schema.field("embedding").type == pa.list_(pa.float32(), 576)
            assert tables[day].column("id").to_pylist() == ids
        with LLM(runner="pooling") as llm:
            ids = [i for day in DAYS for i in DAYS[day]]
            expected = np.array([o.outputs.embedding for o in llm.embed([texts_by_id[i] for i in ids], use_tqdm=False)])
        got = np.array([v for day in DAYS for v in tables[day].column("embedding").to_pylist()])
        np.testing.assert_allclose(got, expected, atol=1e-5)

        assert dg.materialize([raw_support_tickets, ticket_texts, ticket_embeddings, similar_tickets],
                              selection=[similar_tickets.key],
                              resources=resources, instance=instance).success
        similar = pd.read_parquet(partition_file(root, dg.AssetKey("similar_tickets"), None))
        every_ticket = [f"T-{1001 + i}" for i in range(14) if i != 3]  # T-1004's body is empty
        assert sorted(similar["id"]) == every_ticket and set(similar["most_similar_id"]) <= set(every_ticket)
        assert (similar["id"] != similar["most_similar_id"]).all() and similar["similarity"].between(-1, 1).all()
        assert latest(instance, "similar_tickets")["tickets"] == 13


def materialize(env: dict) -> subprocess.Popen:
    return subprocess.Popen([str(DAGSTER), "asset", "materialize", "-f", "tests/dagster_llm/embedding_crash_defs.py",
                             "--select", "*crash_embeddings", "--partition", "p1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.long("two `dagster asset materialize` runs embedding 24 texts with the embedded model on one thread, the first SIGKILLed; then the same texts in this process")
def test_killed_in_the_middle_of_a_partition_then_resumed(tmp_path):
    """`dagster asset materialize` SIGKILLed while the partition's rows are being embedded:
    its step worker stops, the saved shards stay, and the rerun embeds only the rest, each id
    once, with the vectors a run from scratch gives."""
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "out")}
    (tmp_path / "home").mkdir()
    folder = UPath(tmp_path / "out" / "tables" / "crash_embeddings")
    cli = materialize(env)
    wait_for(lambda: shard_rows(folder, "p1") >= 4, 180, "shards of p1")
    kill_launcher_and_wait_for_worker(cli, folder, "p1")
    saved = shard_rows(folder, "p1")
    assert 0 < saved < ROWS and not (folder / "p1.parquet").exists()

    rerun = materialize(env)
    output, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, output
    table = pq.read_table(str(folder / "p1.parquet"))
    assert table.column("id").to_pylist() == [f"p1-{i}" for i in range(ROWS)]
    assert table.column("error").null_count == ROWS
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        meta = latest(instance, "crash_embeddings", "p1")
    assert meta["resumed_rows"] == saved and meta["embedded_rows"] == ROWS - saved
    with LLM(runner="pooling", dtype="float32") as llm:
        expected = [o.outputs.embedding for o in llm.embed(texts("p1")["text"].tolist(), use_tqdm=False)]
    np.testing.assert_allclose(np.array(table.column("embedding").to_pylist()), np.array(expected), atol=1e-5)


def test_bad_rows_get_their_error_and_the_checks_see_them():
    rows = text_rows(["a", "b", "a", None, "c"], ["one", "", "two", "three", 4])
    assert [r.error is None for r in rows] == [True, False, False, False, False]
    assert "repeats an earlier row's" in rows[2].error and "is null" in rows[3].error
    assert "is empty" in rows[1].error and "is missing" in rows[4].error
    schema = pa.schema([("id", pa.string()), ("embedding", pa.list_(pa.float32(), 2)), ("error", pa.string())])
    table = pa.table({"id": ["a", "a", "b"], "embedding": [[1.0, 0.0], [float("nan"), 1.0], None],
                      "error": [None, None, "text: is empty"]}, schema=schema)
    outcomes = evaluate_embeddings(table, 2)
    assert {name: o.passed for name, o in outcomes.items()} == {
        "no_error_rows": False, "finite_vectors": False, "dimension": True, "unique_ids": False}
    assert outcomes["no_error_rows"].metadata == {"error_rows": 1}
    assert not evaluate_embeddings(table, 3)["dimension"].passed


@pytest.mark.slow
def test_definition_and_run_errors_name_the_fix(tmp_path):
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="text_colum: Extra inputs are not permitted"):
        build_embedding_asset("vectors", upstream="texts", text_colum="body")

    @dg.asset
    def texts() -> pd.DataFrame:
        return pd.DataFrame({"id": ["a"], "body": ["hello"]})

    vectors = build_embedding_asset("vectors", upstream=texts, resource_key="llm")
    resources = {"llm": LLMResource(), "io_manager": ParquetIOManager(base_path=str(tmp_path))}
    with pytest.raises(dg.Failure, match="has no column 'text'.*text_column="):
        dg.materialize([texts, vectors], resources=resources)
    vectors = build_embedding_asset("vectors", upstream=texts, resource_key="llm", text_column="body")
    with pytest.raises(dg.Failure, match="loads a model that does not embed.*runner='pooling'"):
        dg.materialize([texts, vectors], resources=resources)


def test_the_embedding_component_builds_the_factorys_asset():
    component = EmbeddingComponent(name="vectors", upstream="texts", text_column="body", daily_start_date="2024-06-01",
                                   daily_end_date="2024-06-03")
    [asset] = dg.build_defs_for_component(component).assets
    assert asset.key == dg.AssetKey("vectors") and asset.partitions_def.get_partition_keys() == ["2024-06-01",
                                                                                                 "2024-06-02"]
    assert {c.name for c in asset.check_specs} == {"no_error_rows", "finite_vectors", "dimension", "unique_ids"}
    assert asset.required_resource_keys == {"embedder", "io_manager"}
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="give partitions or daily_start_date, not both"):
        dg.build_defs_for_component(EmbeddingComponent(name="v", upstream="t", partitions=["a"],
                                                       daily_start_date="2024-06-01"))


def test_both_components_resolve_their_new_options_from_yaml():
    """What a defs.yaml gives: Dagster's resolver refuses pydantic constraints it cannot map,
    so these options must resolve from YAML, not only from Python."""
    embedding = EmbeddingComponent.resolve_from_yaml('name: v\nupstream: t\ndaily_start_date: "2024-06-01"\n'
                                                     "shard_rows: 4\nnormalize: false")
    assert embedding.shard_rows == 4 and embedding.normalize is False
    generation = GenerationComponent.resolve_from_yaml(
        "name: g\nupstream: t\nbeam_search: {beam_width: 3}\n"
        "beam_search_by_partition: {a: {beam_width: 2, length_penalty: 0.5}}")
    assert generation.beam_search.beam_width == 3 and generation.beam_search_by_partition["a"].length_penalty == 0.5
