"""Input ranges for int8's smoothing, measured at load: the unquantized model runs a short
built-in text, and every projection whose method asks (`wants_input_range`) is left the
largest |x| each of its input channels reached (`layer.input_range`), which the method
reads when it quantizes the weight (`engine.quantization.int8`).

Why at load: a 16-bit checkpoint carries no activation statistics, and activations, unlike
weights, have outlier channels that per-row int8 scales cannot absorb. The text mixes
prose, code, a ticket, figures, another language and chat turns, so that the channels
that are wide on any of them are seen; it is not the benchmark's prompts. A vision-language
model's encoder reads a few drawn pictures (`calibration_images`) the same way, an audio
model's a few drawn clips (`calibration_audio`); an encoder-decoder model's decoder (Whisper's)
reads the text while attending to the clips' encoder rows.
"""

import itertools
import logging
import time

import numpy as np
import torch
from PIL import Image, ImageDraw
from torch import nn
from transformers import PreTrainedTokenizerBase

from engine.layers.linear import Linear
from engine.worker.kv_cache import KVCache, prefill_cross_inputs, prefill_metadata

logger = logging.getLogger(__name__)

CALIBRATION_TEXTS = (
    "The committee met on Tuesday to review the quarterly budget. Spending on travel fell by twelve percent, "
    "while software licences rose sharply after the migration to the new billing platform.",
    "def merge(a, b):\n    out = []\n    while a and b:\n        out.append(a.pop(0) if a[0] < b[0] else b.pop(0))\n"
    "    return out + a + b\n",
    "Customer ticket #4821: the mobile app crashes when I upload a photo larger than 10 MB. Steps: open the "
    "gallery, pick the image, tap send. Expected: upload. Actual: the app closes.",
    "In 1869 the transcontinental railroad joined the Central Pacific and Union Pacific lines at Promontory "
    "Summit, Utah, cutting the journey across the country from months to about a week.",
    "Mix two cups of flour with a teaspoon of salt, add warm water slowly, and knead for ten minutes until the "
    "dough is smooth. Let it rest, covered, for an hour.",
    "Les chercheurs ont observé que la température moyenne de la mer a augmenté de 0,8 degré depuis 1980, ce "
    "qui modifie la migration des poissons.",
    "SELECT region, COUNT(*) AS orders, SUM(total) FROM sales WHERE created_at >= '2024-01-01' GROUP BY region "
    "ORDER BY 3 DESC;",
    "Q: If a train leaves at 3:15 pm and travels 180 km at 60 km/h, when does it arrive? A: It takes three "
    "hours, so it arrives at 6:15 pm.",
)


def layers_wanting_ranges(model: nn.Module) -> list[Linear]:
    """The projections whose quantization method smooths by measured input ranges."""
    return [m for m in model.modules()
            if isinstance(m, Linear) and getattr(m.quant_method, "wants_input_range", False)]


def calibration_prompts(tokenizer: PreTrainedTokenizerBase, max_len: int) -> list[list[int]]:
    """The texts as token ids, each cut to `max_len` (the model's context): every other one
    as a user turn of the tokenizer's chat template, where it has one (chat prompts are what
    the engine mostly runs)."""
    prompts = []
    for i, text in enumerate(CALIBRATION_TEXTS):
        if i % 2 == 0 and tokenizer.chat_template:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids[:max_len])
    return prompts


