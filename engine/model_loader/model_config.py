"""`ModelConfig` from a model folder: what config.json, generation_config.json and a
sentence-transformers folder decide, resolved against the engine settings."""

import json
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from engine.config import DTYPES, EngineConfig, ModelConfig, PoolerConfig
from engine.hardware import cpu_dtype, detect_cpu, resolve_device
from engine.model_loader.folder import ModelLoadError
from engine.models import POOLING_ARCHITECTURES, is_encoder_decoder, language_model_config, multimodal_class_for
from engine.quantization import checkpoint_quantization, resolve_quantization

# generation_config.json keys that vLLM takes as sampling defaults -> SamplingParams field.
_GENERATION_DEFAULTS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens",
}

# sentence-transformers' Pooling modes -> our pooling type: its `pooling_mode` (version 6), or
# one flag set among the older `pooling_mode_*` flags.
_SENTENCE_TRANSFORMERS_MODES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}
_SENTENCE_TRANSFORMERS_FLAGS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
                                "pooling_mode_cls_token": "cls"}


def resolve_model_config(path: Path, engine: EngineConfig, eos_token_id: int | None) -> ModelConfig:
    """The model folder's facts resolved against the engine settings: its language model's
    config, the compute dtype, the context length, the end-of-sequence ids and sampling
    defaults of generation_config.json, the quantization method and a pooling model's pooler."""
    whole = AutoConfig.from_pretrained(path)
    try:
        hf_config = language_model_config(whole)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    multimodal = whole if multimodal_class_for(getattr(whole, "architectures", None) or []) else None
    if not getattr(hf_config, "architectures", None) and hf_config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        # As transformers' AutoModelForCausalLM (and vLLM) resolve a config.json without one.
        hf_config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type]]
    device = resolve_device(engine.device)
    architectures = getattr(whole, "architectures", None) or []
    encoder_decoder = is_encoder_decoder(architectures)
    method = checkpoint_quantization(hf_config) or engine.quantization
    if encoder_decoder and method not in (None, "auto", "int8"):
        raise ModelLoadError(f"{path}: quantization={method!r} is not supported for {architectures[0]} yet: "
                             "leave quantization unset, or use 'int8' (on a CPU with VNNI) or an unquantized "
                             "checkpoint")
    max_model_len = _max_model_len(hf_config, engine.max_model_len,
                                   multimodal_class_for(architectures) if encoder_decoder else None)
    eos = {eos_token_id} if eos_token_id is not None else set()
    defaults = {}
    if (path / "generation_config.json").exists():
        generation = json.loads((path / "generation_config.json").read_text())
        ids = generation.get("eos_token_id")
        eos |= set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        # Only what the file sets: transformers' own defaults (top_k=50) are not vLLM's.
        defaults = {name: generation[key] for key, name in _GENERATION_DEFAULTS.items() if key in generation}
    dtype = _resolve_dtype(engine.dtype, hf_config, device)
    pooler = resolve_pooler(path, hf_config, engine.runner, engine.pooling_type, POOLING_ARCHITECTURES)
    quantization = resolve_quantization(engine.quantization, hf_config, device,
                                        auto_dtype=dtype if engine.dtype == "auto" else None,
                                        batch_invariant=engine.batch_invariant, pooling=pooler is not None)
    if multimodal is not None and pooler is not None:
        raise ModelLoadError(f"{path}: {whole.architectures[0]} generates text from images or audio; embedding or "
                             "classifying with it is not supported: use runner='generate'")
    return ModelConfig(path, hf_config, dtype, device, max_model_len, eos, defaults, quantization, pooler,
                       multimodal)


def resolve_pooler(path: Path, hf_config: PretrainedConfig, runner: str, pooling_type: str | None,
                   pooling_names: dict[str, tuple[type, str]]) -> PoolerConfig | None:
    """The pooler of the model folder, or None for a generative model.

    "auto" pools for a pooling architecture or a folder with sentence-transformers'
    modules.json; "pooling" pools any supported decoder (a causal LM's head is then
    unused, as for Qwen3-Embedding). The pooling type is `pooling_type` when set, else
    the sentence-transformers Pooling module's, else LAST.

    Raises:
        ValueError: "generate" for a checkpoint that has no language-model head.
    """
    architectures = getattr(hf_config, "architectures", None) or []
    pooling_arch = next((a for a in architectures if a in pooling_names), None)
    sentence = _sentence_transformers_pooling(path)
    if runner == "generate" and pooling_arch is not None:
        raise ValueError(f"{path}: architecture {pooling_arch} has no language-model head to generate with: "
                         "load it with runner='pooling' (or 'auto') and call embed, classify or score")
    if runner == "generate" or (runner == "auto" and pooling_arch is None and sentence is None):
        return None
    task = pooling_names[pooling_arch][1] if pooling_arch is not None else "embed"
    chosen = pooling_type or (sentence[0] if sentence else "LAST")
    normalize = sentence[1] if sentence else task == "embed"
    num_labels = getattr(hf_config, "num_labels", 0) if task == "classify" else 0
    return PoolerConfig(task, chosen, normalize, num_labels)


def _sentence_transformers_pooling(path: Path) -> tuple[str, bool] | None:
    """(pooling type, normalize) from a sentence-transformers folder's modules.json and
    its Pooling module's config.json, or None when the folder has none."""
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return None
    modules = json.loads(modules_file.read_text())
    pooling_type = "LAST"
    for module in modules:
        if module.get("type", "").endswith(".Pooling"):
            settings = json.loads((path / module["path"] / "config.json").read_text())
            modes = settings.get("pooling_mode")
            modes = [modes] if isinstance(modes, str) else modes or [
                mode for flag, mode in _SENTENCE_TRANSFORMERS_FLAGS.items() if settings.get(flag)]
            if len(modes) != 1 or modes[0] not in _SENTENCE_TRANSFORMERS_MODES:
                raise ValueError(f"{path}: the Pooling module pools by {modes or 'no mode'}; the engine pools by "
                                 f"exactly one of {sorted(_SENTENCE_TRANSFORMERS_MODES)}")
            pooling_type = _SENTENCE_TRANSFORMERS_MODES[modes[0]]
    normalize = any(module.get("type", "").endswith(".Normalize") for module in modules)
    return pooling_type, normalize


def _resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """The compute dtype: on a CPU by what it can do (see `cpu_dtype`); on a GPU the
    requested one, or for "auto" the checkpoint's own where it is 16-bit and bfloat16
    otherwise (as vLLM does for float32 checkpoints)."""
    checkpoint = getattr(hf_config, "dtype", None) or torch.float32
    if isinstance(checkpoint, str):
        checkpoint = getattr(torch, checkpoint) if checkpoint in DTYPES else torch.float32
    requested = None if dtype == "auto" else getattr(torch, dtype)
    if device.type == "cpu":
        return cpu_dtype(requested, checkpoint, detect_cpu())
    if requested is None and checkpoint == torch.float32:
        return torch.bfloat16
    return requested or checkpoint


def _max_model_len(hf_config: PretrainedConfig, requested: int | None, model_class: type | None = None) -> int:
    """`requested`, or the model's context: config.json's max_position_embeddings, or what
    `model_class.max_positions` reads for a model whose config has none (Whisper's decoder:
    max_target_positions)."""
    limit = (model_class.max_positions(hf_config) if model_class is not None
             else getattr(hf_config, "max_position_embeddings", None) or 2048)
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len={requested} exceeds the model's context of {limit} tokens "
            f"(its config.json); use at most {limit}"
        )
    return requested
