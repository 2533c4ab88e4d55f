"""Quantized copies of a model folder, packed as each format stores them (no download).

`quantize_folder(source, target, fmt)` writes `target`: `source`'s tokenizer and
config.json with the format's `quantization_config`, and its weights with every decoder
projection quantized; it returns the dequantized projections in float32, which a
reference model takes in place of its own to compute what the quantized one should.
Written here from the formats' descriptions, independently of the engine's reader:

- "fp8-tensor" / "fp8-channel": compressed-tensors' float-quantized e4m3 with one scale,
  or one per output feature (`weight_scale`);
- "fp8-block": block-wise FP8 (`quant_method` "fp8", `weight_block_size`), one scale per
  BLOCK x BLOCK tile (`weight_scale_inv`, the name the Qwen3 and DeepSeek releases use);
- "awq": AutoAWQ's GEMM format: asymmetric, `group_size` input features per scale and zero point,
  `qweight` [in, out / 8] with output features interleaved in each int32;
- "gptq" / "gptq-sym": AutoGPTQ's format with an activation order (`g_idx`, `desc_act`),
  `qweight` [in / 8, out], zero points stored minus one; "gptq-sym" with zero point 8.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FORMATS = ("fp8-tensor", "fp8-channel", "fp8-block", "awq", "gptq", "gptq-sym")
GROUP = 32  # the tiny test models'; released checkpoints mostly take 128
BLOCK = 32
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8(w: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values of w / scale, their float32 dequantization)."""
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, q.float() * scale


def _fp8_block(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    rows, cols = -(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK)
    scales = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scales[i, j] = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].abs().max() / FP8_MAX
    full = scales.repeat_interleave(BLOCK, 0)[:w.shape[0]].repeat_interleave(BLOCK, 1)[:, :w.shape[1]]
    q, deq = _fp8(w, full)
    return {"weight": q, "weight_scale_inv": scales}, deq


def _pack(values: torch.Tensor, order: list[int]) -> torch.Tensor:
    """uint4 values [rows, 8k] -> int32 [rows, k]: nibble j holds value order[j] of each eight."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for j, which in enumerate(order):
        words |= values[:, which::8].long() << (4 * j)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)


def _int4_groups(wt: torch.Tensor, group_of: torch.Tensor, sym: bool):  # noqa: ANN202
    """wt [in, out]; per (group, output feature) scale and zero point; q [in, out]."""
    groups = int(group_of.max()) + 1
    scales, zeros = torch.zeros(groups, wt.shape[1]), torch.zeros(groups, wt.shape[1])
    for g in range(groups):
        rows = wt[group_of == g]
        if sym:
            scales[g] = rows.abs().amax(0) * 2 / 15
            zeros[g] = 8
        else:
            low, high = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
            scales[g] = (high - low) / 15
            zeros[g] = torch.round(-low / scales[g]).clamp(0, 15)
    scales = scales.half().float()  # the checkpoint stores them in float16
    q = (torch.round(wt / scales[group_of]) + zeros[group_of]).clamp(0, 15)
    return q, scales, zeros, (q - zeros[group_of]) * scales[group_of]


def _awq(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    q, scales, zeros, deq = _int4_groups(w.t(), torch.arange(w.shape[1]) // group_size, sym=False)
    return {"qweight": _pack(q, order), "qzeros": _pack(zeros, order), "scales": scales.half()}, deq.t()


def _gptq(w: torch.Tensor, sym: bool, seed: int, group_size: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    inputs = w.shape[1]
    activation_order = torch.randperm(inputs, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(inputs, dtype=torch.int32)
    g_idx[activation_order] = (torch.arange(inputs) // group_size).int()
    q, scales, zeros, deq = _int4_groups(w.t(), g_idx.long(), sym)
    qweight = _pack(q.t().contiguous(), list(range(8))).t().contiguous()  # eight input features per word
    return {"qweight": qweight, "qzeros": _pack(zeros - 1, list(range(8))), "scales": scales.half(),
            "g_idx": g_idx}, deq.t()


def _quantization_config(fmt: str, group_size: int) -> dict:
    if fmt.startswith("fp8-") and fmt != "fp8-block":
        weights = {"num_bits": 8, "type": "float", "strategy": fmt.removeprefix("fp8-"), "symmetric": True,
                   "dynamic": False}
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"weights": weights, "input_activations": activations,
                                              "targets": ["Linear"]}}}
    if fmt == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": True, "sym": fmt == "gptq-sym",
            "checkpoint_format": "gptq"}


def quantize_weight(w: torch.Tensor, fmt: str, seed: int = 0,
                    group_size: int = GROUP) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's weight [out, in] as `fmt` stores it (tensor suffix -> tensor) and
    its dequantization in float32; 4-bit formats take `group_size` input features per scale."""
    w = w.float()
    if fmt == "fp8-tensor":
        q, deq = _fp8(w, w.abs().max() / FP8_MAX)
        return {"weight": q, "weight_scale": (w.abs().max() / FP8_MAX).reshape(1)}, deq
    if fmt == "fp8-channel":
        scale = w.abs().amax(1, keepdim=True) / FP8_MAX
        q, deq = _fp8(w, scale)
        return {"weight": q, "weight_scale": scale}, deq
    if fmt == "fp8-block":
        return _fp8_block(w)
    if fmt == "awq":
        return _awq(w, group_size)
    return _gptq(w, sym=fmt == "gptq-sym", seed=seed, group_size=group_size)


def quantize_folder(source: Path, target: Path, fmt: str, group_size: int = GROUP) -> dict[str, torch.Tensor]:
    """Writes `source` quantized in `fmt` to `target`; returns the dequantized weights by name."""
    shutil.copytree(source, target)
    weights_file = next(target.glob("*.safetensors"))
    state = load_file(weights_file)
    out, dequantized = {}, {}
    for seed, (name, tensor) in enumerate(sorted(state.items())):
        prefix, _, kind = name.rpartition(".")
        if kind == "weight" and prefix.rpartition(".")[2] in PROJECTIONS:
            stored, dequantized[name] = quantize_weight(tensor, fmt, seed, group_size)
            out.update({f"{prefix}.{suffix}": value.contiguous() for suffix, value in stored.items()})
        else:
            out[name] = tensor
    save_file(out, weights_file, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"] = _quantization_config(fmt, group_size)
    (target / "config.json").write_text(json.dumps(config))
    return dequantized
