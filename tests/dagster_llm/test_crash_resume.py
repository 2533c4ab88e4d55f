"""Killing `dagster asset materialize` with SIGKILL in the middle of a partition: the step
worker stops without writing, committed partitions stay, and the rerun generates only the
rows that are missing, each id exactly once."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from tests.dagster_llm.crash_defs import MAX_TOKENS, ROWS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
DEFS = "tests/dagster_llm/crash_defs.py"


@pytest.fixture
def setup(tiny_models, tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "out"),
           "CRASH_TEST_MODEL": str(tiny_models["llama"])}
    (tmp_path / "home").mkdir()
    return env, tmp_path / "out" / "tables" / "crash_gen"


def materialize(env: dict, partition_args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([str(DAGSTER), "asset", "materialize", "-f", DEFS, "--select", "*crash_gen",
                             *partition_args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def shard_rows(folder: Path, partition: str) -> int:
    return sum(len(pd.read_parquet(p)) for p in (folder / f".{partition}.shards").glob("*/shard-*.parquet"))


def kill_launcher_and_wait_for_worker(cli: subprocess.Popen, folder: Path, partition: str) -> None:
    """SIGKILLs the CLI alone; its step worker (the lock holder) must stop within seconds."""
    holder = (folder / f".{partition}.lock").read_text()
    worker = int(holder.rsplit("pid ", 1)[1].rstrip(")"))
    os.kill(cli.pid, signal.SIGKILL)
    cli.wait()
    wait_for(lambda: not Path(f"/proc/{worker}").exists() or "zombie" in _state(worker), 30, "the worker to stop")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


def finish(env: dict, partition_args: list[str]) -> str:
    done = materialize(env, partition_args)
    output, _ = done.communicate(timeout=600)
    assert done.returncode == 0, output
    return output


def latest(env: dict, partition: str) -> dict:
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("crash_gen"), asset_partitions=[partition]), limit=1).records
        return {k: v.value for k, v in records[0].asset_materialization.metadata.items()} if records else {}


def assert_complete(folder: Path, partition: str) -> pd.DataFrame:
    table = pd.read_parquet(folder / f"{partition}.parquet")
    assert list(table["id"]) == [f"{partition}-{i}" for i in range(ROWS)] and table["id"].is_unique
    assert table["error"].isna().all() and (table["completion_tokens"] == MAX_TOKENS).all()
    return table


def test_killed_in_the_middle_of_a_partition_then_resumed(setup):
    env, folder = setup
    cli = materialize(env, ["--partition", "p1"])
    wait_for(lambda: shard_rows(folder, "p1") >= 4, 120, "shards of p1")
    kill_launcher_and_wait_for_worker(cli, folder, "p1")
    saved = shard_rows(folder, "p1")
    time.sleep(2)
    assert shard_rows(folder, "p1") == saved and not (folder / "p1.parquet").exists()  # nothing written after
    assert 0 < saved < ROWS and not latest(env, "p1")

    finish(env, ["--partition", "p1"])
    assert_complete(folder, "p1")
    meta = latest(env, "p1")
    assert meta["resumed_rows"] == saved and meta["generated_rows"] == ROWS - saved
    assert meta["generated_tokens"] == MAX_TOKENS * (ROWS - saved)


def test_killed_in_the_second_partition_of_a_range_keeps_the_first(setup):
    env, folder = setup
    cli = materialize(env, ["--partition-range", "p1...p3"])
    wait_for(lambda: (folder / "p1.parquet").exists() and shard_rows(folder, "p2") >= 2, 180, "p1 and shards of p2")
    kill_launcher_and_wait_for_worker(cli, folder, "p2")
    first = pd.read_parquet(folder / "p1.parquet")
    saved = shard_rows(folder, "p2")
    assert latest(env, "p1")["dagster/row_count"] == ROWS  # committed with its materialization
    assert not (folder / "p2.parquet").exists() and not (folder / "p3.parquet").exists()

    finish(env, ["--partition-range", "p1...p3"])
    pd.testing.assert_frame_equal(assert_complete(folder, "p1"), first)
    for partition in ("p2", "p3"):
        assert_complete(folder, partition)
    resumed = {p: latest(env, p)["resumed_rows"] for p in ("p1", "p2", "p3")}
    assert resumed == {"p1": ROWS, "p2": saved, "p3": 0}
    assert latest(env, "p2")["generated_tokens"] == MAX_TOKENS * (ROWS - saved)


def test_two_runs_of_one_partition_on_a_fresh_instance_take_turns(setup, tmp_path):
    """The instance `make` sets up (migrated once, the llm pool at one slot): two runs
    launched at once both succeed; the second waits for the slot, then reuses every row."""
    env, folder = setup
    home = tmp_path / "fresh_home"
    subprocess.run(["make", "-s", "instance", f"DAGSTER_HOME={home}"], cwd=REPO, check=True, capture_output=True)
    env = {**env, "DAGSTER_HOME": str(home)}
    first, second = (materialize(env, ["--partition", "p1"]) for _ in range(2))
    for cli in (first, second):
        output, _ = cli.communicate(timeout=600)
        assert cli.returncode == 0, output
    assert_complete(folder, "p1")
    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("crash_gen"), asset_partitions=["p1"]), limit=2).records
    generated = sorted(r.asset_materialization.metadata["generated_rows"].value for r in records)
    assert generated == [0, ROWS]  # one generated everything, the other reused it: never both at once
