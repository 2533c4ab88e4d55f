"""benchmarks/gpu_families.py, nano-vllm's workload on gpt-oss-20b- and DeepSeek-V2-Lite-shaped
random models on a GPU: its dry run goes through the same code on a CPU at tiny size, so that
a broken script shows up here and not on a lent GPU; the full-size checkpoint layouts are
checked on the meta device (no weights), and the sizing of the timed run on a made-up clock."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors import safe_open

from benchmarks.gpu_check import DRY_SIZES, FULL_SIZES, random_workload
from benchmarks.gpu_families import SHAPES, StepClock, checkpoint_layout, fit, shape_config, write_checkpoint
from engine.models import MODEL_REGISTRY
from engine.quantization.mxfp4 import dequantize_mxfp4

ROOT = Path(__file__).resolve().parents[2]


def table_rows(markdown: str) -> dict[str, list[str]]:
    """The table's cells by model (workload, output tok/s, total tok/s, build s, load s, KV cache, result)."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split(" | ")] for line in markdown.splitlines()
            if line.startswith("| ") and not line.startswith("| model ")]
    return {row[0]: row[1:] for row in rows}


def test_dry_run_runs_both_models_without_dagster(tmp_path):
    """Both tiny models run (DeepSeek's only once the engine registers it: until then it is
    reported unsupported), the table is printed and written; Dagster is never imported."""
    blocker = tmp_path / "blocker" / "dagster"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('the GPU benchmark must not import Dagster')\n")
    env = {key: value for key, value in os.environ.items() if key != "OUT"}
    env["PYTHONPATH"] = os.pathsep.join([str(blocker.parent), str(ROOT)])
    output = tmp_path / "gpu-families.md"
    done = subprocess.run([sys.executable, "benchmarks/gpu_families.py", "--dry-run", "--output", str(output)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = table_rows(output.read_text())
    assert table_rows(done.stdout) == rows
    assert set(rows) == {"gpt-oss-20b", "DeepSeek-V2-Lite"}
    assert rows["gpt-oss-20b"][-1] == "dry run" and float(rows["gpt-oss-20b"][1].replace(",", "")) > 0
    assert "B/token" in rows["gpt-oss-20b"][5]
    deepseek = "dry run" if "DeepseekV2ForCausalLM" in MODEL_REGISTRY else "not run (unsupported)"
    assert rows["DeepSeek-V2-Lite"][-1] == deepseek


def test_full_size_layouts_are_the_releases():
    """gpt-oss-20b: 20.9B parameters, each layer's experts as MXFP4 blocks and scales (rows
    first), nothing stacked left in transformers' layout. DeepSeek-V2-Lite: 15.7B, layer 0
    dense, then 64 experts each under its own name, all bfloat16."""
    gpt_oss = checkpoint_layout(shape_config(SHAPES["gpt-oss-20b"], tiny=False), mxfp4=True)
    assert gpt_oss["model.layers.23.mlp.experts.gate_up_proj_blocks"].shape == (32, 5760, 90, 16)
    assert gpt_oss["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (32, 5760, 90)
    assert gpt_oss["model.layers.0.mlp.experts.down_proj_blocks"].shape == (32, 2880, 90, 16)
    assert gpt_oss["model.layers.0.mlp.experts.down_proj_scales"].dtype == torch.uint8
    assert gpt_oss["model.layers.0.self_attn.sinks"].shape == (64,)
    assert not [name for name in gpt_oss if name.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert 12.5e9 < sum(tensor.nbytes for tensor in gpt_oss.values()) < 14e9  # the release's 13 GB
    deepseek = checkpoint_layout(shape_config(SHAPES["deepseek-v2-lite"], tiny=False), mxfp4=False)
    assert deepseek["model.layers.26.mlp.experts.63.gate_proj.weight"].shape == (1408, 2048)
    assert deepseek["model.layers.1.mlp.shared_experts.down_proj.weight"].shape == (2048, 2816)
    assert deepseek["model.layers.0.mlp.gate_proj.weight"].shape == (10944, 2048)
    assert deepseek["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].shape == (576, 2048)
    assert not [name for name in deepseek if "gate_up_proj" in name or ".layers.0.mlp.experts" in name]
    assert {tensor.dtype for tensor in deepseek.values()} == {torch.bfloat16}
    assert 15.6e9 < sum(tensor.nbytes for tensor in deepseek.values()) / 2 < 15.8e9


def test_written_mxfp4_checkpoint_is_sharded_and_sane(tmp_path):
    """The tiny gpt-oss folder: several shards with an index naming every tensor, config.json
    with the release's quantization_config, experts that dequantize to values of about 0.02."""
    shape = SHAPES["gpt-oss-20b"]
    config = shape_config(shape, tiny=True)
    write_checkpoint(tmp_path / "gpt-oss", shape, config, torch.device("cpu"), shard_bytes=64 << 10)
    folder = tmp_path / "gpt-oss"
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert set(weight_map) == set(checkpoint_layout(config, mxfp4=True))
    saved = json.loads((folder / "config.json").read_text())
    assert saved["quantization_config"]["quant_method"] == "mxfp4"
    assert saved["architectures"] == ["GptOssForCausalLM"]
    name = "model.layers.1.mlp.experts.down_proj"
    with safe_open(folder / weight_map[f"{name}_blocks"], "pt") as blocks, \
            safe_open(folder / weight_map[f"{name}_scales"], "pt") as scales:
        values = dequantize_mxfp4(blocks.get_tensor(f"{name}_blocks"), scales.get_tensor(f"{name}_scales"),
                                  torch.float32)
    assert values.isfinite().all() and 0.01 < values.std() < 0.04


def clock(seconds: float, steps: int) -> StepClock:
    """A warm-up that took `seconds` in `steps` equal steps."""
    made = StepClock(float("inf"))
    made.ends = [i * seconds / steps for i in range(steps + 1)]
    return made


def test_the_timed_run_is_cut_to_the_time_left():
    """All 256 prompts where their estimate (the warm-up's share for their prefill, then a
    decode step per token up to the longest output) fits; the most that fit where not; None
    where even the minimum would not."""
    full = random_workload(FULL_SIZES.nano_prompts, FULL_SIZES.nano_lengths, FULL_SIZES.nano_lengths, 1000)
    warm = clock(8.0, 64)  # steps of 0.125 s, exact in binary

    def estimate(count: int) -> float:
        return 8.0 * count / 256 + (max(full.max_tokens[:count]) - 64) * 0.125

    assert fit(full, warm, 64, estimate(256), FULL_SIZES).prompts == full.prompts
    cut = fit(full, warm, 64, estimate(256) - 0.5, FULL_SIZES)
    assert len(cut.prompts) in (192, 128, 64, 32) and estimate(len(cut.prompts)) <= estimate(256) - 0.5
    assert fit(full, warm, 64, 1.0, FULL_SIZES) is None
    assert len(fit(full.head(4), clock(1.0, 4), 2, float("inf"), DRY_SIZES).prompts) == 4
