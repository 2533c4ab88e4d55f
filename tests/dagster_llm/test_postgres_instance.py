"""The example dagster.yaml of a deployment (example_pipelines/deploy/dagster.yaml) makes a
working PostgreSQL-backed instance with what `pip install '.[postgres]'` brings: a generation
asset's run, its materialization metadata and the llm pool's slot are stored in PostgreSQL."""

import shutil
from pathlib import Path
from urllib.parse import urlparse

import dagster as dg
import pandas as pd

from dagster_llm import SamplingConfig, build_generation_asset

DEPLOY_YAML = Path(__file__).resolve().parents[2] / "example_pipelines" / "deploy" / "dagster.yaml"


def test_the_deployment_instance_runs_a_generation_asset_on_postgres(postgres_server, env, tmp_path, monkeypatch):
    url = urlparse(postgres_server.create_database())
    for name, value in {"HOST": url.hostname, "PORT": str(url.port), "DB": url.path.lstrip("/"),
                        "USERNAME": url.username, "PASSWORD": ""}.items():
        monkeypatch.setenv(f"DAGSTER_PG_{name}", value)
    shutil.copy(DEPLOY_YAML, tmp_path / "dagster.yaml")

    @dg.asset
    def prompts() -> pd.DataFrame:
        return pd.DataFrame({"id": ["r1", "r2"], "prompt": ["Paris is the", "A paged KV"]})

    gen = build_generation_asset("gen", upstream=prompts, sampling=SamplingConfig(temperature=0, max_tokens=3))
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        assert type(instance.run_storage).__name__ == "PostgresRunStorage"
        instance.event_log_storage.set_concurrency_slots("llm", 1)
        result = dg.materialize([prompts, gen], instance=instance, resources=env["resources"])
        assert result.success
        [record] = instance.fetch_materializations(dg.AssetKey("gen"), limit=1).records
        assert record.asset_materialization.metadata["generated_rows"].value == 2
        assert instance.get_run_by_id(result.run_id).is_success
        assert instance.event_log_storage.get_concurrency_info("llm").slot_count == 1
