"""Speech-to-text throughput on the CPU: ours (`LLM.transcribe`) against transformers' batched
Whisper `generate`.

Seconds of audio transcribed per wall second by both on a Whisper-base-shaped model, the ratio,
and where our time goes (features, encoder with decoder prefill, decode).

Why: transcribing a table of recordings is the audio job a pipeline runs; each clip becomes
log-mel features on the host, the encoder reads a whole 30 s window (1,500 rows) whatever the
clip's length, and the decoder writes a short text while attending to those rows. The issue's
target is at least 2x transformers' batched `generate` on the CPU, measured in the same run.

Model: random weights, built at run time into a temporary folder as a hub checkpoint
(`WhisperForConditionalGeneration` saved in bfloat16 with a real `WhisperFeatureExtractor`, 80
mel bins, 30 s windows) of Whisper-base's shape (`SHAPE`: width 512, 6 encoder and 6 decoder
layers, 8 heads, MLP 2,048, 1,500 encoder positions, 448 decoder positions) and vocabulary
(51,865: SmolLM2's tokenizer with Whisper's task tokens, padded). Workload: `--clips` clips of
5 to 30 s (each within one window, so that transformers' short-form `generate` reads them as
we do), voiced tones with pauses, each transcribed in English with as many greedy tokens as
speech of its length makes (`--tokens-per-second`, 3 by default: about 150 words a minute), or
`--new-tokens` each; random weights never stop on their own, so both sides generate exactly
that many (`min_tokens` = `max_tokens`). A static batch of transformers' runs until its longest
clip's count, as a batch of real transcripts runs until its longest ends.

Ours: `LLM(folder, num_threads=T)` with the engine's defaults (dtype "auto": bfloat16 on a CPU
with native bfloat16; quantization "auto": int8 products, calibrated at load, on such a CPU with
VNNI and without AMX; `--quantization none` keeps the dtype's products), all clips in one `generate` of Whisper prompts (what `LLM.transcribe`
runs for clips within a window, with each clip's own count). Transformers:
`WhisperForConditionalGeneration.from_pretrained(folder, dtype=ours)`, the feature extractor on
static batches of `--batch-sizes` (included in the time), `generate(input_features,
decoder_input_ids=the same prompt, min_new_tokens = max_new_tokens, do_sample=False)`; the
first round tries each batch size, later rounds the fastest. Both run T threads (`--threads`).
The two alternate (the first mover swaps each round) and the best of `--rounds` counts.

Our breakdown, after the rounds: features is the feature extractor alone over every clip;
encoder with prefill is a run with one token per clip less the features; decode is the best run
less both.

    .venv/bin/python benchmarks/whisper_throughput.py
    .venv/bin/python benchmarks/whisper_throughput.py --clips 8 --rounds 1 --batch-sizes 8
    .venv/bin/python benchmarks/whisper_throughput.py --quantization none
"""

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.model_loader.folder import resolve_model_path  # noqa: E402

RATE = 16_000
SHAPE = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
             encoder_ffn_dim=2048, decoder_ffn_dim=2048, num_mel_bins=80, max_source_positions=1500,
             max_target_positions=448)
VOCAB = 51_865
TASK_TOKENS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>",
               "<|notimestamps|>", "<|prev|>"]
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


