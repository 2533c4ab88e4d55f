"""Embeddings of the support tickets, and the tickets that look alike across the export.

Each day's ticket bodies are embedded (the `embedder` resource: an embedding model, or the
default model read as one with runner="pooling"); `similar_tickets` then reads every day's
vectors and gives each ticket its nearest other ticket by cosine similarity, flagging the
pairs close enough to be the same request filed twice.
"""

import dagster as dg
import numpy as np
import pandas as pd

from dagster_llm import build_embedding_asset
from example_pipelines.defs.daily_tickets import by_day, days, per_day_output, with_body

# Cosine similarity from which two tickets count as near-duplicates.
NEAR_DUPLICATE = 0.95


@dg.asset(partitions_def=days, group_name="support", kinds={"pandas"},
          backfill_policy=dg.BackfillPolicy.single_run())
def ticket_texts(context: dg.AssetExecutionContext, raw_support_tickets):
    """Each day's ticket bodies, whitespace trimmed, empty ones dropped."""
    tables = {day: pd.DataFrame({"id": kept["ticket_id"], "text": kept["body"]})
              for day, kept in ((day, with_body(frame)) for day, frame in by_day(context, raw_support_tickets).items())}
    return per_day_output(context, tables)


ticket_embeddings = build_embedding_asset(
    "ticket_embeddings",
    upstream=ticket_texts,
    group_name="support",
    description="One vector per support ticket, for search and de-duplication.",
)


@dg.asset(group_name="support", kinds={"pandas"})
def similar_tickets(context: dg.AssetExecutionContext, ticket_embeddings) -> pd.DataFrame:
    """Every ticket's most similar other ticket over all days, most similar first;
    `near_duplicate` where the cosine similarity reaches NEAR_DUPLICATE."""
    tables = ticket_embeddings.values() if isinstance(ticket_embeddings, dict) else [ticket_embeddings]
    table = pd.concat(list(tables), ignore_index=True)
    table = table[table["error"].isna()].reset_index(drop=True)
    vectors = np.stack(table["embedding"].to_numpy()).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    similarity = vectors @ vectors.T
    np.fill_diagonal(similarity, -np.inf)
    nearest = similarity.argmax(axis=1)
    pairs = pd.DataFrame({
        "id": table["id"],
        "most_similar_id": table["id"].to_numpy()[nearest],
        "similarity": similarity[np.arange(len(table)), nearest].round(4),
    }).sort_values("similarity", ascending=False, ignore_index=True)
    pairs["near_duplicate"] = pairs["similarity"] >= NEAR_DUPLICATE
    context.add_output_metadata({"tickets": len(pairs), "near_duplicates": int(pairs["near_duplicate"].sum()),
                                 "preview": dg.MetadataValue.md(pairs.head(10).to_markdown(index=False))})
    return pairs
