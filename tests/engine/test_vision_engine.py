"""Vision-language models through the engine, on every family: the same greedy tokens however
the engine schedules a prompt's images (chunks inside image tokens, preemption and recompute,
prefix-cache hits, mixed batches), each image encoded once, every way of giving an image, and
the bad rows' errors. Each family's agreement with transformers is in its own test file
(test_vision_llava.py, test_vision_qwen2_vl.py, test_vision_idefics3.py)."""

import base64
import io
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from engine.sampling_params import StructuredOutputsParams
from engine.hardware import detect_cpu
from engine.kernels import triton as triton_kernels
from engine.multimodal.image import image_hash
from tests.tiny_models import build_tokenizer
from tests.vision_models.idefics3 import build_tiny_idefics3
from tests.vision_models.llava import build_tiny_llava
from tests.vision_models.qwen2_vl import build_tiny_qwen2_vl

BUILDERS: dict[str, Callable[[Path], Path]] = {
    "llava": lambda folder: build_tiny_llava(folder),
    "llava_next": lambda folder: build_tiny_llava(folder, next_=True),
    "qwen2_vl": lambda folder: build_tiny_qwen2_vl(folder, version="2"),
    "qwen2_5_vl": lambda folder: build_tiny_qwen2_vl(folder, version="2.5"),
    "idefics3": lambda folder: build_tiny_idefics3(folder),
    "smolvlm": lambda folder: build_tiny_idefics3(folder, smolvlm=True),
}
GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def vision_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision_models")
    return {name: build(root / name) for name, build in BUILDERS.items()}


