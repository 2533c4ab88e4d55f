"""Mixture-of-experts throughput on the CPU: ours against transformers' static batched generate.

Output tokens/s of both on Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, Llama 4 (text) and
DeepSeek-V2/V3 models, and our ratio.

Why: in an MoE model most of a token's work is its experts' products, which the engine runs
as grouped products over the experts that received tokens (`engine/layers/fused_moe.py`, on
a CPU through `engine/kernels/cpu_fused_moe.cpp`);
the dense suite (`benchmarks/throughput.py`) never exercises them. The issue's target is at
least 2x transformers' static batched `generate` on each family.

Models: random weights from transformers' config classes (`from_config`), saved in bfloat16
as MoE checkpoints ship, into a temporary folder with a word-level tokenizer of one word per
token id (the engine loads a tokenizer and detokenizes; prompts are token ids). Shapes, chosen
so that the experts dominate a token's products as in real MoE models (`MODEL_SHAPES`):
hidden 512, 6 layers, 8 query / 4 KV heads of 64, vocabulary 8,192 (untied head), and
  mixtral:     8 experts, top-2, expert intermediate 1,024 (Mixtral's proportions);
  qwen2_moe:   16 experts, top-4, expert intermediate 384, a gated shared expert of 1,536;
  qwen3_moe:   16 experts, top-4 renormalised, expert intermediate 384, q/k head norms;
  gpt_oss:     16 experts, top-4, expert intermediate 512 (= hidden, as released), a router
               with a bias, experts with biases and the SwiGLU clamped at 7; attention with
               q/k/v/o biases and sinks, a 128-token sliding window on alternate layers
               (layers 0, 2, 4), YaRN rotary as released (factor 32 over 4,096); saved in
               bfloat16 as transformers saves it (not the released MXFP4 experts, which the
               engine dequantizes at load: the products are the same);
  llama4:      experts (16, top-1 by sigmoid, intermediate 1,024, plus a shared expert of
               1,024) on layers 1, 3, 5 (`interleave_moe_layer_step` 2), dense MLPs of 1,024
               between them (the MoE blocks are half a token's products); rotary layers
               attend within 32-token chunks (shorter than every unscaled prompt), layers 2
               and 5 are NoPE (whole context, temperature-tuned queries);
  deepseek_v2: multi-head latent attention (8 heads; KV compressed to rank 128, q/k of 64
               features without and 32 with rotary, values of 64, no q compression), 16
               experts top-4 of 384 plus 2 shared, chosen "group_limited_greedy" (4 groups,
               the best 2), layer 0 a dense MLP of 1,536 (`first_k_dense_replace` 1);
  deepseek_v3: as deepseek_v2 with queries compressed to rank 256, interleaved rotary,
               sigmoid routing with a score-correction bias (4 groups, the best 2),
               renormalised top-4, one shared expert.
A family whose architecture is not in `engine.models.MODEL_REGISTRY` is reported skipped
(with the reason), and one that fails is reported with its error; the others still run.
Workload: `--prompts` prompts of 64-256 random token ids x `--new-tokens` new tokens, EOS
ignored; `--scale` shrinks all three (`--scale 0.1`: a smoke run of under a minute).

Ours: `LLM(folder, num_threads=T)`, dtype "auto" (bfloat16 where the CPU has native bfloat16,
float32 elsewhere), all prompts in one `generate`. Transformers:
`AutoModelForCausalLM.from_pretrained(folder, dtype=...)`, left-padded static batches,
greedy, `min_new_tokens = max_new_tokens`. Its dtype and experts implementation are the
fastest in a probe (the first 16 prompts x 8 new tokens, one batch) of float32 and bfloat16 x
`grouped_mm` (its default) and `eager`, of those the family takes (Llama 4's experts have no
`grouped_mm`; an option that fails is shown with its error); its batch size, the faster of
all prompts at once and batches of 16 in the first round, which tries both. Both run T threads (`--threads`). The
two alternate (the first mover swaps each round) and the best of `--rounds` counts: other
processes on a shared machine make single timings noisy.

`--profile` adds one more run of ours per family, timed by component (experts, router and
shared expert, attention kernel, attention projections, the rest of the forward, and the
host's work outside it); `--check N` compares greedy tokens with transformers in float32.

    .venv/bin/python benchmarks/moe_throughput.py
    .venv/bin/python benchmarks/moe_throughput.py --families qwen3_moe --rounds 3 --profile
    .venv/bin/python benchmarks/moe_throughput.py --scale 0.1 --families gpt_oss,llama4 --rounds 1
"""

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from benchmarks.comparison import best_times  # noqa: E402
from benchmarks.workloads import Workload, _scaled  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402
from engine.models import MODEL_REGISTRY  # noqa: E402

