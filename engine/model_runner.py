"""Runs the model for one scheduled step: builds its inputs, owns the KV cache, samples."""

import logging
from dataclasses import dataclass

import torch

from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, ModelConfig
from engine.hardware import detect_cpu, keep_freed_memory, set_num_threads
from engine.kernels import cpu_attention
from engine.layers.attention import Attention, AttentionGroup, AttentionMetadata, PagedRows, padded_context
from engine.layers.linear import linear_kernel
from engine.layers.sampler import Penalties, SampledToken, Sampler, SamplingMetadata, token_logprobs
from engine.lora.manager import LoRAManager
from engine.model_loader import load_model
from engine.models.llama import head_dim_of
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


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
        self.paged_kernel = self._choose_attention()
        if self.device.type == "cpu":
            keep_freed_memory()
            threads = set_num_threads(config.num_threads)
            logger.info("CPU: %s; dtype %s, %s matrix products, %s attention, %d threads", detect_cpu().describe(),
                        str(model_config.dtype).removeprefix("torch."),
                        linear_kernel(model_config.dtype, self.device),
                        "compiled paged" if self.paged_kernel else "PyTorch batched", threads)
        self.model = load_model(model_config)
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

    def _choose_attention(self) -> bool:
        """Whether attention runs on the compiled CPU kernel (else PyTorch's products)."""
        backend = self.config.attention_backend
        if backend == "torch" or self.device.type != "cpu":
            return False
        if cpu_attention.load() is not None:
            return True
        if backend == "cpu":
            raise RuntimeError("attention_backend='cpu': the CPU attention kernel could not be built (see the "
                               "warning above: it needs a C++ compiler and ninja); use 'auto' or 'torch'")
        return False

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
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Room for one step's activations and logits, estimated from the step budget.
            hf = self.model_config.hf_config
            element = torch.empty(0, dtype=self.model_config.dtype).element_size()
            activations = self.config.max_num_batched_tokens * (
                4 * hf.intermediate_size + 8 * hf.hidden_size) * element
            logits = self.config.max_num_seqs * hf.vocab_size * 4 * 3
            budget = int(total * self.config.gpu_memory_utilization) - (total - free) - activations - logits
            how = (f"gpu_memory_utilization={self.config.gpu_memory_utilization} of "
                   f"{total / 2**30:.1f} GiB, less {(total - free) / 2**30:.2f} GiB in use and "
                   f"{(activations + logits) / 2**30:.2f} GiB for activations")
        else:
            budget = self.config.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
            how = f"kv_cache_memory={budget / 2**30:.2f} GiB"
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

    def _allocate_kv_cache(self) -> None:
        """One extra block past the managed ones is the null block: zeros that padded key
        positions point to, so attention never reads memory nothing has written."""
        num_slots = (self.num_blocks + 1) * self.block_size
        self.null_slot = self.num_blocks * self.block_size
        for attn in self._attention_layers():
            shape = (attn.num_kv_heads, num_slots, attn.head_dim)
            for name in ("k_cache", "v_cache"):
                cache = torch.empty(shape, dtype=self.model_config.dtype, device=self.device)
                cache[:, self.null_slot :].zero_()
                setattr(attn, name, cache)

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
        entries = list(zip(batch.seqs, batch.num_new_tokens))
        lora_slots = self._activate_adapters(batch.seqs)
        if lora_slots:
            # Each adapter's rows contiguous, so that its delta is one product per projection.
            entries.sort(key=lambda e: lora_slots.get(e[0].lora_int_id, -1))
        lora_ranges: list[tuple[int, int, int]] = []
        input_ids, positions, slots = [], [], []
        decode, prefill, sample_rows, sample_seqs = [], [], [], []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # seq, first row, first position, count
        row_of = {}
        for seq, num_new in entries:
            start = seq.num_computed_tokens
            row = len(input_ids)
            slot = lora_slots.get(seq.lora_int_id)
            if slot is not None:
                if lora_ranges and lora_ranges[-1][0] == slot:
                    lora_ranges[-1] = (slot, lora_ranges[-1][1], row + num_new)
                else:
                    lora_ranges.append((slot, row, row + num_new))
            input_ids.extend(seq.token_ids[start : start + num_new])
            positions.extend(range(start, start + num_new))
            table, size = seq.block_table, self.block_size
            slots.extend(table[p // size] * size + p % size for p in range(start, start + num_new))
            (decode if num_new == 1 else prefill).append((row, num_new, start, table))
            if start + num_new == seq.num_tokens:
                row_of[seq] = row + num_new - 1
                sample_rows.append(row_of[seq])
                sample_seqs.append(seq)
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                count = min(start + num_new, seq.num_prompt_tokens - 1) - start
                prompt_rows.append((seq, row, start, count))
        for child, parent in batch.forks:
            sample_rows.append(row_of[parent])
            sample_seqs.append(child)

        if self.lora_manager is not None:
            self.lora_manager.batch.set(lora_ranges, len(input_ids), self.device)
        to_device = dict(dtype=torch.long, device=self.device)
        if self.paged_kernel:
            meta = AttentionMetadata(torch.tensor(slots, **to_device), [], self._paged_rows(decode + prefill))
        else:
            meta = AttentionMetadata(torch.tensor(slots, **to_device),
                                     [self._attention_group(g) for g in (decode, prefill) if g])
        hidden = self.model(torch.tensor(input_ids, **to_device), torch.tensor(positions, **to_device), meta)
        output = StepOutput({}, {})
        for seq, row, start, count in prompt_rows:
            output.prompt_logprobs[seq] = self._prompt_logprobs(seq, hidden[row : row + count], start)
        if sample_seqs:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, **to_device)])
            sampled = self.sampler(logits, self._sampling_metadata(sample_seqs))
            output.sampled = dict(zip(sample_seqs, sampled))
        return output

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
            attn.k_cache[:, dst] = attn.k_cache[:, src]
            attn.v_cache[:, dst] = attn.v_cache[:, src]

    def _prompt_logprobs(self, seq: Sequence, hidden: torch.Tensor, start: int) -> list[tuple[int, SampledToken]]:
        """(position, logprobs of that prompt token) for the prompt tokens after `start`."""
        targets = torch.tensor(seq.token_ids[start + 1 : start + 1 + hidden.shape[0]], device=self.device)
        entries = token_logprobs(self.model.compute_logits(hidden), targets,
                                 [seq.sampling_params.prompt_logprobs] * hidden.shape[0])
        return [(start + 1 + i, entry) for i, entry in enumerate(entries)]

    def _paged_rows(self, entries: list[tuple[int, int, int, list[int]]]) -> PagedRows:
        """Per-row metadata of (first row, new tokens, computed tokens, block table) entries."""
        num_rows = sum(num_new for _, num_new, _, _ in entries)
        row_seq, row_keys, tables = [0] * num_rows, [0] * num_rows, []
        width = max(len(table) for _, _, _, table in entries)
        for index, (row, num_new, computed, table) in enumerate(entries):
            row_seq[row : row + num_new] = [index] * num_new
            row_keys[row : row + num_new] = range(computed + 1, computed + num_new + 1)
            tables.append(table + [0] * (width - len(table)))
        to_device = dict(dtype=torch.long, device=self.device)
        return PagedRows(torch.tensor(tables, **to_device), torch.tensor(row_seq, **to_device),
                         torch.tensor(row_keys, **to_device), self.block_size)

    def _attention_group(self, entries: list[tuple[int, int, int, list[int]]]) -> AttentionGroup:
        """Padded batch of (first row, new tokens, computed tokens, block table) entries."""
        device = self.device
        rows = torch.tensor([e[0] for e in entries], device=device)
        num_new = torch.tensor([e[1] for e in entries], device=device)
        computed = torch.tensor([e[2] for e in entries], device=device)
        max_query = int(num_new.max())
        max_context = padded_context(int((computed + num_new).max()))
        max_blocks = -(-max_context // self.block_size)
        tables = torch.tensor([e[3][:max_blocks] + [0] * (max_blocks - len(e[3][:max_blocks]))
                               for e in entries], device=device)
        query = torch.arange(max_query, device=device)
        valid = query.unsqueeze(0) < num_new.unsqueeze(1)
        query_index = torch.where(valid, rows.unsqueeze(1) + query, 0)
        key_pos = torch.arange(max_context, device=device)
        key_slots = tables[:, key_pos // self.block_size] * self.block_size + key_pos % self.block_size
        key_slots = torch.where(key_pos < (computed + num_new).unsqueeze(1), key_slots, self.null_slot)
        query_pos = computed.unsqueeze(1) + query  # [seqs, max_query]
        mask = key_pos.view(1, 1, -1) <= query_pos.unsqueeze(2)
        return AttentionGroup(query_index, key_slots, mask.unsqueeze(1), valid,
                              num_computed=[e[2] for e in entries], num_new=[e[1] for e in entries])

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
