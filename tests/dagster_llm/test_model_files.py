"""A model folder on an object store (moto's S3 server): fetched once per machine into the
cache, fetched again when its files change, and loaded by the resource from its URL."""

import os

import pytest

from dagster_llm import LLMResource
from engine import LLM
from dagster_llm.core.model_files import is_remote, local_model_folder


@pytest.fixture
def remote_model(s3_bucket, tiny_models, tmp_path, monkeypatch):
    """The tiny Llama uploaded to s3://<bucket>/models/llama; the environment names the server."""
    for name, value in s3_bucket.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("DAGSTER_LLM_CACHE", str(tmp_path / "cache"))
    folder = s3_bucket.path("models", "llama")
    folder.fs.put(str(tiny_models["llama"]) + "/", folder.path, recursive=True)
    return folder


def test_only_object_store_urls_are_fetched():
    assert is_remote("s3://bucket/models/x") and is_remote("gs://b/m") and is_remote("az://c/m")
    assert not is_remote("/models/x") and not is_remote("file:///models/x") and not is_remote("smollm2-135m-instruct")
    assert local_model_folder("/models/x") == "/models/x"


def test_a_folder_is_fetched_once_and_again_when_it_changes(remote_model, tiny_models, tmp_path):
    url = f"s3://{remote_model.path}"
    local = local_model_folder(url)
    assert local.startswith(str(tmp_path / "cache" / "remote-models" / "llama-"))
    assert sorted(os.listdir(local)) == sorted(os.listdir(tiny_models["llama"]))
    fetched = os.stat(os.path.join(local, "config.json")).st_mtime_ns
    assert local_model_folder(url) == local and os.stat(os.path.join(local, "config.json")).st_mtime_ns == fetched
    remote_model.fs.pipe_file((remote_model / "extra.txt").path, b"new")
    changed = local_model_folder(url)
    assert changed != local and os.path.exists(os.path.join(changed, "extra.txt"))
    assert not [name for name in os.listdir(tmp_path / "cache" / "remote-models") if name.startswith(".")]


def test_an_empty_url_says_what_to_point_at(remote_model):
    with pytest.raises(FileNotFoundError, match="no files there; point model_id at a model folder"):
        local_model_folder(f"s3://{remote_model.path}-missing")


@pytest.mark.slow
def test_the_resource_loads_a_model_from_its_url(remote_model, tiny_models):
    resource = LLMResource(model_id=f"s3://{remote_model.path}", dtype="float32", kv_cache_memory=10 << 20)
    llm = resource.get_llm()
    try:
        local = LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory=10 << 20)
        assert llm.model_fingerprint == local.model_fingerprint  # the same weights: the same data versions
        local.close()
    finally:
        llm.close()