def picture(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    """A real image: a colour gradient under random shapes, different for each seed."""
    rng = np.random.default_rng(seed)
    width, height = size
    gradient = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * rng.uniform(0.2, 1.0, 3)
    pixels = np.broadcast_to(gradient, (height, width, 3)).copy()
    for _ in range(4):
        x, y = rng.integers(0, width - 4), rng.integers(0, height - 4)
        pixels[y : y + rng.integers(3, height // 2), x : x + rng.integers(3, width // 2)] = rng.integers(0, 255, 3)
    return Image.fromarray(pixels.astype(np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_prompt(llm: LLM, text: str, *images: Image.Image) -> dict:
    return {"prompt": llm.image_placeholder * len(images) + text, "multi_modal_data": {"image": list(images)}}


def mixed_prompts(llm: LLM) -> list:
    """Two prompts with the same image and text (a prefix hit), the same text with another
    image (no hit past the text), two images in one prompt, a text-only prompt."""
    red, blue, green = picture(1), picture(2, (64, 32)), picture(3, (30, 50))
    return [image_prompt(llm, " what is this?", red), image_prompt(llm, " describe it", blue), "plain text only",
            image_prompt(llm, " what is this?", red), image_prompt(llm, " what is this?", green),
            image_prompt(llm, " compare them", blue, red)]


def greedy(llm: LLM, prompts: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def kv_token_bytes(folder: Path) -> int:
    text = json.loads((folder / "config.json").read_text())["text_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return 2 * text["num_hidden_layers"] * text.get("num_key_value_heads", text["num_attention_heads"]) * head_dim * 4


@pytest.mark.parametrize("family", list(BUILDERS))
def test_chunks_inside_images_preemption_and_prefix_hits_change_no_token(vision_models, family):
    folder = vision_models[family]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(folder), dtype="float32", quantization=None, enable_prefix_caching=False) as llm:
        prompts = mixed_prompts(llm)
        reference = llm.generate(prompts, params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in reference]
    longest = max(len(o.prompt_token_ids) for o in reference) + params.max_tokens
    chunked = {"max_num_batched_tokens": 8}  # chunks end inside image tokens
    preempting = {"kv_cache_memory": (-(-longest // 16) + 1) * 16 * kv_token_bytes(folder)}  # the longest fits
    for settings in (chunked, preempting):
        with LLM(str(folder), dtype="float32", quantization=None, **settings) as llm:
            outputs = llm.generate(prompts, params, use_tqdm=False)
            assert [list(o.outputs[0].token_ids) for o in outputs] == expected
            engine = llm.llm_engine
            assert engine.stats.num_images_encoded == 3  # red, blue and green, each once
            if settings is preempting:
                assert engine.scheduler.num_preemptions > 0
            else:  # the same image and text: its blocks are hits; another image: the text's alone
                assert outputs[3].num_cached_tokens >= 16
                assert outputs[4].num_cached_tokens < outputs[3].num_cached_tokens


def test_every_form_of_an_image_gives_the_same_tokens_and_one_encoder_run(vision_models, tmp_path):
    image = picture(5)
    path = tmp_path / "photo.png"
    path.write_bytes(png_bytes(image))
    data_uri = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    with LLM(str(vision_models["llava"]), dtype="float32", quantization=None) as llm:
        forms = [image, png_bytes(image), str(path), path, f"file://{path}", data_uri, image.convert("RGBA")]
        tokens = greedy(llm, [image_prompt(llm, " what is it?", form) for form in forms[:-1]])
        assert all(t == tokens[0] for t in tokens)
        assert llm.get_stats().num_images_encoded == 1
        chat = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri}},
                                                      {"type": "text", "text": "what is it?"}]}],
                        GREEDY, use_tqdm=False)
        rendered = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}],
            tokenize=False, add_generation_prompt=True)
        direct = llm.generate([{"prompt": rendered, "multi_modal_data": {"image": image}}], GREEDY, use_tqdm=False)
        assert chat[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    assert image_hash(image) != image_hash(image.convert("RGBA"))


def test_bad_image_rows_fail_alone_before_any_work(vision_models, tmp_path):
    good = picture(7)
    sixteen_bit = Image.fromarray(np.zeros((20, 20), dtype=np.uint16))
    with LLM(str(vision_models["llava"]), dtype="float32", quantization=None, max_model_len=64,
             limit_mm_per_prompt={"image": 2}) as llm:
        p = llm.image_placeholder
        rows = [
            {"prompt": p + " ok", "multi_modal_data": {"image": good}},
            {"prompt": p + " cut", "multi_modal_data": {"image": png_bytes(good)[:60]}},
            {"prompt": p + " noise", "multi_modal_data": {"image": b"not an image at all"}},
            {"prompt": p + " mode", "multi_modal_data": {"image": sixteen_bit}},
            {"prompt": " no placeholder", "multi_modal_data": {"image": good}},
            {"prompt": p + p + " one image for two"},
            {"prompt": p * 3 + " three", "multi_modal_data": {"image": [good] * 3}},
            {"prompt": p * 2 + " long " * 20, "multi_modal_data": {"image": [good, good]}},
            {"prompt": p + " web", "multi_modal_data": {"image": "https://example.com/cat.png"}},
            {"prompt": p + " missing", "multi_modal_data": {"image": f"file://{tmp_path}/absent.png"}},
            {"prompt": p + " video", "multi_modal_data": {"video": good}},
        ]
        problems = llm.validate(rows, GREEDY)
        assert problems[0] is None
        expected = ["truncated or corrupt", "not an image", "mode 'I;16' is not supported", "1 image(s) but the "
                    "prompt has 0", "more image placeholders", "limit_mm_per_prompt allows 2", "max_model_len is 64",
                    "does not fetch https://", "cannot be read", "the model reads no video: drop the videos, or load Qwen2-VL"]
        for problem, words in zip(problems[1:], expected):
            assert problem is not None and words in problem, (words, problem)
        assert all(problem.startswith(("multi_modal_data", "prompt")) for problem in problems[1:])
        with pytest.raises(ValueError, match=r"10 invalid prompt row\(s\); nothing was run"):
            llm.generate(rows, GREEDY, use_tqdm=False)
        assert llm.get_stats().num_steps == 0
        assert len(greedy(llm, [rows[0]])[0]) == GREEDY.max_tokens


def test_images_for_a_text_model_and_an_unsupported_vision_model_say_so(tiny_models, tmp_path):
    import transformers
    from safetensors.torch import save_file

    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        assert llm.image_placeholder is None
        problem = llm.validate([{"prompt": "hi", "multi_modal_data": {"image": picture(1)}}])[0]
        assert "the model reads text only" in problem
    folder = tmp_path / "paligemma"
    transformers.PaliGemmaConfig().save_pretrained(folder)
    build_tokenizer(folder)
    save_file({}, folder / "model.safetensors")
    with pytest.raises(ValueError, match="vision-language model the engine does not run"):
        LLM(str(folder))


def test_seeded_and_structured_rows_with_images(vision_models):
    with LLM(str(vision_models["qwen2_vl"]), dtype="float32", quantization=None) as llm:
        seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=6)
        alone = llm.generate([image_prompt(llm, " go", picture(4))], seeded, use_tqdm=False)[0]
        batch = llm.generate(["text first", image_prompt(llm, " go", picture(4)), image_prompt(llm, " x", picture(9))],
                             [GREEDY, seeded, GREEDY], use_tqdm=False)
        assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
        choices = ["a red one", "a blue one", "nothing"]
        params = SamplingParams(temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(choice=choices))
        outputs = llm.generate([image_prompt(llm, " which?", picture(4)), "which?"], params, use_tqdm=False)
        assert all(o.outputs[0].text in choices for o in outputs)


