"""Both example pipelines, materialized with the embedded SmolLM2 model through Dagster."""

import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dagster_llm import LLMResource, ParquetIOManager, partition_file
from example_pipelines.defs.daily_tickets import (
    raw_support_tickets,
    support_prompts,
    ticket_summaries,
    ticket_summary_quality,
)
from example_pipelines.defs.prompt_sets import prompt_sets
from example_pipelines.defs.triage_prompts import triage_prompts
from tests.dagster_llm.test_generation_asset import METADATA_KEYS, latest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("DAGSTER_LLM_OUTPUT_DIR", str(tmp_path))
    resources = {"llm": LLMResource(), "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables"))}
    return tmp_path / "tables", resources


def _load_component(name: str) -> dg.AssetsDefinition:
    defs = dg.load_from_defs_folder(path_within_project=REPO)
    return next(a for a in defs.assets if isinstance(a, dg.AssetsDefinition) and dg.AssetKey(name) in a.keys)


@pytest.mark.cpu_kinds
def test_daily_pipeline_one_day_and_a_single_run_range(outputs):
    root, resources = outputs
    assets = [raw_support_tickets, support_prompts, ticket_summaries, ticket_summary_quality]
    with dg.instance_for_test() as instance:
        assert dg.materialize(assets, partition_key="2024-06-01", resources=resources, instance=instance).success
        day = pd.read_parquet(partition_file(root, dg.AssetKey("ticket_summaries"), "2024-06-01"))
        assert list(day["id"]) == ["T-1001", "T-1002", "T-1003"]  # T-1004 has an empty body: cleaned away
        assert day["error"].isna().all() and (day["generated_text"].str.len() > 10).all()
        assert (day["temperature"] == 0).all() and (day["model"] == "smollm2-135m-instruct").all()
        meta = latest(instance, "ticket_summaries", "2024-06-01").metadata
        assert METADATA_KEYS <= set(meta)
        assert meta["dagster/row_count"].value == 3 and meta["error_rows"].value == 0
        assert meta["prompt_tokens"].value == int(day["prompt_tokens"].sum()) > 3 * 40  # chat template applied
        quality = latest(instance, "ticket_summary_quality", "2024-06-01").metadata  # read through the IO manager
        assert quality["rows"].value == 3 and quality["error_rows"].value == 0

        tags = {"dagster/asset_partition_range_start": "2024-06-02", "dagster/asset_partition_range_end": "2024-06-04"}
        result = dg.materialize(assets, tags=tags, resources=resources, instance=instance)
        assert result.success
        for day_key, ids in (("2024-06-02", ["T-1005", "T-1006", "T-1007"]), ("2024-06-03", ["T-1008", "T-1009", "T-1010"]),
                             ("2024-06-04", ["T-1011", "T-1012"])):
            table = pd.read_parquet(partition_file(root, dg.AssetKey("ticket_summaries"), day_key))
            assert list(table["id"]) == ids
            meta = latest(instance, "ticket_summaries", day_key).metadata
            assert meta["dagster/row_count"].value == len(ids) and meta["partitions_in_run"].value == 3
            # The downstream asset took the range as a {day: DataFrame} dict.
            assert latest(instance, "ticket_summary_quality", day_key).metadata["rows"].value == len(ids)
        checks = {(e.check_name, e.partition) for e in result.get_asset_check_evaluations()}
        assert {p for _, p in checks} == {"2024-06-02", "2024-06-03", "2024-06-04"}


