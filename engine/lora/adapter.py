"""Reads a PEFT LoRA adapter from disk and checks it against the model before anything runs."""

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT saves `base_model.model.<module path>.lora_A.weight` and `...lora_B.weight`.
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
# The parts of a mixture-of-experts layer, as Mixtral's and Qwen-MoE's checkpoints name them:
# experts, the router (`gate`), the shared expert and its gate.
_MOE_MODULE = re.compile(r"\.(block_sparse_moe|experts|shared_expert)\.|\.mlp\.(gate|shared_expert_gate)$")
_MOE_FIX = ("adapters on the experts, routers and shared experts of mixture-of-experts layers are not supported: "
            "train the adapter on the attention projections (target_modules=[\"q_proj\", \"k_proj\", \"v_proj\", "
            "\"o_proj\"])")


class LoRAError(ValueError):
    """An adapter that cannot run on this engine; the message names it, the problem and the fix."""


@dataclass
class ModuleLoRA:
    """One projection's adapter: `a` [rank, in], and `b` [out, rank] already multiplied by
    the scaling (alpha / rank, or alpha / sqrt(rank) for rsLoRA)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    """An adapter read into host memory. `modules` is keyed by the projection's path in
    the Hugging Face model ("model.layers.0.self_attn.q_proj"); `digest` is the sha256 of
    its config and weights, what changes when the adapter does."""

    request: LoRARequest
    modules: dict[str, ModuleLoRA]
    digest: str


def describe(request: LoRARequest) -> str:
    return f"LoRA adapter {request.lora_name!r} (lora_int_id {request.lora_int_id}, {request.lora_path})"


def read_adapter_config(request: LoRARequest, max_rank: int) -> dict:
    """The adapter's config, checked for what this engine supports; reads no weights."""
    where = describe(request)
    folder = Path(request.lora_path).expanduser()
    if not folder.is_dir():
        raise LoRAError(f"{where}: the folder does not exist; pass the folder PEFT's save_pretrained wrote")
    if not (folder / CONFIG_FILE).is_file():
        raise LoRAError(f"{where}: has no {CONFIG_FILE}; it is not a PEFT adapter folder")
    if not (folder / WEIGHTS_FILE).is_file():
        raise LoRAError(f"{where}: has no {WEIGHTS_FILE} (only safetensors adapters are loaded; save with "
                        f"PEFT's save_pretrained(safe_serialization=True))")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    unsupported = []
    if config.get("peft_type", "LORA") != "LORA":
        unsupported.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    if config.get("use_dora"):
        unsupported.append("use_dora (DoRA)")
    if config.get("bias", "none") != "none":
        unsupported.append(f"bias={config.get('bias')!r} (only 'none')")
    if config.get("modules_to_save"):
        unsupported.append(f"modules_to_save={config.get('modules_to_save')!r}")
    if config.get("fan_in_fan_out"):
        unsupported.append("fan_in_fan_out")
    if unsupported:
        raise LoRAError(f"{where}: uses {', '.join(unsupported)}, which this engine does not support")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_rank:
        raise LoRAError(f"{where}: rank {max(ranks)} is above max_lora_rank={max_rank}; "
                        f"create the LLM with max_lora_rank={_next_power_of_two(max(ranks))} or more")
    return config


