"""The `dagster` CLI against the example pipelines in definitions.py, as a user runs it.

Each test runs the real `dagster` command in a subprocess, from the repository root, with
its own DAGSTER_HOME and DAGSTER_LLM_OUTPUT_DIR, and generates with the embedded
SmolLM2 model, capped at a few tokens per row to stay quick.
"""

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from engine import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 8
SHORT_RUN_CONFIG = {"ops": {"ticket_summaries": {"config": {"sampling": {"max_tokens": MAX_TOKENS}}}}}
CLI_TIMEOUT_S = 600


def run_dagster(args: list[str], home: Path, output_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run `dagster <args>` from the repository root with its own instance and output folder."""
    home.mkdir(exist_ok=True)
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_LLM_OUTPUT_DIR": str(output_dir)}
    return subprocess.run(
        [str(DAGSTER), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT_S
    )


def assert_succeeded(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"exit code {result.returncode}\n{result.stdout}\n{result.stderr}"


def generations(output_dir: Path, partition: str) -> pd.DataFrame:
    return pd.read_parquet(output_dir / "tables" / "ticket_summaries" / f"{partition}.parquet")


def latest_metadata(instance: dg.DagsterInstance, partition: str) -> dict[str, object]:
    """The metadata values of the newest ticket_summaries materialization of a partition."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("ticket_summaries"), asset_partitions=[partition]), limit=1
    ).records
    assert records, f"no materialization of ticket_summaries[{partition}]"
    return {label: entry.value for label, entry in records[0].asset_materialization.metadata.items()}


@dataclass(frozen=True)
class ExecutedDay:
    """An instance and output folder where `dagster job execute` ran one day."""

    home: Path
    output_dir: Path
    result: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def executed_day(tmp_path_factory: pytest.TempPathFactory) -> ExecutedDay:
    """`dagster job execute` of the daily job for 2024-06-02, with a run config file."""
    tmp_path = tmp_path_factory.mktemp("job_execute")
    config_file = tmp_path / "run_config.json"
    config_file.write_text(json.dumps(SHORT_RUN_CONFIG))
    home, output_dir = tmp_path / "home", tmp_path / "output"
    result = run_dagster(
        ["job", "execute", "-f", "definitions.py", "-j", "daily_ticket_summaries_job",
         "--tags", json.dumps({"dagster/partition": "2024-06-02"}), "-c", str(config_file)],
        home, output_dir,
    )
    return ExecutedDay(home, output_dir, result)


@pytest.mark.slow
def test_job_execute_one_partition_with_run_config_file(executed_day: ExecutedDay) -> None:
    """`dagster job execute` of the daily job for one partition, with a run config file,
    writes that day's summaries with the overridden max_tokens and the default model."""
    assert_succeeded(executed_day.result)
    table = generations(executed_day.output_dir, "2024-06-02")
    assert list(table["id"]) == ["T-1005", "T-1006", "T-1007"]
    assert all(isinstance(text, str) and text for text in table["generated_text"])
    assert table["error"].isna().all()
    assert (table["max_tokens"] == MAX_TOKENS).all()
    assert (table["model"] == MODEL).all()


@pytest.mark.slow
def test_asset_materialize_partition_range_is_one_run(tmp_path: Path) -> None:
    """`dagster asset materialize --partition-range` over two days runs once (single-run
    backfill policy), writes one file per day and records per-partition metadata; its output
    shows the engine's start-up line."""
    home = tmp_path / "home"
    output_dir = tmp_path / "output"

    result = run_dagster(
        ["asset", "materialize", "-f", "definitions.py", "--select", "*ticket_summaries",
         "--partition-range", "2024-06-03...2024-06-04", "--config-json", json.dumps(SHORT_RUN_CONFIG)],
        home, output_dir,
    )

    assert_succeeded(result)
    # The engine's start-up choices are printed with the run's events (as `make run` prints them).
    assert "engine: CPU: " in result.stdout + result.stderr
    expected_rows = {"2024-06-03": 3, "2024-06-04": 2}
    for partition, rows in expected_rows.items():
        assert len(generations(output_dir, partition)) == rows
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert len(instance.get_runs()) == 1
        for partition, rows in expected_rows.items():
            metadata = latest_metadata(instance, partition)
            assert metadata["partitions_in_run"] == 2
            assert metadata["dagster/row_count"] == rows


@pytest.mark.slow
def test_invalid_run_config_fails_before_generating(executed_day: ExecutedDay) -> None:
    """A negative temperature in the run config makes `dagster asset materialize` fail,
    naming the field and the rule, before the model loads: the day's table already written
    stays as it was.

    Dagster checks field names and types at launch (see the quick tests) but its config
    system has no ranges; those fail the generation step before it loads the model.
    """
    assert_succeeded(executed_day.result)
    table = executed_day.output_dir / "tables" / "ticket_summaries" / "2024-06-02.parquet"
    before = table.read_bytes()
    bad_config = {"ops": {"ticket_summaries": {"config": {"sampling": {"temperature": -1}}}}}

    result = run_dagster(
        ["asset", "materialize", "-f", "definitions.py", "--select", "ticket_summaries",
         "--partition", "2024-06-02", "--config-json", json.dumps(bad_config)],
        executed_day.home, executed_day.output_dir,
    )

    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"ops.ticket_summaries.config.sampling.temperature must be {SamplingParams.rule('temperature')}, got -1" \
        in output
    assert "ValidationError" not in output
    assert table.read_bytes() == before
