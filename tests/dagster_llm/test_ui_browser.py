"""The Dagster UI in a real browser, as a newcomer uses it (`make test-ui`).

Debian's chromium, headless, driven by Playwright's Python client, against `make ui`'s
launcher (`dagster dev` on workspace.yaml) started as real processes with a temporary
DAGSTER_HOME set up by `make instance`. The tests run in file order and share the server:
the asset graph, one partition launched from the Launchpad with a sampling override, the
asset page's metadata and preview, a two-day range launched from the materialize dialog
(one run), and a bad sampling value. Screenshots go to test-artifacts/ui/ (or
$DAGSTER_LLM_UI_ARTIFACTS).
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest

from dagster_llm import partition_file
from engine import SamplingParams
from tests.dagster_llm.test_webserver import Webserver, free_port, wait_for_run, wait_until_up

pytestmark = [pytest.mark.ui, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("DAGSTER_LLM_UI_ARTIFACTS", REPO / "test-artifacts" / "ui"))
ONE_DAY = "2024-06-03"
RANGE = ("2024-06-04", "2024-06-05")
SUMMARIES = dg.AssetKey("ticket_summaries")
OVERRIDE = """ops:
  ticket_summaries:
    config:
      sampling:
        max_tokens: 24
        temperature: {temperature}
"""


def chromium_path() -> str:
    """The browser to drive; a failure that says what to install when there is none."""
    path = os.environ.get("DAGSTER_LLM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path or not Path(path).exists():
        pytest.fail("no Chromium found: install Debian's chromium (sudo apt-get install chromium; `make test-ui` "
                    "does it when run as root) or set DAGSTER_LLM_CHROMIUM=/path/to/chromium", pytrace=False)
    return path


@dataclass
class DagsterUI(Webserver):
    """The running UI: its address, its GraphQL API (to wait on runs), its log and its storage."""

    home: Path
    tables: Path

    def runs(self) -> list[dict]:
        data = self.graphql("{ runsOrError { ... on Runs { results { runId status tags { key value } } } } }")
        return [{**run, "tags": {t["key"]: t["value"] for t in run["tags"]}} for run in data["runsOrError"]["results"]]

    def finished_run(self, run_id: str) -> dict:
        """The run, with its tags, once it has finished (success, failure or cancellation)."""
        wait_for_run(self, run_id)
        return next(r for r in self.runs() if r["runId"] == run_id)

    def messages(self, run_id: str) -> list[str]:
        """The run's event log: messages, with each error's message appended."""
        data = self.graphql("""query($id: ID!) { logsForRun(runId: $id) { ... on EventConnection { events {
            ... on MessageEvent { message } ... on ExecutionStepFailureEvent { error { message } } } } } }""",
                            {"id": run_id})
        events = data["logsForRun"]["events"]
        return [e.get("message", "") + " " + ((e.get("error") or {}).get("message") or "") for e in events]


def run_make_instance(home: Path) -> None:
    subprocess.run(["make", "-s", "instance", f"DAGSTER_HOME={home}"], cwd=REPO, check=True, timeout=300)


def processes_with_home(home: Path) -> list[int]:
    """Live processes whose environment holds this DAGSTER_HOME (the server and its runs)."""
    marker = f"DAGSTER_HOME={home}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes().split(b"\0") and "Z" not in (environ.parent / "stat").read_text().split()[2]:
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def ui(tmp_path_factory) -> Iterator[DagsterUI]:
    root = tmp_path_factory.mktemp("ui")
    home, output = root / "home", root / "output"
    env = {**os.environ, "DAGSTER_HOME": str(home), "DAGSTER_LLM_OUTPUT_DIR": str(output)}
    chromium_path()
    run_make_instance(home)
    # The prompt tables, as a scheduled upstream run would have left them.
    subprocess.run([str(Path(sys.executable).with_name("dagster")), "asset", "materialize", "-f", "definitions.py",
                    "--select", "raw_support_tickets,support_prompts", "--partition-range", "2024-06-01...2024-06-05"],
                   cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    port = free_port()
    ui = DagsterUI(url=f"http://127.0.0.1:{port}", log=root / "dagster_dev.log", home=home, tables=output / "tables")
    with ui.log.open("w") as log:
        server = subprocess.Popen([sys.executable, "-m", "example_pipelines.serve_ui", "--port", str(port)],
                                  cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_up(ui, server)
        yield ui
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=90)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(ui.log, ARTIFACTS / "dagster_dev.log")
    left = processes_with_home(home)
    assert not left, f"stopping the UI left processes running: {left}"


@pytest.fixture(scope="module")
def page(ui):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(),
                                             args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def shot(page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def choose_partition(page, dialog, partition: str) -> None:
    """Types a partition into the Launchpad's selector until its tag shows. The selector takes Enter
    only once its list of partitions has loaded, which a loaded machine can delay past the typing."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    chosen = dialog.get_by_text(f"partition: {partition}")
    for attempt in range(3):
        box = dialog.get_by_placeholder("Partition")
        box.click()
        box.fill(partition)
        page.get_by_text(partition, exact=True).last.wait_for()  # the list offers it
        page.keyboard.press("Enter")
        try:
            chosen.wait_for(timeout=15_000)
            return
        except PlaywrightTimeout:
            shot(page, f"partition-not-chosen-{attempt}")
    chosen.wait_for()


