"""`LLMResource`: one inference engine per process, created on first use.

Its fields are the engine's settings (`engine.config.EngineConfig`), with their types,
defaults and descriptions, derived rather than declared again; only `model_id` (the
engine's `model`, named so that it does not clash with pydantic's `model_` namespace)
is the resource's own.

The engine is created lazily by `get_llm()`, never in `setup_for_execution` (`dagster job
execute` sets resources up a second time in the CLI's own process), and freed in
`teardown_after_execution`. From the first `get_llm()` to the teardown the engine's own log
(INFO and above: what it chose at start-up, the first-run kernel build, warnings) goes to the
step's Dagster log (`RunLogForwarder`), unless the instance's `python_logs` captures the
`engine` logger itself. The class docstring is what the Dagster UI shows (the
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

import logging
from typing import TYPE_CHECKING, Any

import dagster as dg
from pydantic import Field, PrivateAttr, create_model

from dagster_llm.core.devices import GPULease, lease_gpus
from dagster_llm.core.model_files import local_model_folder
from engine.config import MODEL_FILES, OPERATIONAL, engine_settings

if TYPE_CHECKING:
    from engine import LLM


def _engine_fields() -> dict[str, Any]:
    return {
        setting.name: (setting.type, Field(default=setting.default, description=setting.metadata["help"],
                                           json_schema_extra={"affects": setting.metadata.get("affects")}))
        for setting in engine_settings() if setting.name != "model"
    }


_EngineSettings = create_model("_EngineSettings", __base__=dg.ConfigurableResource, **_engine_fields())

# The engine's loggers' root: start-up choices (device, dtype, quantization, KV cache blocks), the
# first-run kernel build, warnings.
ENGINE_LOGGER = "engine"


class RunLogForwarder(logging.Handler):
    """Forwards the engine's log records at INFO and above to a step's Dagster log (the run's
    event log: the UI's run view, `dagster asset materialize`'s output), prefixed "engine: ",
    for as long as it is attached (`attach`, `detach`). The engine's loggers are set to INFO
    meanwhile (they have no level of their own, so Python's default would drop INFO)."""

    def __init__(self, log: "dg.DagsterLogManager") -> None:
        super().__init__(logging.INFO)
        self.log = log
        self._level = logging.NOTSET

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.log(record.levelno, f"engine: {record.getMessage()}")
        except Exception:  # a record that cannot be formatted or forwarded must not fail the step
            self.handleError(record)

    def attach(self) -> None:
        logger = logging.getLogger(ENGINE_LOGGER)
        self._level = logger.level
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def detach(self) -> None:
        logger = logging.getLogger(ENGINE_LOGGER)
        logger.removeHandler(self)
        logger.setLevel(self._level)


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
        json_schema_extra={"affects": MODEL_FILES},
    )

    gpu_lease_timeout_s: float = Field(
        default=600.0,
        description="With device 'auto' or 'cuda' on a GPU machine, the engine leases the GPUs it needs (its first "
                    "free ones, tensor_parallel_size x data_parallel_size in a row) for its life, so that runs "
                    "launched together use different GPUs; this is how long it waits for them before failing.",
        json_schema_extra={"affects": OPERATIONAL},
    )

    _llm: "LLM | None" = PrivateAttr(default=None)
    _lease: GPULease | None = PrivateAttr(default=None)
    _run_id: str = PrivateAttr(default="")
    _run_log: "dg.DagsterLogManager | None" = PrivateAttr(default=None)
    _forwarder: RunLogForwarder | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._run_id = context.run.run_id if context.run else ""
        managed = context.instance.managed_python_loggers if context.instance is not None else []
        # An instance that captures the engine's logger itself (dagster.yaml's python_logs) needs no forwarding.
        self._run_log = None if ENGINE_LOGGER in managed else context.log

    def get_llm(self) -> "LLM":
        """The process's engine, loaded on first call (on its leased GPUs, on a GPU machine).
        The engine (and torch) load here, not with the definitions: a process that never runs
        a generation step does not import them."""
        if self._llm is None:
            if self._run_log is not None and self._forwarder is None:
                self._forwarder = RunLogForwarder(self._run_log)
                self._forwarder.attach()
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
        if self._forwarder is not None:
            self._forwarder.detach()
            self._forwarder = None

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
