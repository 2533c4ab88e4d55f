"""Catalog pipeline: product photos -> a typed table of what each shows, by a vision-language model.

The photos (PNG files under data/product_photos, drawn by example_pipelines/make_product_photos.py)
are listed in data/product_photos.csv; the prompt table gives each row's photo as a path in its
`photo` column (encoded bytes or s3:// / gs:// URIs work the same way), and the generation
asset sends it to the model with a JSON schema, so that each photo becomes a category, a color
and whether it shows text, in typed columns.

The model is the `vlm` resource's: a local folder of a vision-language checkpoint named by
DAGSTER_LLM_VISION_MODEL (e.g. HuggingFaceTB/SmolVLM-256M-Instruct or Qwen/Qwen2-VL-2B-Instruct,
downloaded beforehand). There is no default: without it, materializing product_attributes fails
naming the variable (the other pipelines, and any job or plan over all assets, do not need it),
and `make run` leaves this pipeline out.
"""

import os
from pathlib import Path

import dagster as dg
import pandas as pd

from dagster_llm import LLMResource, SamplingConfig, build_generation_asset

DATA = Path(__file__).resolve().parents[1] / "data"
# Unset, the model is a text that names the setting: loading it fails saying what to set. (A
# dg.EnvVar would fail every run and execution plan over all assets, which resolve every resource.)
VISION_MODEL = (os.environ.get("DAGSTER_LLM_VISION_MODEL")
                or "unset: set DAGSTER_LLM_VISION_MODEL to a vision-language model folder")
PROMPT = ("What product does this photo show? Answer with JSON: its category, its main color, and whether the "
          "photo shows any printed text.")
ATTRIBUTES = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": ["apparel", "kitchen", "books", "toys", "gifts", "other"]},
        "color": {"type": "string", "enum": ["red", "orange", "yellow", "green", "blue", "purple", "black",
                                             "white", "other"]},
        "has_text": {"type": "boolean"},
    },
    "required": ["category", "color", "has_text"],
    "additionalProperties": False,
}


@dg.asset(group_name="catalog", kinds={"csv"})
def product_photos() -> pd.DataFrame:
    """The catalog's products: id, name, the photo's path and the question asked about it."""
    products = pd.read_csv(DATA / "product_photos.csv", dtype=str)
    return pd.DataFrame({
        "id": products["product_id"],
        "name": products["name"],
        "photo": [str(DATA / photo) for photo in products["photo"]],
        "prompt": PROMPT,
    })


product_attributes = build_generation_asset(
    "product_attributes",
    upstream=product_photos,
    image_column="photo",
    chat=True,
    output_schema=ATTRIBUTES,
    sampling=SamplingConfig(temperature=0.0, max_tokens=96),
    resource_key="vlm",
    group_name="catalog",
    description="Category, color and printed text of each product photo, read by a vision-language model.",
)

defs = dg.Definitions(
    assets=[product_photos, product_attributes],
    resources={
        "vlm": LLMResource(model_id=VISION_MODEL,
                           dtype=os.environ.get("DAGSTER_LLM_DTYPE", "auto")),
    },
)
