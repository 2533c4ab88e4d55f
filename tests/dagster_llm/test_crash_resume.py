"""Killing `dagster asset materialize` with SIGKILL in the middle of a partition: the step
worker stops without writing, committed partitions stay, and the rerun generates only the
rows that are missing, each id exactly once. On the local disk and on an S3-compatible
server (moto, on loopback), where runs with different instances (different pods) share the
bucket: the writer lease keeps a second run out and expires when its holder was killed. The
tests of runs that meet (pool slots, partition locks) run on an instance stored in SQLite and
on one stored in PostgreSQL, as a deployment's is; the lease takeover on PostgreSQL."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pandas as pd
import pyarrow.parquet as pq
import pytest
from upath import UPath

from dagster_llm.core.leases import StoreLease
from tests.dagster_llm.crash_defs import MAX_TOKENS, ROWS
from tests.postgres import instance_yaml
from tests.processes import is_gone

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
DEFS = "tests/dagster_llm/crash_defs.py"


@pytest.fixture
def setup(tiny_models, tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "out"),
           "CRASH_TEST_MODEL": str(tiny_models["llama"])}
    (tmp_path / "home").mkdir()
    return env, UPath(tmp_path / "out" / "tables" / "crash_gen")


@pytest.fixture
def s3_setup(setup, s3_bucket):
    """The crash pipeline's tables in a bucket of their own; leases live 8 s past their last renewal."""
    env, _ = setup
    env = {**env, **s3_bucket.env, "CRASH_TEST_TABLES": f"{s3_bucket.url}/tables", "CRASH_TEST_LEASE_TTL_S": "8"}
    return env, s3_bucket.path("tables", "crash_gen")


def instance_home(home: Path, storage: str | None, base: str = "") -> Path:
    """A DAGSTER_HOME whose dagster.yaml is `base` with the instance stored at `storage` (a
    PostgreSQL URL; None: SQLite files in the home)."""
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text(instance_yaml(storage, base))
    return home


def make_instance(home: Path, storage: str | None) -> Path:
    """The instance `make` sets up (the example dagster.yaml, migrated once, the llm pool at
    one slot) in `home`, stored at `storage`."""
    instance_home(home, storage, (REPO / "example_pipelines" / "dagster.yaml").read_text())
    subprocess.run(["make", "-s", "instance", f"DAGSTER_HOME={home}"], cwd=REPO, check=True, capture_output=True)
    return home


def materialize(env: dict, partition_args: list[str], select: str = "*crash_gen") -> subprocess.Popen:
    return subprocess.Popen([str(DAGSTER), "asset", "materialize", "-f", DEFS, "--select", select,
                             *partition_args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def listing(folder: UPath) -> list[str]:
    """The files under `folder` now (never a cached listing)."""
    folder.fs.invalidate_cache()
    return folder.fs.find(folder.path) if folder.fs.exists(folder.path) else []


def exists(folder: UPath, name: str) -> bool:
    return any(f.endswith(f"/{name}") for f in listing(folder))


def shard_rows(folder: UPath, partition: str) -> int:
    shards = [f for f in listing(folder / f".{partition}.shards") if f.endswith(".parquet")]
    return sum(pq.read_metadata(f, filesystem=folder.fs).num_rows for f in shards)


def read(folder: UPath, partition: str) -> pd.DataFrame:
    folder.fs.invalidate_cache()
    return pq.read_table((folder / f"{partition}.parquet").path, filesystem=folder.fs).to_pandas()


def store_lease(folder: UPath, partition: str) -> StoreLease:
    return StoreLease(folder.fs, (folder / f".{partition}.lease").path, partition, 8.0)


def writer_pid(folder: UPath, partition: str) -> int:
    """The pid of the process holding the partition's lock (local disk) or lease (store)."""
    if isinstance(folder, Path):
        return int((folder / f".{partition}.lock").read_text().rsplit("pid ", 1)[1].rstrip(")"))
    return store_lease(folder, partition).latest().pid


def kill_launcher_and_wait_for_worker(cli: subprocess.Popen, folder: UPath, partition: str) -> None:
    """SIGKILLs the CLI alone; its step worker (the lock holder) must stop within seconds."""
    worker = writer_pid(folder, partition)
    os.kill(cli.pid, signal.SIGKILL)
    cli.wait()
    wait_for(lambda: is_gone(worker), 30, "the worker to stop")


def finish(env: dict, partition_args: list[str], select: str = "*crash_gen") -> str:
    done = materialize(env, partition_args, select)
    output, _ = done.communicate(timeout=600)
    assert done.returncode == 0, output
    return output


def latest(env: dict, partition: str) -> dict:
    with dg.DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("crash_gen"), asset_partitions=[partition]), limit=1).records
        return {k: v.value for k, v in records[0].asset_materialization.metadata.items()} if records else {}


