"""Idefics3 and SmolVLM against transformers on tiny random checkpoints: the vision encoder
and connector's output per image (split and not, sub-images padded), the prompt's image
expansion, and greedy generation with images and without in one batch."""

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from transformers import AutoTokenizer
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_loader.loader import load_model
from engine.model_loader.model_config import resolve_model_config
from engine.models.idefics3 import Idefics3ForConditionalGeneration, Idefics3Processor
from engine.multimodal.image import read_image
from tests.vision_models.idefics3 import build_tiny_idefics3

FAMILIES = ["idefics3", "smolvlm"]
PROMPT = "User:<image>What is in the picture?<end_of_utterance>\nAssistant:"


def gradient(width: int, height: int) -> Image.Image:
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(255, 0, height, dtype=np.float32)[:, None, None]
    return Image.fromarray(np.concatenate([x + 0 * y, y + 0 * x, (x + y) / 2], axis=2).astype(np.uint8))


def shapes(width: int, height: int) -> Image.Image:
    image = Image.new("RGB", (width, height), (240, 230, 200))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 8, height // 8, width // 2, height // 2), fill=(200, 20, 30))
    draw.rectangle((width // 2, height // 3, width - 4, height - 4), fill=(20, 60, 200))
    return image


def noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


# Square, wide, tall, small (upscaled), grey.
IMAGES = [gradient(64, 64), shapes(150, 70), noise(30, 100, seed=1), noise(12, 9, seed=2),
          gradient(50, 80).convert("L")]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    folder = build_tiny_idefics3(tmp_path_factory.mktemp(request.param), smolvlm=request.param == "smolvlm")
    return request.param, folder


@pytest.fixture(scope="module")
def engine_model(family) -> tuple[Idefics3ForConditionalGeneration, Idefics3Processor]:
    """The engine's model, loaded as `LLM` loads it, and its processor."""
    _, folder = family
    config = resolve_model_config(folder, EngineConfig(dtype="float32", device="cpu", quantization=None),
                                  eos_token_id=2)
    model = load_model(config)
    return model, model.processor_class(folder, config.multimodal_config, AutoTokenizer.from_pretrained(folder))


@pytest.fixture(scope="module")
def hf_model(family) -> transformers.PreTrainedModel:
    return transformers.AutoModelForImageTextToText.from_pretrained(family[1], dtype=torch.float32).eval()


def hf_features(hf_model, data: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model.model.get_image_features(pixel_values=data["pixel_values"][None],
                                                 pixel_attention_mask=data["pixel_attention_mask"][None]
                                                 ).pooler_output[0]


@pytest.mark.parametrize("splitting", [True, False])
def test_image_features_match_transformers(engine_model, hf_model, splitting):
    model, processor = engine_model
    processor.image_processor.do_image_splitting = splitting
    try:
        sub_images = set()
        for image in IMAGES:
            processed = processor.process_image(image)
            sub_images.add(len(processed.data["pixel_values"]))
            with torch.no_grad():
                ours = model.embed_multimodal(processed.data)
            assert ours.shape == (processed.tokens.num_embeds, model.config.get_text_config().hidden_size)
            torch.testing.assert_close(ours, hf_features(hf_model, processed.data), atol=1e-4, rtol=1e-4)
    finally:
        processor.image_processor.do_image_splitting = True
    # The longest edge is resized to 3 sub-images' width: 3 x 1, 3 x 2 and 3 x 3 grids, plus the global image.
    assert sub_images == ({3 * 1 + 1, 3 * 2 + 1, 3 * 3 + 1} if splitting else {1})


def test_padded_sub_images_match_transformers(engine_model, hf_model):
    """Sub-images smaller than the encoder's size, padded (as transformers pads a batch):
    positions bucketed over their real patches, attention kept to them."""
    model, _ = engine_model
    side = model.config.vision_config.image_size
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(3, 3, side, side, generator=generator)
    mask = torch.zeros(3, side, side, dtype=torch.bool)
    for index, (height, width) in enumerate([(side, side), (side // 2, side - 5), (side - 9, side // 3)]):
        mask[index, :height, :width] = True
    pixels[~mask[:, None].expand_as(pixels)] = 0.0
    data = {"pixel_values": pixels, "pixel_attention_mask": mask}
    with torch.no_grad():
        ours = model.embed_multimodal(data)
    torch.testing.assert_close(ours, hf_features(hf_model, data), atol=1e-4, rtol=1e-4)


def transformers_prompt_ids(family: str, folder: Path, prompt: str, images: list[Image.Image],
                            splitting: bool = True) -> list[int]:
    """The prompt's ids as transformers' processor expands its images: `Idefics3Processor`
    itself; SmolVLM's processor needs num2words and torchvision, so its expansion function
    (what `SmolVLMProcessor.replace_image_token` calls) over the image processor's rows and
    columns."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    image_processor = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil",
                                                                      do_image_splitting=splitting)
    config = transformers.AutoConfig.from_pretrained(folder)
    seq_len = (config.vision_config.image_size // config.vision_config.patch_size) ** 2 // config.scale_factor**2
    if family == "idefics3":
        hf_processor = transformers.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                                      image_seq_len=seq_len)
        return hf_processor(text=prompt, images=images or None)["input_ids"][0]
    pieces = prompt.split(tokenizer.image_token)
    text = pieces[0]
    for image, piece in zip(images, pieces[1:]):
        grid = image_processor(images=image, return_row_col_info=True)
        text += get_image_prompt_string(grid["rows"][0][0], grid["cols"][0][0], seq_len, tokenizer.fake_image_token,
                                        tokenizer.image_token, tokenizer.global_image_token) + piece
    return tokenizer(text)["input_ids"]


@pytest.mark.parametrize("splitting", [True, False])
def test_expansion_matches_transformers(family, engine_model, splitting):
    name, folder = family
    _, processor = engine_model
    prompt = "User:<image>Compare with<image>, please.<end_of_utterance>\nAssistant:"
    processor.image_processor.do_image_splitting = splitting
    try:
        for images in ([IMAGES[0], IMAGES[1]], [IMAGES[3], IMAGES[2]]):
            ours = processor.apply(processor.tokenizer(prompt)["input_ids"],
                                   {"image": [read_image(image) for image in images]})
            assert ours.prompt_token_ids == transformers_prompt_ids(name, folder, prompt, images, splitting)
            for feature in ours.features:
                ids = ours.prompt_token_ids[feature.offset : feature.end]
                assert feature.is_embed == [token == processor.image_token_id for token in ids]
                assert ids[0] == processor.tokenizer.convert_tokens_to_ids("<fake_token_around_image>")
    finally:
        processor.image_processor.do_image_splitting = True


def hf_greedy(hf_model, family: str, folder: Path, prompt: str, image: Image.Image | None) -> list[int]:
    """transformers' greedy tokens, cut after an end of sequence."""
    ids = transformers_prompt_ids(family, folder, prompt, [image] if image else [])
    inputs = {"input_ids": torch.tensor([ids])}
    if image is not None:
        pixels = transformers.AutoImageProcessor.from_pretrained(folder, backend="pil")(images=image,
                                                                                         return_tensors="pt")
        inputs.update(pixel_values=pixels["pixel_values"], pixel_attention_mask=pixels["pixel_attention_mask"])
    with torch.no_grad():
        out = hf_model.generate(**inputs, do_sample=False, max_new_tokens=8)[0, len(ids):].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


def test_greedy_generation_matches_transformers(family, hf_model):
    name, folder = family
    rows = [(PROMPT, IMAGES[0]), (PROMPT, IMAGES[1]), ("User: Say something.<end_of_utterance>\nAssistant:", None),
            ("User:<image>Again.<end_of_utterance>\nAssistant:", IMAGES[3]), (PROMPT, IMAGES[4])]
    llm = LLM(str(folder), dtype="float32", quantization=None)
    prompts = [{"prompt": prompt, "multi_modal_data": {"image": image}} if image else prompt
               for prompt, image in rows]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    for (prompt, image), output in zip(rows, outputs):
        assert output.prompt_token_ids == transformers_prompt_ids(name, folder, prompt, [image] if image else [])
        assert list(output.outputs[0].token_ids) == hf_greedy(hf_model, name, folder, prompt, image)
    chat = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES[2]},
                                                  {"type": "text", "text": "What is this?"}]}],
                    SamplingParams(temperature=0, max_tokens=8))[0]
    text = AutoTokenizer.from_pretrained(folder).apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert chat.prompt_token_ids == transformers_prompt_ids(name, folder, text, [IMAGES[2]])
    assert list(chat.outputs[0].token_ids) == hf_greedy(hf_model, name, folder, text, IMAGES[2])
