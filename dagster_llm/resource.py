"""`LLMResource`: one inference engine per process, created on first use.

Its fields are the engine's settings (`engine.config.EngineConfig`), with their types,
defaults and descriptions, derived rather than declared again; only `model_id` (the
engine's `model`, named so that it does not clash with pydantic's `model_` namespace)
is the resource's own.

The engine is created lazily by `get_llm()`, never in `setup_for_execution` (`dagster job
execute` sets resources up a second time in the CLI's own process), and freed in
`teardown_after_execution`. The class docstring is what the Dagster UI shows (the
resource page and the Launchpad), so it is plain prose; the example lives here:

    import dagster as dg
    from dagster_llm import LLMResource, ParquetIOManager, build_generation_asset

    summaries = build_generation_asset("summaries", upstream="tickets", prompt_column="text")
    defs = dg.Definitions(
        assets=[summaries],
        resources={
            "llm": LLMResource(model_id="smollm2-135m-instruct", kv_cache_memory=2 << 30),
            "io_manager": ParquetIOManager(),
        },
    )
"""

from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field, PrivateAttr, create_model

from dagster_llm.core.devices import GPULease, lease_gpus
from dagster_llm.core.model_files import local_model_folder
from engine.config import engine_settings

if TYPE_CHECKING:
    from engine import LLM


def _engine_fields() -> dict[str, Any]:
    return {
        setting.name: (setting.type, Field(default=setting.default, description=setting.metadata["help"]))
        for setting in engine_settings() if setting.name != "model"
    }


_EngineSettings = create_model("_EngineSettings", __base__=dg.ConfigurableResource, **_engine_fields())


class LLMResource(_EngineSettings):
    """An offline LLM engine (continuous batching, paged KV cache) shared by the
    generation assets of a process. Every engine setting is a field: dtype, device,
    max_num_seqs, kv_cache_memory in bytes, enable_lora, attention_backend,
    tensor_parallel_size and data_parallel_size (several GPUs, or CPU cores, for one
    run) and the rest. The engine loads on first use and is freed, with any processes it
    started, when the step ends.
    """

    model_id: str = Field(
        default="smollm2-135m-instruct",
        description="A local Hugging Face model folder, 'smollm2-135m-instruct' for the embedded model, or a "
                    "folder on an object store (s3://bucket/models/name, gs://, az://), fetched once per machine into "
                    "$DAGSTER_LLM_CACHE/remote-models (credentials from the store's environment, as for the tables).",
    )

    gpu_lease_timeout_s: float = Field(
        default=600.0,
        description="With device 'auto' or 'cuda' on a GPU machine, the engine leases the GPUs it needs (its first "
                    "free ones, tensor_parallel_size x data_parallel_size in a row) for its life, so that runs "
                    "launched together use different GPUs; this is how long it waits for them before failing.",
    )

    _llm: "LLM | None" = PrivateAttr(default=None)
    _lease: GPULease | None = PrivateAttr(default=None)
    _run_id: str = PrivateAttr(default="")

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._run_id = context.run.run_id if context.run else ""

    def get_llm(self) -> "LLM":
        """The process's engine, loaded on first call (on its leased GPUs, on a GPU machine).
        The engine (and torch) load here, not with the definitions: a process that never runs
        a generation step does not import them."""
        if self._llm is None:
            import torch

            from engine import LLM

            settings = {name: getattr(self, name) for name in _engine_fields()}
            if self.device in ("auto", "cuda") and torch.cuda.is_available():
                self._lease = lease_gpus(self.tensor_parallel_size * self.data_parallel_size,
                                         self.gpu_lease_timeout_s, holder=self._run_id)
                settings["device"] = self._lease.device
            try:
                self._llm = LLM(local_model_folder(self.model_id), **settings)
            except BaseException:
                self._release_gpus()
                raise
        return self._llm

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        self.release()

    def release(self) -> None:
        """Frees the engine (and the processes it started) and its GPUs now; the next
        `get_llm()` loads it again. A step that needs a second engine on the same GPUs
        (an OpenAI batch's embedding lines after its chat lines) frees the first."""
        if self._llm is not None:
            self._llm.close()
            self._llm = None
        self._release_gpus()

    def _release_gpus(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None