def assert_complete(folder: UPath, partition: str) -> pd.DataFrame:
    table = read(folder, partition)
    assert list(table["id"]) == [f"{partition}-{i}" for i in range(ROWS)] and table["id"].is_unique
    assert table["error"].isna().all() and (table["completion_tokens"] == MAX_TOKENS).all()
    return table


@pytest.mark.long("two `dagster asset materialize` runs of three partitions, the first SIGKILLed in the second")
def test_killed_in_the_middle_of_a_range_keeps_what_it_finished_and_resumes_the_rest(setup):
    """The launcher of a run of three partitions SIGKILLed in the middle of the second: its
    step worker stops without writing (no shard after, no table, no materialization), the
    first partition stays committed, and the rerun reuses the first, resumes the saved rows
    of the second (generating only the rest, each id once) and generates the third. (On the
    store, resuming after a kill is the last test's: the writer stops the same way whatever
    it writes to.)"""
    env, folder = setup
    cli = materialize(env, ["--partition-range", "p1...p3"])
    wait_for(lambda: (folder / "p1.parquet").exists() and shard_rows(folder, "p2") >= 4, 180, "p1 and shards of p2")
    kill_launcher_and_wait_for_worker(cli, folder, "p2")
    first = read(folder, "p1")
    saved = shard_rows(folder, "p2")
    time.sleep(2)
    assert shard_rows(folder, "p2") == saved and not exists(folder, "p2.parquet")  # nothing written after
    assert 0 < saved < ROWS and not latest(env, "p2") and not exists(folder, "p3.parquet")
    assert latest(env, "p1")["dagster/row_count"] == ROWS  # committed with its materialization

    finish(env, ["--partition-range", "p1...p3"])
    pd.testing.assert_frame_equal(assert_complete(folder, "p1"), first)
    for partition in ("p2", "p3"):
        assert_complete(folder, partition)
    meta = {p: latest(env, p) for p in ("p1", "p2", "p3")}
    assert {p: m["resumed_rows"] for p, m in meta.items()} == {"p1": ROWS, "p2": saved, "p3": 0}
    assert meta["p2"]["generated_rows"] == ROWS - saved
    assert meta["p2"]["generated_tokens"] == MAX_TOKENS * (ROWS - saved)


def generated_rows(home: Path, partition: str) -> list[int]:
    """`generated_rows` of each of the partition's materializations, fewest first."""
    with dg.DagsterInstance.from_config(str(home)) as instance:
        records = instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("crash_gen"), asset_partitions=[partition]), limit=5).records
    return sorted(r.asset_materialization.metadata["generated_rows"].value for r in records)


@pytest.mark.long("an instance set up by `make instance`, then two `dagster asset materialize` runs of a partition, the second waiting for the first's pool slot")
def test_two_runs_of_one_partition_on_a_fresh_instance_take_turns(setup, tmp_path, instance_storage):
    """A second run launched while the first generates succeeds: it waits for the pool's
    slot, then resumes every row. The second starts once the first's step holds the slot
    (claims at the same instant: the next test)."""
    env, folder = setup
    env = {**env, "DAGSTER_HOME": str(make_instance(tmp_path / "fresh_home", instance_storage))}
    first = materialize(env, ["--partition", "p1"])
    wait_for(lambda: (folder / ".p1.lock").exists(), 180, "the first run's step to hold p1")
    second = materialize(env, ["--partition", "p1"])
    for cli in (first, second):
        output, _ = cli.communicate(timeout=600)
        assert cli.returncode == 0, output
    assert_complete(folder, "p1")
    assert generated_rows(Path(env["DAGSTER_HOME"]), "p1") == [0, ROWS]  # never both at once


