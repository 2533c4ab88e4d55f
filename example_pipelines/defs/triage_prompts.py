"""Support tickets worded as triage requests: chat messages with three worked examples, so
that even the small embedded model fills the triage schema (ticket_triage/defs.yaml) sensibly."""

import json

import dagster as dg
import pandas as pd

from example_pipelines.defs.daily_tickets import days, per_day_prompts

SYSTEM = (
    "You triage customer support tickets of a software company. Answer with JSON: a one-line summary, "
    "the category (billing, technical, account or sales), the urgency from 1 (can wait) to 5 (blocks "
    "their work), and the products or features the ticket names."
)
# (ticket, triage) pairs shown before each ticket; their fields in the schema's order.
EXAMPLES = (
    ("I was billed twice for June on the Pro plan, please refund the extra charge.",
     {"summary": "Billed twice for June on the Pro plan; wants a refund.", "category": "billing", "urgency": 3,
      "products": ["Pro plan"]}),
    ("The invoice PDF download shows an error page since this morning and our accountant is blocked.",
     {"summary": "Invoice PDF download fails with an error page.", "category": "technical", "urgency": 4,
      "products": ["invoice PDF"]}),
    ("Please add my colleague as a second owner of our workspace.",
     {"summary": "Add a colleague as a second workspace owner.", "category": "account", "urgency": 2,
      "products": ["workspace"]}),
)


def triage_messages(body: str) -> list[dict[str, str]]:
    """The chat prompt of one ticket: instructions, the worked examples, then the ticket."""
    messages = [{"role": "system", "content": SYSTEM}]
    for ticket, triage in EXAMPLES:
        messages += [{"role": "user", "content": f"Ticket: {ticket}"},
                     {"role": "assistant", "content": json.dumps(triage, separators=(",", ":"))}]
    return [*messages, {"role": "user", "content": f"Ticket: {body}"}]


@dg.asset(partitions_def=days, group_name="support", kinds={"pandas"},
          backfill_policy=dg.BackfillPolicy.single_run())
def triage_prompts(context: dg.AssetExecutionContext, raw_support_tickets):
    """The day's tickets with a body, as triage chat prompts (id, prompt)."""
    return per_day_prompts(context, raw_support_tickets, lambda kept: pd.DataFrame(
        {"id": kept["ticket_id"], "prompt": [triage_messages(b) for b in kept["body"]]}))
