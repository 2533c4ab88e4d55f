"""Daily pipeline: raw support tickets -> cleaned prompts -> one-line summaries by the LLM.

A schedule runs each day's partition; a backfill over many days runs as a single run
that loads the model once. The days are those of the ticket export: from its first
ticket's day to its last, so that no partition is empty (the partitions grow with the
export when the code location reloads).
"""

import csv
import datetime as dt
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pandas as pd

from dagster_llm import SamplingConfig, build_generation_asset
from dagster_llm.kubernetes import KubernetesStep, run_tags

TICKETS_CSV = Path(__file__).resolve().parents[1] / "data" / "support_tickets.csv"


def _export_days() -> tuple[str, str]:
    """The first day of the ticket export and the day after its last (end dates are exclusive)."""
    with TICKETS_CSV.open(newline="") as file:
        dates = sorted(row["created_date"] for row in csv.DictReader(file))
    after_last = dt.date.fromisoformat(dates[-1]) + dt.timedelta(days=1)
    return dates[0], after_last.isoformat()


FIRST_DAY, END_DAY = _export_days()
days = dg.DailyPartitionsDefinition(start_date=FIRST_DAY, end_date=END_DAY)


@dg.template_var
def ticket_days_start() -> str:
    """`days`' first day, for the daily components' defs.yaml."""
    return FIRST_DAY


@dg.template_var
def ticket_days_end() -> str:
    """`days`' end (exclusive), for the daily components' defs.yaml."""
    return END_DAY

PROMPT = (
    "Summarize this customer support ticket in one sentence, then name the team that should "
    "handle it (billing, technical or account).\n\nTicket: {body}"
)


def by_day(context: dg.AssetExecutionContext, value: pd.DataFrame | dict[str, pd.DataFrame]
           ) -> dict[str, pd.DataFrame]:
    """A daily input as {day: table}: one day's table, or the dict a range of days loads as."""
    return value if isinstance(value, dict) else {context.partition_key: value}


def per_day_output(context: dg.AssetExecutionContext, tables: dict[str, pd.DataFrame]
                   ) -> pd.DataFrame | dict[str, pd.DataFrame]:
    """What a daily asset returns: the day's table, or the {day: table} dict of a range."""
    return tables if len(tables) > 1 else tables[context.partition_key]


def with_body(tickets: pd.DataFrame) -> pd.DataFrame:
    """The tickets that have a body, stripped of surrounding whitespace."""
    body = tickets["body"].str.strip()
    return tickets.assign(body=body)[body != ""].reset_index(drop=True)


def per_day_prompts(context: dg.AssetExecutionContext, raw_tickets: pd.DataFrame | dict[str, pd.DataFrame],
                    prompts_of: Callable[[pd.DataFrame], pd.DataFrame]) -> pd.DataFrame | dict[str, pd.DataFrame]:
    """Each day's tickets that have a body, made into a prompt table by `prompts_of`; logs
    how many were dropped."""
    tables = {}
    for day, frame in by_day(context, raw_tickets).items():
        kept = with_body(frame)
        context.log.info(f"{day}: {len(kept)} tickets, {len(frame) - len(kept)} empty dropped")
        tables[day] = prompts_of(kept)
    return per_day_output(context, tables)


@dg.asset(partitions_def=days, group_name="support", kinds={"csv"},
          backfill_policy=dg.BackfillPolicy.single_run())
def raw_support_tickets(context: dg.AssetExecutionContext):
    """The day's tickets from the ticket export (a CSV shipped with the repository)."""
    tickets = pd.read_csv(TICKETS_CSV, dtype=str, keep_default_na=False)
    return per_day_output(context, {day: tickets[tickets["created_date"] == day].reset_index(drop=True)
                                    for day in context.partition_keys})


@dg.asset(partitions_def=days, group_name="support", kinds={"pandas"},
          backfill_policy=dg.BackfillPolicy.single_run())
def support_prompts(context: dg.AssetExecutionContext, raw_support_tickets):
    """Tickets with whitespace trimmed and empty bodies dropped, worded as prompts."""
    return per_day_prompts(context, raw_support_tickets, lambda kept: pd.DataFrame({
        "id": kept["ticket_id"],
        "customer": kept["customer"],
        "prompt": [PROMPT.format(body=b) for b in kept["body"]],
    }))


# On Kubernetes (dagster-k8s): one GPU, the model from the `llm-models` volume claim. Local runs ignore it.
GPU_POD = KubernetesStep(
    gpus=1,
    model_volume_claim="llm-models",
    env={"DAGSTER_LLM_MODEL": "/models/Qwen2.5-7B-Instruct", "DAGSTER_LLM_DTYPE": "bfloat16"},
)

ticket_summaries = build_generation_asset(
    "ticket_summaries",
    upstream=support_prompts,
    chat=True,
    sampling=SamplingConfig(temperature=0.0, max_tokens=64),
    kubernetes=GPU_POD,
    group_name="support",
    description="One-sentence summary and routing of each support ticket.",
)

TEAMS = ("billing", "technical", "account")


@dg.asset(partitions_def=days, group_name="support", kinds={"pandas"},
          backfill_policy=dg.BackfillPolicy.single_run())
def ticket_summary_quality(context: dg.AssetExecutionContext, ticket_summaries) -> dg.MaterializeResult:
    """Per day: how many summaries came back, how long they are, and which team each names.

    Reads the generation table through the IO manager: one DataFrame for a day, a
    {day: DataFrame} dict for a range of days.
    """
    for day, table in by_day(context, ticket_summaries).items():
        ok = table[table["error"].isna()]
        text = ok["generated_text"].str.lower()
        routed = {team: int(text.str.contains(team).sum()) for team in TEAMS}
        context.add_asset_metadata({
            "rows": len(table),
            "error_rows": len(table) - len(ok),
            "mean_words": round(float(ok["generated_text"].str.split().str.len().mean() or 0), 1) if len(ok) else 0.0,
            "truncated": int((ok["finish_reason"] == "length").sum()),
            "routed_to": dg.MetadataValue.json(routed),
            "unrouted": int(len(ok) - text.str.contains("|".join(TEAMS)).sum()),
        }, partition_key=day)
    return dg.MaterializeResult()


daily_ticket_summaries_job = dg.define_asset_job(
    "daily_ticket_summaries_job",
    selection=[raw_support_tickets, support_prompts, ticket_summaries, ticket_summary_quality],
    # Under K8sRunLauncher (one pod per run) the run's pod gets ticket_summaries' GPU and model volume.
    tags=run_tags([ticket_summaries]),
)
daily_ticket_summaries_schedule = dg.build_schedule_from_partitioned_job(daily_ticket_summaries_job, hour_of_day=2)
