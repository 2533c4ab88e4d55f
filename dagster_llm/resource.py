"""`LLMResource`: one inference engine per process, created on first use."""

from typing import Any

import dagster as dg
from pydantic import Field, PrivateAttr

from engine import LLM


class LLMResource(dg.ConfigurableResource):
    """An offline LLM engine (continuous batching, paged KV cache) shared by the assets
    of a process.

    The engine is created lazily by `get_llm()`, never in `setup_for_execution`
    (`dagster job execute` sets resources up a second time in the CLI's own process),
    and freed in `teardown_after_execution`.

    Examples:
        .. code-block:: python

            import dagster as dg
            from dagster_llm import LLMResource, build_generation_asset

            summaries = build_generation_asset("summaries", upstream="tickets", prompt_column="text")
            defs = dg.Definitions(
                assets=[summaries],
                resources={"llm": LLMResource(model_id="smollm2-135m-instruct")},
            )
    """

    model_id: str = Field(
        default="smollm2-135m-instruct",
        description="A local Hugging Face model folder, or 'smollm2-135m-instruct' for the embedded model.",
    )
    dtype: str = Field(
        default="auto",
        description="'auto' (on a CPU: bfloat16 where it has native bfloat16, else float32; on a GPU: the "
        "checkpoint's own), 'float32', 'bfloat16' or 'float16'.",
    )
    device: str = Field(default="auto", description="'auto' (a GPU if present), 'cpu' or 'cuda'.")
    seed: int = Field(default=0, description="Seed for rows without a seed of their own.")
    max_model_len: int | None = Field(default=None, description="Longest prompt plus completion; the model's context if unset.")
    max_num_seqs: int = Field(default=256, ge=1, description="Most sequences decoded together in one step.")
    max_num_batched_tokens: int | None = Field(default=None, ge=1, description="Token budget of one engine step.")
    kv_cache_memory_gb: float | None = Field(
        default=None, gt=0,
        description="KV cache size in GiB (default: 4 on a CPU; on a GPU what gpu_memory_utilization leaves).")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1,
        description="Fraction of GPU memory for weights, activations (measured at start-up) and KV cache.")
    enforce_eager: bool = Field(default=False, description="On a GPU, run decode steps without CUDA graphs.")
    enable_prefix_caching: bool = Field(default=True, description="Reuse the KV cache of shared prompt prefixes.")
    enable_lora: bool = Field(default=False, description="Accept LoRA adapters (needed by assets that declare adapters).")
    max_loras: int = Field(default=1, ge=1, description="Most distinct adapters in one engine step.")
    max_lora_rank: int = Field(default=16, ge=1, description="Highest adapter rank accepted.")
    max_cpu_loras: int | None = Field(default=None, ge=1, description="Adapters kept in host memory (default max_loras).")
    num_threads: int | None = Field(
        default=None, ge=1,
        description="CPU threads of the step process (default: OMP_NUM_THREADS if set, else the cores it may use).",
    )

    attention_backend: str = Field(
        default="auto",
        description="'auto' (Triton kernels on a GPU; on a CPU the compiled paged-attention kernel where it "
                    "builds), 'triton', 'cpu' or 'torch'.",
    )

    _llm: LLM | None = PrivateAttr(default=None)

    def engine_kwargs(self) -> dict[str, Any]:
        return dict(
            dtype=self.dtype,
            device=self.device,
            seed=self.seed,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_memory=int(self.kv_cache_memory_gb * 2**30) if self.kv_cache_memory_gb else None,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_lora=self.enable_lora,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            max_cpu_loras=self.max_cpu_loras,
            num_threads=self.num_threads,
            attention_backend=self.attention_backend,
        )

    def get_llm(self) -> LLM:
        """The process's engine, loaded on first call."""
        if self._llm is None:
            self._llm = LLM(self.model_id, **self.engine_kwargs())
        return self._llm

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
