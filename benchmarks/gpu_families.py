"""nano-vllm's workload on random models of the released gpt-oss-20b and DeepSeek-V2-Lite
shapes on one GPU: output tok/s of each (the MoE families' note; benchmarks/moe_throughput.py
covers them on a CPU at hidden 512). Dagster is never imported; nothing downloads.

Models: random checkpoints written without building the model. Tensor names and shapes come
from transformers' model on the meta device, as a release stores them (`revert_weight_conversion`,
what `save_pretrained` writes: DeepSeek's experts one by one, `experts.<e>.gate_proj.weight`);
gpt-oss's experts in the released MXFP4 layout (`gate_up_proj_blocks`/`_scales`,
`down_proj_blocks`/`_scales`; random codes, scales 2**-7 +- 1 so that values deviate about as
much as the rest) with config.json's quantization_config as released, the engine
dequantizing them at load. Each tensor is drawn on the device (N(0, 0.02); norms ones), into
bfloat16 safetensors shards of 4 GB with an index, in /dev/shm where it has room, with
gpu_check's byte-level tokenizer of the whole vocabulary; deleted once its model has run.

Workload (gpu_check's stage (b)): 256 prompts, input and output lengths each uniform in
100-1,024, random token ids, EOS ignored, one `generate`. A warm-up (every prompt,
WARM_TOKENS tokens each) times the prefill and a decode step: where the full count would not
fit the model's share of `--budget-s` (the time left over the models left), fewer prompts
run (3/4, 1/2, 1/4, 32); a run past its share stops, "not run (time)". A model whose
architecture the engine lacks is "not run (unsupported)"; one that fails shows its error.

--dry-run: tiny configs of both families on a CPU through the same code (names, MXFP4 layout,
shards, workload) at 4 prompts of 8-24 tokens; no time limit, nothing judged.

    PYTHONPATH=. python3 benchmarks/gpu_families.py          # the GPU: $OUT/gpu-families.md
    .venv/bin/python benchmarks/gpu_families.py --dry-run    # a CPU, in seconds
"""

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers.core_model_loading import revert_weight_conversion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.gpu_check import (  # noqa: E402
    DRY_SIZES, FULL_SIZES, NOT_RUN_TIME, TINY, Sizes, TimeUp, Workload, _Guard, build_vocab_tokenizer, git_commit,
    header, random_workload,
)
from engine import LLM  # noqa: E402
from engine.models import MODEL_REGISTRY  # noqa: E402

