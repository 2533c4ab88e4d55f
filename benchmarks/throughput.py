"""Offline throughput: our engine against transformers' static batched `generate`, one run.

Both get the same chat prompts as token ids, the same dtype and the same number of new
tokens per prompt (EOS ignored). Prints output tokens per second for each and their ratio.

    .venv/bin/python benchmarks/throughput.py --num-prompts 64 --output-len 64 --dtype bfloat16
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import chat_prompt_ids  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_loader import resolve_model_path  # noqa: E402


def run_engine(model: str, prompts: list[list[int]], output_len: int, dtype: str) -> float:
    with LLM(model, dtype=dtype) as llm:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outputs)
    return elapsed


def run_transformers(path: Path, prompts: list[list[int]], output_len: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = model.generation_config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(input_ids[:4], attention_mask=attention_mask[:4], **{**kwargs, "max_new_tokens": 4,
                                                                             "min_new_tokens": 4})
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == width + output_len
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    from transformers import AutoTokenizer

    path = resolve_model_path(args.model)
    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(path), args.num_prompts)
    new_tokens = args.num_prompts * args.output_len
    print(f"model={path.name} prompts={args.num_prompts} output_len={args.output_len} dtype={args.dtype} "
          f"threads={torch.get_num_threads()} mean_prompt_len={sum(map(len, prompts)) / len(prompts):.1f}")
    ours = new_tokens / run_engine(args.model, prompts, args.output_len, args.dtype)
    print(f"engine:       {ours:8.1f} output tokens/s")
    theirs = new_tokens / run_transformers(path, prompts, args.output_len, args.dtype)
    print(f"transformers: {theirs:8.1f} output tokens/s (static batched generate)")
    print(f"ratio engine/transformers: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
