"""Embeddings per second on the CPU: ours (`LLM.embed`) against transformers' batched forward.

Why: embedding a table of documents is a prefill-only job; the issue's target is at least 2x
transformers' batched forward pass on a CPU, in the same run.

Model: the embedded SmolLM2-135M-Instruct as an embedding model (`runner="pooling"`: its
decoder's last-token hidden state, L2-normalised, the LM head unused). Documents: `--docs`
texts of 16-`--max-tokens` tokens, cut at seeded random lengths from the throughput suite's
paragraphs (a mix like a ticket or product table), each opening with its own record number
so that none shares a prefix-cache block with another, given to both as token ids. Our
prefix cache is reset before each timed run.

Ours: `LLM(runner="pooling", num_threads=T)` with the engine's defaults (on a CPU with
bfloat16 and VNNI that is bfloat16 with int8 products; on an AVX2 CPU without VNNI, float32
with int8 products as int16 pairs), all documents in one `embed`.
Transformers: `AutoModel.from_pretrained(folder, dtype=...)`, documents sorted by length
(its best case: the least padding) in batches of `--batch-size`, right-padded, the last real
token's hidden state of each, normalised; its dtype is the faster of float32 and bfloat16 in
a probe on the first batch. Both run T threads. The two alternate (the first mover swaps each
round) and the best of `--rounds` counts. A check compares our vectors with transformers'
float32 ones (the smallest cosine over all documents).
"""

import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.workloads import PARAGRAPHS
from engine import LLM
from engine.hardware import detect_cpu
from engine.model_loader.folder import resolve_model_path

HF_DTYPES = ("float32", "bfloat16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256, help="longest document, in tokens")
    parser.add_argument("--batch-size", type=int, default=32, help="transformers' batch size")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best of each counts")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_documents(tokenizer, count: int, max_tokens: int, seed: int) -> list[list[int]]:
    """`count` token-id documents of 16 to `max_tokens` tokens, cut from the paragraphs, each
    opening with its own number, so that no two share a prefix-cache block."""
    rng = random.Random(seed)
    corpus = tokenizer(" ".join(PARAGRAPHS * 4), add_special_tokens=False).input_ids
    documents = []
    for i in range(count):
        head = tokenizer(f"Record {i}:", add_special_tokens=False).input_ids
        length = rng.randint(16, max_tokens) - len(head)
        start = rng.randrange(0, len(corpus) - length)
        documents.append(head + corpus[start : start + length])
    return documents


def hf_embed(model, documents: list[list[int]], batch_size: int) -> torch.Tensor:
    """transformers' last-token embeddings, normalised, in the documents' order: batches of
    documents sorted by length, right-padded."""
    order = sorted(range(len(documents)), key=lambda i: len(documents[i]))
    vectors = [None] * len(documents)
    with torch.inference_mode():
        for first in range(0, len(order), batch_size):
            batch = [documents[i] for i in order[first : first + batch_size]]
            width = max(map(len, batch))
            ids = torch.tensor([d + [0] * (width - len(d)) for d in batch])
            mask = torch.tensor([[1] * len(d) + [0] * (width - len(d)) for d in batch])
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(batch)), mask.sum(1) - 1].float()
            for i, vector in zip(order[first : first + batch_size], F.normalize(last, dim=-1)):
                vectors[i] = vector
    return torch.stack(vectors)


def ours_embed(llm: LLM, documents: list[list[int]]) -> torch.Tensor:
    """Our embeddings, from a cold prefix cache (an earlier round's blocks would be hits)."""
    llm.reset_prefix_cache()
    outputs = llm.embed([{"prompt_token_ids": d} for d in documents], use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outputs])


def timed(call) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    result = call()
    return time.perf_counter() - started, result


def main() -> None:
    from transformers import AutoModel, AutoTokenizer

    args = parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model_path(None)
    documents = make_documents(AutoTokenizer.from_pretrained(folder), args.docs, args.max_tokens, args.seed)
    tokens = sum(map(len, documents))
    print(f"CPU: {detect_cpu().describe()} | threads: {args.threads} | torch {torch.__version__}")
    print(f"{len(documents)} documents, {tokens} tokens (16-{args.max_tokens} each)")
    hf = {d: AutoModel.from_pretrained(folder, dtype=getattr(torch, d)).eval() for d in HF_DTYPES}
    for model in hf.values():  # warm-up
        hf_embed(model, documents[:2], 2)
    probe = {d: timed(lambda d=d: hf_embed(hf[d], documents[: args.batch_size], args.batch_size))[0]
             for d in HF_DTYPES}
    hf_dtype = min(probe, key=probe.get)
    times = {"ours": [], "transformers": []}
    with LLM(runner="pooling", num_threads=args.threads) as llm:
        setup = llm.dtype + (f" + {q}" if (q := llm.llm_engine.config.quantization) else "")
        ours_embed(llm, documents[:8])  # warm-up
        for round_index in range(args.rounds):
            for turn in ["ours", "transformers"] if round_index % 2 == 0 else ["transformers", "ours"]:
                print(f"round {round_index + 1}/{args.rounds}: {turn} ...", file=sys.stderr, flush=True)
                if turn == "ours":
                    seconds, ours_vectors = timed(lambda: ours_embed(llm, documents))
                else:
                    seconds, _ = timed(lambda: hf_embed(hf[hf_dtype], documents, args.batch_size))
                times[turn].append(seconds)
    reference = hf_embed(hf["float32"], documents, args.batch_size)
    cosine = F.cosine_similarity(ours_vectors, reference, dim=-1)
    ours_rate, hf_rate = (len(documents) / min(times[k]) for k in ("ours", "transformers"))
    print("probe (s, first batch): " + ", ".join(f"{d} {s:.3f}" for d, s in probe.items()))
    print(f"ours ({setup}): {ours_rate:,.1f} embeddings/s ({tokens / min(times['ours']):,.0f} tokens/s)")
    print(f"transformers ({hf_dtype}, batches of {args.batch_size}): {hf_rate:,.1f} embeddings/s "
          f"({tokens / min(times['transformers']):,.0f} tokens/s)")
    print(f"ratio ours / transformers: {ours_rate / hf_rate:.2f}x")
    print(f"agreement with transformers float32: cosine min {cosine.min():.4f}, mean {cosine.mean():.4f}")


if __name__ == "__main__":
    main()
