"""Fixtures of the Dagster tests."""

import logging
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from upath import UPath

import engine

from dagster_llm import LLMResource, ParquetIOManager
from tests.postgres import PostgresServer, running_server, unavailable_reason


@pytest.fixture
def env(tiny_models, tmp_path, monkeypatch):
    """Output under tmp_path, a resource on the tiny Llama, and a count of engine loads."""
    monkeypatch.setenv("DAGSTER_LLM_OUTPUT_DIR", str(tmp_path / "out"))
    loads = []
    original = engine.LLM.__init__

    def counting_init(self, *args, **kwargs):
        loads.append(args)
        original(self, *args, **kwargs)

    monkeypatch.setattr(engine.LLM, "__init__", counting_init)
    resources = {
        "llm": LLMResource(model_id=str(tiny_models["llama"]), dtype="float32", kv_cache_memory=10 << 20),
        "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables")),
    }
    return {"root": tmp_path / "tables", "resources": resources, "loads": loads,
            "model": tiny_models["llama"]}


@dataclass(frozen=True)
class S3Bucket:
    """A bucket of its own on the tests' S3-compatible server: `url` (s3://name), what an
    in-process client passes (`storage_options`) and what a child process's environment
    needs (`env`: credentials and AWS_ENDPOINT_URL, as on a real deployment)."""

    url: str
    storage_options: dict[str, str]
    env: dict[str, str]

    def path(self, *parts: str) -> UPath:
        return UPath(self.url, **self.storage_options).joinpath(*parts)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """moto's S3 server on a free loopback port, for the whole session; yields its URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: str) -> S3Bucket:
    """A fresh bucket on the tests' S3 server."""
    import s3fs

    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    options = {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}
    name = f"tables-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**options).mkdir(name)
    return S3Bucket(f"s3://{name}", options, {**credentials, "AWS_ENDPOINT_URL": s3_server})


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server on loopback for the session (`tests/postgres.py`). Where none is
    installed the tests that need it are skipped with the reason, or fail where
    DAGSTER_LLM_REQUIRE_POSTGRES is set (CI: a skip there would hide the missing server)."""
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get("DAGSTER_LLM_REQUIRE_POSTGRES"):
            pytest.fail(f"DAGSTER_LLM_REQUIRE_POSTGRES is set, but {reason}")
        pytest.skip(reason)
    with running_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def instance_storage(request: pytest.FixtureRequest) -> str | None:
    """Where a test's Dagster instance keeps runs, event log and pool slots: SQLite files under
    its DAGSTER_HOME (None), or a fresh database on the tests' PostgreSQL server (its URL), as a
    deployment does."""
    return request.getfixturevalue("postgres_server").create_database() if request.param == "postgres" else None
