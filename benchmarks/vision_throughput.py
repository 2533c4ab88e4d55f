"""Vision-language throughput on the CPU: ours against transformers' batched LLaVA generate.

Images/s of both on a LLaVA-1.5-shaped model, the ratio, and where our time goes
(preprocessing, vision encoder, decoder prefill and decode).

Why: describing a table of images is the vision-language job a pipeline runs; each image is
preprocessed on the host, read by a vision transformer, and its embeddings fill a long
prompt prefill before a short answer. The issue's target is at least 2x transformers'
batched `generate` on the CPU, measured in the same run.

Model: random weights, built at run time into a temporary folder as a hub checkpoint
(`LlavaForConditionalGeneration` saved in bfloat16 with a real `CLIPImageProcessorPil`, a
`LlavaProcessor` and SmolLM2's tokenizer with "<image>" added). LLaVA-1.5's structure,
CPU-affordable sizes (`VISION_SHAPE`, `TEXT_SHAPE`): a CLIP tower read at layer -2 of
12 (hidden 768, 12 heads, MLP 3,072, quick-GELU) on a 224x224 crop in 14-pixel patches (256
image tokens), the two-layer GELU projector, and a decoder of SmolLM2-135M's shape (hidden
576, 30 layers, 9 query / 3 KV heads, MLP 1,536, SmolLM2's 49,152 tokens + "<image>" padded to
49,216, tied head).
Workload: `--images` Pillow-drawn pictures (landscapes, still lifes, pages of text,
patterns, under film grain drawn anew for each run) at six sizes from 480x640 to 1280x720, each with a short
question in llava-hf's prompt form ("USER: <image>\\n... ASSISTANT:"), `--new-tokens`
greedy tokens each, EOS ignored.

Ours: `LLM(folder, num_threads=T)` with the engine's defaults (dtype "auto"; on a CPU with
native bfloat16 and VNNI that is bfloat16 with int8 products, the vision tower's and
projector's included, calibrated on drawn pictures), all requests in one `generate`, the prefix cache reset
before each run. Transformers: `LlavaForConditionalGeneration.from_pretrained(folder,
dtype=ours)` (the dtype our engine resolved, so that both run it), `LlavaProcessor` on
static batches of `--batch-sizes` (left padding, the processor included in the time),
`generate(min_new_tokens = max_new_tokens, do_sample=False)`; the first round tries each
batch size, later rounds the fastest. Both run T threads (`--threads`). The two alternate
(the first mover swaps each round) and the best of `--rounds` counts.

The breakdown of our time, measured after the rounds on new pictures: preprocessing is
what our processor does for every request (`mm_processor.apply` when the row is checked: the
content hash, the placeholder's expansion; `mm_processor.encoder_inputs` in the step that
encodes the image: the image processor, shown alone beside it); encoder is
`model.embed_images` over those inputs, as many at a time as a step encodes (the step's
budget of max_num_batched_tokens rows);
prefill is a run with `max_tokens=1` less those two; decode is the best run less that.
Transformers' own split (its processor and `get_image_features` per batch) is shown beside.

    .venv/bin/python benchmarks/vision_throughput.py
    .venv/bin/python benchmarks/vision_throughput.py --images 8 --rounds 1 --batch-sizes 8
"""

import argparse
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.model_loader.folder import resolve_model_path  # noqa: E402
from engine.multimodal.image import read_image  # noqa: E402

if TYPE_CHECKING:
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

IMAGE_TOKEN = "<image>"
VISION_SHAPE = dict(image_size=224, patch_size=14, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                    num_attention_heads=12, projection_dim=512, hidden_act="quick_gelu")
TEXT_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
IMAGE_SIZES = [(640, 480), (1024, 768), (480, 640), (1280, 720), (512, 512), (800, 600)]
QUESTIONS = [
    "Describe this image.", "What objects are in the picture?", "Write a short caption for this photo.",
    "What colours dominate the scene?", "Is this indoors or outdoors?", "What is the main subject here?",
    "Describe the lighting in this picture.", "List three things you can see.",
]
WARMUP_IMAGES = 2