def open_launchpad(page, ui: DagsterUI, partition: str, temperature: float) -> None:
    """The asset page's Materialize menu -> Open launchpad, a partition and a typed override."""
    page.goto(f"{ui.url}/assets/ticket_summaries", wait_until="networkidle")
    page.locator("button:right-of(:text('Materialize…'))").first.click()
    page.get_by_text("Open launchpad").click()
    dialog = page.get_by_role("dialog")
    choose_partition(page, dialog, partition)
    page.locator(".CodeMirror").first.click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(OVERRIDE.format(temperature=temperature))
    dialog.get_by_text("No errors").wait_for()


def launch_from_launchpad(page) -> str:
    """Clicks Materialize; the UI moves to the new run's page, whose id is returned."""
    page.get_by_role("dialog").get_by_role("button", name="Materialize").click()
    page.wait_for_url("**/runs/*", timeout=60_000)
    return page.url.rstrip("/").split("/runs/")[1].split("?")[0]


def test_asset_graph_shows_the_pipelines(ui, page):
    page.goto(f"{ui.url}/asset-groups", wait_until="networkidle")  # the Lineage item of the side bar
    page.get_by_text("Global asset lineage").wait_for()
    page.goto(f"{ui.url}/locations/dagster_llm_examples/asset-groups/support/lineage", wait_until="networkidle")
    for name in ("raw_support_tickets", "support_prompts", "ticket_summaries", "ticket_summary_quality",
                 "triage_prompts", "ticket_triage"):
        page.get_by_text(name, exact=True).first.wait_for()
    page.get_by_text("5 partitions").first.wait_for()  # one per day of the ticket export
    # Every daily asset has the export's days, none an open-ended count from its first day to today.
    counts = set(re.findall(r"([\d,]+)\s+partitions", page.locator("body").inner_text()))
    assert counts == {"5"}, f"the support assets show {sorted(counts)} partitions; expected the export's 5 days"
    shot(page, "01-asset-graph")


def test_columns_show_before_the_first_run(ui, page):
    page.goto(f"{ui.url}/assets/ticket_triage", wait_until="networkidle")
    page.get_by_text("Never materialized").wait_for()
    columns = page.locator("table").filter(has=page.get_by_text("Column name"))
    for name, description in (("generated_text", "The completion"), ("urgency", "1 (can wait) to 5")):
        columns.locator("tr").filter(has=page.get_by_text(name, exact=True)).get_by_text(description).wait_for()


def test_launchpad_override_runs_one_partition(ui, page):
    open_launchpad(page, ui, ONE_DAY, temperature=0)
    shot(page, "02-launchpad-override")
    run_id = launch_from_launchpad(page)
    run = ui.finished_run(run_id)
    shot(page, "03-run")
    assert run["status"] == "SUCCESS", ui.messages(run_id)[-5:]
    assert run["tags"]["dagster/partition"] == ONE_DAY
    # The engine's start-up choices are in the run's log, and the run view shows them.
    assert any("engine: CPU: " in m and "dtype" in m for m in ui.messages(run_id)), ui.messages(run_id)
    page.get_by_placeholder("Filter…").fill("engine: CPU")
    page.get_by_text(re.compile(r"engine: CPU: .*dtype")).first.wait_for(timeout=30_000)
    shot(page, "03-run-engine-log")
    table = pd.read_parquet(partition_file(ui.tables, SUMMARIES, ONE_DAY))
    assert len(table) == 3 and (table["max_tokens"] == 24).all()  # the typed override reached every row