@pytest.mark.long("an instance set up by `make instance`, then two `dagster asset materialize` runs of a partition launched together")
def test_two_runs_launched_at_the_same_instant_never_both_write(setup, tmp_path, instance_storage):
    """Two runs of one partition launched together. Dagster 1.13's pool claim is not atomic
    on either storage (it selects a free slot row, then updates it, in autocommit), so both
    may get the llm slot; the partition's lock then turns the later away, naming the first.
    Either way exactly one run generates, each row once, and a run that failed says why."""
    env, folder = setup
    env = {**env, "DAGSTER_HOME": str(make_instance(tmp_path / "fresh_home", instance_storage))}
    clis = [materialize(env, ["--partition", "p1"]) for _ in range(2)]
    finished = [(cli.communicate(timeout=600)[0], cli.returncode) for cli in clis]
    assert_complete(folder, "p1")
    failed = [output for output, code in finished if code != 0]
    assert len(failed) <= 1 and all("p1 is being generated by" in output for output in failed), failed
    assert generated_rows(Path(env["DAGSTER_HOME"]), "p1") == [0, ROWS][len(failed):]


@pytest.mark.long("two `dagster asset materialize` runs on two instances sharing a bucket, the first paused while the second fails")
def test_a_second_instance_sharing_the_bucket_fails_fast_naming_the_first(s3_setup, tmp_path):
    """Two runs of one partition from two processes with their own DAGSTER_HOMEs (two pods):
    the second fails at once naming the first, which finishes undisturbed. The first's worker
    is paused (well within its lease) while the second starts, so that it cannot finish first."""
    env, folder = s3_setup
    env = {**env, "CRASH_TEST_LEASE_TTL_S": "120"}
    (tmp_path / "other_home").mkdir()
    first = materialize(env, ["--partition", "p1"])
    wait_for(lambda: shard_rows(folder, "p1") >= 2, 120, "shards of p1")
    holder = store_lease(folder, "p1").latest()
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        second = materialize({**env, "DAGSTER_HOME": str(tmp_path / "other_home")}, ["--partition", "p1"])
        output, _ = second.communicate(timeout=100)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert second.returncode != 0 and first.poll() is None
    assert f"p1 is being generated by {holder.holder} on {holder.host} (pid {holder.pid}, lease expires in" in output
    output, _ = first.communicate(timeout=600)
    assert first.returncode == 0, output
    assert_complete(folder, "p1")
    assert store_lease(folder, "p1").latest().released


@pytest.mark.long("a `dagster asset materialize` run killed with its worker, 8 s for its lease to expire, then two more runs")
def test_a_killed_pods_lease_expires_and_the_next_run_takes_over(s3_setup, tmp_path, postgres_server):
    """The run and its step worker killed together (a pod gone): the lease stays until it
    expires, then a run in another pod takes over, resumes the saved rows, and a downstream
    asset in a third pod reads the table from the store. The pods share one instance stored
    in PostgreSQL, as a deployment's do (the previous test's pods have instances of their own)."""
    env, folder = s3_setup
    instance_storage = postgres_server.create_database()
    instance_home(Path(env["DAGSTER_HOME"]), instance_storage)
    cli = materialize(env, ["--partition", "p1"])
    wait_for(lambda: shard_rows(folder, "p1") >= 4, 120, "shards of p1")
    worker = writer_pid(folder, "p1")
    os.killpg(cli.pid, signal.SIGKILL)
    os.kill(worker, signal.SIGKILL)
    cli.wait()
    wait_for(lambda: is_gone(worker), 30, "the worker to die")
    saved = shard_rows(folder, "p1")
    left = store_lease(folder, "p1").latest()
    assert left.pid == worker and not left.released and left.expires_at > time.time()  # nobody gave it back

    homes = [instance_home(tmp_path / name, instance_storage) for name in ("second_home", "third_home")]
    wait_for(lambda: store_lease(folder, "p1").latest().expires_at < time.time(), 30, "the lease to expire")
    output = finish({**env, "DAGSTER_HOME": str(homes[0])}, ["--partition", "p1"])
    assert f"took over the lease of {left.holder} on {left.host} (pid {worker}, lease expired" in output
    assert_complete(folder, "p1")
    assert latest({**env, "DAGSTER_HOME": str(homes[0])}, "p1")["resumed_rows"] == saved

    finish({**env, "DAGSTER_HOME": str(homes[1])}, ["--partition", "p1"], select="crash_lengths")
    folder.fs.invalidate_cache()
    lengths = pq.read_table((folder.parent / "crash_lengths" / "p1.parquet").path, filesystem=folder.fs)
    assert lengths.column("id").to_pylist() == [f"p1-{i}" for i in range(ROWS)]
