"""Runs the model for one scheduled step: builds its inputs, owns the KV cache, samples."""

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
from engine.layers.sampler import Penalties, SampledToken, Sampler, SamplingMetadata, token_logprobs
from engine.lora.manager import LoRAManager
from engine.model_loader import load_model
from engine.models.llama import head_dim_of
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.structured_output.manager import grammar_bitmask

logger = logging.getLogger(__name__)


@dataclass
class PromptRows:
    """A sequence's rows in the step whose next prompt token needs its logprobs."""

    seq: Sequence
    first_row: int
    first_position: int
    count: int


@dataclass
class StepInputs:
    """One step's rows, flattened: each sequence's new tokens back to back."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    prompt_rows: list[PromptRows] = field(default_factory=list)
    lora_ranges: list[tuple[int, int, int]] = field(default_factory=list)  # (slot, first row, end row)


@dataclass
class StepOutput:
    """What one step produced: sampled tokens, and prompt logprobs by position."""

    sampled: dict[Sequence, SampledToken]
    prompt_logprobs: dict[Sequence, list[tuple[int, SampledToken]]]


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
        step = StepInputs(input_ids=[0] * tokens, positions=[p for n in lengths for p in range(n)],
                          slots=[self.null_slot] * tokens, query_lens=lengths, context_lens=lengths,
                          block_tables=[[0] * -(-n // self.block_size) for n in lengths])
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
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Runs the step: the sampled token of each sequence whose tokens are all computed
        (forked children sample from their parent's logits), and prompt logprobs."""
        self._copy_blocks(batch.block_copies)
        step = self._prepare_step(batch)
        if self.lora_manager is not None:
            self.lora_manager.batch.set(step.lora_ranges, len(step.input_ids), self.device)
        hidden = self._forward(step)
        output = StepOutput({}, {})
        for rows in step.prompt_rows:
            output.prompt_logprobs[rows.seq] = self._prompt_logprobs(
                rows.seq, hidden[rows.first_row : rows.first_row + rows.count], rows.first_position)
        if step.sample_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(step.sample_rows, device=self.device)])
            sampled = self.sampler(logits, self._sampling_metadata(step.sample_seqs))
            output.sampled = dict(zip(step.sample_seqs, sampled))
        return output

    def _prepare_step(self, batch: ScheduledBatch) -> "StepInputs":
        """The step's rows in a flat layout: each sequence's new tokens back to back (grouped
        by LoRA slot, so that an adapter's delta is one product per projection)."""
        entries = list(zip(batch.seqs, batch.num_new_tokens))
        lora_slots = self._activate_adapters(batch.seqs)
        if lora_slots:
            entries.sort(key=lambda entry: lora_slots.get(entry[0].lora_int_id, -1))
        step = StepInputs()
        row_of = {}
        for seq, num_new in entries:
            start, row = seq.num_computed_tokens, len(step.input_ids)
            slot = lora_slots.get(seq.lora_int_id)
            if slot is not None:
                if step.lora_ranges and step.lora_ranges[-1][0] == slot:
                    step.lora_ranges[-1] = (slot, step.lora_ranges[-1][1], row + num_new)
                else:
                    step.lora_ranges.append((slot, row, row + num_new))
            step.input_ids.extend(seq.token_ids[start : start + num_new])
            step.positions.extend(range(start, start + num_new))
            table, size = seq.block_table, self.block_size
            step.slots.extend(table[p // size] * size + p % size for p in range(start, start + num_new))
            step.query_lens.append(num_new)
            step.context_lens.append(start + num_new)
            step.block_tables.append(table)
            if start + num_new == seq.num_tokens:
                row_of[seq] = row + num_new - 1
                step.sample_rows.append(row_of[seq])
                step.sample_seqs.append(seq)
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                count = min(start + num_new, seq.num_prompt_tokens - 1) - start
                step.prompt_rows.append(PromptRows(seq, row, start, count))
        for child, parent in batch.forks:
            step.sample_rows.append(row_of[parent])
            step.sample_seqs.append(child)
        return step

    def _attention_metadata(self, step: "StepInputs") -> AttentionMetadata:
        """The step's attention metadata, prepared by the backend."""
        device = self.device
        width = max(len(table) for table in step.block_tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(step.slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor([0, *itertools.accumulate(step.query_lens)], dtype=torch.int32,
                                         device=device),
            seq_lens=torch.tensor(step.context_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables], dtype=torch.int32,
                                      device=device),
            query_lens=step.query_lens, context_lens=step.context_lens, host_block_tables=step.block_tables,
            block_size=self.block_size)
        self.backend.prepare(meta)
        return meta

    def _forward(self, step: "StepInputs") -> torch.Tensor:
        """Hidden states [tokens, hidden] of the step's rows: a CUDA graph's replay for a
        decode step that fits one, else the model run eagerly."""
        graphs = self.cuda_graphs
        if graphs is not None and max(step.query_lens) == 1 and graphs.fits(len(step.query_lens)):
            return graphs.run(step.input_ids, step.positions, step.slots, step.context_lens, step.block_tables)
        return self._run_eager(step)

    def _run_eager(self, step: "StepInputs") -> torch.Tensor:
        meta = self._attention_metadata(step)
        to_device = dict(dtype=torch.long, device=self.device)
        return self.model(torch.tensor(step.input_ids, **to_device), torch.tensor(step.positions, **to_device), meta)

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

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int) -> list[tuple[int, SampledToken]]:
        """(position, logprobs of that prompt token) for the prompt tokens after `start`."""
        targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + hidden.shape[0]], device=self.device)
        entries = token_logprobs(self.model.compute_logits(hidden), targets,
                                 [seq.sampling_params.prompt_logprobs] * hidden.shape[0])
        return [(start + 1 + i, entry) for i, entry in enumerate(entries)]

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        params = [s.sampling_params for s in seqs]
        device = self.device
        floats = self._floats
        banned, allowed, bias_rows, bias_ids, bias_values = [], [], [], [], []
        penalized = []
        for row, (seq, p) in enumerate(zip(seqs, params)):
            ban = [ids[-1] for ids in seq.bad_words_ids if _ends_with(seq.output_token_ids, ids[:-1])]
            if seq.num_output_tokens < p.min_tokens:
                ban += [*self.model_config.eos_token_ids, *p.stop_token_ids]
            if ban:
                banned.append((row, ban))
            if p.allowed_token_ids:
                allowed.append((row, p.allowed_token_ids))
            for token, value in (p.logit_bias or {}).items():
                bias_rows.append(row)
                bias_ids.append(token)
                bias_values.append(value)
            if p.needs_penalties:
                penalized.append(row)
        return SamplingMetadata(
            temperatures=floats([p.temperature for p in params]),
            top_ps=floats([p.top_p for p in params]),
            top_ks=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
            min_ps=floats([p.min_p for p in params]),
            generators=[s.generator for s in seqs],
            all_greedy=all(p.greedy for p in params),
            any_min_p=any(p.min_p > 0 for p in params),
            penalties=self._penalties([seqs[r] for r in penalized], penalized) if penalized else None,
            banned=banned or None,
            allowed=allowed or None,
            bias=(torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device),
                  floats(bias_values)) if bias_rows else None,
            num_logprobs=[p.logprobs for p in params],
            grammar=grammar_bitmask([s.grammar for s in seqs]),
        )

    def _floats(self, values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=self.device)

    def _penalties(self, seqs: list[Sequence], rows: list[int]) -> Penalties:
        vocab = self.model_config.hf_config.vocab_size

        def padded(lists: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(x) for x in lists))
            return torch.tensor([x + [vocab] * (width - len(x)) for x in lists], dtype=torch.long, device=self.device)

        params = [s.sampling_params for s in seqs]
        return Penalties(
            rows=torch.tensor(rows, device=self.device),
            prompt_ids=padded([s.token_ids[: s.num_prompt_tokens] for s in seqs]),
            output_ids=padded([s.output_token_ids for s in seqs]),
            presence=self._floats([p.presence_penalty for p in params]),
            frequency=self._floats([p.frequency_penalty for p in params]),
            repetition=self._floats([p.repetition_penalty for p in params]),
        )


def _ends_with(tokens: list[int], suffix: list[int]) -> bool:
    return not suffix or tokens[-len(suffix):] == suffix
