"""Throughput with a JSON schema against without, on the same prompts, in one run.

The constrained run goes first and fixes the workload: each row's output length is
what the schema's JSON took. The unconstrained run then generates exactly that many
tokens per row (EOS ignored), so both runs schedule the same token counts and the
ratio measures the cost of the constraints alone: the grammar's token masks, filled
on the host for every constrained row at every step, and applying them. Runs
alternate for `--repeats` rounds; the best of each counts.

    .venv/bin/python benchmarks/structured_throughput.py --num-prompts 64
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.comparison import best_times, comparison_parser  # noqa: E402
from benchmarks.prompts import chat_prompt_ids  # noqa: E402
from engine import LLM, RequestOutput, SamplingParams, StructuredOutputsParams  # noqa: E402

# An answer card: nested object, enum, bounded numbers, a bounded array and strings.
SCHEMA = {
    "type": "object",
    "properties": {
        "topic": {"enum": ["science", "history", "language", "nature", "technology", "other"]},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 5},
        "answer": {"type": "string", "maxLength": 200},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 4},
        "review": {
            "type": "object",
            "properties": {"confidence": {"type": "number", "minimum": 0, "maximum": 1},
                           "needs_source": {"type": "boolean"}},
            "required": ["confidence", "needs_source"],
        },
    },
    "required": ["topic", "difficulty", "answer", "keywords", "review"],
}


def main() -> None:
    parser = comparison_parser(__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    parser.add_argument("--unbounded-strings", action="store_true",
                        help="drop the strings' maxLength: their masks are much cheaper to fill")
    args = parser.parse_args()
    schema = unbounded_strings(SCHEMA) if args.unbounded_strings else SCHEMA
    constraint = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    with LLM(args.model, dtype=args.dtype) as llm:
        dtype = llm.dtype  # what "auto" picked
        prompts = [{"prompt_token_ids": p} for p in chat_prompt_ids(llm.get_tokenizer(), args.num_prompts)]
        constrained = [SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=constraint)
                       ] * len(prompts)
        started = time.perf_counter()
        first = llm.generate(prompts, constrained, use_tqdm=False)  # also the warm-up and the compile
        compile_and_first = time.perf_counter() - started
        lengths = [len(o.outputs[0].token_ids) for o in first]
        plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]

        def same_lengths(outputs: list[RequestOutput]) -> None:
            assert [len(o.outputs[0].token_ids) for o in outputs] == lengths, "the workloads differ"

        times = best_times(llm, prompts, {"plain": plain, "json": constrained}, args.repeats, same_lengths)
    tokens = sum(lengths)
    rates = {name: tokens / seconds for name, seconds in times.items()}
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in first)
    print(f"schema: {'strings without maxLength' if args.unbounded_strings else 'strings with maxLength'}")
    print(f"prompts={args.num_prompts} output tokens={tokens} (mean {tokens / len(lengths):.0f} per row, "
          f"{stopped} of {len(first)} complete JSON) dtype={dtype} best of {args.repeats}")
    print(f"first constrained run, schema compile included: {compile_and_first:.1f} s")
    print(f"unconstrained: {rates['plain']:8.1f} output tokens/s")
    print(f"JSON schema:   {rates['json']:8.1f} output tokens/s")
    print(f"json/unconstrained: {rates['json'] / rates['plain']:.3f} (target: at least 0.85)")


def unbounded_strings(schema: dict) -> dict:
    """The schema with no maxLength anywhere."""
    if isinstance(schema, dict):
        return {k: unbounded_strings(v) for k, v in schema.items() if k != "maxLength"}
    return schema


if __name__ == "__main__":
    main()
