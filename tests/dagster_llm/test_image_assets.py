"""Prompt tables with an image column on a tiny random LLaVA: every cell form read before any
work, a bad image as its row's error, images in the data version by their content, resume
after a crash, images on an object store, and the catalog example from the CLI."""

import base64
import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pandas as pd
import pytest
from PIL import Image
from transformers import AutoTokenizer
from upath import UPath

from dagster_llm import (
    BeamSearchConfig, LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset, partition_file,
)
from dagster_llm.core.prompts import (
    ModelMedia, PartitionSettings, PromptTableError, PromptTableRules, check_columns, read_rows,
)
from engine import SamplingParams
from engine.multimodal.media import short_location
from tests.dagster_llm.crash_defs import MAX_TOKENS, ROWS
from tests.dagster_llm.test_crash_resume import (
    assert_complete, exists, finish, kill_launcher_and_wait_for_worker, latest, materialize, shard_rows, wait_for,
)
from tests.vision_models.llava import build_tiny_llava

REPO = Path(__file__).resolve().parents[2]
DAGSTER = Path(sys.executable).parent / "dagster"
PLACEHOLDER = "<image>"
SETTINGS = PartitionSettings(None, SamplingConfig(max_tokens=4), None, None, SamplingParams())
PHOTOS = REPO / "example_pipelines" / "data" / "product_photos"


def png(color: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> bytes:
    encoded = io.BytesIO()
    Image.new("RGB", size, color).save(encoded, "PNG")
    return encoded.getvalue()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


RED, GREEN, BLUE = png((200, 30, 30)), png((30, 200, 30), (24, 48)), png((30, 30, 200), (64, 20))


def truncated_png() -> bytes:
    """The first half of a noisy PNG: its header reads, its pixels do not."""
    encoded = io.BytesIO()
    Image.effect_noise((48, 48), 60).convert("RGB").save(encoded, "PNG")
    return encoded.getvalue()[:len(encoded.getvalue()) // 2]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("vlm") / "llava")


@pytest.fixture(scope="module")
def tokenizer(vlm):
    return AutoTokenizer.from_pretrained(vlm)


@pytest.fixture
def resources(vlm, tmp_path) -> dict:
    return {"llm": LLMResource(model_id=str(vlm), dtype="float32", kv_cache_memory=10 << 20),
            "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables"))}


def rows_of(frame: pd.DataFrame, tokenizer, placeholder: str | None = PLACEHOLDER, **rules):
    media = ModelMedia({"image": placeholder} if placeholder is not None else {})
    return read_rows(frame, SETTINGS, PromptTableRules(image_column="photo", **rules), tokenizer, media)


def table_asset(frame: pd.DataFrame, partitions_def: dg.PartitionsDefinition | None = None) -> dg.AssetsDefinition:
    @dg.asset(name="photos", partitions_def=partitions_def)
    def photos() -> pd.DataFrame:
        return frame

    return photos


def test_every_cell_form_is_read_to_bytes_and_digested(tokenizer, tmp_path):
    (tmp_path / "green.png").write_bytes(GREEN)
    data_uri = "data:image/png;base64," + base64.b64encode(BLUE).decode()
    cells = [RED, str(tmp_path / "green.png"), (tmp_path / "green.png").as_uri(), data_uri, [RED, BLUE],
             {"bytes": None, "path": str(tmp_path / "green.png")}, None]
    frame = pd.DataFrame({"id": [f"r{i}" for i in range(len(cells))], "photo": cells,
                          "prompt": [f"{PLACEHOLDER} Describe"] * 4 + [f"{PLACEHOLDER}{PLACEHOLDER} Compare",
                                                                       f"{PLACEHOLDER} Describe", "No image"]})
    rows = rows_of(frame, tokenizer)
    expected = [[RED], [GREEN], [GREEN], [BLUE], [RED, BLUE], [GREEN], []]
    assert [r.error for r in rows] == [None] * len(cells)
    assert [r.digests.get("image") for r in rows] == [[sha256(b) for b in images] for images in expected]
    assert [r.prompt.get("multi_modal_data", {}).get("image", []) for r in rows] == expected
    assert "multi_modal_data" not in rows[-1].prompt and rows[-1].prompt_text == "No image"


