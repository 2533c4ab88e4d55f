"""Runs the model for one scheduled step: owns the KV cache, launches the forward pass,
then samples; what a step sampled is read back separately, so that the engine can queue
the next step's forward before it waits for this one's tokens."""

import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.config import EngineConfig, ModelConfig
from engine.device_queue import Pending, launch
from engine.hardware import detect_cpu, keep_freed_memory, long_lived_allocations, set_num_threads
from engine.input_batch import InputBatch, PromptRows, StepInputs, upload
from engine.kv_cache import KVCache, plan_num_blocks
from engine.layers.linear import linear_kernel
from engine.layers.sampler import SampledToken, Sampler, SamplerOutput, token_logprobs
from engine.layers.triton_routing import route_through_triton
from engine.lora.manager import LoRAManager
from engine.model_loader import load_model
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.sampling_metadata import SamplingMetadataBuilder

if TYPE_CHECKING:
    from engine.cuda_graphs import CUDAGraphRunner

logger = logging.getLogger(__name__)


@dataclass
class StepOutput:
    """What one step produced, read back on the host: the token each of `seqs` sampled
    (with its logprobs when any row asked), and prompt logprobs by position."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[SampledToken] | None
    prompt_logprobs: dict[Sequence, list[tuple[int, SampledToken]]]


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: its inputs, its forward pass (the
    hidden states, until it samples) and then its sampling, whose result is what it
    sampled and the prompt logprobs, copied to the host."""

    inputs: StepInputs
    forward: Pending[torch.Tensor]
    sample_seqs: list[Sequence] = field(default_factory=list)
    sampling: Pending[tuple[SamplerOutput | None, list[tuple[PromptRows, SamplerOutput]]]] | None = None


