"""Runs the model for one scheduled step: builds its inputs, owns the KV cache, samples."""

import logging

import torch

from engine.config import DEFAULT_KV_CACHE_MEMORY, EngineConfig, ModelConfig
from engine.layers.attention import Attention, AttentionGroup, AttentionMetadata
from engine.layers.sampler import Sampler, SamplingMetadata
from engine.model_loader import load_model
from engine.models.llama import head_dim_of
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


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
        self.model = load_model(model_config)
        self.num_blocks = self._plan_kv_cache()
        self._allocate_kv_cache()
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))

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
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Runs the step and returns the sampled token of each sequence that completed."""
        input_ids, positions, slots = [], [], []
        decode, prefill, sample_rows, sample_seqs = [], [], [], []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + num_new])
            positions.extend(range(start, start + num_new))
            table, size = seq.block_table, self.block_size
            slots.extend(table[p // size] * size + p % size for p in range(start, start + num_new))
            (decode if num_new == 1 else prefill).append((row, num_new, start, table))
            if start + num_new == seq.num_tokens:
                sample_rows.append(row + num_new - 1)
                sample_seqs.append(seq)

        to_device = dict(dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, **to_device),
            groups=[self._attention_group(g) for g in (decode, prefill) if g],
        )
        hidden = self.model(torch.tensor(input_ids, **to_device), torch.tensor(positions, **to_device), meta)
        if not sample_seqs:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, **to_device)])
        tokens = self.sampler(logits, self._sampling_metadata(sample_seqs)).tolist()
        return dict(zip(sample_seqs, tokens))

    def _attention_group(self, entries: list[tuple[int, int, int, list[int]]]) -> AttentionGroup:
        """Padded batch of (first row, new tokens, computed tokens, block table) entries."""
        device = self.device
        rows = torch.tensor([e[0] for e in entries], device=device)
        num_new = torch.tensor([e[1] for e in entries], device=device)
        computed = torch.tensor([e[2] for e in entries], device=device)
        max_query = int(num_new.max())
        max_context = int((computed + num_new).max())
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
        return AttentionGroup(query_index, key_slots, mask.unsqueeze(1), valid, query_index[valid])

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        params = [s.sampling_params for s in seqs]
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        top_ps = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device)
        top_ks = torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=self.device)
        return SamplingMetadata(
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
            generators=[s.generator for s in seqs],
            all_greedy=all(p.greedy for p in params),
            any_top_p=any(p.top_p < 1 for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
        )