def load_adapter(
    request: LoRARequest,
    targets: Mapping[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
    base_model: str,
) -> LoRAAdapter:
    """Reads the adapter and checks every tensor against the model's projections.

    `targets` maps each projection that can take an adapter ("model.layers.0.self_attn.
    q_proj") to its (in_features, out_features). `base_model` names the model in errors.

    Raises:
        LoRAError: a missing folder or file, an unsupported PEFT feature, a rank above
            `max_rank`, a projection the model lacks, or shapes from another base model.
    """
    where = describe(request)
    config = read_adapter_config(request, max_rank)
    supported = sorted({t.rpartition(".")[2] for t in targets})
    named = config.get("target_modules")
    unknown = sorted(set(named) - set(supported)) if isinstance(named, list) else []
    if unknown:
        moe = " (this model's MLPs are mixtures of experts: " + _MOE_FIX + ")" if _routed_mlps(targets) else ""
        raise LoRAError(f"{where}: targets {', '.join(unknown)}, which this model cannot adapt "
                        f"(LoRA goes on {', '.join(supported)}){moe}")
    folder = Path(request.lora_path).expanduser()
    digest = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        digest.update((folder / name).read_bytes())
    try:
        tensors = load_file(folder / WEIGHTS_FILE)
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise LoRAError(f"{where}: {WEIGHTS_FILE} cannot be read ({exc}); save the adapter again") from exc
    trained_for = config.get("base_model_name_or_path") or "an unnamed base model"
    check = _ModuleCheck(where, config, targets, supported, max_rank, dtype,
                         mismatch=f"the adapter was trained for {trained_for!r}; this engine runs {base_model!r}")
    modules = {module: check.module_lora(module, pair) for module, pair in sorted(_lora_pairs(where, tensors).items())}
    if not modules:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return LoRAAdapter(request, modules, digest.hexdigest())


def _routed_mlps(targets: Mapping[str, tuple[int, int]]) -> bool:
    """Whether some layers' MLPs take no adapter because they are mixtures of experts: a
    layer with attention targets and no MLP ones."""
    layers = {t.split(".self_attn.")[0] for t in targets if ".self_attn." in t}
    return any(not any(t.startswith(layer + ".mlp.") for t in targets) for layer in layers)


def _lora_pairs(where: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """The weights file's tensors by module path, then "A" or "B"."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key!r} is not a LoRA A or B matrix; only LoRA weights are supported")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    return pairs


@dataclass(frozen=True)
class _ModuleCheck:
    """Checks one adapter's modules against the model's projections (`load_adapter`'s
    arguments); `mismatch` says which base model the adapter was trained for, and which
    this engine runs."""

    where: str
    config: dict
    targets: Mapping[str, tuple[int, int]]
    supported: list[str]
    max_rank: int
    dtype: torch.dtype
    mismatch: str

    def module_lora(self, module: str, pair: dict[str, torch.Tensor]) -> ModuleLoRA:
        """The module's A and B matrices, once they fit its projection, B scaled.

        Raises:
            LoRAError: a matrix without its partner, a projection the model lacks, shapes
                from another base model, or a rank above max_lora_rank.
        """
        where = self.where
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{where}: {module} has lora_{''.join(pair)} but not its partner; save the adapter again")
        if _MOE_MODULE.search(module):
            raise LoRAError(f"{where}: targets {module}, part of a mixture-of-experts layer; {_MOE_FIX}")
        if module not in self.targets:
            leaf = module.rpartition(".")[2]
            if any(t.endswith("." + leaf) for t in self.targets):
                raise LoRAError(f"{where}: targets {module}, which this model lacks: {self.mismatch}")
            raise LoRAError(f"{where}: targets {module}, which this model lacks or cannot adapt "
                            f"(LoRA goes on {', '.join(self.supported)})")
        a, b = pair["A"], pair["B"]
        in_features, out_features = self.targets[module]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
            raise LoRAError(
                f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, but the model's "
                f"projection maps {in_features} to {out_features} features: {self.mismatch}"
            )
        if rank > self.max_rank:
            raise LoRAError(f"{where}: {module} has rank {rank}, above max_lora_rank={self.max_rank}; create the "
                            f"LLM with max_lora_rank={_next_power_of_two(rank)} or more")
        scaling = _scaling(self.config, module, rank)
        return ModuleLoRA(a.to(torch.float32).to(self.dtype), (b.to(torch.float32) * scaling).to(self.dtype))


def _scaling(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling for one module: its alpha (from alpha_pattern when a pattern
    matches the module's path, as PEFT matches them) over its rank, or over sqrt(rank)."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?{pattern}$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _next_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()
