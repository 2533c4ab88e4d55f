"""Runs the model for one scheduled step: owns the KV cache, launches the forward pass,
then samples; what a step sampled is read back separately, so that the engine can queue
the next step's forward before it waits for this one's tokens."""

import contextlib
import itertools
import logging
from dataclasses import dataclass, field

import torch

from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, ModelConfig
from engine.hardware import detect_cpu, keep_freed_memory, long_lived_allocations, set_num_threads
from engine.layers.attention import Attention, AttentionMetadata
from engine.layers.attention_selector import make_backend, resolve_backend_name
from engine.layers.kernels import use_triton_kernels
from engine.layers.linear import linear_kernel
from engine.device_queue import Pending, launch
from engine.input_batch import InputBatch, PromptRows, StepInputs, upload
from engine.layers.sampler import (
    SampledToken, Sampler, SamplerOutput, token_logprobs,
)
from engine.lora.manager import LoRAManager
from engine.model_loader import load_model
from engine.models.llama import head_dim_of
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.sampling_metadata import SamplingMetadataBuilder

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
        self.config = config
        self.model_config = model_config
        self.device = model_config.device
        self.block_size = config.block_size
        self.attention_backend = resolve_backend_name(config.attention_backend, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
            threads = set_num_threads(config.num_threads)
            logger.info("CPU: %s; dtype %s, %s matrix products, %s attention, %d threads", detect_cpu().describe(),
                        model_config.dtype_name, linear_kernel(model_config.dtype, self.device),
                        self.attention_backend, threads)
        else:
            logger.info("GPU: %s; dtype %s, %s attention", torch.cuda.get_device_name(self.device),
                        model_config.dtype_name, self.attention_backend)
            free, total = torch.cuda.mem_get_info(self.device)
            self._gpu_used_at_start = total - free
        # Weights and cache in mappings of their own on a CPU: freed, they leave the process.
        with long_lived_allocations() if self.device.type == "cpu" else contextlib.nullcontext():
            self.model = load_model(model_config)
            if self.attention_backend == "triton":
                use_triton_kernels(self.model)
            self.num_blocks = self._plan_kv_cache()
            self._allocate_kv_cache()
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        self.sampling_metadata = SamplingMetadataBuilder(model_config.hf_config.vocab_size,
                                                         model_config.eos_token_ids, self.device)
        self.input_batch = InputBatch(config.max_num_seqs, model_config.max_model_len, self.block_size, self.device)
        self.lora_manager = None
        if config.enable_lora:
            self.lora_manager = LoRAManager(
                self.model.lora_targets(), max_loras=config.max_loras, max_cpu_loras=config.max_cpu_loras,
                max_lora_rank=config.max_lora_rank, dtype=model_config.dtype, device=self.device,
                base_model=str(config.model or model_config.path),
            )
            if self.attention_backend == "triton":
                from engine.kernels.triton.lora import sgmv

                self.lora_manager.batch.kernel = sgmv
        self.cuda_graphs = None
        if self.attention_backend == "triton" and self.device.type == "cuda" and not config.enforce_eager:
            if config.enable_lora:
                logger.info("CUDA graphs are off with enable_lora (adapter slots change between steps)")
            else:
                from engine.cuda_graphs import CUDAGraphRunner

                self.cuda_graphs = CUDAGraphRunner(self.model, config.max_num_seqs, model_config.max_model_len,
                                                   self.block_size, self.device)
                self.cuda_graphs.capture()

    # -- KV cache ------------------------------------------------------------------------

    def _attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    @property
    def kv_bytes_per_token(self) -> int:
        hf = self.model_config.hf_config
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        element = torch.empty(0, dtype=self.model_config.dtype).element_size()
        return 2 * len(self._attention_layers()) * num_kv_heads * head_dim_of(hf) * element

    def _plan_kv_cache(self) -> int:
        """Number of blocks that fit the memory budget, logged with how it was computed."""
        block_bytes = self.kv_bytes_per_token * self.block_size
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
            how = f"kv_cache_memory={budget / 2**30:.2f} GiB"
        elif self.device.type == "cuda":
            budget, how = self._gpu_cache_budget()
        else:
            budget = DEFAULT_KV_CACHE_MEMORY
            how = f"kv_cache_memory={budget / 2**30:.2f} GiB (the CPU default)"
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({how}) holds no block of {block_bytes} bytes; raise it")
        most_needed = self.config.max_num_seqs * -(-self.model_config.max_model_len // self.block_size)
        if num_blocks > most_needed:
            num_blocks = most_needed
            how += f", capped at what max_num_seqs={self.config.max_num_seqs} full-length sequences need"
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %d bytes per token) from %s",
            num_blocks, self.block_size, num_blocks * self.block_size,
            num_blocks * block_bytes / 2**30, self.kv_bytes_per_token, how,
        )
        return num_blocks

    def _gpu_cache_budget(self) -> tuple[int, str]:
        """Bytes for the KV cache as vLLM counts them: `gpu_memory_utilization` of the GPU,
        less the weights, the peak activations of a measured forward pass at the step
        budget, and the memory this process holds outside PyTorch's allocator (CUDA
        context, library workspaces)."""
        weights = torch.cuda.memory_allocated(self.device)
        activations = self._profile_step()
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = max(0, (total - free) - self._gpu_used_at_start - torch.cuda.memory_reserved(self.device))
        budget = int(total * self.config.gpu_memory_utilization) - weights - activations - non_torch
        how = (f"gpu_memory_utilization={self.config.gpu_memory_utilization} of {total / 2**30:.1f} GiB, less "
               f"weights {weights / 2**30:.2f} GiB, activations {activations / 2**30:.2f} GiB (measured at "
               f"{self.config.max_num_batched_tokens} tokens) and {non_torch / 2**30:.2f} GiB outside PyTorch")
        if budget <= 0:
            raise ValueError(f"no GPU memory is left for the KV cache ({how}); raise gpu_memory_utilization or "
                             "lower max_num_batched_tokens")
        return budget, how

    def _profile_step(self) -> int:
        """Peak bytes above the weights of a forward pass over `max_num_batched_tokens`
        tokens (sequences of at most max_model_len) and the sampler's logits for
        max_num_seqs rows, on a one-block scratch cache."""
        tokens, longest = self.config.max_num_batched_tokens, self.model_config.max_model_len
        lengths = [min(longest, tokens - start) for start in range(0, tokens, longest)]
        self.num_blocks = 1
        self._allocate_kv_cache()
        step = self._profile_inputs(lengths)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        weights = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            hidden = self._run_eager(step)
            rows = min(self.config.max_num_seqs, tokens)
            self.model.compute_logits(hidden[:rows]).float().sort(dim=-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - weights
        for attn in self._attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        return peak

    def _profile_inputs(self, lengths: list[int]) -> StepInputs:
        """Prompts of these lengths whose keys and values all go to the null slot."""
        device, size = self.device, self.block_size
        positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((len(positions),), self.null_slot, dtype=torch.long, device=device),
            query_start_loc=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_tables=torch.zeros(len(lengths), -(-max(lengths) // size), dtype=torch.int32, device=device),
            positions=positions, query_lens=lengths, context_lens=lengths, block_size=size)
        return StepInputs(torch.zeros_like(positions), positions, meta, len(positions))

    def _allocate_kv_cache(self) -> None:
        """One extra block past the managed ones is the null block: zeros that padded key
        positions point to, so attention never reads memory nothing has written."""
        num_slots = (self.num_blocks + 1) * self.block_size
        self.null_slot = self.num_blocks * self.block_size
        self.backend = make_backend(self.attention_backend, self.null_slot)
        for attn in self._attention_layers():
            shape = self.backend.cache_shape(num_slots, self.block_size, attn.num_kv_heads, attn.head_dim)
            for name in ("k_cache", "v_cache"):
                cache = torch.empty(shape, dtype=self.model_config.dtype, device=self.device)
                self.backend.slot_major(cache)[self.null_slot :].zero_()
                setattr(attn, name, cache)
            attn.backend = self.backend

    def release(self) -> None:
        """Drops the model and the KV cache so that their memory can be returned."""
        for attn in self._attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
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
            self._copy_blocks(batch.block_copies)
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
        self.backend.prepare(step.attention)
        return self.model(step.input_ids, step.positions, step.attention)

    def _activate_adapters(self, seqs: list[Sequence]) -> dict[int, int]:
        """Puts the step's LoRA adapters into device slots: slot by adapter id."""
        requests = [s.lora_request for s in seqs if s.lora_request is not None]
        if not requests:
            return {}
        return self.lora_manager.activate(requests)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write: gives forked sequences their own copy of a shared partial block."""
        if not copies:
            return
        size = self.block_size
        src = torch.cat([torch.arange(s * size, (s + 1) * size) for s, _ in copies]).to(self.device)
        dst = torch.cat([torch.arange(d * size, (d + 1) * size) for _, d in copies]).to(self.device)
        for attn in self._attention_layers():
            for cache in (attn.k_cache, attn.v_cache):
                slots = self.backend.slot_major(cache)
                slots[dst] = slots[src]

    def _prompt_logprobs(self, rows: PromptRows, hidden: torch.Tensor) -> SamplerOutput:
        """The logprobs of the prompt tokens that follow each of the sequence's rows."""
        seq, start, count = rows.seq, rows.first_position, rows.count
        targets = upload(seq.token_ids[start + 1 : start + 1 + count], torch.long, self.device)
        logits = self.model.compute_logits(hidden[rows.first_row : rows.first_row + count])
        return SamplerOutput(targets, token_logprobs(logits, targets, [seq.sampling_params.prompt_logprobs] * count))
