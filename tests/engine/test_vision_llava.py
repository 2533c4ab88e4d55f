"""LLaVA 1.5 and LLaVA-NeXT against transformers: the image embeddings, the number of image
tokens each image takes in a prompt, the checkpoint name forms, and greedy generation."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_loader.loader import load_model
from engine.model_loader.model_config import resolve_model_config
from engine.models.llava import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from tests.vision_models.llava import build_tiny_llava

# Variants of the tiny checkpoints: (LLaVA-NeXT, config overrides).
VARIANTS = {
    "llava": (False, {}),  # layer -2 of 2: the tower's last layer is never built
    "llava_full_layers": (False, {"vision_feature_select_strategy": "full", "vision_feature_layer": [0, -1]}),
    "next": (True, {}),
    "next_layers": (True, {"vision_feature_layer": [-3, -2]}),
}
# (width, height): square, landscape, portrait, extreme ratios, smaller and larger than a crop.
SIZES = [(32, 32), (40, 30), (64, 100), (23, 57), (100, 20), (97, 33), (5, 90), (130, 129)]


def make_image(width: int, height: int, seed: int) -> Image.Image:
    """Noise with a gradient and a shape on it, so that every crop differs."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    image = Image.fromarray(pixels)
    ImageDraw.Draw(image).ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=(200, 30, 90))
    return image


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {name: build_tiny_llava(root / name, next_=next_, **overrides)
            for name, (next_, overrides) in VARIANTS.items()}


def hf_classes(folder: Path) -> tuple[type, type]:
    """transformers' model and processor classes of the folder's checkpoint."""
    config = transformers.AutoConfig.from_pretrained(folder)
    if config.model_type == "llava_next":
        return transformers.LlavaNextForConditionalGeneration, transformers.LlavaNextProcessor
    return transformers.LlavaForConditionalGeneration, transformers.LlavaProcessor


def engine_model(folder: Path) -> tuple[torch.nn.Module, object]:
    """The folder's model as the engine loads it (float32, CPU) and its processor."""
    model_config = resolve_model_config(folder, EngineConfig(dtype="float32", device="cpu"), eos_token_id=2)
    model = load_model(model_config)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return model, model.processor_class(folder, model_config.multimodal_config, tokenizer)


@pytest.mark.parametrize("variant", VARIANTS)
def test_image_embeddings_match_transformers(folders, variant):
    """`embed_multimodal` of each image's processed inputs equals transformers'
    `get_image_features` of its processor's inputs (float32)."""
    folder = folders[variant]
    model, processor = engine_model(folder)
    model_class, processor_class = hf_classes(folder)
    hf_model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    hf_processor = processor_class.from_pretrained(folder)
    for seed, size in enumerate(SIZES):
        image = make_image(*size, seed)
        processed = processor.process_image(image)
        inputs = hf_processor(images=[image], text="<image>", return_tensors="pt")
        kwargs = {key: inputs[key] for key in ("pixel_values", "image_sizes") if key in inputs}
        with torch.no_grad():
            ours = model.embed_multimodal(processed.data)
            theirs = torch.cat(hf_model.model.get_image_features(**kwargs).pooler_output)
        assert ours.shape == theirs.shape == (len(processed.tokens.replacement), 64), size
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5, msg=f"{variant} {size}")


@pytest.mark.parametrize("variant", ["llava", "llava_full_layers", "next"])
def test_image_token_counts_match_transformers_processor(folders, variant):
    """An image's replacement is as many image tokens as transformers' processor expands
    its "<image>" into, for sizes and aspect ratios that pick every grid pinpoint."""
    folder = folders[variant]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    config = transformers.AutoConfig.from_pretrained(folder)
    processor = LlavaForConditionalGeneration.processor_class
    if config.model_type == "llava_next":
        processor = LlavaNextForConditionalGeneration.processor_class
    ours = processor(folder, config, tokenizer)
    hf_processor = hf_classes(folder)[1].from_pretrained(folder)
    sizes = SIZES + [(1, 200), (200, 1), (333, 77), (31, 64), (64, 31), (96, 33), (48, 48), (1, 1)]
    for seed, size in enumerate(sizes):
        image = make_image(*size, seed)
        replacement = ours.image_tokens(image).replacement  # from the size alone
        assert replacement == ours.process_image(image).tokens.replacement
        ids = hf_processor(images=[image], text="a <image> b", return_tensors="pt")["input_ids"][0].tolist()
        assert set(replacement) == {config.image_token_index}
        assert len(replacement) == ids.count(config.image_token_index), size