@dataclass(frozen=True)
class Request:
    """One image with its question."""

    prompt: str
    image: Image.Image


@dataclass
class Breakdown:
    """Seconds of our engine's parts over the whole workload (see the module's docstring)."""

    preprocessing: float
    image_processor: float
    encoder: float
    prefill: float
    decode: float


@dataclass
class HfSplit:
    """Seconds of transformers' processor and vision features over the whole workload."""

    processor: float
    encoder: float


@dataclass
class Results:
    """The timings of one run of the benchmark."""

    dtype: str = ""
    quantization: str | None = None
    ours: list[float] = field(default_factory=list)
    hf: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    breakdown: Breakdown | None = None
    hf_split: HfSplit | None = None

    def best_batch(self) -> int:
        return min(self.hf, key=lambda size: min(self.hf[size]))

    def our_setup(self) -> str:
        return self.dtype + (f" + {self.quantization} products" if self.quantization else "")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--images", type=int, default=32, help="requests, one image each")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per request, EOS ignored")
    parser.add_argument("--batch-sizes", default="8,16",
                        help="transformers' static batch sizes tried in the first round (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each engine counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads of both engines (default: torch's default here, %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.batch_sizes = sorted({int(size) for size in args.batch_sizes.split(",")})
    return args


def build_model(folder: Path) -> Path:
    """The random LLaVA of VISION_SHAPE and TEXT_SHAPE, in bfloat16, with its processor."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(None))
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.padding_side = "left"
    vision = transformers.CLIPVisionConfig(**VISION_SHAPE)
    vocab = -(-len(tokenizer) // 64) * 64  # the added token, padded as checkpoints pad their vocabulary
    text = transformers.LlamaConfig(vocab_size=vocab, **TEXT_SHAPE)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, projector_hidden_act="gelu",
                                      image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                                      vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    side = VISION_SHAPE["image_size"]
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": side},
                                                         crop_size={"height": side, "width": side})
    transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                patch_size=VISION_SHAPE["patch_size"], vision_feature_select_strategy="default",
                                num_additional_image_tokens=1).save_pretrained(folder)
    return folder


def draw_scene(draw: ImageDraw.ImageDraw, rng: random.Random, width: int, height: int) -> None:
    """One of four kinds of picture: a landscape, a still life, a page of text, a pattern."""
    def colour() -> tuple[int, int, int]:
        return rng.randrange(256), rng.randrange(256), rng.randrange(256)

    kind = rng.randrange(4)
    if kind == 0:  # sky gradient, hills, sun, trees
        top, bottom = colour(), colour()
        for y in range(height):
            t = y / height
            draw.line([(0, y), (width, y)], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom)))
        radius = rng.randint(height // 12, height // 6)
        x, y = rng.randrange(width), rng.randrange(height // 3)
        draw.ellipse([x - radius, y - radius, x + radius, y + radius], fill=(255, 220, 120))
        horizon = [(x, int(height * 0.6 + rng.uniform(-0.1, 0.1) * height)) for x in range(0, width + 40, 40)]
        draw.polygon([(0, height), *horizon, (width, height)], fill=colour())
        for _ in range(rng.randint(3, 8)):
            x, y, size = rng.randrange(width), rng.randint(height * 6 // 10, height), rng.randint(10, height // 8)
            draw.rectangle([x - size // 6, y - size, x + size // 6, y], fill=(90, 60, 30))
            draw.ellipse([x - size, y - 2 * size, x + size, y - size // 2], fill=(30, rng.randint(90, 160), 40))
    elif kind == 1:  # a table with fruit and a vase
        draw.rectangle([0, 0, width, height], fill=colour())
        draw.rectangle([0, height * 2 // 3, width, height], fill=(120, 80, 50))
        for _ in range(rng.randint(4, 9)):
            x, y, r = rng.randrange(width), rng.randint(height * 2 // 3, height), rng.randint(15, height // 7)
            draw.ellipse([x - r, y - 2 * r, x + r, y], fill=colour(), outline=(0, 0, 0))
        x = rng.randrange(width // 4, width * 3 // 4)
        draw.polygon([(x - 40, height * 2 // 3), (x + 40, height * 2 // 3), (x + 25, height // 3),
                      (x - 25, height // 3)], fill=colour())
    elif kind == 2:  # a page of text
        draw.rectangle([0, 0, width, height], fill=(245, 242, 235))
        words = " ".join(QUESTIONS).split()
        for y in range(30, height - 30, 22):
            line = " ".join(rng.choice(words) for _ in range(width // 60))
            draw.text((30, y), line, fill=(20, 20, 30))
    else:  # stripes and checks
        size = rng.randint(16, 64)
        a, b = colour(), colour()
        for x in range(0, width, size):
            for y in range(0, height, size):
                draw.rectangle([x, y, x + size, y + size], fill=a if (x // size + y // size) % 2 else b)
        for _ in range(rng.randint(2, 6)):
            x, y, r = rng.randrange(width), rng.randrange(height), rng.randint(20, height // 4)
            draw.ellipse([x - r, y - r, x + r, y + r], outline=colour(), width=rng.randint(3, 12))


def make_picture(width: int, height: int, seed: int) -> Image.Image:
    """A drawn picture, softened a little so that it resizes like a photograph rather than
    flat colour."""
    rng = random.Random(seed)
    image = Image.new("RGB", (width, height))
    draw_scene(ImageDraw.Draw(image), rng, width, height)
    return image.filter(ImageFilter.GaussianBlur(1.2))


def make_workload(count: int, seed: int) -> list[Request]:
    """`count` pictures at IMAGE_SIZES in turn, each with a question (without grain: see
    `with_grain`)."""
    return [Request(f"USER: {IMAGE_TOKEN}\n{QUESTIONS[i % len(QUESTIONS)]} ASSISTANT:",
                    make_picture(*IMAGE_SIZES[i % len(IMAGE_SIZES)], seed * 1000 + i)) for i in range(count)]


def with_grain(requests: list[Request], variant: int) -> list[Request]:
    """The requests' pictures under film grain drawn from `variant`: each run gets new
    images (new content hashes: our engine keeps encoder outputs by content across calls,
    and would not encode a picture it saw in an earlier round) for the same work."""
    rng = np.random.default_rng(variant)
    grained = []
    for request in requests:
        pixels = np.asarray(request.image, dtype=np.int16)
        noise = rng.normal(0.0, 6.0, pixels.shape).round().astype(np.int16)
        grained.append(Request(request.prompt, Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))))
    return grained


def run_ours(llm: LLM, requests: list[Request], new_tokens: int) -> float:
    """Seconds for all requests in one `generate`, from an empty prefix cache."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate([{"prompt": r.prompt, "multi_modal_data": {"image": r.image}} for r in requests],
                           params, use_tqdm=False)
    seconds = time.perf_counter() - started
    if any(len(o.outputs[0].token_ids) != new_tokens for o in outputs):
        raise RuntimeError(f"our engine did not generate {new_tokens} tokens for every request")
    return seconds


