"""Builds the model family a checkpoint names and loads its weights (vLLM's `DefaultModelLoader`)."""

import logging
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.config import ModelConfig
from engine.distributed.communicator import TensorParallelGroup
from engine.layers.fused_moe import FusedMoE
from engine.layers.linear import Linear
from engine.model_loader.folder import ModelLoadError, check_model_folder
from engine.model_loader.kernel_routing import route_through_cpu_kernels, route_through_triton
from engine.model_loader.weights import open_safetensors
from engine.models import MODEL_REGISTRY, model_class_for
from engine.quantization import apply_quantization, checkpoint_format

logger = logging.getLogger(__name__)


class SkipInitializers(TorchFunctionMode):
    """Leaves out `torch.nn.init`'s initializers while a model is built on the meta device,
    where they would fill nothing: the weights come from the checkpoint. On meta tensors they
    run PyTorch's Python reference kernels, whose first use imports torch._dynamo (0.7 s of
    every engine process's start)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def load_model(model_config: ModelConfig, group: TensorParallelGroup | None = None,
               triton_kernels: bool = False, calibrate: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """Builds the model family named in config.json and fills it from the folder's
    weights: with a tensor-parallel `group`, this rank's share of them. With
    `triton_kernels` its layers run through Triton (`route_through_triton`), and otherwise
    on a CPU its norms, rotary embeddings and MLP activations through C++
    (`route_through_cpu_kernels`),
    before the rest are prepacked for this device; `calibrate` runs on the routed model
    just before (int8's input ranges, measured on the unquantized weights)."""
    started = time.perf_counter()
    hf_config = model_config.hf_config
    architectures = getattr(hf_config, "architectures", None) or []
    model_class = model_class_for(architectures, model_config.pooler)
    if model_class is None:
        raise ModelLoadError(
            f"{model_config.path}: architecture {architectures} is not supported "
            f"(supported: {sorted(MODEL_REGISTRY)}, and each family's Model and ForSequenceClassification)"
        )
    files = check_model_folder(model_config.path)
    with torch.device("meta"), SkipInitializers():
        model = model_class(model_config.multimodal_config or hf_config, max_position=model_config.max_model_len,
                            group=group)
    if model_config.quantization is not None:
        apply_quantization(model, model_config.quantization, hf_config, model_config.device, triton_kernels)
    model.materialize(model_config.device, model_config.dtype)
    try:
        with open_safetensors(files) as weights:
            if (stored := checkpoint_format(hf_config)) is not None:
                weights = stored.quantized_tensors(weights)
            model.load_weights(weights)
    except ModelLoadError:
        raise
    except ValueError as exc:
        raise ModelLoadError(f"{model_config.path}: {exc}") from exc
    if triton_kernels:
        route_through_triton(model)
    elif model_config.device.type == "cpu":
        route_through_cpu_kernels(model)
    if calibrate is not None:
        calibrate(model)
    model.prepack()
    model.eval()
    logger.info(
        "Loaded %s (%s%s, %s, weights %.1f MiB) from %s in %.2f s", model_class.__name__, model_config.dtype_name,
        f", quantization {model_config.quantization}" if model_config.quantization else "", model_config.device, weight_bytes(model) / 2**20, model_config.path, time.perf_counter() - started,
    )
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold: its parameters and buffers (tied ones once) and the
    prepacked copies that replaced projection weights (`Linear.prepack`)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*model.parameters(), *model.buffers()) if t.numel()}
    packed = [m.packed_weight for m in model.modules() if isinstance(m, Linear) and m.packed_weight is not None]
    packed += [w for m in model.modules() if isinstance(m, FusedMoE) and m.packed for w in m.packed.w13 + m.packed.w2]
    return sum(storages.values()) + sum(p.numel() * p.element_size() for p in packed)  # oneDNN's are opaque