if TYPE_CHECKING:
    from transformers import PreTrainedModel

COMMON_SHAPE = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, head_dim=64,
                    num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclass(frozen=True)
class Family:
    """A family's transformers config class, the architecture our engine runs it as, and the
    settings of its shape over COMMON_SHAPE's."""

    config_class: str
    architecture: str
    settings: dict


# Multi-head latent attention and experts of both DeepSeek shapes: its KV heads are its query heads,
# and transformers' rotary takes head_dim (V3 keeps one given) to be the rotary features'.
DEEPSEEK = dict(num_key_value_heads=8, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, head_dim=32,
                v_head_dim=64, intermediate_size=1536, moe_intermediate_size=384, n_routed_experts=16,
                num_experts_per_tok=4, first_k_dense_replace=1, n_group=4, topk_group=2)
MODEL_SHAPES = {
    "mixtral": Family("MixtralConfig", "MixtralForCausalLM",
                      dict(intermediate_size=1024, num_local_experts=8, num_experts_per_tok=2)),
    "qwen2_moe": Family("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                        dict(moe_intermediate_size=384, num_experts=16, num_experts_per_tok=4,
                             shared_expert_intermediate_size=1536, norm_topk_prob=False)),
    "qwen3_moe": Family("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        dict(moe_intermediate_size=384, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)),
    "gpt_oss": Family("GptOssConfig", "GptOssForCausalLM",
                      dict(intermediate_size=512, num_local_experts=16, num_experts_per_tok=4, sliding_window=128,
                           layer_types=["sliding_attention", "full_attention"] * 3, swiglu_limit=7.0)),
    "llama4": Family("Llama4TextConfig", "Llama4ForCausalLM",
                     dict(intermediate_size=1024, intermediate_size_mlp=1024, num_local_experts=16,
                          num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=32,
                          no_rope_layers=[1, 1, 0, 1, 1, 0])),
    "deepseek_v2": Family("DeepseekV2Config", "DeepseekV2ForCausalLM",
                          dict(DEEPSEEK, q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy")),
    "deepseek_v3": Family("DeepseekV3Config", "DeepseekV3ForCausalLM",
                          dict(DEEPSEEK, q_lora_rank=256, n_shared_experts=1, norm_topk_prob=True,
                               rope_interleave=True)),
}
PROMPT_LENGTHS = (64, 256)
HF_DTYPES = ("float32", "bfloat16")
HF_EXPERTS = ("grouped_mm", "eager")  # transformers' experts implementations: its default, and its loop
HF_CHUNK = 16  # the static batch size tried beside one batch of all prompts
PROBE = (16, 8)  # prompts, new tokens of the probe that picks transformers' dtype and experts implementation
WARMUP = [[5, 6, 7, 8], [9, 10, 11]]


@dataclass(frozen=True)
class HfSetting:
    """One way of running transformers' `generate`."""

    dtype: str
    experts: str
    batch_size: int

    def __str__(self) -> str:
        return f"{self.dtype}, experts {self.experts}, batch {self.batch_size}"


@dataclass
class FamilyResult:
    """The best seconds of ours and of each transformers setting tried, on one family."""

    family: str
    workload: Workload
    dtype: str = ""
    ours: list[float] = field(default_factory=list)
    hf: dict[HfSetting, list[float]] = field(default_factory=lambda: defaultdict(list))
    probe: dict[tuple[str, str], float] = field(default_factory=dict)
    probe_errors: dict[tuple[str, str], str] = field(default_factory=dict)  # options transformers failed on
    check: str = ""
    profile: dict[str, dict[str, float]] | None = None
    skipped: str = ""  # why the family has no timings: not in our registry, or the error it failed with

    def rate(self, seconds: list[float]) -> float:
        return self.workload.output_tokens / min(seconds)

    def best_hf(self) -> HfSetting:
        return min(self.hf, key=lambda setting: min(self.hf[setting]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--families", default=",".join(MODEL_SHAPES), help="comma-separated subset of %(default)s")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best of each engine counts")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="shrinks the prompt count, prompt lengths and new tokens (0.1: a smoke run)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads of both engines (default: torch's default here, %(default)s)")
    parser.add_argument("--check", type=int, default=4, metavar="N",
                        help="prompts whose greedy tokens are compared with transformers' in float32 (0: none)")
    parser.add_argument("--profile", action="store_true", help="time our engine's components in one more run")
    parser.add_argument("--quantization", default="auto", type=lambda v: None if v == "none" else v,
                        help="our engine's quantization: its default 'auto' (int8 where that is the default), "
                             "'none' (the dtype's products), or a method")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    unknown = sorted(set(args.families.split(",")) - set(MODEL_SHAPES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {sorted(MODEL_SHAPES)}")
    return args


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {detect_cpu().describe()} | threads: {args.threads} | torch {torch.__version__}")
    results = []
    with tempfile.TemporaryDirectory(prefix="moe-throughput-") as tmp:
        for family in args.families.split(","):
            result = run_family(Path(tmp) / family, make_workload(family, args), args)
            print_family(result, args.rounds)
            results.append(result)
    print_summary(results)
    return 1 if any(r.skipped.startswith("failed") for r in results) else 0


def run_family(folder: Path, workload: Workload, args: argparse.Namespace) -> FamilyResult:
    """The family's measurements; skipped where our engine has no such architecture, and
    its error (traceback on stderr) where building or running it fails."""
    architecture = MODEL_SHAPES[folder.name].architecture
    if architecture not in MODEL_REGISTRY:
        reason = f"skipped: {architecture} is not in engine.models.MODEL_REGISTRY (the engine lacks the family)"
        return FamilyResult(folder.name, workload, skipped=reason)
    try:
        return measure_family(build_model(folder, folder.name), workload, args)
    except Exception as exc:  # noqa: BLE001 - one family's failure is its row; the others still run
        traceback.print_exc()
        return FamilyResult(folder.name, workload, skipped=f"failed: {type(exc).__name__}: {str(exc)[:300]}")


def build_model(folder: Path, family: str) -> Path:
    """A random-weight `family` model of MODEL_SHAPES' shape, in bfloat16, with a tokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    shape = MODEL_SHAPES[family]
    config = getattr(transformers, shape.config_class)(**{**COMMON_SHAPE, **shape.settings})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    # One word per token id: ids 0-2 are the special tokens the config names, then "w3", "w4", ...
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, config.vocab_size)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", bos_token="<s>",
                                         eos_token="</s>", unk_token="<pad>").save_pretrained(folder)
    return folder


def make_workload(family: str, args: argparse.Namespace) -> Workload:
    """`--prompts` prompts of random token ids (none of the special ids 0-2) x `--new-tokens`, scaled."""
    rng = random.Random(args.seed)
    low, high = (_scaled(n, args.scale, minimum=4) for n in PROMPT_LENGTHS)
    prompts = [[rng.randrange(3, COMMON_SHAPE["vocab_size"]) for _ in range(rng.randint(low, high))]
               for _ in range(_scaled(args.prompts, args.scale))]
    new_tokens = _scaled(args.new_tokens, args.scale)
    return Workload(family, "random token ids", prompts, [new_tokens] * len(prompts), warmup=WARMUP)


def probe_hf(hf_models: dict[str, "PreTrainedModel"], result: FamilyResult) -> None:
    """Seconds of transformers in each dtype x experts implementation on the first PROBE
    prompts x new tokens of the workload, as one batch, into `result.probe`; the error of
    each it refuses or fails on into `result.probe_errors`.

    Raises:
        RuntimeError: no option ran, naming each one's error.
    """
    workload = result.workload
    prompts = workload.prompts[:PROBE[0]]
    probe = Workload("probe", "", prompts, [min(PROBE[1], max(workload.max_tokens))] * len(prompts),
                     warmup=workload.warmup)
    for d in HF_DTYPES:
        for e in HF_EXPERTS:
            try:
                result.probe[d, e] = time_hf(hf_models[d], HfSetting(d, e, len(prompts)), probe)
            except Exception as exc:  # noqa: BLE001 - an option the family lacks is left out
                result.probe_errors[d, e] = f"{type(exc).__name__}: {str(exc)[:120]}"
    if not result.probe:
        raise RuntimeError(f"transformers ran none of the probe's options: {result.probe_errors}")


def measure_family(folder: Path, workload: Workload, args: argparse.Namespace) -> FamilyResult:
    """Alternating rounds of ours and transformers on one family (see the module's docstring)."""
    from transformers import AutoModelForCausalLM

    result = FamilyResult(folder.name, workload)
    hf_models = {d: AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, d)).eval() for d in HF_DTYPES}
    probe_hf(hf_models, result)
    dtype, experts = min(result.probe, key=result.probe.get)
    sizes = sorted({len(workload.prompts), min(len(workload.prompts), HF_CHUNK)}, reverse=True)
    with LLM(str(folder), num_threads=args.threads, quantization=args.quantization) as llm:
        quantization = llm.llm_engine.config.quantization
        result.dtype = llm.dtype + (f" + {quantization}" if quantization else "")
        run_ours(llm, workload.warmup, [4] * len(workload.warmup))
        for round_index in range(args.rounds):
            settings = [HfSetting(dtype, experts, b) for b in sizes] if round_index == 0 else [result.best_hf()]
            for turn in ["ours", "hf"] if round_index % 2 == 0 else ["hf", "ours"]:
                print(f"[{folder.name}] round {round_index + 1}/{args.rounds}: {turn} ...", file=sys.stderr, flush=True)
                if turn == "ours":
                    result.ours.append(time_ours(llm, workload))
                else:
                    for setting in settings:
                        result.hf[setting].append(time_hf(hf_models[setting.dtype], setting, workload))
        if args.profile:
            result.profile = profile_ours(llm, workload)
    if args.check:
        result.check = check_greedy(folder, hf_models["float32"], workload, args)
    return result


def run_ours(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Our engine's greedy tokens for `prompts`, EOS ignored."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def time_ours(llm: LLM, workload: Workload) -> float:
    """Seconds for the whole workload in one `generate`, from an empty prefix cache."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.max_tokens]

    def check(outputs: list) -> None:
        if [len(o.outputs[0].token_ids) for o in outputs] != workload.max_tokens:
            raise RuntimeError("our engine did not generate the tokens asked for")

    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    return best_times(llm, prompts, {"ours": params}, repeats=1, check=check)["ours"]


def hf_generate(model: "PreTrainedModel", prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for one left-padded static batch, exactly `new_tokens` each."""
    pad = model.config.pad_token_id
    width = max(map(len, prompts))
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, not {new_tokens}")
    return out[:, width:].tolist()


def set_experts(model: "PreTrainedModel", experts: str) -> None:
    """transformers' experts implementation `experts` on `model`.

    Raises:
        ValueError: the family cannot take it (transformers refuses, or keeps another one).
    """
    model.set_experts_implementation(experts)
    if model.config._experts_implementation != experts:
        raise ValueError(f"{type(model).__name__} keeps experts implementation "
                         f"{model.config._experts_implementation!r}, not {experts!r}")


def time_hf(model: "PreTrainedModel", setting: HfSetting, workload: Workload) -> float:
    """Seconds for the whole workload in static batches of `setting.batch_size`, after a warm-up."""
    set_experts(model, setting.experts)
    hf_generate(model, workload.warmup, 4)
    new_tokens, size = max(workload.max_tokens), setting.batch_size
    started = time.perf_counter()
    for i in range(0, len(workload.prompts), size):
        hf_generate(model, workload.prompts[i:i + size], new_tokens)
    return time.perf_counter() - started


def check_greedy(folder: Path, hf_model: "PreTrainedModel", workload: Workload, args: argparse.Namespace) -> str:
    """How many of the first `--check` prompts get the same greedy tokens from ours and from
    transformers, both in float32 (our timed runs may be bfloat16, whose roundings differ)."""
    prompts = workload.prompts[:args.check]
    new_tokens = min(16, max(workload.max_tokens))
    set_experts(hf_model, "eager")
    theirs = hf_generate(hf_model, prompts, new_tokens)
    with LLM(str(folder), dtype="float32", num_threads=args.threads) as llm:
        ours = run_ours(llm, prompts, [new_tokens] * len(prompts))
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return f"greedy, float32: {same}/{len(prompts)} prompts with the same {new_tokens} tokens as transformers"


def profile_ours(llm: LLM, workload: Workload) -> dict[str, dict[str, float]]:
    """Seconds of one more run of the workload, by component and by phase (prefill: a step
    with prompt tokens; decode: one token per sequence), from forward hooks. Components
    nest (the experts are in the MoE block, the kernel in the attention layer): each row
    counts its own time only. The MoE block is the module holding a `FusedMoE`, the
    attention layer the one holding an `Attention` (whatever the family's classes).
    "outside the forward" (logits, sampling, scheduling, the host's work) is the wall time
    the model's forward does not take."""
    from engine.attention.layer import Attention
    from engine.layers.fused_moe import FusedMoE

    model = llm.llm_engine.model_runner.model
    inclusive: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    started: dict[int, float] = {}
    phase = ["prefill"]

    def timed(module: torch.nn.Module, name: str) -> list[torch.utils.hooks.RemovableHandle]:
        def before(mod: torch.nn.Module, args: tuple) -> None:
            if mod is model:
                phase[0] = "decode" if args[2].is_decode else "prefill"
            started[id(mod)] = time.perf_counter()

        def after(mod: torch.nn.Module, args: tuple, out: object) -> None:
            inclusive[name][phase[0]] += time.perf_counter() - started[id(mod)]

        return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]

    def kind(module: torch.nn.Module) -> str | None:
        children = tuple(module.children())
        for leaf, name, holder in ((FusedMoE, "experts", "moe block"), (Attention, "kernel", "attention")):
            if isinstance(module, leaf):
                return name
            if any(isinstance(child, leaf) for child in children):
                return holder
        return None

    handles = timed(model, "forward")
    for module in model.modules():
        handles += timed(module, name) if (name := kind(module)) else []
    wall = time_ours(llm, workload)
    for handle in handles:
        handle.remove()
    return exclusive_times(inclusive, wall)


def exclusive_times(inclusive: dict[str, dict[str, float]], wall: float) -> dict[str, dict[str, float]]:
    """profile_ours' nested timings as each component's own time."""
    def minus(name: str, *inner: str) -> dict[str, float]:
        return {p: inclusive[name][p] - sum(inclusive[i][p] for i in inner) for p in ("prefill", "decode")}

    return {
        "experts (grouped products)": dict(inclusive["experts"]),
        "router, shared expert, MoE glue": minus("moe block", "experts"),
        "attention (the backend's kernel, cache writes)": dict(inclusive["kernel"]),
        "attention projections, q/k norms, rotary": minus("attention", "kernel"),
        "rest of the forward (embeddings, norms, dense MLPs)": minus("forward", "moe block", "attention"),
        "outside the forward (logits, sampling, host)": {"both": wall - sum(inclusive["forward"].values())},
    }


def print_profile(family: str, times: dict[str, dict[str, float]]) -> None:
    wall = sum(sum(phases.values()) for phases in times.values())
    print(f"-- profile of ours on {family} (one run, {wall:.2f} s):")
    print(f"{'component':<52}{'prefill s':>10}{'decode s':>10}{'total s':>9}{'share':>8}")
    for name, phases in times.items():
        total = sum(phases.values())
        prefill, decode = (f"{phases[p]:.2f}" if p in phases else "-" for p in ("prefill", "decode"))
        print(f"{name:<52}{prefill:>10}{decode:>10}{total:>9.2f}{total / wall:>8.1%}")


def print_family(result: FamilyResult, rounds: int) -> None:
    """Ours and every transformers setting tried, best of the rounds each ran."""
    print(f"== {result.family}: {result.workload.summary()}, EOS ignored, best of {rounds} round(s)")
    if result.skipped:
        print(f"{result.skipped}\n")
        return
    shape = f"{min(PROBE[0], len(result.workload.prompts))} prompts x {min(PROBE[1], result.workload.max_tokens[0])}"
    probe = " | ".join([*(f"{d} {e} {seconds:.2f} s" for (d, e), seconds in result.probe.items()),
                        *(f"{d} {e} failed ({error})" for (d, e), error in result.probe_errors.items())])
    print(f"transformers' probe ({shape} new tokens, one batch): {probe}")
    print(f"{'engine':<14}{'setup':<40}{'runs':>5}{'out tok/s':>11}{'ours/peer':>11}")
    ours = result.rate(result.ours)
    print(f"{'ours':<14}{result.dtype + ', one generate call':<40}{len(result.ours):>5}{ours:>11.1f}{'-':>11}")
    for setting, seconds in sorted(result.hf.items(), key=lambda item: min(item[1])):
        rate = result.rate(seconds)
        print(f"{'transformers':<14}{setting!s:<40}{len(seconds):>5}{rate:>11.1f}{ours / rate:>10.2f}x")
    if result.check:
        print(result.check)
    if result.profile:
        print_profile(result.family, result.profile)
    print()


def print_summary(results: list[FamilyResult]) -> None:
    """One row per family: ours against transformers' best setting."""
    print("== summary: output tokens/s, ours against transformers' static batched generate (its best setting)")
    print(f"{'family':<13}{'ours':>9}{'transformers':>14}  {'(its setting)':<40}{'ours/peer':>10}")
    for result in results:
        if result.skipped:
            print(f"{result.family:<13}{result.skipped}")
            continue
        best = result.best_hf()
        ours, theirs = result.rate(result.ours), result.rate(result.hf[best])
        print(f"{result.family:<13}{ours:>9.1f}{theirs:>14.1f}  {best!s:<40}{ours / theirs:>9.2f}x")


if __name__ == "__main__":
    sys.exit(main())
