"""GPU throughput: our engine against transformers on one GPU, same prompts, one run.

The model is random-weight, shaped like Llama-3.2-1B (config built here, nothing
downloaded), in bfloat16; `--model qwen3-moe` takes Qwen3-30B-A3B's shape instead (128
experts, 8 per token) with 12 of its 48 layers, so that it fits beside its KV cache. Workload: prompts of 128-1,024 random tokens x 128-512 new
tokens, EOS ignored (`--prompts`, default 1,024). Peers: transformers' static batched
`generate` (batches of 64, left-padded; only requested tokens count) and its continuous
batching (`generate_batch`, paged attention), each on the first `--peer-prompts` prompts
(they are much slower) and compared by tokens/s. Then the decode step's fraction of the
HBM roofline at batch 256: bytes a decode step must read (weights and the batch's KV
cache) at the measured copy bandwidth, against our measured decode step.

    PYTHONPATH=. python3 benchmarks/gpu_throughput.py
    PYTHONPATH=. python3 benchmarks/gpu_throughput.py --prompts 256 --peer-prompts 64
    PYTHONPATH=. python3 benchmarks/gpu_throughput.py --model qwen3-moe --prompts 256 --peers hf-generate
"""

import argparse
import logging
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import PretrainedConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402
from tests.quantized_checkpoints import quantize_folder  # noqa: E402
from tests.tiny_models import build_tokenizer  # noqa: E402

# --quantizations: what each writes from the bfloat16 model, as the releases store it.
CHECKPOINTS = {"fp8": ("fp8-channel", "compressed-tensors FP8, a scale per output feature"),
               "awq": ("awq", "AWQ 4-bit, groups of 128")}


def model_config(name: str) -> "PretrainedConfig":
    """Llama-3.2-1B's shape, or Qwen3-30B-A3B's with 12 of its 48 layers (7.6B parameters)."""
    import transformers

    if name == "qwen3-moe":
        return transformers.Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
            num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    return transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=4096,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )


def build_model(folder: Path, name: str) -> Path:
    """A random model folder of `model_config(name)`'s shape in bfloat16."""
    import transformers

    config = model_config(name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder


def workload(count: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 128000) for _ in range(rng.randint(128, 1024))] for _ in range(count)]
    return prompts, [rng.randint(128, 512) for _ in range(count)]


def run_ours(folder: Path, prompts: list[list[int]], max_tokens: list[int], **settings) -> float:
    with LLM(str(folder), dtype="bfloat16", **settings) as llm:
        warm = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], warm, use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
    return elapsed


def run_hf_generate(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int = 64) -> float:
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        model.generate(ids, attention_mask=mask, max_new_tokens=max(max_tokens[first : first + batch_size]),
                       min_new_tokens=max(max_tokens[first : first + batch_size]), do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_hf_continuous(model, prompts: list[list[int]], max_tokens: list[int]) -> float:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=max(max_tokens), min_new_tokens=max(max_tokens), do_sample=False,
                              eos_token_id=-1, pad_token_id=0, max_batch_tokens=8192)
    start = time.perf_counter()
    model.generate_batch(inputs=prompts, generation_config=config)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, read and write counted."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - start)


def decode_roofline(folder: Path, batch: int = 256, prompt_len: int = 128, steps: int = 128) -> str:
    """Our decode step at `batch` sequences against the HBM time its bytes need."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 128000) for _ in range(prompt_len)] for _ in range(batch)]
    with LLM(str(folder), dtype="bfloat16", max_num_seqs=batch) as llm:
        runner = llm.llm_engine.model_runner
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        kv_per_token = runner.kv_cache.bytes_per_token
        times = {}
        for new_tokens in (1, steps + 1):
            params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)  # warm
            llm.reset_prefix_cache()
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            times[new_tokens] = time.perf_counter() - start
            llm.reset_prefix_cache()
        replay = _replay_seconds(runner, batch)
    step = (times[steps + 1] - times[1]) / steps
    step_bytes = weight_bytes + batch * (prompt_len + steps / 2) * kv_per_token
    bandwidth = copy_bandwidth()
    floor = step_bytes / bandwidth
    return (f"decode at batch {batch}: {step * 1e3:.2f} ms/step; reads {step_bytes / 1e9:.2f} GB (weights "
            f"{weight_bytes / 1e9:.2f} GB + KV cache) at {bandwidth / 1e12:.2f} TB/s measured copy bandwidth = "
            f"{floor * 1e3:.2f} ms: {floor / step:.0%} of the HBM roofline; the model's forward (a CUDA graph "
            f"replay) takes {replay * 1e3:.2f} ms of the step ({floor / replay:.0%} of the roofline)")


def _replay_seconds(runner, batch: int) -> float:
    """Mean time of the captured decode forward at `batch`, replayed alone."""
    if runner.cuda_graphs is None:
        return float("nan")
    graph = runner.cuda_graphs.graphs[batch]
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--peer-prompts", type=int, default=128, help="prompts the transformers peers run")
    parser.add_argument("--peers", default="hf-generate,hf-continuous")
    parser.add_argument("--roofline-only", action="store_true", help="only the decode roofline measurement")
    parser.add_argument("--model", choices=["llama-1b", "qwen3-moe"], default="llama-1b")
    parser.add_argument("--quantizations", default="", help="also run the model quantized by this benchmark: "
                        + ", ".join(f"{k} ({v[1]})" for k, v in CHECKPOINTS.items()))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / f"{args.model}-random", args.model)
        if args.roofline_only:
            print(decode_roofline(folder))
            return
        prompts, max_tokens = workload(args.prompts)
        rows = []
        for name, settings in (("ours", {}), ("ours, eager", {"enforce_eager": True})):
            seconds = run_ours(folder, prompts, max_tokens, **settings)
            rows.append((name, len(prompts), sum(max_tokens) / seconds))
        for key in filter(None, args.quantizations.split(",")):
            started = time.perf_counter()
            quantized = Path(tmp) / key
            quantize_folder(folder, quantized, CHECKPOINTS[key][0], group_size=128)
            print(f"{key}: checkpoint written in {time.perf_counter() - started:.0f} s")
            seconds = run_ours(quantized, prompts, max_tokens)
            rows.append((f"ours, {CHECKPOINTS[key][1]}", len(prompts), sum(max_tokens) / seconds))
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, device_map="cuda")
        peer_prompts, peer_tokens = prompts[: args.peer_prompts], max_tokens[: args.peer_prompts]
        runners = {"hf-generate": ("transformers generate (batch 64)", run_hf_generate),
                   "hf-continuous": ("transformers generate_batch", run_hf_continuous)}
        for key in filter(None, args.peers.split(",")):
            label, runner = runners[key]
            try:
                seconds = runner(model, peer_prompts, peer_tokens)
                rows.append((label, len(peer_prompts), sum(peer_tokens) / seconds))
            except Exception as error:  # a peer's API differs between transformers versions
                print(f"{label}: failed ({type(error).__name__}: {str(error)[:200]})")
        del model
        torch.cuda.empty_cache()
        ours = rows[0][2]
        print(f"\n{'engine':36} {'prompts':>8} {'out tok/s':>10} {'ours/peer':>10}")
        for name, count, rate in rows:
            print(f"{name:36} {count:>8} {rate:>10.0f} {ours / rate:>9.2f}x")
        if args.model == "llama-1b":  # every weight read per step; a mixture reads only the chosen experts
            print("\n" + decode_roofline(folder))


if __name__ == "__main__":
    main()