def hf_generate(model: "LlavaForConditionalGeneration", processor: "LlavaProcessor", requests: list[Request],
                new_tokens: int) -> None:
    """transformers' greedy answers to one left-padded static batch, exactly `new_tokens` each."""
    inputs = processor(text=[r.prompt for r in requests], images=[r.image for r in requests], padding=True,
                       return_tensors="pt")
    inputs["pixel_values"] = inputs["pixel_values"].to(model.dtype)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=processor.tokenizer.pad_token_id)
    if out.shape[1] != inputs["input_ids"].shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - inputs['input_ids'].shape[1]} tokens, "
                           f"not {new_tokens}")


def run_hf(model: "LlavaForConditionalGeneration", processor: "LlavaProcessor", requests: list[Request],
           new_tokens: int, batch_size: int) -> float:
    """Seconds for all requests in static batches of `batch_size`, processor included."""
    started = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        hf_generate(model, processor, requests[first : first + batch_size], new_tokens)
    return time.perf_counter() - started


def timed(call: Callable[[], object]) -> float:
    """Seconds `call` takes."""
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def our_breakdown(llm: LLM, requests: list[Request], best: float) -> Breakdown:
    """Our time by part (see the module's docstring); `best` is the best full run's seconds."""
    engine = llm.llm_engine
    processor, model, dtype = engine.mm_processor, engine.model_runner.model, engine.model_runner.model_config.dtype
    ids = [engine.tokenizer(r.prompt).input_ids for r in requests]
    features = []
    checking = timed(lambda: features.extend(processor.apply(i, [read_image(r.image)]).features[0]
                                             for i, r in zip(ids, requests)))
    made = []
    image_processor = timed(lambda: made.extend(processor.encoder_inputs(f) for f in features))
    inputs = [{name: value.to(dtype) if value.is_floating_point() else value for name, value in data.items()}
              for data in made]
    per_step = max(1, engine.config.max_num_batched_tokens // features[0].num_embeds)
    steps = [inputs[i : i + per_step] for i in range(0, len(inputs), per_step)]
    with torch.inference_mode():
        encoder = timed(lambda: [model.embed_images(step) for step in steps])
    preprocessing = checking + image_processor
    first_token = run_ours(llm, requests, 1)
    return Breakdown(preprocessing, image_processor, encoder, first_token - preprocessing - encoder,
                     best - first_token)


def hf_split(model: "LlavaForConditionalGeneration", processor: "LlavaProcessor", requests: list[Request],
             batch_size: int) -> HfSplit:
    """transformers' processor and `get_image_features` over all requests, in its batches."""
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    pixels = []
    processing = timed(lambda: pixels.extend(
        processor(text=[r.prompt for r in b], images=[r.image for r in b], padding=True,
                  return_tensors="pt")["pixel_values"] for b in batches))
    with torch.inference_mode():
        encoder = timed(lambda: [model.get_image_features(pixel_values=p.to(model.dtype)) for p in pixels])
    return HfSplit(processing, encoder)


def measure(folder: Path, requests: list[Request], args: argparse.Namespace) -> Results:
    """Alternating rounds of ours and transformers, then the breakdowns."""
    from transformers import LlavaForConditionalGeneration, LlavaProcessor

    results = Results()
    with LLM(str(folder), num_threads=args.threads) as llm:
        results.dtype, results.quantization = llm.dtype, llm.llm_engine.config.quantization
        hf_model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=getattr(torch, llm.dtype)).eval()
        hf_processor = LlavaProcessor.from_pretrained(folder)
        warmup = with_grain(requests[:WARMUP_IMAGES], 0)
        run_ours(llm, warmup, 4)
        hf_generate(hf_model, hf_processor, warmup, 4)
        for round_index in range(args.rounds):
            images = with_grain(requests, round_index + 1)
            sizes = args.batch_sizes if round_index == 0 else [results.best_batch()]
            for turn in ["ours", "hf"] if round_index % 2 == 0 else ["hf", "ours"]:
                print(f"round {round_index + 1}/{args.rounds}: {turn} ...", file=sys.stderr, flush=True)
                if turn == "ours":
                    results.ours.append(run_ours(llm, images, args.new_tokens))
                for size in sizes if turn == "hf" else []:
                    results.hf[size].append(run_hf(hf_model, hf_processor, images, args.new_tokens, size))
        print("breakdown ...", file=sys.stderr, flush=True)
        images = with_grain(requests, args.rounds + 1)
        results.breakdown = our_breakdown(llm, images, min(results.ours))
        results.hf_split = hf_split(hf_model, hf_processor, images, results.best_batch())
    return results


