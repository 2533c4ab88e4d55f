"""Fixtures of the Dagster tests."""

import engine
import pytest

from dagster_llm import LLMResource, ParquetIOManager


@pytest.fixture
def env(tiny_models, tmp_path, monkeypatch):
    """Output under tmp_path, a resource on the tiny Llama, and a count of engine loads."""
    monkeypatch.setenv("DAGSTER_LLM_OUTPUT_DIR", str(tmp_path / "out"))
    loads = []
    original = engine.LLM.__init__

    def counting_init(self, *args, **kwargs):
        loads.append(args)
        original(self, *args, **kwargs)

    monkeypatch.setattr(engine.LLM, "__init__", counting_init)
    resources = {
        "llm": LLMResource(model_id=str(tiny_models["llama"]), dtype="float32", kv_cache_memory=10 << 20),
        "io_manager": ParquetIOManager(base_path=str(tmp_path / "tables")),
    }
    return {"root": tmp_path / "tables", "resources": resources, "loads": loads,
            "model": tiny_models["llama"]}
