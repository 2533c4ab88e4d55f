"""Finds a model folder, checks it, and loads its weights from safetensors."""

import functools
import hashlib
import json
import logging
import time
from contextlib import ExitStack, contextmanager
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.distributed.communicator import TensorParallelGroup
from engine.embedded_model import EMBEDDED_MODEL_NAME, ensure_embedded_model
from engine.layers.cpu_routing import route_through_cpu_kernels
from engine.layers.fused_moe import FusedMoE
from engine.layers.linear import Linear, ShardSlice
from engine.layers.triton_routing import route_through_triton
from engine.models import MODEL_REGISTRY, model_class_for
from engine.quantization import apply_quantization, checkpoint_format

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


class ModelLoadError(ValueError):
    """A model folder that cannot be used; the message names the path and the fix."""


def resolve_model_path(model: str | Path | None) -> Path:
    """The local folder for `model`: the embedded default, or a Hugging Face model folder."""
    if model is None or str(model) == EMBEDDED_MODEL_NAME:
        return ensure_embedded_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"model {str(model)!r} is not a local folder. This engine loads Hugging Face model "
            f"folders from disk (config.json, *.safetensors, tokenizer files) and never "
            f"downloads; pass a folder path or {EMBEDDED_MODEL_NAME!r}."
        )
    return path


def check_model_folder(path: Path, tokenizer_path: Path | None = None) -> list[Path]:
    """Checks that the folder holds a config, weights and a tokenizer; returns the weight files."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path} has no config.json: it is not a Hugging Face model folder")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / name for name in names]
        lost = [f.name for f in files if not f.is_file()]
        if lost:
            raise ModelLoadError(f"{path} lacks weight files listed in {index.name}: {lost}")
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(
            f"{path} has no *.safetensors weights (only safetensors are loaded; convert "
            f"pytorch_model.bin with transformers' save_pretrained(safe_serialization=True))"
        )
    tokenizer_dir = tokenizer_path or path
    if not any((tokenizer_dir / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{tokenizer_dir} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); save the "
            f"tokenizer into the model folder or pass tokenizer=PATH"
        )
    return files


@functools.cache
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def weights_fingerprint(path: Path) -> str:
    """sha256 over the names and contents of the folder's weight files.

    Identifies the weights in lineage metadata and data versions; cached per process by
    each file's size and modification time, so only the first call reads the files.
    """
    digest = hashlib.sha256()
    for file in check_model_folder(path):
        stat = file.stat()
        digest.update(f"{file.name}:{_file_sha256(file, stat.st_size, stat.st_mtime_ns)}\n".encode())
    return digest.hexdigest()


class CheckpointTensor:
    """A tensor of an open safetensors file, read only when asked: whole, or the slice a
    tensor-parallel rank holds (so no rank reads the whole checkpoint into memory)."""

    def __init__(self, reader: Any, name: str) -> None:
        self._reader = reader
        self._name = name
        self.shape = tuple(reader.get_slice(name).get_shape())

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        """The tensor, or its slice `piece`."""
        if piece is None:
            return self._reader.get_tensor(self._name)
        index = [slice(None)] * len(self.shape)
        index[piece.dim] = slice(piece.start, piece.start + piece.length)
        return self.read_region(tuple(index))

    def read_region(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The part of the tensor `index` selects, reading nothing else."""
        return self._reader.get_slice(self._name)[index]

    def rows(self, start: int, length: int) -> "CheckpointRows":
        """Rows [start, start + length) of the tensor, as a tensor of their own (one of the
        projections a checkpoint stores fused, as Phi-3's qkv_proj)."""
        return CheckpointRows(self, start, length)


class CheckpointRows:
    """Rows of a `CheckpointTensor`, read only when asked, like it: of a tensor-parallel
    slice, only the slice's part of these rows is read."""

    def __init__(self, tensor: CheckpointTensor, start: int, length: int) -> None:
        self._tensor = tensor
        self._start = start
        self.shape = (length, *tensor.shape[1:])

    def read(self, piece: ShardSlice | None = None) -> torch.Tensor:
        """These rows, or their slice `piece`."""
        index = [slice(self._start, self._start + self.shape[0])] + [slice(None)] * (len(self.shape) - 1)
        if piece is not None:
            first = piece.start + (self._start if piece.dim == 0 else 0)
            index[piece.dim] = slice(first, first + piece.length)
        return self._tensor.read_region(tuple(index))


@contextmanager
def open_safetensors(files: list[Path]) -> Iterator[list[tuple[str, CheckpointTensor]]]:
    """Every tensor in the files, to be read while the files are open (until the block
    ends: a quantized projection's parts may lie in several); a damaged file raises
    ModelLoadError naming it."""
    with ExitStack() as files_open:
        tensors = []
        for file in files:
            try:
                reader = files_open.enter_context(safe_open(file, framework="pt"))
                tensors += [(name, CheckpointTensor(reader, name)) for name in reader.keys()]
            except Exception as exc:  # safetensors raises several types for a damaged file
                raise ModelLoadError(
                    f"weight file {file} could not be read ({exc}); it may be truncated or "
                    f"corrupt: copy or convert it again"
                ) from exc
        yield tensors


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
    with torch.device("meta"):
        model = model_class(hf_config, max_position=model_config.max_model_len, group=group)
    if model_config.quantization is not None:
        apply_quantization(model, model_config.quantization, hf_config, model_config.device)
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