def calibration_images() -> list[Image.Image]:
    """Pictures for a vision encoder's calibration, drawn here (none is downloaded): a scene
    of colour gradients and shapes, a page of dark text lines on white, a noisy texture; in
    three sizes and aspect ratios. A ViT's outlier channels are mostly the same for any input,
    so these find them; they are not the images a pipeline will read."""
    rng = np.random.default_rng(0)
    scene = Image.fromarray(np.uint8(np.linspace(0, 255, 640)[None, :, None] * [[[0.9, 0.5, 0.2]]]
                                     + np.linspace(0, 255, 480)[:, None, None] * [[[0.1, 0.4, 0.8]]]) // 2)
    draw = ImageDraw.Draw(scene)
    for _ in range(12):
        x, y = rng.integers(0, 600), rng.integers(0, 440)
        draw.ellipse([x, y, x + rng.integers(20, 160), y + rng.integers(20, 160)], fill=tuple(rng.integers(0, 255, 3)))
    page = Image.new("RGB", (420, 600), "white")
    draw = ImageDraw.Draw(page)
    for line in range(28):
        draw.text((24, 20 + 20 * line), " ".join(CALIBRATION_TEXTS[line % len(CALIBRATION_TEXTS)].split()[:9]),
                  fill=(20, 20, 30))
    texture = Image.fromarray(rng.integers(0, 255, (300, 720, 3), dtype=np.uint8))
    return [scene, page, texture]


VOWEL_FORMANTS = ((730, 1090), (270, 2290), (300, 870), (530, 1840), (640, 1190), (490, 1350))  # a, i, u, e, o, er


def calibration_audio(sample_rate: int) -> list[np.ndarray]:
    """Clips for an audio encoder's calibration, drawn here (none is downloaded), float32 mono
    at `sample_rate`: about 11 s of voiced syllables with pauses (a speaker's pitch, vowel
    formants and rhythm over a faint noise floor), 4 s of noise with mains hum, and 29 s of
    chords (a window nearly full, where the others are mostly its padding). As with pictures,
    an encoder's outlier channels are mostly its own; these are not a pipeline's recordings."""
    rng = np.random.default_rng(0)

    def times(seconds: float) -> np.ndarray:
        return np.arange(int(seconds * sample_rate)) / sample_rate

    speech = []
    for _ in range(48):
        t, pitch = times(rng.uniform(0.12, 0.3)), rng.uniform(100, 230)
        harmonics = np.arange(1, int(4000 // pitch))[:, None]
        loudness = sum(np.exp(-((harmonics * pitch - f) / 120.0) ** 2) for f in VOWEL_FORMANTS[rng.integers(6)])
        speech.append((loudness * np.sin(2 * np.pi * pitch * harmonics * t * (1 - 0.2 * t))).sum(0) * np.hanning(len(t)))
        if rng.random() < 0.2:
            speech.append(np.zeros(int(rng.uniform(0.2, 0.6) * sample_rate)))
    speech = np.concatenate(speech)
    speech += 0.01 * np.abs(speech).max() * rng.standard_normal(len(speech))
    t = times(4.0)
    noise = np.cumsum(rng.standard_normal(len(t))) * 0.02 + 0.3 * np.sin(2 * np.pi * 50 * t)
    noise -= np.convolve(noise, np.ones(400) / 400, mode="same")  # the random walk's drift out: pink-ish noise
    chords = np.concatenate([sum(np.sin(2 * np.pi * 220 * 2 ** (step / 12) * times(1.45)) for step in chord)
                             * np.hanning(int(1.45 * sample_rate)) for chord in ((0, 4, 7), (5, 9, 12), (7, 11, 14),
                                                                                 (0, 3, 7)) * 5])
    return [np.float32(0.5 * clip / np.abs(clip).max()) for clip in (speech, noise, chords)]


def record_input_ranges(model: nn.Module, kv_cache: KVCache, prompts: list[list[int]],
                        items: list[dict[str, torch.Tensor]] | None = None) -> None:
    """Runs a multimodal model's encoder over `items` (the encoder inputs of the calibration
    pictures or clips) and `prompts` as one prefill step on scratch blocks of `kv_cache` (freed
    after), every quantized layer (projections and experts) multiplying by its loaded weights,
    not yet quantized, and sets `input_range` [in] float32 on each layer of
    `layers_wanting_ranges`. An encoder-decoder model's prompts attend to the clips' encoder
    rows, prompt i to clip i modulo their count, each clip written once to cross blocks."""
    layers = layers_wanting_ranges(model)
    methods = {m: m.quant_method for m in model.modules() if getattr(m, "quant_method", None) is not None}
    started = time.perf_counter()
    ranges: dict[Linear, torch.Tensor] = {}

    def record(layer: nn.Module, args: tuple) -> None:
        x = args[0].detach()
        peak = x.reshape(-1, x.shape[-1]).abs().amax(0).float()
        ranges[layer] = torch.maximum(ranges[layer], peak) if layer in ranges else peak

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    for module in methods:
        module.quant_method = None
    lengths = [len(p) for p in prompts]
    try:
        with torch.inference_mode():
            encoded = model.embed_images(items) if items else []
            clips = encoded if getattr(model, "max_cross_rows", 0) else []
            blocks = [-(-n // kv_cache.block_size) for n in lengths + [len(clip) for clip in clips]]
            kv_cache.allocate(sum(blocks))
            first_blocks = [0, *itertools.accumulate(blocks)][:-1]
            meta = prefill_metadata(lengths, kv_cache, first_blocks[: len(prompts)])
            kv_cache.backend.prepare(meta)
            extra = {}
            if clips:
                extra["cross"] = prefill_cross_inputs(model, meta, kv_cache, clips, first_blocks[len(prompts):],
                                                      [i % len(clips) for i in range(len(prompts))])
                kv_cache.backend.prepare(extra["cross"].meta)
            ids = torch.tensor(list(itertools.chain(*prompts)), dtype=torch.long, device=kv_cache.device)
            model(ids, meta.positions, meta, **extra)
    finally:
        for hook in hooks:
            hook.remove()
        for module, method in methods.items():
            module.quant_method = method
        kv_cache.free()
    for layer, peak in ranges.items():
        layer.input_range = peak.clone()
    logger.info("int8 smoothing: input ranges of %d projections measured on %d calibration tokens and %d encoder "
                "inputs in %.2f s", len(ranges), sum(lengths), len(items or []), time.perf_counter() - started)