def test_lora_on_the_decoder_matches_peft(vision_models, tmp_path):
    """A PEFT adapter on the decoder's attention of a whole LLaVA model (as one is trained on
    it), in a step with a base-model row."""
    import math

    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from engine import LoRARequest

    folder = vision_models["llava"]
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                  target_modules=r".*language_model.*\.(q_proj|v_proj)"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:  # PEFT's lora_B starts at zero: an adapter that changes nothing
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
    peft_model.save_pretrained(tmp_path / "adapter")
    image, prompt = picture(3), "USER: <image>\nwhat? ASSISTANT:"
    inputs = transformers.AutoProcessor.from_pretrained(folder)(images=image, text=prompt, return_tensors="pt")
    with torch.no_grad():
        expected = peft_model.eval().generate(**inputs, do_sample=False, max_new_tokens=6)
    expected = expected[0, inputs["input_ids"].shape[1]:].tolist()
    with LLM(str(folder), dtype="float32", quantization=None, enable_lora=True, max_lora_rank=4) as llm:
        row = {"prompt": prompt, "multi_modal_data": {"image": image}}
        outputs = llm.generate([row, row], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                               lora_request=[LoRARequest("decoder", 1, str(tmp_path / "adapter")), None],
                               use_tqdm=False)
        assert list(outputs[0].outputs[0].token_ids) == expected
        assert outputs[1].outputs[0].token_ids != outputs[0].outputs[0].token_ids


@pytest.mark.skipif(not triton_kernels.installed(), reason="triton is not installed")
@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_triton_backend_runs_the_decoder_of_a_vision_model(vision_models, family):
    """The decoder's Triton kernels (under the interpreter without a GPU) with images in
    the prompt: a plain rotary (LLaVA) and M-RoPE (Qwen2-VL)."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    results = []
    for backend in ("cpu", "triton"):
        with LLM(str(vision_models[family]), dtype="float32", quantization=None, attention_backend=backend) as llm:
            prompts = [image_prompt(llm, " what?", picture(6)), "text"]
            results.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
    assert results[0] == results[1]


def test_queued_prompts_hold_their_images_compressed_until_encoded(vision_models, tmp_path):
    """A checked request keeps each image as given (a PIL image) or as its encoded bytes (a
    path is read once), never as pixels; the encoder's inputs exist only while it runs."""
    from engine.entrypoints.inputs import RequestChecker, valid_requests

    path = tmp_path / "photo.png"
    path.write_bytes(png_bytes(picture(8)))
    with LLM(str(vision_models["qwen2_vl"]), dtype="float32", quantization=None) as llm:
        rows = [image_prompt(llm, " a", picture(1)), image_prompt(llm, " b", str(path))]
        requests = valid_requests(RequestChecker(llm.llm_engine).check(rows, GREEDY, None, None))
        features = [f for request in requests for f in request.multi_modal.features]
        assert [type(f.source) for f in features] == [Image.Image, bytes] and features[1].source == path.read_bytes()
        assert all(f.data is None for f in features)
        outputs = llm.generate(rows, GREEDY, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)


@pytest.mark.parametrize("family", ["llava", "llava_next"])
def test_images_encoded_together_equal_each_alone(vision_models, family):
    """A step's images through the tower as one batch (LLaVA's equal crops) or one by one
    (NeXT's grids): the same rows as each image alone."""
    import torch

    with LLM(str(vision_models[family]), dtype="float32", quantization=None) as llm:
        engine = llm.llm_engine
        model, processor = engine.model_runner.model, engine.mm_processor
        inputs = [processor.process_image(picture(seed, size)).data
                  for seed, size in enumerate([(48, 40), (64, 32), (30, 50)])]
        with torch.inference_mode():
            together = model.embed_images(inputs)
            alone = [model.embed_multimodal(data) for data in inputs]
        for a, b in zip(together, alone):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not detect_cpu().int8_products, reason="int8 products need VNNI, AMX or AVX2")
def test_int8_at_load_quantizes_the_tower_calibrated_on_drawn_pictures(vision_models):
    """int8 covers the vision tower and projector as the decoder, each projection smoothed by
    the input ranges the calibration pictures reached; its image rows stay close to float32's."""
    import torch

    from engine.quantization.int8 import Int8LinearMethod

    folder, image = vision_models["qwen2_vl"], picture(3)
    rows = {}
    for quantization in (None, "int8"):
        with LLM(str(folder), dtype="float32", quantization=quantization) as llm:
            model, processor = llm.llm_engine.model_runner.model, llm.llm_engine.mm_processor
            with torch.inference_mode():
                rows[quantization] = model.embed_multimodal(processor.process_image(image).data)
            tower = [m for name, m in model.named_modules() if name.startswith("visual.") and hasattr(m, "prepack")]
    assert tower and all(isinstance(m.quant_method, Int8LinearMethod) and m.smoothing is not None for m in tower)
    cosine = torch.nn.functional.cosine_similarity(rows[None], rows["int8"], dim=-1)
    assert cosine.min() > 0.98, cosine.min()