class ModelRunner:
    """The model, its paged KV cache and the sampler, on one device.

    Each step's tokens run as one flat batch of rows ([tokens, hidden]); only the rows
    whose logits are needed (a sequence's last token, once its prompt is fully computed)
    go through the language-model head and the sampler.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        """`config` is resolved (`EngineConfig.resolve`)."""
        self.config = config
        self.model_config = model_config
        self.device = model_config.device
        self.block_size = config.block_size
        self.attention_backend = config.attention_backend
        self._gpu_used_at_start = self._set_up_device()
        # Weights and cache in mappings of their own on a CPU: freed, they leave the process.
        with long_lived_allocations() if self.device.type == "cpu" else contextlib.nullcontext():
            self.model = load_model(model_config)
            if self.attention_backend == "triton":
                route_through_triton(self.model)
            self.kv_cache = KVCache(self.model, self.attention_backend, self.block_size, model_config.dtype,
                                    self.device)
            self.kv_cache.allocate(plan_num_blocks(config, self.model, self.kv_cache, self._gpu_used_at_start))
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        self.sampling_metadata = SamplingMetadataBuilder(model_config.hf_config.vocab_size,
                                                         model_config.eos_token_ids, self.device)
        self.input_batch = InputBatch(config.max_num_seqs, model_config.max_model_len, self.block_size, self.device)
        self.lora_manager = self._make_lora_manager() if config.enable_lora else None
        self.cuda_graphs = self._capture_cuda_graphs()

    def _set_up_device(self) -> int:
        """Sets the CPU threads and logs the device and the kernels chosen; returns the
        bytes of GPU memory in use before the engine loads anything (0 on a CPU)."""
        model_config = self.model_config
        if self.device.type == "cpu":
            keep_freed_memory()
            set_num_threads(self.config.num_threads)
            logger.info("CPU: %s; dtype %s, %s matrix products, %s attention, %d threads", detect_cpu().describe(),
                        model_config.dtype_name, linear_kernel(model_config.dtype, self.device),
                        self.attention_backend, self.config.num_threads)
            return 0
        logger.info("GPU: %s; dtype %s, %s attention", torch.cuda.get_device_name(self.device),
                    model_config.dtype_name, self.attention_backend)
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
        if self.attention_backend == "triton":
            from engine.kernels.triton.lora import sgmv

            manager.batch.kernel = sgmv
        return manager

    def _capture_cuda_graphs(self) -> "CUDAGraphRunner | None":
        """Decode graphs, captured now, on a GPU with the Triton backend unless
        enforce_eager or LoRA (whose adapter slots change between steps) rule them out."""
        if self.attention_backend != "triton" or self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.config.enable_lora:
            logger.info("CUDA graphs are off with enable_lora (adapter slots change between steps)")
            return None
        from engine.cuda_graphs import CUDAGraphRunner

        graphs = CUDAGraphRunner(self.model, self.config.max_num_seqs, self.model_config.max_model_len,
                                 self.block_size, self.device)
        graphs.capture()
        return graphs

    def release(self) -> None:
        """Drops the model and the KV cache so that their memory can be returned."""
        self.kv_cache.free()
        del self.model
        self.lora_manager = None  # it holds the model's projections and the adapters
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queues the step's forward pass. Rows of the sequences that left the running set
        are freed first."""
        self.input_batch.release(batch.released)
        lora_slots = self._activate_adapters(batch.seqs)
        inputs = self.input_batch.prepare(batch, lora_slots)

        def forward() -> torch.Tensor:
            self.kv_cache.copy_blocks(batch.block_copies)
            self.input_batch.fill_pending(inputs)
            if self.lora_manager is not None:
                self.lora_manager.batch.set(inputs.lora_ranges, inputs.num_tokens, self.device)
            return self._forward(inputs)

        return LaunchedStep(inputs, launch(forward, self.device))

    def release_rows(self, seqs: list[Sequence]) -> None:
        """Frees the persistent-batch rows of sequences that left the running set."""
        self.input_batch.release(seqs)

    @torch.inference_mode()
    def launch_sampling(self, step: LaunchedStep) -> None:
        """Queues the step's sampling, its settings read now: the engine calls this once
        the previous step's tokens are on the host (penalties, grammars and min_tokens see
        them), and while the forward pass runs. A sequence that finished since its rows
        were launched does not sample. The sampled ids stay on the device as the next
        step's inputs; their host copy is queued behind them."""
        inputs = step.inputs
        seqs, rows = inputs.sample_seqs, inputs.sample_rows
        if any(seq.is_finished for seq in seqs):
            live = [i for i, seq in enumerate(seqs) if not seq.is_finished]
            seqs, rows = [seqs[i] for i in live], [rows[i] for i in live]
        meta = self.sampling_metadata.build(seqs) if seqs else None
        rows_t = upload(rows, torch.long, self.device)
        slots_t = upload([seq.batch_slot for seq in seqs], torch.long, self.device)
        for seq in seqs:
            seq.num_pending_tokens = 1
        non_blocking = self.device.type == "cuda"

        def sample() -> tuple[SamplerOutput | None, list[tuple[PromptRows, SamplerOutput]]]:
            hidden = step.forward.result()
            prompt = [(prompt_rows, self._prompt_logprobs(prompt_rows, hidden).to_host(non_blocking))
                      for prompt_rows in inputs.prompt_rows]
            if meta is None:
                return None, prompt
            sampled = self.sampler.sample(self.model.compute_logits(hidden[rows_t]), meta)
            self.input_batch.last_token_ids[slots_t] = sampled.token_ids
            return sampled.to_host(non_blocking), prompt

        step.sample_seqs = seqs
        step.sampling = launch(sample, self.device, read_back=True)

    def collect(self, step: LaunchedStep) -> StepOutput:
        """Waits for the step's sampled tokens and reads them on the host."""
        sampled, prompt = step.sampling.result()
        step.forward = step.sampling = None  # the hidden states go
        output = StepOutput(step.sample_seqs, [], None, {})
        if sampled is not None and sampled.logprobs is not None:
            output.logprobs = sampled.entries()
            output.token_ids = [entry.token_id for entry in output.logprobs]
        elif sampled is not None:
            output.token_ids = sampled.token_ids.tolist()
        for rows, logprobs in prompt:
            output.prompt_logprobs[rows.seq] = [(rows.first_position + 1 + i, entry)
                                                for i, entry in enumerate(logprobs.entries())]
        return output

    def _forward(self, step: StepInputs) -> torch.Tensor:
        """Hidden states [tokens, hidden] of the step's rows: a CUDA graph's replay for a
        decode step that fits one, else the model run eagerly."""
        graphs = self.cuda_graphs
        if graphs is not None and step.is_decode and graphs.fits(step.num_tokens):
            return graphs.run(step.input_ids, step.attention)
        return self._run_eager(step)

    def _run_eager(self, step: StepInputs) -> torch.Tensor:
        self.kv_cache.backend.prepare(step.attention)
        return self.model(step.input_ids, step.positions, step.attention)

    def _activate_adapters(self, seqs: list[Sequence]) -> dict[int, int]:
        """Puts the step's LoRA adapters into device slots: slot by adapter id."""
        requests = [s.lora_request for s in seqs if s.lora_request is not None]
        if not requests:
            return {}
        return self.lora_manager.activate(requests)

    def _prompt_logprobs(self, rows: PromptRows, hidden: torch.Tensor) -> SamplerOutput:
        """The logprobs of the prompt tokens that follow each of the sequence's rows."""
        seq, start, count = rows.seq, rows.first_position, rows.count
        targets = upload(seq.token_ids[start + 1 : start + 1 + count], torch.long, self.device)
        logits = self.model.compute_logits(hidden[rows.first_row : rows.first_row + count])
        return SamplerOutput(targets, token_logprobs(logits, targets, [seq.sampling_params.prompt_logprobs] * count))
