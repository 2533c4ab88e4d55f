"""One tensor-parallel rank's share of the model on its device: the weights, the paged
KV cache of its heads and its LoRA adapter slots. It runs forward passes and computes
the logits of chosen rows.

Every rank's Worker makes the same calls in the same order: rank 0's model runner makes
them and `WorkerGroup` (engine.worker.worker_group) repeats them on the other
ranks, so that the collectives inside the model pair up.
"""

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention.layer import AttentionMetadata, CrossInputs
from engine.attention.mla import use_absorbed_attention_only
from engine.config import EngineConfig, ModelConfig
from engine.distributed.communicator import TensorParallelGroup
from engine.hardware import amx_products, detect_cpu, keep_freed_memory, long_lived_allocations, set_num_threads
from engine.kernels.kv_cache_quant import cache_torch_dtype
from engine.layers.linear import enforce_batch_invariance, linear_kernel
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest
from engine.lora.slots import LoRARange
from engine.model_loader.loader import load_model
from engine.models import multimodal_class_for
from engine.multimodal.audio import PromptAudio, audio_hash
from engine.multimodal.inputs import MultiModalEmbeds, encoder_inputs_on
from engine.worker.calibration import (
    calibration_audio, calibration_images, calibration_prompts, layers_wanting_ranges, record_input_ranges,
)
from engine.worker.draft_model_runner import DraftModelRunner
from engine.worker.kv_cache import KVCache, plan_num_blocks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from engine.worker.cuda_graphs import CUDAGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class ModelInputs:
    """What a forward pass reads beyond the weights and the cache: the step's tokens and
    attention metadata, the blocks to copy on write first, and the runs of rows per
    adapter slot."""

    input_ids: torch.Tensor
    attention: AttentionMetadata
    block_copies: list[tuple[int, int]]
    lora_ranges: list[LoRARange]
    kept_rows: torch.Tensor | None = None  # the rows whose final hidden states are read (None: all)
    mm_embeds: MultiModalEmbeds | None = None  # encoder outputs taking the place of image tokens' embeddings
    rope_positions: torch.Tensor | None = None  # [3, tokens] positions of an M-RoPE model
    cross: CrossInputs | None = None  # an encoder-decoder model's cross-attention rows and writes



