"""The model folder: where a model name points (the embedded default or a local folder), what
it must hold, and a fingerprint of the files that decide its outputs."""

import functools
import hashlib
import importlib.util
import json
from pathlib import Path

from engine.model_loader.embedded_model import EMBEDDED_MODEL_NAME, ensure_embedded_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Mistral's own tokenizer file (Voxtral's hub folders hold only it): transformers reads it through mistral_common.
_MISTRAL_TOKENIZER = "tekken.json"


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
    mistral = (tokenizer_dir / _MISTRAL_TOKENIZER).is_file()
    if any((tokenizer_dir / name).is_file() for name in _TOKENIZER_FILES) or (mistral and mistral_common_installed()):
        return files
    if mistral:
        raise ModelLoadError(
            f"{tokenizer_dir} holds Mistral's {_MISTRAL_TOKENIZER} tokenizer only, which transformers reads through "
            "mistral_common: pip install 'dagster-llm[audio]', or pass tokenizer=PATH of a folder with tokenizer.json")
    raise ModelLoadError(
        f"{tokenizer_dir} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); save the "
        f"tokenizer into the model folder or pass tokenizer=PATH"
    )


def mistral_common_installed() -> bool:
    """Whether mistral_common, which reads Mistral's tokenizer files, can be imported."""
    return importlib.util.find_spec("mistral_common") is not None


@functools.cache
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


# Files of a model folder that no loader here reads and that cannot change a row: documentation
# and weights in formats other than safetensors (PyTorch pickles, GGUF, ONNX, TensorFlow, Flax).
_NOT_READ = ("*.md", "LICENSE*", "NOTICE*", "USE_POLICY*", "*.bin", "*.pt", "*.pth", "*.gguf", "*.onnx", "*.onnx_data",
             "*.h5", "*.msgpack", "*.ot", "*.tflite", "*.png", "*.jpg", "*.jpeg", "*.gif", "*.svg")


def model_fingerprint(path: Path, tokenizer_path: Path | None = None) -> str:
    """sha256 over the names and contents of every file of the model folder (and of the
    tokenizer's, when it is another) that can change a completion: the weights the engine
    reads, config.json, generation_config.json (sampling defaults), the tokenizer and its
    chat template, processor configs, sentence-transformers modules; not documentation,
    hidden files, nor weights in formats never loaded (nor *.safetensors that the
    checkpoint's index does not list).

    Identifies the model in lineage metadata, row digests and data versions; cached per
    process by each file's size and modification time, so only the first call reads the files.
    """
    weights = set(check_model_folder(path, tokenizer_path))
    files = [(f"model/{file.relative_to(path).as_posix()}", file) for file in _read_files(path, weights)]
    if tokenizer_path is not None and tokenizer_path.resolve() != path.resolve():
        files += [(f"tokenizer/{file.relative_to(tokenizer_path).as_posix()}", file)
                  for file in _read_files(tokenizer_path, set())]
    digest = hashlib.sha256()
    for name, file in sorted(files):
        stat = file.stat()
        digest.update(f"{name}:{_file_sha256(file, stat.st_size, stat.st_mtime_ns)}\n".encode())
    return digest.hexdigest()


def _read_files(folder: Path, weights: set[Path]) -> list[Path]:
    """The folder's files, through its subfolders, that a loader may read: `weights`, and
    every file that is neither hidden, nor in _NOT_READ, nor other safetensors."""
    found = []
    for file in folder.rglob("*"):
        if not file.is_file() or any(part.startswith(".") for part in file.relative_to(folder).parts):
            continue
        if file in weights or not (file.suffix == ".safetensors" or any(file.match(p) for p in _NOT_READ)):
            found.append(file)
    return found
