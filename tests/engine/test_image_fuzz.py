"""No image, however hostile, escapes a row (issue 62): property-based tests of every place a
row's image enters the engine, on tiny random checkpoints of each family with their real image
processors (tests/vision_models/).

* `load_image` under drawn limits: an `ImageInputError`, or an image within the limits that a
  processor reads; never another exception.
* `LLM.validate` on each family: a hostile image is its row's problem, naming the image; the
  rows beside it pass; an accepted image makes its encoder inputs; `generate` lists the bad row
  and runs nothing; and accepted rows generate.
* `run_batch_file` (python -m engine.run_batch): a line with a hostile image_url gets an error
  record naming the line, every other line its response.

The two reported cases (a 500x2 strip on Qwen2-VL, a 57-byte PNG claiming 20000x10000 on each
family) are tests of their own. HYPOTHESIS_PROFILE=thorough runs 10,000 examples of each fuzz
test (300 where each example generates).
"""

import base64
import contextlib
import io
import json
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from engine import LLM, SamplingParams
from engine.entrypoints.inputs import RequestChecker
from engine.entrypoints.openai import batch as openai_batch
from engine.multimodal.image import SUPPORTED_MODES, ImageInputError, ImageLimits, image_hash, load_image
from tests.fuzzing import examples
from tests.image_fuzz import (
    BOMB, HostileImage, decodable_images, encode, good_picture, hostile_images, png_header, strip_png,
)
from tests.vision_models.idefics3 import build_tiny_idefics3
from tests.vision_models.llava import build_tiny_llava
from tests.vision_models.qwen2_vl import build_tiny_qwen2_vl

BUILDERS = {
    "llava": lambda folder: build_tiny_llava(folder),
    "llava_next": lambda folder: build_tiny_llava(folder, next_=True),
    "qwen2_vl": lambda folder: build_tiny_qwen2_vl(folder),
    "idefics3": lambda folder: build_tiny_idefics3(folder),
    "smolvlm": lambda folder: build_tiny_idefics3(folder, smolvlm=True),
}
GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # a random model may pick EOS first
GOOD = good_picture(0)
FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("image_fuzz_models")
    return {name: build(root / name) for name, build in BUILDERS.items()}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def llm(request, folders) -> LLM:
    with LLM(str(folders[request.param]), dtype="float32", quantization=None, max_model_len=512,
             limit_mm_per_prompt={"image": 2}) as built:
        yield built


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """Where the path forms of drawn images are written."""
    return tmp_path_factory.mktemp("image_fuzz_files")


def rows_around(llm: LLM, value: object) -> list[dict]:
    """A good row, the hostile image's row, a good row."""
    p = llm.image_placeholder
    good = {"prompt": p + " describe", "multi_modal_data": {"image": GOOD}}
    return [good, {"prompt": p + " and this?", "multi_modal_data": {"image": value}}, good]


@contextlib.contextmanager
def bomb_warnings(as_errors: bool):
    """Pillow's DecompressionBombWarning as an error (as `-W error` makes it), or as it is."""
    with warnings.catch_warnings():
        if as_errors:
            warnings.simplefilter("error", Image.DecompressionBombWarning)
        yield


@settings(max_examples=examples(400), **FUZZ)
@given(image=hostile_images(), max_pixels=st.integers(1, 50_000), ratio=st.one_of(st.none(), st.floats(1, 300)),
       strict=st.booleans())
def test_load_image_refuses_or_returns_an_image_within_its_limits(image, max_pixels, ratio, strict, files):
    limits, value = ImageLimits(max_pixels, ratio), image.value(files)
    with bomb_warnings(strict):
        try:
            loaded = load_image(value, limits)
        except ImageInputError as exc:
            assert str(exc) and "\n" not in str(exc)
            return
    width, height = loaded.size
    assert loaded.mode in SUPPORTED_MODES and 0 < width * height <= max_pixels
    assert ratio is None or max(width, height) / min(width, height) <= ratio * 1.01  # a draft rounds its sides
    loaded.convert("RGB")
    image_hash(loaded)


