"""Transcript tables (issue 65) on a tiny random Whisper: every cell form read, a long clip cut
into windows and transcribed as `LLM.transcribe` transcribes it, a bad clip as its row's error
while the others run, unchanged rows reused when rows are added, a model that does not
transcribe failing the step, and a `dagster asset materialize` SIGKILLed in the middle of a
partition resuming without encoding its finished rows again."""

import io
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import soundfile
from upath import UPath

from dagster_llm import LLMResource, ParquetIOManager, build_transcription_asset, partition_file
from dagster_llm.components import TranscriptionComponent
from dagster_llm.core.transcription import evaluate_transcripts
from engine import LLM, SamplingParams
from tests.audio_models.whisper import SAMPLE_RATE, build_tiny_whisper
from tests.dagster_llm.test_crash_resume import kill_launcher_and_wait_for_worker, listing, shard_rows, wait_for
from tests.dagster_llm.transcription_crash_defs import MAX_TOKENS, ROWS, clip

REPO = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
TOKENS = 6


@pytest.fixture(scope="module")
def whisper(tmp_path_factory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("transcripts") / "whisper")


def resources(whisper: Path, tmp_path: Path) -> dict:
    return {"transcriber": LLMResource(model_id=str(whisper), dtype="float32"),
            "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables")), "cells": dg.InMemoryIOManager()}


def calls_asset(frame: pd.DataFrame) -> dg.AssetsDefinition:
    @dg.asset(name="calls", io_manager_key="cells")  # cells of mixed kinds, which Parquet would not store
    def calls() -> pd.DataFrame:
        return frame

    return calls


def materialize(frame: pd.DataFrame, whisper: Path, tmp_path: Path, instance: dg.DagsterInstance,
                **options) -> dg.ExecuteInProcessResult:
    calls = calls_asset(frame)
    transcripts = build_transcription_asset("transcripts", upstream=calls, language="en", max_tokens=TOKENS,
                                            **options)
    return dg.materialize([calls, transcripts], resources=resources(whisper, tmp_path), instance=instance,
                          raise_on_error=False)


