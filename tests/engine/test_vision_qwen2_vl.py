"""Qwen2-VL and Qwen2.5-VL against transformers (float32, tiny random checkpoints): the
vision encoder's rows, the prompt's M-RoPE positions, the M-RoPE rotation, both checkpoint
layouts, and greedy generation with images."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers.linear import Linear
from engine.layers.rotary import MRotaryEmbedding, rope_parameters
from engine.model_loader.loader import load_model
from engine.model_loader.model_config import resolve_model_config
from engine.models.qwen2_vl import Qwen2VLProcessor
from engine.multimodal.image import read_image
from tests.vision_models.qwen2_vl import build_tiny_qwen2_vl

REFERENCE_CLASSES = {"2": transformers.Qwen2VLForConditionalGeneration,
                     "2.5": transformers.Qwen2_5_VLForConditionalGeneration}


@pytest.fixture(scope="module", params=["2", "2.5"])
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(tmp_path_factory, version) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp(f"qwen{version}_vl"), version)


@pytest.fixture(scope="module")
def reference(folder, version) -> transformers.PreTrainedModel:
    return REFERENCE_CLASSES[version].from_pretrained(folder, dtype=torch.float32).eval()


def images() -> list[Image.Image]:
    """Pictures of different sizes and aspect ratios: a gradient, shapes, noise, a tall strip."""
    ramp = np.linspace(0, 255, 90, dtype=np.uint8)
    gradient = Image.fromarray(np.stack([np.tile(ramp, (60, 1)), np.tile(ramp[::-1], (60, 1)),
                                         np.full((60, 90), 128, np.uint8)], axis=-1))
    shapes = Image.new("RGB", (200, 200), "white")
    draw = ImageDraw.Draw(shapes)
    draw.rectangle((20, 30, 120, 90), fill="red")
    draw.ellipse((90, 100, 180, 190), fill="blue")
    rng = np.random.default_rng(0)
    noise = Image.fromarray(rng.integers(0, 256, (45, 70, 3), dtype=np.uint8))
    strip = Image.fromarray(rng.integers(0, 256, (140, 33, 3), dtype=np.uint8))
    return [gradient, shapes, noise, strip]


def load(folder: Path, **settings) -> torch.nn.Module:
    model_config = resolve_model_config(folder, EngineConfig(dtype="float32", device="cpu", quantization=None,
                                                             **settings), eos_token_id=2)
    return load_model(model_config)


def engine_processor(folder: Path) -> Qwen2VLProcessor:
    return Qwen2VLProcessor(folder, transformers.AutoConfig.from_pretrained(folder),
                            transformers.AutoTokenizer.from_pretrained(folder))


def chat_text(folder: Path, parts: list[dict]) -> str:
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return tokenizer.apply_chat_template([{"role": "user", "content": parts}], tokenize=False,
                                         add_generation_prompt=True)


def reference_inputs(folder: Path, text: str, pictures: list[Image.Image]) -> dict[str, torch.Tensor]:
    """What transformers' Qwen2VLProcessor gives for the prompt (it needs torchvision, so
    its steps are here): each "<|image_pad|>" repeated once per merged row of its image."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    inputs = {}
    if pictures:
        inputs = dict(transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")(
            images=pictures, return_tensors="pt"))
        first, *rest = text.split("<|image_pad|>")
        text = first + "".join("<|image_pad|>" * (int(grid.prod()) // 4) + after
                               for grid, after in zip(inputs["image_grid_thw"], rest))
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    image_token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {**inputs, "input_ids": ids, "mm_token_type_ids": (ids == image_token).int()}


def test_vision_encoder_matches_transformers(folder, reference):
    model = load(folder)
    processor = engine_processor(folder)
    processed = [processor.process_image(image) for image in images()]
    with torch.no_grad():
        expected = reference.get_image_features(torch.cat([p.data["pixel_values"] for p in processed]),
                                                torch.cat([p.data["image_grid_thw"] for p in processed])).pooler_output
        for image, theirs in zip(processed, expected, strict=True):
            ours = model.embed_multimodal(image.data)
            assert ours.shape == (len(image.tokens.replacement), 64)
            torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert len({tuple(p.data["image_grid_thw"][0].tolist()) for p in processed}) == 4


@pytest.mark.parametrize("count", [0, 1, 2])
def test_rope_positions_match_get_rope_index(folder, reference, count):
    pictures = images()[1 : 1 + count]
    parts = [{"type": "text", "text": "Compare"}, *[{"type": "image"}] * count, {"type": "text", "text": "now."}]
    text = chat_text(folder, parts)
    processor = engine_processor(folder)
    prompt = processor.apply(processor.tokenizer(text, add_special_tokens=False).input_ids,
                             {"image": [read_image(picture) for picture in pictures]})
    for picture in pictures:  # the grid from the size alone is the image processor's
        assert processor.image_tokens(picture) == processor.process_image(picture).tokens
    inputs = reference_inputs(folder, text, pictures)
    assert prompt.prompt_token_ids == inputs["input_ids"][0].tolist()
    if count == 0:  # transformers counts a text prompt's positions up itself
        expected, delta = torch.arange(len(prompt.prompt_token_ids)).expand(3, -1), 0
    else:
        positions, deltas = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                           image_grid_thw=inputs["image_grid_thw"])
        expected, delta = positions[:, 0], int(deltas[0, 0])
    assert torch.equal(prompt.rope_positions, expected)
    assert prompt.rope_delta == delta