def metadata_value(page, key: str) -> str:
    """The value cell of a row of the asset page's metadata table."""
    row = page.locator("tr").filter(has=page.get_by_text(key, exact=True)).first
    return row.locator("td").nth(1).inner_text().strip()


def test_asset_page_shows_row_count_model_tokens_and_preview(ui, page):
    table = pd.read_parquet(partition_file(ui.tables, SUMMARIES, ONE_DAY))
    page.goto(f"{ui.url}/assets/ticket_summaries?view=partitions&partition={ONE_DAY}", wait_until="networkidle")
    page.get_by_text("smollm2-135m-instruct", exact=True).wait_for()
    assert metadata_value(page, "dagster/row_count") == "3"
    assert metadata_value(page, "model_id") == "smollm2-135m-instruct"
    assert metadata_value(page, "prompt_tokens") == str(table["prompt_tokens"].sum())
    assert metadata_value(page, "completion_tokens") == str(table["completion_tokens"].sum())
    preview = " ".join(metadata_value(page, "preview").split())
    for row_id, generated in zip(table["id"], table["generated_text"]):
        assert " ".join(generated.split())[:60] in preview  # every completion, readable
        assert row_id.replace("-", "-\u2060") in preview
    page.set_viewport_size({"width": 1600, "height": 1500})  # the metadata down to the token counts
    page.get_by_text("completion_tokens", exact=True).scroll_into_view_if_needed()
    shot(page, "04-asset-partition")
    page.set_viewport_size({"width": 1600, "height": 1000})


@pytest.mark.long("the backfill the dialog launches waits for the daemon's backfill loop (it runs every 30 s) to "
                  "become a run, which then generates two days")
def test_two_day_range_from_the_materialize_dialog_is_one_run(ui, page):
    before = {run["runId"] for run in ui.runs()}
    page.goto(f"{ui.url}/assets/ticket_summaries", wait_until="networkidle")
    page.get_by_role("button", name="Materialize…").click()
    dialog = page.get_by_role("dialog")
    selection = dialog.get_by_placeholder("ex: 2024-06-01")
    selection.fill(f"[{RANGE[0]}...{RANGE[1]}]")  # the dialog's range syntax (the CLI's has no brackets)
    selection.press("Enter")
    dialog.get_by_text("2 partitions").wait_for()
    dialog.get_by_text("Backfills all partitions in a single run.").wait_for()
    shot(page, "05-range-dialog")
    dialog.get_by_role("button", name="Launch backfill").click()
    deadline = time.monotonic() + 120
    while not (new := [r for r in ui.runs() if r["runId"] not in before]) and time.monotonic() < deadline:
        time.sleep(0.5)  # the daemon turns the backfill into its run
    assert len(new) == 1, new
    run = ui.finished_run(new[0]["runId"])
    assert run["status"] == "SUCCESS", ui.messages(run["runId"])[-5:]
    assert (run["tags"]["dagster/asset_partition_range_start"], run["tags"]["dagster/asset_partition_range_end"]) == RANGE
    assert len([r for r in ui.runs() if r["runId"] not in before]) == 1
    for day in RANGE:
        assert len(pd.read_parquet(partition_file(ui.tables, SUMMARIES, day))) == 2
    assert not [m for m in ui.messages(run["runId"]) if "did not yield or return expected outputs" in m]


def test_out_of_range_sampling_value_fails_before_the_model_loads(ui, page):
    open_launchpad(page, ui, "2024-06-01", temperature=-1)  # the Launchpad checks types only
    run = ui.finished_run(launch_from_launchpad(page))
    assert run["status"] == "FAILURE"
    failure = " ".join(ui.messages(run["runId"]))
    rule = SamplingParams.rule("temperature")
    assert f"ops.ticket_summaries.config.sampling.temperature must be {rule}, got -1" in failure
    assert "Fix the value in the Launchpad" in failure and "ValidationError" not in failure
    assert not partition_file(ui.tables, SUMMARIES, "2024-06-01").exists()
    page.get_by_text(f"must be {rule}").first.wait_for()
    shot(page, "06-bad-sampling-value")


def test_llm_pool_has_its_slot(ui, page):
    page.goto(f"{ui.url}/deployment/concurrency/llm", wait_until="networkidle")
    page.get_by_text("Edit limit").wait_for()
    assert "no slots" not in page.locator("body").inner_text().lower()
    data = ui.graphql('{ instance { concurrencyLimit(concurrencyKey: "llm") { slotCount } } }')
    assert data["instance"]["concurrencyLimit"]["slotCount"] == 1