@settings(max_examples=examples(40), **FUZZ)
@given(image=hostile_images(), strict=st.booleans())
def test_a_hostile_image_is_its_rows_problem_and_an_accepted_one_encodes(llm, image: HostileImage, strict, files):
    rows = rows_around(llm, image.value(files))
    with bomb_warnings(strict):
        problems = llm.validate(rows, GREEDY)
        assert problems[0] is None and problems[2] is None
        if problems[1] is not None:  # the image named, or the prompt where a list held no image
            assert problems[1].startswith(("multi_modal_data['image'][0]: ", "prompt: ")), problems[1]
            with pytest.raises(ValueError) as raised:
                llm.generate(rows, GREEDY, use_tqdm=False)
            assert f"row 1, {problems[1]}" in str(raised.value) and "row 0" not in str(raised.value)
            return
    request = RequestChecker(llm.llm_engine).check(rows[1:2], GREEDY, None, None)[0].request
    for feature in request.multi_modal.features:
        assert llm.llm_engine.mm_processor.encoder_inputs(feature)


@settings(max_examples=examples(5, thorough=300), **FUZZ)
@given(image=st.one_of(decodable_images(), hostile_images()))
def test_accepted_hostile_images_generate_beside_good_rows(llm, image: HostileImage, files):
    rows = rows_around(llm, image.value(files))
    problems = llm.validate(rows, GREEDY)
    runnable = [row for row, problem in zip(rows, problems) if problem is None]
    outputs = llm.generate(runnable, GREEDY, use_tqdm=False)
    assert len(outputs) == len(runnable) >= 2
    assert all(len(output.outputs[0].token_ids) == GREEDY.max_tokens for output in outputs)


def test_a_strip_over_qwen2_vls_aspect_ratio_is_its_rows_error(folders):
    with LLM(str(folders["qwen2_vl"]), dtype="float32", quantization=None) as llm:
        rows = rows_around(llm, strip_png())
        problem = ("multi_modal_data['image'][0]: the image is 500x2, an aspect ratio of 250, over the 200 that the "
                   "qwen2_vl image processor takes: crop or pad it to an aspect ratio of at most 200")
        assert llm.validate(rows, GREEDY) == [None, problem, None]
        with pytest.raises(ValueError, match=r"1 invalid prompt row\(s\); nothing was run:\n  row 1, ") as raised:
            llm.generate(rows, GREEDY, use_tqdm=False)
        assert problem in str(raised.value)
        chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": Image.new("RGB", (3, 3000))},
                                             {"type": "text", "text": "what?"}]}]
        with pytest.raises(ValueError, match="aspect ratio of 1000, over the 200"):
            llm.chat(chat, GREEDY, use_tqdm=False)
        assert len(llm.generate([rows[0], rows[2]], GREEDY, use_tqdm=False)) == 2


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_a_png_header_claiming_200_megapixels_is_its_rows_error_on_every_family(folders, family):
    assert len(BOMB) < 60
    with LLM(str(folders[family]), dtype="float32", quantization=None) as llm:
        problems = llm.validate(rows_around(llm, BOMB), GREEDY)
        assert problems[0] is None and problems[2] is None
        assert problems[1].startswith("multi_modal_data['image'][0]: the bytes claim more pixels than Pillow opens")
        assert "resize the image below 40,000,000 pixels" in problems[1]
        under_pillows_limit = png_header(8000, 6000)  # 48 Mpx: Pillow only warns; the budget refuses
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing decodes it, so nothing warns
            problem = llm.validate([rows_around(llm, under_pillows_limit)[1]], GREEDY)[0]
        assert "the image is 8000x6000 (48,000,000 pixels), over the decode budget of 40,000,000" in problem


# --- python -m engine.run_batch ---------------------------------------------------------------


def batch_line(custom_id: str, url: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is it?"}]
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 2}}