def test_an_unreadable_image_is_its_rows_error_naming_the_row_and_column(tokenizer, tmp_path):
    frame = pd.DataFrame({"id": ["ok", "cut", "gone", "second", "thing"],
                          "photo": [RED, truncated_png(), str(tmp_path / "gone.png"), [RED, b"not a png"], 7],
                          "prompt": [f"{PLACEHOLDER} Describe"] * 5})
    ok, cut, gone, second, thing = rows_of(frame, tokenizer)
    assert ok.error is None and ok.prompt["multi_modal_data"]["image"] == [RED]
    assert cut.error.startswith("photo: row 'cut': the bytes") and "truncated or corrupt" in cut.error
    assert gone.error == (f"photo: row 'gone': {short_location(str(tmp_path / 'gone.png'))}: no such file or object: "
                          "fix the path or drop the row")
    assert second.error.startswith("photo: row 'second': image 2 of 2: the bytes are not an image")
    assert thing.error.startswith("photo: row 'thing': expected encoded image bytes, a path or a URI")
    assert [r.digests.get("image") for r in (cut, gone, second, thing)] == [None] * 4


def test_plain_text_needs_one_placeholder_per_image_and_chat_places_them(tokenizer):
    frame = pd.DataFrame({"id": ["none", "two", "extra"], "photo": [RED, [RED, BLUE], None],
                          "prompt": ["Describe", f"{PLACEHOLDER} Describe", f"{PLACEHOLDER} Describe"]})
    problems = [r.error for r in rows_of(frame, tokenizer)]
    assert problems[0] == ("prompt: holds 0 '<image>' placeholder(s) for the row's 1 image(s) in 'photo': write "
                           "'<image>' once where each image goes, or set chat=True for the model's chat template to "
                           "place them")
    assert "holds 1 '<image>' placeholder(s) for the row's 2 image(s)" in problems[1]
    assert "holds 1 '<image>' placeholder(s) for the row's 0 image(s)" in problems[2]

    chats = pd.DataFrame({"id": ["text", "messages"], "photo": [[RED, BLUE], GREEN], "prompt": [
        "Compare them", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "First"},
                         {"role": "assistant", "content": "Ok"}, {"role": "user", "content": "Describe"}]]})
    text, messages = rows_of(chats, tokenizer, chat=True)
    assert text.error is None and text.prompt["prompt"] == "USER: <image>\n<image>\nCompare them ASSISTANT:"
    assert text.prompt["multi_modal_data"]["image"] == [RED, BLUE]
    assert messages.prompt["prompt"].endswith("USER: First ASSISTANT: Ok USER: <image>\nDescribe ASSISTANT:")
    assert messages.prompt["multi_modal_data"]["image"] == [GREEN]
    assert text.prompt_text == "Compare them"  # the table keeps the text; the images are in image_digests


def test_a_text_only_model_refuses_rows_with_images_and_runs_the_others(tokenizer):
    frame = pd.DataFrame({"id": ["photo", "text"], "photo": [RED, None], "prompt": ["Describe", "Hello"]})
    with_image, text = rows_of(frame, tokenizer, placeholder=None, chat=True)
    assert with_image.error == ("photo: the model reads text only, so it cannot take the row's 1 image(s): point the "
                                "resource's model_id at a vision-language model, or leave image_column unset")
    assert text.error is None and text.digests["image"] == []


def test_a_missing_image_column_fails_the_table():
    frame = pd.DataFrame({"id": ["a"], "prompt": ["Describe"]})
    with pytest.raises(PromptTableError, match=r"has no column 'photo' .* pass image_column= to the generation"):
        check_columns(frame, PromptTableRules(image_column="photo"), "")