def latest(instance: dg.DagsterInstance) -> dict:
    records = instance.fetch_materializations(dg.AssetKey("transcripts"), limit=1).records
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def wav(samples: np.ndarray) -> bytes:
    encoded = io.BytesIO()
    soundfile.write(encoded, samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")
    return encoded.getvalue()


def test_a_partition_of_clips_is_transcribed_as_llm_transcribe_does_it(whisper, tmp_path):
    (tmp_path / "long.wav").write_bytes(wav(clip(4)))  # 3.4 s: two or more windows of the 2 s model
    frame = pd.DataFrame({"id": ["path", "bytes", "struct", "broken", "empty"],
                          "audio": [str(tmp_path / "long.wav"), wav(clip(1)),
                                    {"array": clip(2), "sampling_rate": SAMPLE_RATE}, b"not audio", None]})
    with dg.instance_for_test() as instance:
        result = materialize(frame, whisper, tmp_path, instance)
        assert result.success
        meta = latest(instance)
    table = pd.read_parquet(partition_file(tmp_path / "tables", ["transcripts"], None)).set_index("id")
    with LLM(str(whisper), dtype="float32") as llm:
        expected = llm.transcribe([(clip(4), SAMPLE_RATE), (clip(1), SAMPLE_RATE), (clip(2), SAMPLE_RATE)],
                                  language="en", sampling_params=SamplingParams(temperature=0, max_tokens=TOKENS),
                                  use_tqdm=False)
    for row_id, out in zip(["path", "bytes", "struct"], expected):
        assert table.loc[row_id, "text"] == out.text and table.loc[row_id, "windows"] == len(out.windows)
        assert table.loc[row_id, "duration_s"] == pytest.approx(out.duration_s) and table.loc[row_id, "language"] == "en"
    assert table.loc["path", "windows"] >= 2
    assert table.loc["broken", "error"].startswith("audio: the bytes") and pd.isna(table.loc["broken", "text"])
    assert table.loc["empty", "error"] == ("audio: the row holds 0 clips: a transcript is of one clip; give one per "
                                           "row (a null cell has none)")
    assert meta["transcribed_rows"] == 3 and meta["error_rows"] == 2
    assert meta["audio_encoder_runs"] == sum(len(o.windows) for o in expected)
    checks = {c.check_name: c.passed for c in result.get_asset_check_evaluations()}
    assert checks == {"no_error_rows": False, "no_empty_text": True, "unique_ids": True}


def test_rows_added_to_the_table_leave_the_unchanged_rows_reused(whisper, tmp_path):
    first = pd.DataFrame({"id": ["a", "b"], "audio": [wav(clip(0)), wav(clip(1))]})
    more = pd.DataFrame({"id": ["a", "b", "c"], "audio": [wav(clip(0)), wav(clip(1)), wav(clip(3))]})
    with dg.instance_for_test() as instance:
        assert materialize(first, whisper, tmp_path, instance).success
        assert materialize(more, whisper, tmp_path, instance).success
        meta = latest(instance)
        assert (meta["reused_rows"], meta["transcribed_rows"]) == (2, 1)
        assert meta["audio_encoder_runs"] == meta["windows"] - 2  # rows a and b were not encoded again
        assert materialize(more, whisper, tmp_path, instance).success  # the same table: resumed whole
        assert (latest(instance)["resumed_rows"], latest(instance)["audio_encoder_runs"]) == (3, 0)


def test_a_model_that_does_not_transcribe_fails_the_step(tmp_path, tiny_models):
    frame = pd.DataFrame({"id": ["a"], "audio": [wav(clip(0))]})
    with dg.instance_for_test() as instance:
        result = materialize(frame, tiny_models["llama"], tmp_path, instance)
    assert not result.success
    failure = next(e for e in result.all_events if e.is_step_failure).step_failure_data.error.message
    assert "transcripts: transcribe: the model does not transcribe: load Whisper" in failure


def test_the_checks_flag_empty_transcripts_and_repeated_ids():
    import pyarrow as pa

    from dagster_llm.core.transcription import SCHEMA

    rows = [{"id": "a", "text": " ", "error": None}, {"id": "a", "text": "hi", "error": None}]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    outcomes = evaluate_transcripts(table)
    assert [outcomes[name].passed for name in ("no_error_rows", "no_empty_text", "unique_ids")] == [True, False, False]


def run_crash_defs(env: dict) -> subprocess.Popen:
    return subprocess.Popen([str(DAGSTER), "asset", "materialize", "-f", "tests/dagster_llm/transcription_crash_defs.py",
                             "--select", "*crash_transcripts", "--partition", "p1"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.long("two `dagster asset materialize` runs transcribing 24 files on the tiny Whisper, one window at a "
                  "time, the first SIGKILLed")
def test_killed_in_the_middle_of_a_partition_then_resumed_without_encoding_again(whisper, tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "out"),
           "CRASH_TEST_MODEL": str(whisper)}
    (tmp_path / "home").mkdir()
    folder = UPath(tmp_path / "out" / "tables" / "crash_transcripts")
    cli = run_crash_defs(env)
    wait_for(lambda: shard_rows(folder, "p1") >= 4, 240, "shards of p1")
    kill_launcher_and_wait_for_worker(cli, folder, "p1")
    saved = shard_rows(folder, "p1")
    assert 0 < saved < ROWS and not (folder / "p1.parquet").exists()
    saved_windows = sum(sum(pq.read_table(f).column("windows").to_pylist())
                        for f in listing(folder / ".p1.shards") if f.endswith(".parquet"))

    rerun = run_crash_defs(env)
    output, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, output
    table = pq.read_table(str(folder / "p1.parquet")).to_pandas()
    assert list(table["id"]) == [f"p1-{i}" for i in range(ROWS)] and table["error"].isna().all()
    assert (table["completion_tokens"] == MAX_TOKENS * table["windows"]).all()
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        records = instance.fetch_materializations(dg.AssetKey("crash_transcripts"), limit=1).records
        meta = {k: v.value for k, v in records[0].asset_materialization.metadata.items()}
    assert meta["resumed_rows"] == saved and meta["transcribed_rows"] == ROWS - saved
    assert meta["audio_encoder_runs"] == meta["windows"] - saved_windows  # no saved row's window encoded again


def test_the_transcription_component_builds_the_factorys_asset_from_yaml():
    component = TranscriptionComponent.resolve_from_yaml(
        'name: call_transcripts\nupstream: calls\naudio_column: recording\nlanguage: en\ntask: translate\n'
        'max_tokens: 200\npartitions: ["a", "b"]')
    [asset] = dg.build_defs_for_component(component).assets
    assert asset.key == dg.AssetKey("call_transcripts") and asset.partitions_def.get_partition_keys() == ["a", "b"]
    assert {c.name for c in asset.check_specs} == {"no_error_rows", "no_empty_text", "unique_ids"}
    assert asset.required_resource_keys == {"transcriber", "io_manager"}
    assert (component.task, component.max_tokens) == ("translate", 200)
    with pytest.raises(dg.DagsterInvalidDefinitionError, match="task: Input should be 'transcribe' or 'translate'"):
        build_transcription_asset("t", upstream="calls", task="summarize")


def run_dagster(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "home").mkdir(exist_ok=True)
    environment = {**{k: v for k, v in os.environ.items() if k != "DAGSTER_LLM_AUDIO_MODEL"},
                   "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "out"), **env}
    return subprocess.run([str(DAGSTER), *args], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_the_call_example_from_the_cli(whisper, tmp_path):
    result = run_dagster(["asset", "materialize", "-f", "definitions.py", "--select", "*call_transcripts"], tmp_path,
                         DAGSTER_LLM_AUDIO_MODEL=str(whisper), DAGSTER_LLM_DTYPE="float32")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = pd.read_parquet(tmp_path / "out" / "tables" / "call_transcripts" / "data.parquet").set_index("id")
    calls = pd.read_csv(REPO / "example_pipelines" / "data" / "call_recordings.csv")
    assert list(table.index) == list(calls["call_id"]) and table["error"].isna().all()
    durations = [soundfile.info(REPO / "example_pipelines" / "data" / path).duration for path in calls["recording"]]
    assert table["duration_s"].tolist() == pytest.approx(durations)
    assert (table["windows"] >= np.ceil(np.array(durations) / 2)).all()  # the tiny model's 2 s window


@pytest.mark.slow
def test_the_call_example_without_a_model_fails_naming_the_setting(tmp_path):
    result = run_dagster(["asset", "materialize", "-f", "definitions.py", "--select", "*call_transcripts"], tmp_path)
    assert result.returncode != 0
    assert "DAGSTER_LLM_AUDIO_MODEL" in result.stdout + result.stderr