def run_lines(llm: LLM, lines: list[dict], folder: Path, monkeypatch) -> dict[str, dict]:
    """The batch runner's output records by custom_id, run on `llm` (not closed after)."""
    source, out = folder / "in.jsonl", folder / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out.unlink(missing_ok=True)
    monkeypatch.setattr(openai_batch, "_load", lambda model, settings: contextlib.nullcontext(llm))
    openai_batch.run_batch_file(str(source), str(out), openai_batch.BatchRun("tiny"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {record["custom_id"]: record for record in records}


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def qwen(folders) -> LLM:
    with LLM(str(folders["qwen2_vl"]), dtype="float32", quantization=None) as llm:
        yield llm


def test_run_batch_answers_every_line_but_the_strip_and_the_bomb(qwen, tmp_path, monkeypatch):
    lines = [batch_line("good-1", data_uri(GOOD)), batch_line("strip", data_uri(strip_png())),
             batch_line("bomb", data_uri(BOMB)), batch_line("good-2", data_uri(good_picture(1)))]
    records = run_lines(qwen, lines, tmp_path, monkeypatch)
    assert records["good-1"]["error"] is None and records["good-2"]["error"] is None
    strip, bomb = records["strip"]["error"], records["bomb"]["error"]
    assert strip["line"] == 2 and strip["message"].startswith("line 2: multi_modal_data['image'][0]: the image is "
                                                              "500x2, an aspect ratio of 250")
    assert "crop or pad it to an aspect ratio of at most 200" in strip["message"]
    assert bomb["line"] == 3 and "resize the image below 40,000,000 pixels" in bomb["message"]


@settings(max_examples=examples(10, thorough=300), **FUZZ)
@given(image=hostile_images())
def test_run_batch_gives_a_hostile_images_line_its_error_and_answers_the_others(qwen, image, tmp_path_factory,
                                                                              monkeypatch_module):
    folder = tmp_path_factory.mktemp("batch")
    value = image.value(folder)
    url = value if isinstance(value, str) else data_uri(value) if isinstance(value, bytes) else None
    if url is None:  # a PIL image or an object has no URL
        return
    lines = [batch_line("good-1", data_uri(GOOD)), batch_line("hostile", url), batch_line("good-2", data_uri(GOOD))]
    records = run_lines(qwen, lines, folder, monkeypatch_module)
    assert set(records) == {"good-1", "hostile", "good-2"}
    assert records["good-1"]["error"] is None and records["good-2"]["error"] is None
    error = records["hostile"]["error"]
    assert error is None or error["message"].startswith("line 2: "), error


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_palette_images_that_differ_only_in_their_palette_or_transparency_hash_apart():
    """Their pixels are the same indices but the processor sees other colours: they must not
    share an encoder output or prefix-cache blocks."""
    red, blue = Image.new("P", (8, 8), 1), Image.new("P", (8, 8), 1)
    red.putpalette([0, 0, 0, 255, 0, 0])
    blue.putpalette([0, 0, 0, 0, 0, 255])
    see_through = red.copy()
    see_through.info["transparency"] = 1
    assert len({image_hash(red), image_hash(blue), image_hash(see_through)}) == 3
    assert image_hash(red) == image_hash(load_image(encode(red, "PNG")))


def test_a_jpeg_over_the_budget_decodes_at_a_reduced_scale_and_other_formats_are_refused():
    photo = Image.new("RGB", (400, 300), (30, 120, 200))
    limits = ImageLimits(max_pixels=40_000)  # 400x300 is 120,000: half a side fits
    assert load_image(encode(photo, "JPEG"), limits).size == (200, 150)
    assert load_image(encode(photo, "JPEG"), ImageLimits(max_pixels=2_000)).size == (50, 38)  # an eighth
    with pytest.raises(ImageInputError, match=r"the image is 400x300 \(120,000 pixels\), over the decode budget of "
                                              r"40,000 pixels: resize it below 40,000 pixels \(e.g. to 230x173\)"):
        load_image(encode(photo, "PNG"), limits)
    with pytest.raises(ImageInputError, match="over the decode budget of 1,000 pixels"):  # an eighth is 1,900
        load_image(encode(photo, "JPEG"), ImageLimits(max_pixels=1_000))


def test_a_lazily_opened_image_that_fails_to_decode_stays_refused(qwen):
    """Pillow takes a lazily opened image whose load failed as loaded (a second load() returns
    the pixels decoded so far): the engine refuses it every time, not only the first."""
    broken = bytearray(encode(Image.new("1", (1, 1)), "PNG"))
    broken[broken.index(b"IDAT") + 4] = 0  # the compressed pixels' first byte overwritten (found by the fuzz test)
    lazy = Image.open(io.BytesIO(bytes(broken)))
    first = pytest.raises(ImageInputError, load_image, lazy)
    second = pytest.raises(ImageInputError, load_image, lazy)
    assert str(first.value) == str(second.value) and "broken data stream" in str(first.value)
    rows = rows_around(qwen, Image.open(io.BytesIO(bytes(broken))))
    assert qwen.validate(rows, GREEDY)[1] is not None
    with pytest.raises(ValueError, match="row 1, multi_modal_data"):  # not run on the partly decoded pixels
        qwen.generate(rows, GREEDY, use_tqdm=False)
