"""How far quantization moves greedy output: ours against our bfloat16, OpenVINO GenAI's int8
model against its own fp16, and each one's narrower KV cache against its 16-bit one, on the
same prompts in one run; and how far our default set-up (what dtype='auto' and
quantization='auto' pick on this CPU, a float32 checkpoint's too) and our bfloat16 are from
our float32.

Why: a quantized model is only worth its speed if it says what the full-precision one says.
The measure is greedy agreement on the embedded model: of 64 chat prompts, how many give the
same first 16 tokens (EOS ignored), and how many of all 64 x 16 tokens agree before a
prompt's first difference. Ours: `LLM(dtype="bfloat16")` against `LLM(dtype="bfloat16",
quantization=...)` for each method given, and against `kv_cache_dtype=...` for each cache
dtype given; our float32 against its narrower caches (`--float32-kv-cache-dtypes`: a
bfloat16 cache halves what decode reads where float32 is the default). OpenVINO GenAI (with
`--openvino-python`): its fp16 export against its int8 one (optimum-intel's per-channel
asymmetric int8 weights), both run with the CPU plugin's defaults (bfloat16 compute where the
CPU has it, its dynamic quantization of activations, a u8 KV cache on x86 by its
documentation), exported once by `benchmarks/openvino_export.py`; and its fp16 export with a
u8 KV cache against a bf16 one, each asked for by `KV_CACHE_PRECISION` (the plugin's default
differs between CPUs: a Zen 4 with bfloat16 gets bf16, so the run also says which one the default gave).

    .venv/bin/python benchmarks/quantization_agreement.py
    .venv/bin/python benchmarks/quantization_agreement.py --openvino-python .venv-openvino/bin/python
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__" and "--worker" in sys.argv:
    # OpenVINO's process, under its own virtualenv: prompts in, greedy tokens out, as JSON.
    import json

    import numpy as np
    import openvino as ov
    import openvino_genai

    model, prompts_file, tokens, properties = sys.argv[2], sys.argv[3], int(sys.argv[4]), json.loads(sys.argv[5])
    pipeline = openvino_genai.ContinuousBatchingPipeline(model, openvino_genai.SchedulerConfig(), "CPU", properties)
    prompts = json.loads(Path(prompts_file).read_text())
    config = openvino_genai.GenerationConfig(max_new_tokens=tokens, ignore_eos=True)
    results = pipeline.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts], [config] * len(prompts))
    print("TOKENS " + json.dumps([list(r.m_generation_ids[0]) for r in results]))
    sys.exit(0)

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402

from benchmarks.openvino_export import ensure_export  # noqa: E402
from benchmarks.prompts import chat_prompt_ids  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.model_loader.folder import resolve_model_path  # noqa: E402


def agreement(reference: list[list[int]], other: list[list[int]]) -> str:
    """Prompts whose tokens all agree, and tokens that agree before each prompt's first difference."""
    same = sum(a == b for a, b in zip(reference, other))
    prefix = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(reference, other))
    total = sum(len(a) for a in reference)
    return f"{same}/{len(reference)} prompts identical, {prefix}/{total} tokens before the first difference"


def ours(prompts: list[list[int]], tokens: int, **settings: object) -> list[list[int]]:
    """Our greedy tokens, in bfloat16 unless `settings` say otherwise."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(**{"dtype": "bfloat16", **settings}) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        print(f"  ours {settings or 'bfloat16'}: {llm.llm_engine.model_config.dtype_name}, "
              f"quantization {llm.llm_engine.model_config.quantization}", file=sys.stderr)
    return [list(o.outputs[0].token_ids) for o in outputs]


def openvino(python: Path, model: Path, prompts_file: Path, tokens: int,
             properties: dict[str, str] | None = None) -> list[list[int]]:
    done = subprocess.run([str(python), __file__, "--worker", str(model), str(prompts_file), str(tokens),
                           json.dumps(properties or {})], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    if done.returncode or not lines:
        raise RuntimeError(f"OpenVINO's worker failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("TOKENS "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--methods", default="int8", help="comma-separated quantization methods of ours")
    parser.add_argument("--kv-cache-dtypes", default="int8", help="comma-separated narrower KV caches of ours")
    parser.add_argument("--float32-kv-cache-dtypes", default="bfloat16",
                        help="comma-separated narrower KV caches of our float32 model, against its float32 cache")
    parser.add_argument("--openvino-python", type=Path, help="the Python of a virtualenv with openvino-genai")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_path = resolve_model_path(None)
    prompts = chat_prompt_ids(AutoTokenizer.from_pretrained(model_path), args.prompts)
    print(f"CPU: {detect_cpu().describe()} | {args.prompts} chat prompts x {args.tokens} greedy tokens, EOS ignored")
    reference = ours(prompts, args.tokens)
    for method in filter(None, args.methods.split(",")):
        quantized = ours(prompts, args.tokens, quantization=method)
        print(f"ours {method:<5} weights vs ours bfloat16:  {agreement(reference, quantized)}")
    for cache in filter(None, args.kv_cache_dtypes.split(",")):
        narrow = ours(prompts, args.tokens, kv_cache_dtype=cache)
        print(f"ours {cache:<5} KV cache vs bfloat16:   {agreement(reference, narrow)}")
    float32 = ours(prompts, args.tokens, dtype="float32")
    print(f"ours bfloat16 vs ours float32:      {agreement(float32, reference)}")
    for cache in filter(None, args.float32_kv_cache_dtypes.split(",")):
        narrow = ours(prompts, args.tokens, dtype="float32", kv_cache_dtype=cache)
        print(f"ours float32, {cache} KV cache vs float32: {agreement(float32, narrow)}")
    default = ours(prompts, args.tokens, dtype="auto")
    print(f"ours default ('auto') vs float32:   {agreement(float32, default)}")
    if args.openvino_python:
        optimum_cli = args.openvino_python.parent / "optimum-cli"
        with tempfile.TemporaryDirectory() as tmp:
            prompts_file = Path(tmp) / "prompts.json"
            prompts_file.write_text(json.dumps(prompts))
            fp16, int8 = (openvino(args.openvino_python, ensure_export(model_path, optimum_cli, fmt), prompts_file,
                                   args.tokens) for fmt in ("fp16", "int8"))
            caches, refused = {}, None
            try:
                caches = {cache: openvino(args.openvino_python, ensure_export(model_path, optimum_cli, "fp16"),
                                          prompts_file, args.tokens, {"KV_CACHE_PRECISION": cache})
                          for cache in ("u8", "bf16")}
            except RuntimeError as error:  # a CPU without bfloat16 refuses a bf16 cache
                refused = str(error).strip().splitlines()[-1]
        print(f"OpenVINO int8 weights vs its fp16:  {agreement(fp16, int8)}")
        if refused:
            print(f"OpenVINO u8 KV cache vs its bf16:   not measured ({refused})")
        else:
            default = next((name for name, tokens in caches.items() if tokens == fp16), "neither")
            print(f"OpenVINO u8 KV cache vs its bf16:   {agreement(caches['bf16'], caches['u8'])} "
                  f"(its default cache gave {default}'s tokens)")
        print(f"OpenVINO fp16 vs ours bfloat16:     {agreement(reference, fp16)}")


if __name__ == "__main__":
    main()
