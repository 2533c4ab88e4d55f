"""The paged KV cache: how many blocks the memory budget holds, and the cache tensors of
the model's attention layers."""

import itertools
import logging
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.layer import (
    Attention, AttentionBackend, AttentionMetadata, CrossAttention, CrossInputs, cross_attention_metadata,
)
from engine.attention.selector import make_backend
from engine.config import EngineConfig
from engine.kernels.kv_cache_quant import is_scaled

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheBudget:
    """Bytes for the KV cache, and how they were arrived at (for the log and for errors)."""

    num_bytes: int
    how: str


class KVCache:
    """The keys and values of every attention layer of a model, in `num_blocks` blocks of
    `block_size` slots each, laid out as the attention backend reads them, as `dtype`
    (`engine.kernels.kv_cache_quant`); a scaled dtype adds float32 scales per (slot, KV head).
    A latent attention layer (`values_in_keys`) has one tensor, its latent and rotary key.

    One extra block past the managed ones is the null block: zeros that padded key
    positions point to, so attention never reads memory nothing has written.

    A cross-attention layer (`CrossAttention`, an encoder-decoder model's) has no tensors of its
    own: it reads and writes those of the self-attention it is paired with, in blocks of its
    sequence's cross table, so a token costs its bytes once.
    """

    def __init__(self, model: nn.Module, backend_name: str, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        attention = [m for m in model.modules() if isinstance(m, Attention)]
        self.layers = [m for m in attention if not isinstance(m, CrossAttention)]
        self.cross_layers = [m for m in attention if isinstance(m, CrossAttention)]
        self.backend_name = backend_name
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.num_blocks = 0
        self.null_slot = 0
        self.backend: AttentionBackend | None = None

    @property
    def bytes_per_token(self) -> int:
        """Bytes of keys and values that one token takes across all layers."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        scale = 4 if is_scaled(self.dtype) else 0
        return sum((1 if layer.values_in_keys else 2) * layer.num_kv_heads * (layer.head_dim * element + scale)
                   for layer in self.layers)

    def allocate(self, num_blocks: int) -> None:
        """Gives every layer caches of `num_blocks` blocks plus the null block, replacing
        any it had, and the backend that reads them."""
        self.num_blocks = num_blocks
        num_slots = (num_blocks + 1) * self.block_size
        self.null_slot = num_blocks * self.block_size
        self.backend = make_backend(self.backend_name, self.null_slot)
        for layer in self.layers:
            shape = self.backend.cache_shape(num_slots, self.block_size, layer.num_kv_heads, layer.head_dim)
            for name in ("k",) if layer.values_in_keys else ("k", "v"):
                setattr(layer, f"{name}_cache", self._null_zeroed(shape, self.dtype))
                scale_shape = shape[:-1] if is_scaled(self.dtype) else (0,)
                setattr(layer, f"{name}_scale", self._null_zeroed(scale_shape, torch.float32))
            if layer.values_in_keys:  # one tensor, read as keys and values
                layer.v_cache, layer.v_scale = layer.k_cache, layer.k_scale
            layer.backend = self.backend
        for layer in self.cross_layers:
            pair = layer.paired_with[0]
            layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale = (pair.k_cache, pair.v_cache, pair.k_scale,
                                                                          pair.v_scale)
            layer.backend = self.backend

    def _null_zeroed(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of `shape` whose null block is zeros."""
        tensor = torch.empty(shape, dtype=dtype, device=self.device)
        if tensor.numel():
            self.backend.slot_major(tensor)[self.null_slot :].zero_()
        return tensor

    def free(self) -> None:
        """Drops every layer's caches, so that their memory can be returned."""
        for layer in (*self.layers, *self.cross_layers):
            layer.k_cache = layer.v_cache = layer.k_scale = layer.v_scale = torch.empty(0)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy on write: copies each (source, destination) block, in every layer, so that
        forked sequences get their own copy of a shared partial block."""
        if not copies:
            return
        size = self.block_size
        src = torch.cat([torch.arange(s * size, (s + 1) * size) for s, _ in copies]).to(self.device)
        dst = torch.cat([torch.arange(d * size, (d + 1) * size) for _, d in copies]).to(self.device)
        for layer in self.layers:
            caches = (layer.k_cache, layer.k_scale) if layer.values_in_keys else (
                layer.k_cache, layer.v_cache, layer.k_scale, layer.v_scale)
            for cache in caches:
                if cache.numel():
                    slots = self.backend.slot_major(cache)
                    slots[dst] = slots[src]


def plan_num_blocks(config: EngineConfig, model: nn.Module, kv_cache: KVCache, gpu_used_at_start: int,
                    draft_cache: KVCache | None = None) -> int:
    """Blocks that fit the memory budget (kv_cache_memory, or on a GPU what
    gpu_memory_utilization leaves after a measured step), at most what max_num_seqs
    sequences of max_model_len (and their encoder rows' cross blocks) need; logged with how the number was arrived at. With a
    draft model's cache (`draft_cache`), which holds as many blocks, a block counts both.

    Raises:
        ValueError: the budget holds no block, or no GPU memory is left for one.
    """
    if config.kv_cache_memory is not None:
        budget = CacheBudget(config.kv_cache_memory, f"kv_cache_memory={config.kv_cache_memory / 2**30:.2f} GiB")
    else:
        budget = _gpu_cache_budget(config, model, kv_cache, gpu_used_at_start)
    bytes_per_token = kv_cache.bytes_per_token + (draft_cache.bytes_per_token if draft_cache is not None else 0)
    block_bytes = bytes_per_token * config.block_size
    num_blocks = budget.num_bytes // block_bytes
    how = budget.how
    if num_blocks < 1:
        raise ValueError(f"the KV cache budget ({how}) holds no block of {block_bytes} bytes; raise it")
    # An encoder-decoder sequence also holds its encoder rows' cross-attention blocks.
    cross_blocks = -(-getattr(model, "max_cross_rows", 0) // config.block_size)
    most_needed = config.max_num_seqs * (-(-config.max_model_len // config.block_size) + cross_blocks)
    if num_blocks > most_needed:
        num_blocks = most_needed
        how += f", capped at what max_num_seqs={config.max_num_seqs} full-length sequences need"
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %d bytes per token) from %s",
        num_blocks, config.block_size, num_blocks * config.block_size,
        num_blocks * block_bytes / 2**30, bytes_per_token, how,
    )
    return num_blocks


def _gpu_cache_budget(config: EngineConfig, model: nn.Module, kv_cache: KVCache, used_at_start: int) -> CacheBudget:
    """Bytes for the KV cache as vLLM counts them: `gpu_memory_utilization` of the GPU,
    less the weights, the peak activations of a measured forward pass at the step budget,
    and the memory this process holds outside PyTorch's allocator (CUDA context, library
    workspaces) beyond the `used_at_start` bytes in use before the engine loaded anything.

    Raises:
        ValueError: nothing is left for the KV cache.
    """
    device = kv_cache.device
    weights = torch.cuda.memory_allocated(device)
    activations = _profile_step(config, model, kv_cache)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - used_at_start - torch.cuda.memory_reserved(device))
    budget = int(total * config.gpu_memory_utilization) - weights - activations - non_torch
    how = (f"gpu_memory_utilization={config.gpu_memory_utilization} of {total / 2**30:.1f} GiB, less "
           f"weights {weights / 2**30:.2f} GiB, activations {activations / 2**30:.2f} GiB (measured at "
           f"{config.max_num_batched_tokens} tokens) and {non_torch / 2**30:.2f} GiB outside PyTorch")
    if budget <= 0:
        raise ValueError(f"no GPU memory is left for the KV cache ({how}); raise gpu_memory_utilization or "
                         "lower max_num_batched_tokens")
    return CacheBudget(budget, how)


def _profile_step(config: EngineConfig, model: nn.Module, kv_cache: KVCache) -> int:
    """Peak bytes above the weights of a forward pass over `max_num_batched_tokens`
    tokens (prompts of at most max_model_len) and the sampler's logits for max_num_seqs
    rows, on a one-block scratch cache that is freed afterwards."""
    tokens, longest, device = config.max_num_batched_tokens, config.max_model_len, kv_cache.device
    lengths = [min(longest, tokens - start) for start in range(0, tokens, longest)]
    kv_cache.allocate(1)
    meta = prefill_metadata(lengths, kv_cache)
    positions = meta.positions
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        kv_cache.backend.prepare(meta)
        extra = {}
        if getattr(model, "max_cross_rows", 0):
            extra["cross"] = prefill_cross_inputs(model, meta, kv_cache)
            kv_cache.backend.prepare(extra["cross"].meta)
        hidden = model(torch.zeros_like(positions), positions, meta, **extra)
        logits = model.compute_logits(hidden[: min(config.max_num_seqs, tokens)])  # None on ranks 1..
        if logits is not None:
            logits.sort(dim=-1)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights
    kv_cache.free()
    return peak


def prefill_cross_inputs(model: nn.Module, meta: AttentionMetadata, kv_cache: KVCache,
                         clips: list[torch.Tensor] | None = None, first_blocks: list[int] | None = None,
                         reads: list[int] | None = None) -> CrossInputs:
    """An encoder-decoder model's cross-attention inputs for a prefill outside the scheduler
    (`prefill_metadata`'s): each clip's encoder rows `clips[j]` [max_cross_rows, width] are
    written to consecutive cross blocks from `first_blocks[j]` (allocated by the caller), and
    every row of prompt i of `meta` reads clip `reads[i]`'s. With no clips, a pass that keeps
    nothing (the memory profile's): each prompt writes zeros to the null slot and reads block 0."""
    rows, device, size = model.max_cross_rows, kv_cache.device, kv_cache.block_size
    prompts = len(meta.query_lens)
    if clips is None:
        dtype = next(model.parameters()).dtype
        clips = [torch.zeros(rows, model.cross_width, dtype=dtype, device=device)] * prompts
        reads = list(range(prompts))
    writes = prefill_metadata([rows] * len(clips), kv_cache, first_blocks)
    per_row = torch.tensor(reads).repeat_interleave(torch.tensor(meta.query_lens)).to(device)
    tables = writes.block_tables[per_row]
    return CrossInputs(cross_attention_metadata([rows] * len(per_row), tables, size), torch.cat(clips), writes)


def prefill_metadata(lengths: list[int], kv_cache: KVCache, first_blocks: list[int] | None = None) -> AttentionMetadata:
    """Attention inputs of one step that prefills prompts of these lengths, outside the
    scheduler: prompt i's keys and values go to consecutive blocks from `first_blocks[i]`
    (which the caller has allocated), or with None all to the null slot (a pass that keeps
    nothing, such as the memory profile's)."""
    device, size = kv_cache.device, kv_cache.block_size
    num_blocks = [-(-n // size) for n in lengths]
    tables = torch.zeros(len(lengths), max(num_blocks), dtype=torch.int32)
    if first_blocks is None:
        slots = torch.full((sum(lengths),), kv_cache.null_slot, dtype=torch.long)
    else:
        slots = torch.cat([torch.arange(n) + first * size for n, first in zip(lengths, first_blocks)])
        for row, (first, count) in enumerate(zip(first_blocks, num_blocks)):
            tables[row, :count] = torch.arange(first, first + count)
    return AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        positions=torch.cat([torch.arange(n) for n in lengths]).to(device),
        query_lens=lengths, context_lens=lengths, block_size=size)