def rename_checkpoint(folder: Path, rename) -> None:
    """Rewrites the folder's weights with each tensor's name through `rename`."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    save_file({rename(name): tensor for name, tensor in tensors.items()}, path, metadata={"format": "pt"})


def transformers5_names(name: str) -> str:
    """The names transformers 5's LlavaNextForConditionalGeneration holds its tensors under."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


def hub_names(name: str) -> str:
    """The names of llava-hf's checkpoints saved by transformers 4: the tower's under "vision_model."."""
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


def transformers5_hub_names(name: str) -> str:
    """transformers 5's prefixes over the tower's "vision_model."."""
    return transformers5_names(hub_names(name))


@pytest.mark.parametrize("rename", [transformers5_names, hub_names, transformers5_hub_names])
def test_checkpoint_name_forms(folders, tmp_path, rename):
    """The same weights under each name form load to the same model; the tower's layer
    past the feature layer and its post-layernorm are skipped, not built."""
    reference, _ = engine_model(folders["next"])
    folder = tmp_path / "renamed"
    shutil.copytree(folders["next"], folder)
    rename_checkpoint(folder, rename)
    model, processor = engine_model(folder)
    assert not any("post_layernorm" in name or name.startswith("vision_tower.layers.1.")
                   for name, _ in model.named_parameters())
    data = processor.process_image(make_image(70, 40, 0)).data
    with torch.no_grad():
        assert torch.equal(model.embed_multimodal(data), reference.embed_multimodal(data))


@pytest.mark.parametrize("overrides, problem", [
    ({"vision_feature_layer": -4}, "vision_feature_layer -4"),
    ({"vision_feature_select_strategy": "full"}, "'full' is not supported by LLaVA-NeXT"),
    ({"projector_hidden_act": "relu6"}, "projector_hidden_act 'relu6'"),
])
def test_config_errors_name_the_field(folders, overrides, problem):
    config = transformers.AutoConfig.from_pretrained(folders["next"])
    for key, value in overrides.items():
        setattr(config, key, value)
    with torch.device("meta"), pytest.raises(ValueError, match=problem):
        LlavaNextForConditionalGeneration(config, max_position=64)


# (prompt, the sizes of its images)
PROMPTS = [
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [(40, 30)]),
    ("USER: <image>\nDescribe it. ASSISTANT:", [(23, 57)]),
    ("USER: Look: <image>\nand <image>\nAnd? ASSISTANT:", [(100, 20), (33, 64)]),
    ("USER: Say something. ASSISTANT:", []),
]


@pytest.mark.parametrize("variant", ["llava", "next"])
def test_greedy_generation_matches_transformers(folders, variant):
    """One batch of three prompts with different images (one with two) and a text-only one:
    the engine's greedy tokens (and expanded prompts) equal transformers' `generate`, prompt
    by prompt."""
    folder = folders[variant]
    model_class, processor_class = hf_classes(folder)
    hf_model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    hf_processor = processor_class.from_pretrained(folder)
    images = [[make_image(*size, 10 * row + i) for i, size in enumerate(sizes)]
              for row, (_, sizes) in enumerate(PROMPTS)]
    llm = LLM(str(folder), dtype="float32", quantization=None)
    requests = [{"prompt": text, "multi_modal_data": {"image": row}} if row else {"prompt": text}
                for (text, _), row in zip(PROMPTS, images)]
    outputs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=8))
    for (text, _), row, output in zip(PROMPTS, images, outputs):
        inputs = hf_processor(images=row or None, text=text, return_tensors="pt")
        with torch.no_grad():
            generated = hf_model.generate(**inputs, do_sample=False, max_new_tokens=8)
        prompt_ids = inputs["input_ids"][0].tolist()
        assert output.prompt_token_ids == prompt_ids, text
        assert list(output.outputs[0].token_ids) == generated[0, len(prompt_ids):].tolist(), text


def test_chat_places_the_image_as_transformers_template_does(folders):
    """`LLM.chat` with an image part renders the folder's template ("<image>" per image)
    and generates what transformers does from the same conversation."""
    folder = folders["next"]
    model_class, processor_class = hf_classes(folder)
    hf_model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    hf_processor = processor_class.from_pretrained(folder)
    image = make_image(64, 100, 7)
    question = {"type": "text", "text": "What is in the picture?"}
    text = hf_processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, question]}],
                                            add_generation_prompt=True)
    inputs = hf_processor(images=[image], text=text, return_tensors="pt")
    with torch.no_grad():
        generated = hf_model.generate(**inputs, do_sample=False, max_new_tokens=8)
    llm = LLM(str(folder), dtype="float32", quantization=None)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image}, question]}]
    output = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    assert output.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(output.outputs[0].token_ids) == generated[0, inputs["input_ids"].shape[1]:].tolist()