STD = 0.02
MXFP4_SCALE = 120  # E8M0 2**-7: random FP4 codes (rms 2.9) times it have an rms of about STD
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [  # gpt-oss-20b's config.json
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
MXFP4_TENSORS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
SHARD_BYTES = 4 << 30
# By dry run; on the GPU many more decode steps than the prefill of all prompts takes.
WARM_TOKENS = {False: 64, True: 2}
UNSUPPORTED, FAILED, OK, DRY = "not run (unsupported)", "failed", "ok", "dry run"


@dataclass(frozen=True)
class Shape:
    """A released model's shape: transformers' config class and settings, the engine's
    architecture for it, the settings of its tiny dry-run model, and its experts in MXFP4."""

    label: str
    config_class: str
    architecture: str
    settings: dict
    tiny: dict
    mxfp4: bool


SHAPES = {
    "gpt-oss-20b": Shape("gpt-oss-20b", "GptOssConfig", "GptOssForCausalLM", dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
        rms_norm_eps=1e-5, swiglu_limit=7.0, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": False},
        bos_token_id=1, eos_token_id=2, pad_token_id=0),
        dict(TINY, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"]), mxfp4=True),
    "deepseek-v2-lite": Shape("DeepSeek-V2-Lite", "DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=163840, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
        bos_token_id=1, eos_token_id=2),
        dict(TINY, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32), mxfp4=False),
}


def shape_config(shape: Shape, tiny: bool) -> transformers.PretrainedConfig:
    return getattr(transformers, shape.config_class)(**{**shape.settings, **(shape.tiny if tiny else {})})


def checkpoint_layout(config: transformers.PretrainedConfig, mxfp4: bool) -> dict[str, torch.Tensor]:
    """The tensors a released checkpoint of `config` stores, by name, on the meta device:
    bfloat16 but for the MXFP4 experts' blocks [E, out, in / 32, 16] and scales
    [E, out, in / 32] (uint8), which replace transformers' stacked [E, in, out]."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        layout = {}
        for name, tensor in revert_weight_conversion(model, model.state_dict()).items():
            if mxfp4 and name.endswith(MXFP4_TENSORS):
                experts, columns, rows = tensor.shape
                layout[f"{name}_blocks"] = torch.empty(experts, rows, columns // 32, 16, dtype=torch.uint8)
                layout[f"{name}_scales"] = torch.empty(experts, rows, columns // 32, dtype=torch.uint8)
            else:
                layout[name] = tensor.to(torch.bfloat16)
    return layout


def random_tensor(name: str, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """One of `like`'s shape and dtype drawn on `device`, returned on the CPU: MXFP4 codes and
    scales, ones for a norm, else N(0, STD)."""
    if name.endswith("_blocks"):
        tensor = torch.randint(0, 256, like.shape, dtype=torch.uint8, device=device)
    elif name.endswith("_scales"):
        tensor = torch.randint(MXFP4_SCALE - 1, MXFP4_SCALE + 2, like.shape, dtype=torch.uint8, device=device)
    elif name.endswith("norm.weight"):
        tensor = torch.ones(like.shape, dtype=like.dtype, device=device)
    else:
        tensor = torch.empty(like.shape, dtype=like.dtype, device=device).normal_(0.0, STD)
    return tensor.cpu()


def shards(layout: dict[str, torch.Tensor], shard_bytes: int) -> list[list[str]]:
    """The names in order, cut into shards of at most `shard_bytes` (or one tensor)."""
    cut, size = [[]], 0
    for name, tensor in layout.items():
        if cut[-1] and size + tensor.nbytes > shard_bytes:
            cut, size = [*cut, []], 0
        cut[-1].append(name)
        size += tensor.nbytes
    return cut


def write_checkpoint(folder: Path, shape: Shape, config: transformers.PretrainedConfig, device: torch.device,
                     shard_bytes: int) -> int:
    """The random checkpoint (shards, index, config.json, tokenizer) in `folder`; its weights' bytes."""
    layout = checkpoint_layout(config, shape.mxfp4)
    folder.mkdir(parents=True)
    groups = shards(layout, shard_bytes)
    weight_map = {}
    torch.manual_seed(0)
    for index, names in enumerate(groups):
        file = f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: random_tensor(name, layout[name], device) for name in names}, folder / file)
        weight_map.update(dict.fromkeys(names, file))
    total = sum(tensor.nbytes for tensor in layout.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.architectures, config.dtype = [shape.architecture], torch.bfloat16
    if shape.mxfp4:
        config.quantization_config = MXFP4_CONFIG
    config.save_pretrained(folder)
    build_vocab_tokenizer(folder, config.vocab_size)
    return total


@dataclass
class Outcome:
    """One model's row of the table; `note` goes under it."""

    model: str
    result: str
    workload: str = "-"
    output_rate: float | None = None
    total_rate: float | None = None
    build_s: float | None = None
    load_s: float | None = None
    kv_cache: str = "-"
    note: str = ""

    def row(self) -> str:
        def num(value: float | None, digits: int = 0) -> str:
            return "-" if value is None else f"{value:,.{digits}f}"

        return (f"| {self.model} | {self.workload} | {num(self.output_rate)} | {num(self.total_rate)} | "
                f"{num(self.build_s, 1)} | {num(self.load_s, 1)} | {self.kv_cache} | {self.result} |")


class StepClock(_Guard):
    """gpu_check's guard (TimeUp past `deadline`) that also notes when each step ended."""

    def __init__(self, deadline: float) -> None:
        super().__init__(deadline)
        self.ends = [time.monotonic()]

    def update(self, finished: int) -> None:
        self.ends.append(time.monotonic())
        super().update(finished)

    def seconds(self) -> float:
        return self.ends[-1] - self.ends[0]

    def step_s(self) -> float:
        """The median step: a decode step of (nearly) all prompts, which most steps are."""
        return statistics.median(b - a for a, b in zip(self.ends, self.ends[1:]))


def run(llm: LLM, workload: Workload, deadline: float) -> StepClock:
    """The workload in one `generate` from an empty prefix cache, stopped (TimeUp) past `deadline`."""
    llm.reset_prefix_cache()
    clock = StepClock(deadline)
    outputs = llm.generate(workload.inputs(), workload.params(), use_tqdm=lambda **_: clock)
    if [len(o.outputs[0].token_ids) for o in outputs] != workload.max_tokens:
        raise RuntimeError("the engine did not generate the tokens asked for")
    return clock


def fit(full: Workload, warm: StepClock, warm_tokens: int, seconds: float, sizes: Sizes) -> Workload | None:
    """The most prompts (all, 3/4, 1/2, 1/4, the minimum) expected to run in `seconds`: the
    warm-up's time for their prefill, then a decode step for each token past the warm-up's
    up to their longest output; None if even the minimum would not."""
    count = len(full.prompts)
    for n in dict.fromkeys([count, count * 3 // 4, count // 2, count // 4, sizes.min_prompts]):
        head = full.head(n)
        decode_s = (max(head.max_tokens) - warm_tokens) * warm.step_s()
        if 0 < n <= count and warm.seconds() * n / count + decode_s <= seconds:
            return head
    return None


def measure(outcome: Outcome, folder: Path, config: transformers.PretrainedConfig, sizes: Sizes,
            dry_run: bool, deadline: float) -> None:
    """Loads the engine, warms it up, fits and times the workload; fills in `outcome`."""
    full = random_workload(sizes.nano_prompts, sizes.nano_lengths, sizes.nano_lengths, config.vocab_size)
    settings = {"dtype": "float32" if dry_run else "bfloat16", "max_model_len": 2 * sizes.nano_lengths[1]}
    if dry_run:  # a tiny model: a small cache, one thread
        settings.update(kv_cache_memory=64 << 20, num_threads=1)
    started = time.monotonic()
    with LLM(str(folder), **settings) as llm:
        outcome.load_s = time.monotonic() - started
        cache, block = llm.llm_engine.model_runner.kv_cache, llm.llm_engine.config.block_size
        gib = cache.num_blocks * block * cache.bytes_per_token / 2**30
        outcome.kv_cache = f"{cache.num_blocks:,} blocks of {block} ({gib:.2f} GiB), {cache.bytes_per_token:,} B/token"
        warm_tokens = WARM_TOKENS[dry_run]
        warm = run(llm, Workload(full.prompts, [warm_tokens] * len(full.prompts)), deadline)
        workload = fit(full, warm, warm_tokens, deadline - time.monotonic(), sizes)
        outcome.workload = (workload or full).describe()
        say(f"{outcome.model}: loaded in {outcome.load_s:.1f} s, {outcome.kv_cache}; warm-up {warm.seconds():.1f} s, "
            f"median step {warm.step_s() * 1e3:.1f} ms; timing {outcome.workload if workload else 'nothing'}")
        if workload is None:
            outcome.result, outcome.note = NOT_RUN_TIME, "the warm-up says even the fewest prompts would not fit"
            return
        seconds = run(llm, workload, deadline).seconds()
        outputs = sum(workload.max_tokens)
        outcome.output_rate = outputs / seconds
        outcome.total_rate = (outputs + sum(map(len, workload.prompts))) / seconds
        outcome.result = DRY if dry_run else OK
        outcome.note = (f"{outcome.model}: {outputs:,} output tokens in {seconds:.1f} s; quantization "
                        f"{llm.llm_engine.model_config.quantization or 'none'}; warm-up {warm.seconds():.1f} s, "
                        f"its median step {warm.step_s() * 1e3:.1f} ms")


def say(message: str) -> None:
    print(f"[gpu-families {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_model(name: str, root: Path, sizes: Sizes, device: torch.device, deadline: float) -> Outcome:
    """One model from its folder's build to its row; its folder is deleted after."""
    shape = SHAPES[name]
    if shape.architecture not in MODEL_REGISTRY:
        return Outcome(shape.label, UNSUPPORTED, note=f"{shape.label}: {shape.architecture} is not in "
                                                      "engine.models.MODEL_REGISTRY")
    outcome, folder = Outcome(shape.label, FAILED), root / name
    config = shape_config(shape, tiny=device.type != "cuda")
    try:
        started = time.monotonic()
        size = write_checkpoint(folder, shape, config, device, SHARD_BYTES if device.type == "cuda" else 64 << 10)
        outcome.build_s = time.monotonic() - started
        say(f"{name}: {size / 1e9:.2f} GB written in {outcome.build_s:.1f} s")
        if time.monotonic() > deadline:
            raise TimeUp("the build took the model's share")
        measure(outcome, folder, config, sizes, device.type != "cuda", deadline)
    except TimeUp as exc:
        outcome.result, outcome.note = NOT_RUN_TIME, f"{shape.label}: {exc}"
    except Exception as exc:  # noqa: BLE001 - one model's failure is its row; the other still runs
        traceback.print_exc()
        outcome.result, outcome.note = FAILED, f"{shape.label}: {type(exc).__name__}: {str(exc)[:400]}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return outcome


def model_root(names: list[str], dry_run: bool) -> tempfile.TemporaryDirectory:
    """In /dev/shm (memory: 30 GB write and read fast) where it has room for the largest model, else the default."""
    sizes = [sum(t.nbytes for t in checkpoint_layout(shape_config(SHAPES[n], dry_run), SHAPES[n].mxfp4).values())
             for n in names]
    roomy = Path("/dev/shm").is_dir() and shutil.disk_usage("/dev/shm").free > 1.2 * max(sizes)
    return tempfile.TemporaryDirectory(prefix="gpu-families-", dir="/dev/shm" if roomy and not dry_run else None)


def markdown(lines: list[str], outcomes: list[Outcome], total_s: float) -> str:
    table = ["| model | workload | output tok/s | total tok/s | build s | load s | KV cache | result |",
             "|---|---|---|---|---|---|---|---|", *(o.row() for o in outcomes)]
    notes = [f"- {o.note}" for o in outcomes if o.note]
    return "\n".join(["## MoE families on a GPU: `benchmarks/gpu_families.py`", "", *lines, "", *table, "",
                      *notes, "", f"{total_s:.0f} s in all.", ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated subset of %(default)s")
    parser.add_argument("--budget-s", type=float, default=300.0, help="all the models' time (default 300)")
    parser.add_argument("--dry-run", action="store_true", help="tiny models on a CPU, no time limit, nothing judged")
    parser.add_argument("--output", type=Path, default=None, help="the markdown table (default $OUT/gpu-families.md "
                                                                  "where OUT is set, else printed only)")
    args = parser.parse_args()
    names = args.models.split(",")
    if unknown := sorted(set(names) - set(SHAPES)):
        parser.error(f"unknown models {unknown}; choose from {sorted(SHAPES)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry-run")
    started, device = time.monotonic(), torch.device("cpu" if args.dry_run else "cuda")
    output = args.output or (Path(os.environ["OUT"]) / ("gpu-families-dry-run.md" if args.dry_run else
                                                         "gpu-families.md") if os.environ.get("OUT") else None)
    end = float("inf") if args.dry_run else started + args.budget_s
    outcomes = []
    with model_root(names, args.dry_run) as tmp:
        for i, name in enumerate(names):
            share_end = time.monotonic() + (end - time.monotonic()) / (len(names) - i)
            outcomes.append(run_model(name, Path(tmp), DRY_SIZES if args.dry_run else FULL_SIZES, device, share_end))
            say(f"{name}: {outcomes[-1].result}")
    command = "python3 " + " ".join(["benchmarks/gpu_families.py", *sys.argv[1:]])
    text = markdown(header(device, git_commit(), command), outcomes, time.monotonic() - started)
    print(text)
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(text)
    return 1 if any(o.result == FAILED for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