def test_mrope_rotation_matches_transformers(folder):
    text_config = transformers.AutoConfig.from_pretrained(folder).text_config
    rotary = MRotaryEmbedding(16, 512, rope_parameters(text_config))
    torch.manual_seed(0)
    positions = torch.randint(0, 500, (3, 40))
    x = torch.randn(40, 6, 16)
    cos, sin = Qwen2VLRotaryEmbedding(text_config)(x, positions[:, None, :])
    heads_first = x.transpose(0, 1)[None]
    expected, _ = apply_rotary_pos_emb(heads_first, heads_first, cos, sin)
    torch.testing.assert_close(rotary(positions, x), expected[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    text_positions = positions[0]
    assert torch.equal(rotary(text_positions, x), rotary(text_positions.expand(3, -1), x))


def test_both_checkpoint_layouts_load_alike(folder, tmp_path, monkeypatch):
    """transformers 5 writes the older hub layout ("visual.", "model." the decoder); the
    layout of its classes ("model.visual.", "model.language_model.") loads the same."""
    renamed = tmp_path / "renamed"
    shutil.copytree(folder, renamed)
    tensors = load_file(folder / "model.safetensors")
    assert any(name.startswith("visual.") for name in tensors) and "model.norm.weight" in tensors
    save_file({("model." + name if name.startswith("visual.") else name.replace("model.", "model.language_model.", 1))
               : tensor for name, tensor in tensors.items()}, renamed / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setattr(Linear, "prepack", lambda self: None)  # compare the weights as loaded
    old, new = dict(load(folder).named_parameters()), dict(load(renamed).named_parameters())
    assert old.keys() == new.keys()
    assert all(torch.equal(old[name], new[name]) for name in old)


def test_greedy_generation_matches_transformers(folder, reference):
    """Prompts with one image, two images and none, in one batch, as a whole and in chunks
    of 16 tokens (images split over steps), and a chat with an image part."""
    pictures = images()
    requests = [
        (chat_text(folder, [{"type": "image"}, {"type": "text", "text": "Describe the fox."}]), pictures[:1]),
        (chat_text(folder, [{"type": "text", "text": "Paris is the capital"}]), []),
        (chat_text(folder, [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]), pictures[2:]),
    ]
    expected = []
    for text, images_of_prompt in requests:
        inputs = reference_inputs(folder, text, images_of_prompt)
        with torch.no_grad():
            out = reference.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]), do_sample=False,
                                     max_new_tokens=8)
        expected.append(out[0, inputs["input_ids"].shape[1]:].tolist())
    prompts = [{"prompt": text, "multi_modal_data": {"image": imgs}} if imgs else {"prompt": text}
               for text, imgs in requests]
    greedy = SamplingParams(temperature=0, max_tokens=8)
    for settings in ({}, {"max_num_batched_tokens": 16}):
        llm = LLM(str(folder), dtype="float32", quantization=None, **settings)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == expected, settings
    chat = [{"role": "user", "content": [{"type": "image_pil", "image_pil": pictures[0]},
                                         {"type": "text", "text": "Describe the fox."}]}]
    assert llm.chat(chat, greedy)[0].outputs[0].token_ids == expected[0]
