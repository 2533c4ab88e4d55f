"""Throughput with mixed sampling against all-greedy, on the same prompts, in one run.

The mixed batch has a quarter each of greedy, temperature, top-p and penalized
requests. Both runs alternate for `--repeats` rounds; the best of each is compared.

    .venv/bin/python benchmarks/sampling_throughput.py --num-prompts 64 --output-len 64
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.comparison import best_times, comparison_parser  # noqa: E402
from benchmarks.prompts import chat_prompt_ids  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    parser = comparison_parser(__doc__.splitlines()[0])
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    length = dict(max_tokens=args.output_len, ignore_eos=True)
    kinds = [
        SamplingParams(temperature=0, **length),
        SamplingParams(temperature=0.8, seed=1, **length),
        SamplingParams(temperature=1.0, top_p=0.9, seed=2, **length),
        SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                       seed=3, **length),
    ]
    with LLM(dtype=args.dtype) as llm:
        prompts = [{"prompt_token_ids": p} for p in chat_prompt_ids(llm.get_tokenizer(), args.num_prompts)]
        dtype = llm.dtype  # what "auto" picked
        greedy = [kinds[0]] * len(prompts)
        mixed = [kinds[i % 4] for i in range(len(prompts))]
        llm.generate(prompts[:4], mixed[:4], use_tqdm=False)  # warm-up
        times = best_times(llm, prompts, {"greedy": greedy, "mixed": mixed}, args.repeats)
    tokens = args.num_prompts * args.output_len
    rates = {name: tokens / seconds for name, seconds in times.items()}
    print(f"prompts={args.num_prompts} output_len={args.output_len} dtype={dtype} best of {args.repeats}")
    print(f"all greedy:     {rates['greedy']:8.1f} output tokens/s")
    print(f"mixed sampling: {rates['mixed']:8.1f} output tokens/s")
    print(f"mixed/greedy: {rates['mixed'] / rates['greedy']:.3f} (target: at least 0.90)")


if __name__ == "__main__":
    main()
