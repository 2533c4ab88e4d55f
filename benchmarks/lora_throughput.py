"""Throughput of a batch mixing four LoRA adapters against the base model, on the same prompts.

`--adapters` (default four) random rank-`--rank` adapters on all seven projections are
written in PEFT's format into a temporary folder. Each prompt runs with one of them (in
turn) in one call,
against the same prompts on an engine without LoRA. The two alternate for `--repeats`
rounds; the best of each is compared.

The default batch is 256 prompts, the engine's max_num_seqs: on a CPU the adapters add a
nearly fixed cost per step (small batched products, 10-20 ms per decode step on 2 cores),
so their share shrinks as a step carries more sequences. `--num-prompts 64` shows a step of 64.

    .venv/bin/python benchmarks/lora_throughput.py --num-prompts 256 --output-len 32
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.prompts import chat_prompt_ids  # noqa: E402
from engine import LLM, LoRARequest, SamplingParams  # noqa: E402


def write_adapter(folder: Path, llm: LLM, rank: int, seed: int) -> Path:
    """A PEFT-format adapter with random weights on every projection the model can adapt."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for path, target in llm.llm_engine.model_runner.model.lora_targets().items():
        prefix = f"base_model.model.{path}"
        in_features, out_features = target.checkpoint_shape
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * 0.02
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    modules = sorted({p.rpartition(".")[2] for p in llm.llm_engine.model_runner.model.lora_targets()})
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none"}))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=4)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp, LLM(dtype=args.dtype) as base, \
            LLM(dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank) as lora:
        prompts = [{"prompt_token_ids": p} for p in chat_prompt_ids(base.get_tokenizer(), args.num_prompts)]
        dtype = base.dtype  # what "auto" picked
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(write_adapter(Path(tmp) / f"a{i}", lora, args.rank, i)))
                    for i in range(args.adapters)]
        mixed = [adapters[i % args.adapters] for i in range(len(prompts))]
        lora.generate(prompts[:4], params, lora_request=mixed[:4], use_tqdm=False)  # warm-up, adapters in slots
        base.generate(prompts[:4], params, use_tqdm=False)

        def timed(llm: LLM, requests: list[LoRARequest] | None) -> float:
            llm.reset_prefix_cache()
            started = time.perf_counter()
            llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
            return time.perf_counter() - started

        times = {"base": [], "lora": []}
        for _ in range(args.repeats):
            times["base"].append(timed(base, None))
            times["lora"].append(timed(lora, mixed))
    tokens = args.num_prompts * args.output_len
    rates = {name: tokens / min(values) for name, values in times.items()}
    print(f"prompts={args.num_prompts} output_len={args.output_len} dtype={dtype} rank={args.rank} "
          f"best of {args.repeats}")
    print(f"base model:         {rates['base']:8.1f} output tokens/s")
    print(f"{args.adapters} adapter(s) mixed: {rates['lora']:8.1f} output tokens/s")
    print(f"lora/base: {rates['lora'] / rates['base']:.3f} (target: at least 0.80)")


if __name__ == "__main__":
    main()
