"""The Dagster webserver serving definitions.py: launch a generation run over GraphQL, as
the UI's Launchpad does, and read the materialization's metadata back.

The webserver runs as a real subprocess from the repository root, with its own
DAGSTER_HOME (DefaultRunCoordinator, so launched runs start without a daemon) and
DAGSTER_LLM_OUTPUT_DIR.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.vision_models.llava import build_tiny_llava

REPO_ROOT = Path(__file__).resolve().parents[2]
WEBSERVER = Path(sys.executable).parent / "dagster-webserver"
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 8
DAGSTER_YAML = """\
run_coordinator:
  module: dagster._core.run_coordinator
  class: DefaultRunCoordinator
telemetry:
  enabled: false
"""
STARTUP_TIMEOUT_S = 120
RUN_TIMEOUT_S = 240
POLL_S = 0.25  # between two looks at the server: each a GraphQL query of a few milliseconds

WORKSPACE = """
{ workspaceOrError { __typename
    ... on Workspace { locationEntries { name loadStatus
        locationOrLoadError { __typename ... on PythonError { message stack } } } }
    ... on PythonError { message } } }"""

REPOSITORIES = """
{ repositoriesOrError { __typename
    ... on RepositoryConnection { nodes { name location { name } } }
    ... on PythonError { message } } }"""

LAUNCH_RUN = """
mutation LaunchRun($executionParams: ExecutionParams!) {
  launchRun(executionParams: $executionParams) { __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on RunConfigValidationInvalid { errors { message } }
    ... on Error { message } } }"""

RUN_STATUS = """
query RunStatus($runId: ID!) {
  runOrError(runId: $runId) { __typename
    ... on Run { status }
    ... on Error { message } } }"""

RUN_ERRORS = """
query RunErrors($runId: ID!) {
  logsForRun(runId: $runId) { __typename
    ... on EventConnection { events { __typename
        ... on MessageEvent { message stepKey level }
        ... on ErrorEvent { error { message stack } } } }
    ... on Error { message } } }"""

MATERIALIZATIONS = """
query Materializations($assetKey: AssetKeyInput!, $partitions: [String!]) {
  assetOrError(assetKey: $assetKey) { __typename
    ... on Asset { assetMaterializations(partitions: $partitions) { partition
        metadataEntries { __typename label
          ... on IntMetadataEntry { intValue }
          ... on FloatMetadataEntry { floatValue }
          ... on TextMetadataEntry { text }
          ... on JsonMetadataEntry { jsonString }
          ... on PathMetadataEntry { path } } } }
    ... on Error { message } } }"""


@dataclass
class Webserver:
    url: str
    log: Path

    def graphql(self, query: str, variables: dict[str, object] | None = None) -> dict:
        """The `data` of a GraphQL answer; GraphQL-level errors fail the test."""
        request = urllib.request.Request(
            f"{self.url}/graphql",
            data=json.dumps({"query": query, "variables": variables or {}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.load(response)
        assert "errors" not in body, f"GraphQL errors: {body['errors']}"
        return body["data"]

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_up(server: Webserver, process: subprocess.Popen[bytes]) -> None:
    """Wait (bounded) until /server_info answers."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert process.poll() is None, f"webserver exited with {process.returncode}:\n{server.log_tail()}"
        try:
            with urllib.request.urlopen(f"{server.url}/server_info", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            assert time.monotonic() < deadline, f"webserver not up after {STARTUP_TIMEOUT_S}s:\n{server.log_tail()}"
            time.sleep(POLL_S)


def stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate the webserver's process group (it, its code server and run workers)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def webserver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Webserver]:
    """A dagster-webserver on a free port, serving definitions.py from the repository root,
    the catalog example's vision model a tiny random LLaVA."""
    tmp_path = tmp_path_factory.mktemp("webserver")
    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "output"),
           "DAGSTER_LLM_VISION_MODEL": str(build_tiny_llava(tmp_path / "llava")), "DAGSTER_LLM_DTYPE": "float32"}
    port = free_port()
    server = Webserver(url=f"http://127.0.0.1:{port}", log=tmp_path / "webserver.log")
    with server.log.open("wb") as log:
        process = subprocess.Popen(
            [str(WEBSERVER), "-f", "definitions.py", "-h", "127.0.0.1", "-p", str(port)],
            cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_until_up(server, process)
        yield server
    finally:
        stop(process)


def wait_for_location(server: Webserver) -> str:
    """The name of the single code location, once it has loaded."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        workspace = server.graphql(WORKSPACE)["workspaceOrError"]
        assert workspace["__typename"] == "Workspace", workspace
        entries = workspace["locationEntries"]
        assert len(entries) == 1, entries
        entry = entries[0]
        if entry["loadStatus"] == "LOADED":
            assert entry["locationOrLoadError"]["__typename"] == "RepositoryLocation", entry["locationOrLoadError"]
            return entry["name"]
        assert time.monotonic() < deadline, f"code location not loaded after {STARTUP_TIMEOUT_S}s: {entry}"
        time.sleep(POLL_S)


def run_errors(server: Webserver, run_id: str) -> str:
    """The run's error and warning events, readable."""
    logs = server.graphql(RUN_ERRORS, {"runId": run_id})["logsForRun"]
    if logs["__typename"] != "EventConnection":
        return str(logs)
    lines = []
    for event in logs["events"]:
        if event.get("level") in ("ERROR", "CRITICAL", "WARNING") or event.get("error"):
            lines.append(f"[{event['__typename']} {event.get('stepKey')}] {event.get('message')}")
            if event.get("error"):
                lines.append(event["error"]["message"] + "".join(event["error"]["stack"]))
    return "\n".join(lines)


def wait_for_run(server: Webserver, run_id: str) -> str:
    """The run's final status (bounded)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        run = server.graphql(RUN_STATUS, {"runId": run_id})["runOrError"]
        assert run["__typename"] == "Run", run
        if run["status"] in ("SUCCESS", "FAILURE", "CANCELED"):
            return run["status"]
        assert time.monotonic() < deadline, f"run {run_id} still {run['status']} after {RUN_TIMEOUT_S}s"
        time.sleep(POLL_S)


def metadata_values(entries: list[dict]) -> dict[str, object]:
    """label -> value of GraphQL metadata entries (JSON entries decoded)."""
    values: dict[str, object] = {}
    for entry in entries:
        if "jsonString" in entry:
            values[entry["label"]] = json.loads(entry["jsonString"])
        else:
            for field in ("intValue", "floatValue", "text", "path"):
                if field in entry:
                    values[entry["label"]] = entry[field]
    return values


@pytest.mark.slow
def test_launch_partition_run_and_read_metadata(webserver: Webserver) -> None:
    """A run launched over GraphQL for the `creative` partition of prompt_set_answers, with a
    max_tokens override, succeeds; its materialization metadata, read back over GraphQL,
    shows the partition's configured sampling with the override applied, and the file."""
    location = wait_for_location(webserver)
    repositories = webserver.graphql(REPOSITORIES)["repositoriesOrError"]
    assert repositories["__typename"] == "RepositoryConnection", repositories
    [repository] = repositories["nodes"]
    assert repository["location"]["name"] == location

    launch = webserver.graphql(LAUNCH_RUN, {"executionParams": {
        "selector": {
            "repositoryLocationName": location,
            "repositoryName": repository["name"],
            "jobName": "__ASSET_JOB",
            "assetSelection": [{"path": ["prompt_sets"]}, {"path": ["prompt_set_answers"]}],
        },
        "runConfigData": {"ops": {"prompt_set_answers": {"config": {"sampling": {"max_tokens": MAX_TOKENS}}}}},
        "executionMetadata": {"tags": [{"key": "dagster/partition", "value": "creative"}]},
    }})["launchRun"]
    assert launch["__typename"] == "LaunchRunSuccess", launch
    run_id = launch["run"]["runId"]

    status = wait_for_run(webserver, run_id)
    assert status == "SUCCESS", f"run {run_id} ended {status}:\n{run_errors(webserver, run_id)}"

    asset = webserver.graphql(
        MATERIALIZATIONS, {"assetKey": {"path": ["prompt_set_answers"]}, "partitions": ["creative"]}
    )["assetOrError"]
    assert asset["__typename"] == "Asset", asset
    [materialization] = asset["assetMaterializations"]
    assert materialization["partition"] == "creative"
    metadata = metadata_values(materialization["metadataEntries"])
    assert metadata["dagster/row_count"] == 4
    sampling = metadata["sampling_config"]
    assert (sampling["temperature"], sampling["seed"], sampling["max_tokens"]) == (0.8, 7, MAX_TOKENS)
    assert metadata["model_id"] == MODEL
    path = str(metadata["path"])
    assert path.endswith("prompt_set_answers/creative.parquet")
    assert Path(path).is_file()


@pytest.mark.slow
def test_launch_the_catalog_example_with_a_vision_model(webserver: Webserver) -> None:
    """The product-photos pipeline launched as the UI's Materialize does: its photos go to the
    vision model, and the materialization records a row per photo with its typed columns."""
    location = wait_for_location(webserver)
    [repository] = webserver.graphql(REPOSITORIES)["repositoriesOrError"]["nodes"]
    launch = webserver.graphql(LAUNCH_RUN, {"executionParams": {
        "selector": {"repositoryLocationName": location, "repositoryName": repository["name"],
                     "jobName": "__ASSET_JOB",
                     "assetSelection": [{"path": ["product_photos"]}, {"path": ["product_attributes"]}]},
        "runConfigData": {},
    }})["launchRun"]
    assert launch["__typename"] == "LaunchRunSuccess", launch
    run_id = launch["run"]["runId"]
    status = wait_for_run(webserver, run_id)
    assert status == "SUCCESS", f"run {run_id} ended {status}:\n{run_errors(webserver, run_id)}"
    asset = webserver.graphql(MATERIALIZATIONS, {"assetKey": {"path": ["product_attributes"]},
                                                 "partitions": None})["assetOrError"]
    [materialization] = asset["assetMaterializations"]
    metadata = metadata_values(materialization["metadataEntries"])
    assert metadata["dagster/row_count"] == 6
    assert Path(str(metadata["path"])).is_file()