class Worker:
    """The model's share on one rank (all of it with one rank), its KV cache and adapter slots."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, group: TensorParallelGroup,
                 draft_config: ModelConfig | None = None) -> None:
        """`config` is resolved (`EngineConfig.resolve`); `model_config.device` is this rank's.
        `draft_config`: speculative decoding's draft model, loaded beside the target (on the
        first rank only)."""
        self.config = config
        self.model_config = model_config
        self.group = group
        self.device = model_config.device
        self.hidden: torch.Tensor | None = None  # the last forward pass's, until its logits are taken
        used_at_start = self._set_up_device()
        # Weights and cache in mappings of their own on a CPU: freed, they leave the process.
        with long_lived_allocations() if self.device.type == "cpu" else contextlib.nullcontext():
            self.model = load_model(model_config, group, triton_kernels=config.attention_backend == "triton",
                                    calibrate=self._calibrate)
            if config.batch_invariant:
                use_absorbed_attention_only(self.model)
            # Its cache sits beside the target's, in the same budget.
            self.draft = (DraftModelRunner(config, draft_config, lambda draft: self._calibrate(draft, media=False))
                          if draft_config is not None else None)
            self.kv_cache = KVCache(self.model, config.attention_backend, config.block_size,
                                    cache_torch_dtype(config.kv_cache_dtype), self.device)
            draft_cache = self.draft.kv_cache if self.draft is not None else None
            # Every rank holds as many blocks: the fewest any rank's budget allows.
            num_blocks = group.all_reduce_min(plan_num_blocks(config, self.model, self.kv_cache, used_at_start,
                                                              draft_cache))
            self.kv_cache.allocate(num_blocks)
            if draft_cache is not None:
                draft_cache.allocate(num_blocks)
        self.lora_manager = self._make_lora_manager() if config.enable_lora else None
        self.cuda_graphs = self._capture_cuda_graphs()

    def _calibrate(self, model: torch.nn.Module, media: bool = True) -> None:
        """Measures the input ranges that int8's smoothing reads, when the model has
        projections that want them: one prefill of the calibration text on scratch blocks,
        and with `media`, a multimodal model's encoder over the calibration pictures or clips
        (a draft model, which reads text, takes none)."""
        if not layers_wanting_ranges(model):
            return
        from transformers import AutoTokenizer

        config = self.config
        tokenizer = AutoTokenizer.from_pretrained(Path(config.tokenizer).expanduser() if config.tokenizer
                                                  else self.model_config.path)
        scratch = KVCache(model, config.attention_backend, config.block_size,
                          cache_torch_dtype(config.kv_cache_dtype), self.device)
        record_input_ranges(model, scratch, calibration_prompts(tokenizer, self.model_config.max_model_len),
                            self._calibration_items(tokenizer) if media else [])

    def _calibration_items(self, tokenizer: "PreTrainedTokenizerBase") -> list[dict[str, torch.Tensor]]:
        """A multimodal model's encoder inputs of the calibration pictures, where it reads
        images, else of the calibration clips, where it reads audio (none for a text model)."""
        whole = self.model_config.multimodal_config
        processor_class = multimodal_class_for(whole.architectures).processor_class if whole is not None else None
        if processor_class is None:
            return []
        processor = processor_class(self.model_config.path, whole, tokenizer)
        if "image" in processor_class.modalities:
            items = [processor.process_image(image).data for image in calibration_images()]
        elif "audio" in processor_class.modalities:
            rate = processor.audio_limits.sample_rate
            items = [processor.audio_inputs(PromptAudio(clip, rate, audio_hash(clip, rate)))
                     for clip in calibration_audio(rate)]
        else:
            return []
        return [encoder_inputs_on(data, self.device, self.model_config.dtype) for data in items]

    def _set_up_device(self) -> int:
        """Sets the CPU threads (and batch-invariant products where asked) and logs the
        device and the kernels chosen; returns the bytes of GPU memory in use before the
        engine loads anything (0 on a CPU)."""
        model_config, config = self.model_config, self.config
        if self.device.type == "cpu":
            keep_freed_memory()
            set_num_threads(config.num_threads)
            if config.batch_invariant:
                enforce_batch_invariance(model_config.dtype)
            rows = ("AMX tiles (a row's bits depend on its batch; batch_invariant=True keeps them apart)"
                    if model_config.dtype == torch.bfloat16 and amx_products(detect_cpu(), config.batch_invariant)
                    else "rows independent of the batch")
            logger.info("CPU: %s; dtype %s, %s matrix products, %s, %s attention, %s KV cache, %d threads",
                        detect_cpu().describe(), model_config.dtype_name,
                        linear_kernel(model_config.dtype, self.device), rows, config.attention_backend,
                        config.kv_cache_dtype, config.num_threads)
            return 0
        torch.cuda.set_device(self.device)
        logger.info("GPU: %s; dtype %s, %s attention, %s KV cache", torch.cuda.get_device_name(self.device),
                    model_config.dtype_name, config.attention_backend, config.kv_cache_dtype)
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _make_lora_manager(self) -> LoRAManager:
        """The adapter caches over the model's adaptable projections (products through the
        SGMV kernel with the Triton backend)."""
        config = self.config
        manager = LoRAManager(
            self.model.lora_targets(), max_loras=config.max_loras, max_cpu_loras=config.max_cpu_loras,
            max_lora_rank=config.max_lora_rank, dtype=self.model_config.dtype, device=self.device,
            base_model=str(config.model or self.model_config.path),
        )
        if config.attention_backend == "triton":
            from engine.kernels.triton.lora import sgmv

            manager.batch.kernel = sgmv
        return manager

    def _capture_cuda_graphs(self) -> "CUDAGraphRunner | None":
        """Decode graphs, captured now, on a GPU with the Triton backend unless
        enforce_eager, LoRA (whose adapter slots change between steps) or tensor
        parallelism (its collectives are not captured) rule them out."""
        config = self.config
        if config.attention_backend != "triton" or self.device.type != "cuda" or config.enforce_eager:
            return None
        if getattr(self.model, "uses_mrope", False):
            logger.info("CUDA graphs are off: the model's rotary positions are per image grid (M-RoPE)")
            return None
        if getattr(self.model, "max_cross_rows", 0):
            logger.info("CUDA graphs are off: the model's decoder attends to its encoder (cross-attention)")
            return None
        if config.enable_lora or self.group.size > 1:
            logger.info("CUDA graphs are off with %s", "enable_lora (adapter slots change between steps)"
                        if config.enable_lora else "tensor_parallel_size > 1")
            return None
        from engine.worker.cuda_graphs import CUDAGraphRunner

        graphs = CUDAGraphRunner(self.model, config.max_num_seqs, self.model_config.max_model_len,
                                 config.block_size, self.device)
        graphs.capture()
        return graphs

    @torch.inference_mode()
    def execute_model(self, inputs: ModelInputs) -> torch.Tensor:
        """Hidden states [rows, hidden] of the step's kept rows (all its tokens without
        `kept_rows`), held for `logits`: a CUDA graph's replay for a decode step that fits
        one, else the model run eagerly."""
        self.kv_cache.copy_blocks(inputs.block_copies)
        num_tokens = len(inputs.input_ids)
        if self.lora_manager is not None:
            self.lora_manager.batch.set(inputs.lora_ranges, num_tokens, self.device)
        graphs = self.cuda_graphs
        if graphs is not None and inputs.attention.is_decode and inputs.kept_rows is None and graphs.fits(num_tokens):
            self.hidden = graphs.run(inputs.input_ids, inputs.attention)
        else:
            self.kv_cache.backend.prepare(inputs.attention)
            positions = inputs.attention.positions if inputs.rope_positions is None else inputs.rope_positions
            extra = {} if inputs.mm_embeds is None else {"mm_embeds": inputs.mm_embeds}
            if inputs.cross is not None:
                self.kv_cache.backend.prepare(inputs.cross.meta)
                extra["cross"] = inputs.cross
            self.hidden = self.model(inputs.input_ids, positions, inputs.attention, inputs.kept_rows, **extra)
        return self.hidden

    @torch.inference_mode()
    def logits(self, rows: torch.Tensor | list[int]) -> torch.Tensor | None:
        """Logits [rows, vocab] in float32 of these rows of the last forward pass, on rank
        0 (None on the others); the hidden states are dropped afterwards."""
        if not isinstance(rows, torch.Tensor):
            rows = torch.tensor(rows, dtype=torch.long).to(self.device)
        hidden, self.hidden = self.hidden, None
        return self.model.compute_logits(hidden[rows])

    def activate_adapters(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Puts a step's adapters into slots: each one's slot by lora_int_id (the same on
        every rank, since every rank makes the same calls)."""
        return self.lora_manager.activate(requests)

    def release(self) -> None:
        """Drops the model, the KV cache and the adapters so that their memory can be returned."""
        self.kv_cache.free()
        del self.model
        if self.draft is not None:
            self.draft.release()
            self.draft = None
        self.hidden = None
        self.lora_manager = None  # it holds the model's projections and the adapters
        self.cuda_graphs = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