@pytest.mark.cpu_kinds
def test_static_pipeline_samples_each_partition_its_own_way(outputs):
    root, resources = outputs
    answers = _load_component("prompt_set_answers")
    tags = {"dagster/asset_partition_range_start": "factual", "dagster/asset_partition_range_end": "creative"}
    with dg.instance_for_test() as instance:
        for key in ("factual", "creative"):
            assert dg.materialize([prompt_sets], partition_key=key, resources=resources, instance=instance).success
        result = dg.materialize([prompt_sets, answers], selection=[answers], tags=tags, resources=resources,
                                instance=instance)
        assert result.success
        factual = pd.read_parquet(partition_file(root, dg.AssetKey("prompt_set_answers"), "factual"))
        creative = pd.read_parquet(partition_file(root, dg.AssetKey("prompt_set_answers"), "creative"))
        assert list(factual["id"]) == ["f01", "f02", "f03", "f04", "f05"] and len(creative) == 4
        assert (factual["temperature"] == 0).all() and (factual["max_tokens"] == 48).all()
        assert (creative["temperature"] == 0.8).all() and (creative["seed"] == 7).all()
        assert (factual["generated_text"].str.strip().str.len() > 0).all()
        meta = latest(instance, "prompt_set_answers", "creative").metadata
        assert meta["sampling_config"].value["temperature"] == 0.8
        assert {e.partition for e in result.get_asset_check_evaluations()} == {"factual", "creative"}
        version = latest(instance, "prompt_set_answers", "creative").tags["dagster/data_version"]

        # Seeded sampling does not depend on the batch: the creative partition alone (without
        # the factual prompts beside it) gives the range run's answers. The same range run
        # again gives the same data version; a run-config override changes it.
        dg.materialize([prompt_sets, answers], selection=[answers], partition_key="creative", resources=resources,
                       instance=instance)
        alone = pd.read_parquet(partition_file(root, dg.AssetKey("prompt_set_answers"), "creative"))
        assert list(alone["generated_text"]) == list(creative["generated_text"])
        dg.materialize([prompt_sets, answers], selection=[answers], tags=tags, resources=resources,
                       instance=instance)
        assert latest(instance, "prompt_set_answers", "creative").tags["dagster/data_version"] == version
        dg.materialize([prompt_sets, answers], selection=[answers], partition_key="creative", resources=resources,
                       instance=instance, run_config={"ops": {"prompt_set_answers": {"config": {"sampling": {"seed": 8}}}}})
        assert latest(instance, "prompt_set_answers", "creative").tags["dagster/data_version"] != version


@pytest.mark.cpu_kinds
def test_ticket_triage_component_writes_a_typed_table(outputs):
    root, resources = outputs
    triage = _load_component("ticket_triage")
    with dg.instance_for_test() as instance:
        result = dg.materialize([raw_support_tickets, triage_prompts, triage], partition_key="2024-06-01",
                                resources=resources, instance=instance)
        table = pq.read_table(partition_file(root, dg.AssetKey("ticket_triage"), "2024-06-01"))
        assert [(f.name, f.type) for f in table.schema][-4:] == [
            ("summary", pa.string()), ("category", pa.dictionary(pa.int32(), pa.string())),
            ("urgency", pa.int64()), ("products", pa.list_(pa.string()))]
        assert table["id"].to_pylist() == ["T-1001", "T-1002", "T-1003"]
        for row in table.to_pylist():
            assert row["error"] is None and row["summary"] and isinstance(row["products"], list)
            assert row["category"] in {"billing", "technical", "account", "sales"} and 1 <= row["urgency"] <= 5
        meta = latest(instance, "ticket_triage", "2024-06-01").metadata
        assert [c.name for c in meta["dagster/column_schema"].value.columns][-4:] == [
            "summary", "category", "urgency", "products"]
        [dep] = meta["dagster/column_lineage"].value.deps_by_column["category"]
        assert dep.asset_key == dg.AssetKey("triage_prompts") and dep.column_name == "prompt"
        parse_rate = next(e for e in result.get_asset_check_evaluations() if e.check_name == "parse_rate")
        assert parse_rate.passed and parse_rate.metadata["parsed_rows"].value == 3


@pytest.mark.cpu_kinds
def test_chat_message_prompts_are_rendered_with_the_template(outputs):
    root, resources = outputs
    from dagster_llm import SamplingConfig, build_generation_asset

    @dg.asset
    def conversations() -> pd.DataFrame:
        return pd.DataFrame({"id": ["c1"], "prompt": [[
            {"role": "system", "content": "You answer with one word."},
            {"role": "user", "content": "What is the capital of France?"},
        ]]})

    gen = build_generation_asset("chat_answers", upstream=conversations, sampling=SamplingConfig(max_tokens=12))
    assert dg.materialize([conversations, gen], resources=resources).success
    table = pd.read_parquet(partition_file(root, dg.AssetKey("chat_answers"), None))
    assert "Paris" in table["generated_text"][0]
    assert '"role": "system"' in table["prompt"][0]


def test_component_is_registered_for_dg():
    dg_cli = Path(sys.executable).parent / "dg"
    out = subprocess.run([str(dg_cli), "list", "components"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "dagster_llm.components.GenerationComponent" in out.stdout