def test_rows_with_broken_images_get_errors_while_the_others_finish(resources, tmp_path):
    for name, data in (("red", RED), ("green", GREEN), ("blue", BLUE), ("cut", truncated_png())):
        (tmp_path / f"{name}.png").write_bytes(data)
    frame = pd.DataFrame({  # a list<string> column in Parquet
        "id": ["path", "uri", "two", "cut", "gone"],
        "photo": [[str(tmp_path / "red.png")], [(tmp_path / "green.png").as_uri()],
                  [str(tmp_path / "red.png"), str(tmp_path / "blue.png")], [str(tmp_path / "cut.png")],
                  [str(tmp_path / "gone.png")]],
        "prompt": ["Describe", "Describe", "Compare", "Describe", "Describe"],
    })
    photos = table_asset(frame)
    gen = build_generation_asset("gen", upstream=photos, image_column="photo", chat=True,
                                 sampling=SamplingConfig(max_tokens=4, ignore_eos=True))
    result = dg.materialize([photos, gen], resources=resources)
    assert result.success
    table = pd.read_parquet(partition_file(tmp_path / "tables", ["gen"], None))
    assert list(table["error"].isna()) == [True, True, True, False, False]
    assert (table["completion_tokens"][:3] == 4).all() and table["generated_text"][3:].isna().all()
    assert "photo: row 'gone':" in table["error"][4] and "truncated or corrupt" in table["error"][3]
    assert [list(d) if d is not None else None for d in table["image_digests"]] == [
        [sha256(RED)], [sha256(GREEN)], [sha256(RED), sha256(BLUE)], None, None]
    assert table["prompt_tokens"][2] > table["prompt_tokens"][0] > 16  # each image adds its tokens
    meta = result.asset_materializations_for_node("gen")[0].metadata
    assert meta["error_rows"].value == 2 and meta["generated_rows"].value == 3
    assert "image_digests" in [c.name for c in meta["dagster/column_schema"].value.columns]
    deps = meta["dagster/column_lineage"].value.deps_by_column
    assert {d.column_name for d in deps["generated_text"]} == {"prompt", "photo"}
    assert [d.column_name for d in deps["image_digests"]] == ["photo"]
    checks = {e.check_name: e.passed for e in result.get_asset_check_evaluations()}
    assert checks["no_error_rows"] is False and checks["unique_ids"] is True


def test_a_beam_search_completion_leaves_the_image_tokens_in_the_prompt(resources, tmp_path):
    frame = pd.DataFrame({"id": ["a", "b"], "photo": [RED, BLUE], "prompt": "Describe"})
    photos = table_asset(frame)
    gen = build_generation_asset("gen", upstream=photos, image_column="photo", chat=True,
                                 beam_search=BeamSearchConfig(beam_width=2),
                                 sampling=SamplingConfig(max_tokens=3, ignore_eos=True))
    assert dg.materialize([photos, gen], resources=resources).success
    table = pd.read_parquet(partition_file(tmp_path / "tables", ["gen"], None))
    assert table["error"].isna().all() and (table["completion_tokens"] == 3).all()
    assert (table["prompt_tokens"] > 16).all() and (table["beam_width"] == 2).all()


def test_new_bytes_under_the_same_path_change_only_their_shards_version(resources, tmp_path):
    """An image's digest, not its path, is in the data version: with row shards, rewriting
    one photo makes only its shard stale, and the other shard reuses its table."""
    paths = [tmp_path / f"p{i}.png" for i in range(6)]
    for i, path in enumerate(paths):
        path.write_bytes(png((40 * i, 90, 160)))
    frame = pd.DataFrame({"id": [f"p{i}" for i in range(6)], "photo": [str(p) for p in paths],
                          "prompt": "Describe"})
    photos = table_asset(frame, dg.StaticPartitionsDefinition(["catalog"]))
    gen = build_generation_asset("gen", upstream=photos, image_column="photo", chat=True, row_shards=2,
                                 sampling=SamplingConfig(max_tokens=2, ignore_eos=True))
    keys = [dg.MultiPartitionKey({"partition": "catalog", "shard": s}) for s in ("0", "1")]

    def materialize_shards(instance) -> dict[str, dict]:
        dg.materialize([photos], partition_key="catalog", resources=resources, instance=instance)
        shards = {}
        for key in keys:
            result = dg.materialize([photos, gen], selection=[gen], partition_key=key, resources=resources,
                                    instance=instance)
            meta = result.asset_materializations_for_node("gen")[0].metadata
            table = pd.read_parquet(partition_file(tmp_path / "tables", ["gen"], key))
            shards[str(key)] = {"version": meta["data_version"].value, "generated": meta["generated_rows"].value,
                                "digests": dict(zip(table["id"], (list(d) for d in table["image_digests"])))}
        return shards

    with dg.instance_for_test() as instance:
        before = materialize_shards(instance)
        changed = "p3"
        paths[3].write_bytes(png((250, 250, 250)))
        after = materialize_shards(instance)
    holder = next(key for key, shard in before.items() if changed in shard["digests"])
    other = next(key for key in before if key != holder)
    assert after[holder]["version"] != before[holder]["version"] and after[holder]["generated"] > 0
    assert after[other]["version"] == before[other]["version"] and after[other]["generated"] == 0
    assert after[holder]["digests"][changed] == [sha256(paths[3].read_bytes())]
    assert {i: d for i, d in after[holder]["digests"].items() if i != changed} == \
        {i: d for i, d in before[holder]["digests"].items() if i != changed}