def print_results(results: Results, count: int, args: argparse.Namespace) -> None:
    """Images/s of each (transformers: each batch size tried) and the ratio to ours."""
    print(f"== {count} images ({', '.join(f'{w}x{h}' for w, h in IMAGE_SIZES)} in turn), {args.new_tokens} greedy "
          f"tokens each, EOS ignored, best of {args.rounds} round(s); both in {results.dtype}")
    print(f"{'engine':<14}{'setup':<54}{'runs':>5}{'images/s':>10}{'out tok/s':>11}{'ours/peer':>11}")
    ours = count / min(results.ours)
    print(f"{'ours':<14}{results.our_setup() + ', one generate call':<54}{len(results.ours):>5}{ours:>10.2f}"
          f"{ours * args.new_tokens:>11.1f}{'-':>11}")
    for size, seconds in sorted(results.hf.items(), key=lambda item: min(item[1])):
        rate = count / min(seconds)
        setup = f"{results.dtype}, LlavaProcessor + generate, batch {size}"
        print(f"{'transformers':<14}{setup:<54}{len(seconds):>5}{rate:>10.2f}{rate * args.new_tokens:>11.1f}"
              f"{ours / rate:>10.2f}x")


def print_breakdown(results: Results, count: int) -> None:
    """Our time by part beside transformers' (its processor, its vision features, the rest)."""
    parts, split = results.breakdown, results.hf_split
    ours_total, hf_total = min(results.ours), min(results.hf[results.best_batch()])
    rows = [("preprocessing (processor)", parts.preprocessing, split.processor),
            ("  of which the image processor", parts.image_processor, None),
            ("encoder (vision tower + projector)", parts.encoder, split.encoder),
            ("decoder prefill", parts.prefill, None),
            ("decoder decode", parts.decode, None),
            ("decoder (prefill + decode)", parts.prefill + parts.decode, hf_total - split.processor - split.encoder)]
    print(f"-- where the time goes (s over {count} images; the decoder is the rest of the best run)")
    print(f"{'part':<38}{'ours s':>9}{'share':>8}{'ms/image':>10}{'transformers s':>16}")
    for name, mine, theirs in rows:
        share = "" if name.startswith("  ") else f"{mine / ours_total:.1%}"
        peer = "-" if theirs is None else f"{theirs:.2f}"
        print(f"{name:<38}{mine:>9.2f}{share:>8}{1000 * mine / count:>10.1f}{peer:>16}")
    print(f"{'total':<38}{ours_total:>9.2f}{'':>8}{1000 * ours_total / count:>10.1f}{hf_total:>16.2f}")


def describe_model() -> str:
    """The model's shape in one line."""
    vision, text = VISION_SHAPE, TEXT_SHAPE
    tokens = (vision["image_size"] // vision["patch_size"]) ** 2
    return (f"model: random LLaVA-1.5 structure: CLIP {vision['image_size']}px / patch {vision['patch_size']} "
            f"({tokens} image tokens), hidden {vision['hidden_size']}, {vision['num_hidden_layers']} layers (read "
            f"at -2), MLP {vision['intermediate_size']}; decoder of SmolLM2-135M's shape: hidden "
            f"{text['hidden_size']}, {text['num_hidden_layers']} layers, {text['num_attention_heads']}/"
            f"{text['num_key_value_heads']} heads, MLP {text['intermediate_size']}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {detect_cpu().describe()} | threads: {args.threads} | torch {torch.__version__}")
    print(describe_model())
    requests = make_workload(args.images, args.seed)
    with tempfile.TemporaryDirectory(prefix="vision-throughput-") as tmp:
        results = measure(build_model(Path(tmp) / "llava"), requests, args)
    print_results(results, len(requests), args)
    print_breakdown(results, len(requests))


if __name__ == "__main__":
    main()