@dataclass
class Results:
    """The timings of one run of the benchmark, in seconds."""

    dtype: str = ""
    quantization: str = ""
    ours: list[float] = field(default_factory=list)
    hf: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    features: float = 0.0
    encoder_prefill: float = 0.0

    def best_batch(self) -> int:
        return min(self.hf, key=lambda size: min(self.hf[size]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--clips", type=int, default=16, help="clips of 5 to 30 s")
    parser.add_argument("--tokens-per-second", type=float, default=3.0,
                        help="greedy tokens per second of a clip (speech's density)")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per clip, whatever its length")
    parser.add_argument("--batch-sizes", default="8,16",
                        help="transformers' static batch sizes tried in the first round (comma-separated)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each engine counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads of both engines (default: torch's default here, %(default)s)")
    parser.add_argument("--quantization", default="auto",
                        help="ours' quantization setting: auto (the default's), int8, or none (the dtype's products)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.batch_sizes = sorted({int(size) for size in args.batch_sizes.split(",")})
    return args


def build_model(folder: Path) -> Path:
    """The random Whisper of SHAPE in bfloat16, with its feature extractor and a tokenizer."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(None))
    tokenizer.add_special_tokens({"additional_special_tokens": TASK_TOKENS[1:], "eos_token": TASK_TOKENS[0]})
    tokenizer.save_pretrained(folder)
    ids = tokenizer.convert_tokens_to_ids
    config = transformers.WhisperConfig(
        vocab_size=VOCAB, **SHAPE, decoder_start_token_id=ids("<|startoftranscript|>"),
        eos_token_id=ids("<|endoftext|>"), pad_token_id=ids("<|endoftext|>"), bos_token_id=ids("<|endoftext|>"),
        begin_suppress_tokens=None, suppress_tokens=None)
    torch.manual_seed(0)
    transformers.WhisperForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(folder)
    transformers.WhisperFeatureExtractor(feature_size=SHAPE["num_mel_bins"]).save_pretrained(folder)
    return folder


def draw_clips(count: int, seed: int) -> list[np.ndarray]:
    """Clips of 5 to 30 s: turns of a gliding voiced tone with pauses between them."""
    rng = np.random.default_rng(seed)
    clips = []
    for _ in range(count):
        samples = np.zeros(int(rng.uniform(5, 30) * RATE), np.float32)
        at = 0
        while at < len(samples):
            t = np.arange(min(int(rng.uniform(0.5, 2) * RATE), len(samples) - at)) / RATE
            pitch = rng.uniform(120, 280) * (1 + 0.1 * np.sin(2 * np.pi * t))
            samples[at:at + len(t)] = 0.3 * np.sin(2 * np.pi * np.cumsum(pitch) / RATE) * np.hanning(len(t))
            at += len(t) + int(rng.uniform(0.2, 0.8) * RATE)
        clips.append(samples)
    return clips


def token_counts(args: argparse.Namespace, clips: list[np.ndarray]) -> list[int]:
    """Each clip's greedy tokens: `--new-tokens`, else `--tokens-per-second` of its length."""
    if args.new_tokens is not None:
        return [args.new_tokens] * len(clips)
    return [max(1, round(args.tokens_per_second * len(clip) / RATE)) for clip in clips]


def run_ours(llm: LLM, clips: list[np.ndarray], counts: list[int]) -> float:
    rows = [{"prompt": PROMPT, "multi_modal_data": {"audio": (clip, RATE)}} for clip in clips]
    params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n) for n in counts]
    start = time.perf_counter()
    outputs = llm.generate(rows, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(out.outputs[0].token_ids) for out in outputs] == counts
    return elapsed


def run_hf(model, extractor, tokenizer, clips: list[np.ndarray], counts: list[int], batch: int) -> float:
    prompt = tokenizer(PROMPT, add_special_tokens=False, return_tensors="pt").input_ids
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(clips), batch):
            part, longest = clips[first:first + batch], max(counts[first:first + batch])
            features = extractor(part, sampling_rate=RATE, return_tensors="pt").input_features.to(model.dtype)
            model.generate(features, decoder_input_ids=prompt.expand(len(part), -1), min_new_tokens=longest,
                           max_new_tokens=longest, do_sample=False)
    return time.perf_counter() - start


def measure(args: argparse.Namespace, folder: Path) -> Results:
    import transformers

    clips, results = draw_clips(args.clips, args.seed), Results()
    counts = token_counts(args, clips)
    llm = LLM(str(folder), num_threads=args.threads,
              quantization=None if args.quantization == "none" else args.quantization)
    results.dtype = str(llm.llm_engine.config.dtype)
    results.quantization = llm.llm_engine.model_config.quantization or "none"
    model = transformers.WhisperForConditionalGeneration.from_pretrained(
        folder, dtype=getattr(torch, results.dtype.removeprefix("torch."))).eval()
    extractor = transformers.WhisperFeatureExtractor.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    torch.set_num_threads(args.threads)
    run_ours(llm, clips[:2], [2, 2])  # warm-up: the kernels' first calls
    run_hf(model, extractor, tokenizer, clips[:2], [2, 2], 2)
    for round_index in range(args.rounds):
        sizes = args.batch_sizes if round_index == 0 else [results.best_batch()]
        order = ["ours", "hf"] if round_index % 2 == 0 else ["hf", "ours"]
        for side in order:
            if side == "ours":
                results.ours.append(run_ours(llm, clips, counts))
            else:
                for size in sizes:
                    results.hf[size].append(run_hf(model, extractor, tokenizer, clips, counts, size))
    start = time.perf_counter()
    for clip in clips:  # what our processor runs for each clip
        extractor(clip, sampling_rate=RATE, return_tensors="pt")
    results.features = time.perf_counter() - start
    results.encoder_prefill = run_ours(llm, clips, [1] * len(clips)) - results.features
    return results


def report(args: argparse.Namespace, results: Results, audio_seconds: float) -> None:
    ours, batch = min(results.ours), results.best_batch()
    hf = min(results.hf[batch])
    print(f"CPU: {detect_cpu().describe()}; {args.threads} threads; dtype {results.dtype}, "
          f"ours' quantization {results.quantization}")
    counts = token_counts(args, draw_clips(args.clips, args.seed))
    print(f"workload: {args.clips} clips, {audio_seconds:.0f} s of audio, {sum(counts)} tokens "
          f"({min(counts)} to {max(counts)} a clip)")
    print(f"ours:         {ours:7.2f} s  {audio_seconds / ours:7.1f} audio s/s")
    print(f"transformers: {hf:7.2f} s  {audio_seconds / hf:7.1f} audio s/s (batch {batch})")
    print(f"ratio: {hf / ours:.2f}x")
    decode = ours - results.features - results.encoder_prefill
    print(f"our time: features {results.features:.2f} s, encoder + prefill {results.encoder_prefill:.2f} s, "
          f"decode {decode:.2f} s")


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "whisper-base-random")
        results = measure(args, folder)
    report(args, results, sum(len(c) for c in draw_clips(args.clips, args.seed)) / RATE)


if __name__ == "__main__":
    main()