def test_an_image_on_an_object_store_is_read_through_its_file_system(resources, s3_bucket, monkeypatch, tmp_path):
    import s3fs

    for name, value in s3_bucket.env.items():  # the store's own conventions, as on a deployment
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()
    s3_bucket.path("photos", "red.png").write_bytes(RED)
    frame = pd.DataFrame({"id": ["there", "missing"], "prompt": "Describe",
                          "photo": [f"{s3_bucket.url}/photos/red.png", f"{s3_bucket.url}/photos/missing.png"]})
    photos = table_asset(frame)
    gen = build_generation_asset("gen", upstream=photos, image_column="photo", chat=True,
                                 sampling=SamplingConfig(max_tokens=2, ignore_eos=True))
    assert dg.materialize([photos, gen], resources=resources).success
    table = pd.read_parquet(partition_file(tmp_path / "tables", ["gen"], None))
    assert pd.isna(table["error"][0]) and list(table["image_digests"][0]) == [sha256(RED)]
    assert table["error"][1] == (f"photo: row 'missing': {s3_bucket.url}/photos/missing.png: no such file or object: "
                                 "fix the path or drop the row")


@pytest.mark.long("two `dagster asset materialize` runs of a partition of photos on a tiny LLaVA, the first SIGKILLed")
def test_killed_in_the_middle_of_an_image_partition_then_resumed(vlm, tmp_path):
    """As test_crash_resume's kill in the middle of a partition, with a photo per row on the tiny
    LLaVA."""
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "out"),
           "CRASH_TEST_MODEL": str(vlm), "CRASH_TEST_IMAGES": "1"}
    (tmp_path / "home").mkdir()
    folder = UPath(tmp_path / "out" / "tables" / "crash_gen")
    cli = materialize(env, ["--partition", "p1"])
    wait_for(lambda: shard_rows(folder, "p1") >= 4, 120, "shards of p1")
    kill_launcher_and_wait_for_worker(cli, folder, "p1")
    saved = shard_rows(folder, "p1")
    assert 0 < saved < ROWS and not exists(folder, "p1.parquet") and not latest(env, "p1")

    finish(env, ["--partition", "p1"])
    table = assert_complete(folder, "p1")
    assert table["image_digests"].map(len).eq(1).all() and table["image_digests"].map(tuple).is_unique
    meta = latest(env, "p1")
    assert meta["resumed_rows"] == saved and meta["generated_rows"] == ROWS - saved
    assert meta["generated_tokens"] == MAX_TOKENS * (ROWS - saved)


def run_dagster(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "home").mkdir(exist_ok=True)
    environment = {**{k: v for k, v in os.environ.items() if k != "DAGSTER_LLM_VISION_MODEL"},
                   "DAGSTER_HOME": str(tmp_path / "home"), "DAGSTER_LLM_OUTPUT_DIR": str(tmp_path / "out"), **env}
    return subprocess.run([str(DAGSTER), *args], cwd=REPO, env=environment, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_the_catalog_example_from_the_cli(vlm, tmp_path):
    result = run_dagster(["asset", "materialize", "-f", "definitions.py", "--select", "*product_attributes"], tmp_path,
                         DAGSTER_LLM_VISION_MODEL=str(vlm), DAGSTER_LLM_DTYPE="float32")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = pd.read_parquet(tmp_path / "out" / "tables" / "product_attributes" / "data.parquet")
    photos = sorted(PHOTOS.glob("*.png"))
    assert list(table["id"]) == [p.stem.upper() for p in photos]
    assert [list(d) for d in table["image_digests"]] == [[sha256(p.read_bytes())] for p in photos]
    assert list(table.columns[-3:]) == ["category", "color", "has_text"]
    assert table["error"].isna().all() and table["category"].notna().all()  # constrained: every row parses


@pytest.mark.slow
def test_the_catalog_example_without_a_model_fails_naming_the_setting(tmp_path):
    result = run_dagster(["asset", "materialize", "-f", "definitions.py", "--select", "*product_attributes"], tmp_path)
    assert result.returncode != 0
    assert "DAGSTER_LLM_VISION_MODEL" in result.stdout + result.stderr
