"""Multi-head latent attention (MLA: DeepSeek-V2 and V3, Kimi-K2) over the paged KV cache.

A token's keys and values for every head come from one compressed vector: its latent c
(`latent` values, normalised) and one rotary key k_pe (`rope` values) that every head
shares. Head h's key is [W_UK_h c, k_pe] and its value W_UV_h c, where W_UK_h and W_UV_h
are head h's rows of the layer's `kv_b_proj`. The cache keeps only [c, k_pe] per token and
layer (576 values for DeepSeek-V2/V3, against 2 x 128 heads x 128 of multi-head
attention): `MLAAttention` is a layer of one KV head of latent + rope values whose values
are the first `latent` of its keys (`values_in_keys`), so `engine.worker.kv_cache` gives it
one cache tensor, read as both.

Two ways to attend, equal in exact arithmetic, chosen per sequence as vLLM does:
- absorbed (a sequence with one new token, a decode): each head's query without position
  is multiplied by W_UK_h first, so its scores are [q_nope_h W_UK_h, q_pe_h] . [c, k_pe]
  scaled: multi-query attention over the latent cache, whose output (a latent per head) W_UV_h
  maps to the head's value. The backend runs it (`AttentionBackend.forward_latent`): the
  Triton backend's decode steps through a kernel of its own
  (`engine.kernels.triton.mla_decode`), the others through their paged kernels, on the
  one cache tensor as keys and values, the output's first `latent` values kept.
- expanded (a sequence with several new tokens, a prefill or a chunk of one): its whole
  context's latents are read from the cache and expanded by kv_b_proj into per-head keys
  (nope + rope values) and values, and attention runs over those: per key and query a
  prompt then costs nope + rope + value products per head instead of 2 x (latent + rope),
  which pays for the expansion once a prompt has a few hundred tokens.
With `expand_prefill` False (the engine's `batch_invariant=True`) every row takes the
absorbed form, whose kernels keep a row's bits apart from the rest of its step.
"""

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.layer import Attention, AttentionBackend, AttentionMetadata
from engine.kernels.kv_cache_quant import dequantize, is_scaled

# Queries of one sequence attended at once in the expanded form: bounds the score matrix.
_QUERY_CHUNK = 512


@dataclass(frozen=True)
class MLADims:
    """A latent attention layer's widths (config.json's names in brackets): `latent`
    (kv_lora_rank), `rope` (qk_rope_head_dim) the rotary part of a key and query, `nope`
    (qk_nope_head_dim) the rest of a head's query and key, `value` (v_head_dim)."""

    latent: int
    rope: int
    nope: int
    value: int

    @property
    def cache_width(self) -> int:
        """Values the cache holds per token: the latent and the rotary key."""
        return self.latent + self.rope


@dataclass(frozen=True)
class ExpandedSequence:
    """A sequence of the step that attends in the expanded form: its new tokens are rows
    `first_row:first_row + num_new`, and its context (cached tokens, then the new ones) is
    `context_len` tokens at entries `context_start:context_start + context_len` of the
    plan's `context_slots`."""

    first_row: int
    num_new: int
    context_len: int
    context_start: int


@dataclass(frozen=True)
class LatentPlan:
    """How a step's rows split between the two forms, derived once per step by its first
    latent layer (in `AttentionMetadata.layer_plans`): `decode_rows` [rows] and their own
    metadata `decode_meta` (prepared by the backend), None where no sequence decodes;
    the sequences that expand, and the cache slots of their contexts, concatenated."""

    decode_rows: torch.Tensor | None
    decode_meta: AttentionMetadata | None
    expanded: list[ExpandedSequence]
    context_slots: torch.Tensor


class MLAAttention(Attention):
    """One latent attention layer over `num_heads` query heads (this rank's), reading the
    up-projection `kv_b_proj` of its model (a `Linear` of num_heads x (nope + value) rows
    over `latent` inputs). `absorb` derives W_UK and W_UV from it once the weights are in."""

    values_in_keys = True

    def __init__(self, num_heads: int, dims: MLADims, scale: float, kv_b_proj: nn.Linear) -> None:
        super().__init__(num_heads, dims.cache_width, 1, scale=scale)
        self.dims = dims
        self.kv_b_proj = [kv_b_proj]  # a list: the projection is its model's, registered there
        self.expand_prefill = True
        self.w_uk = torch.empty(0)  # [heads, nope, latent]
        self.w_uv = torch.empty(0)  # [heads, latent, value]

    def absorb(self) -> None:
        """W_UK and W_UV from `kv_b_proj`'s weight (call before the projection is prepacked,
        which may drop its plain weight)."""
        dims = self.dims
        weight = self.kv_b_proj[0].weight.detach().view(self.num_heads, dims.nope + dims.value, dims.latent)
        self.w_uk = weight[:, : dims.nope].contiguous()
        self.w_uv = weight[:, dims.nope :].transpose(1, 2).contiguous()

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Each row's attention output [tokens, heads, value] from its query parts `q_nope`
        [tokens, heads, nope] and `q_pe` [tokens, heads, rope] (rotated), after storing the
        step's normalised `latent` [tokens, latent] and rotated `k_pe` [tokens, rope]."""
        entry = torch.cat((latent, k_pe), dim=-1).unsqueeze(1)
        self.backend.write_kv(self, entry, entry, meta)
        if not self.expand_prefill or meta.is_decode:
            return self._absorbed(q_nope, q_pe, meta)
        plan = meta.layer_plans.get("mla")
        if plan is None:
            plan = meta.layer_plans["mla"] = plan_latent_step(meta, self.backend)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.dims.value)
        if plan.decode_meta is not None:
            rows = plan.decode_rows
            out[rows] = self._absorbed(q_nope[rows], q_pe[rows], plan.decode_meta)
        if plan.expanded:
            self._expanded(q_nope, q_pe, plan, out)
        return out

    def _absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The absorbed form: multi-query attention over the latent cache."""
        if not self.w_uk.numel():  # a pass before prepack (int8's calibration)
            self.absorb()
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        q = torch.cat((q_latent, q_pe), dim=-1)
        attended = self.backend.forward_latent(self, q, meta, self.dims.latent)
        return torch.bmm(attended.transpose(0, 1), self.w_uv).transpose(0, 1)

    def _expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, plan: LatentPlan, out: torch.Tensor) -> None:
        """The expanded form for the plan's `expanded` sequences, into their rows of `out`."""
        dims, heads = self.dims, self.num_heads
        context = self._read_latents(plan.context_slots, q_nope.dtype)
        kv = self.kv_b_proj[0](context[:, : dims.latent].contiguous()).view(-1, heads, dims.nope + dims.value)
        k_pe = context[:, dims.latent :].unsqueeze(1).expand(-1, heads, -1)
        keys = torch.cat((kv[..., : dims.nope], k_pe), dim=-1).transpose(0, 1)  # [heads, context, nope + rope]
        values = kv[..., dims.nope :].transpose(0, 1)
        queries = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)  # [heads, rows, nope + rope]
        for seq in plan.expanded:
            span = slice(seq.context_start, seq.context_start + seq.context_len)
            k, v = keys[:, span], values[:, span]
            computed = seq.context_len - seq.num_new
            for start in range(0, seq.num_new, _QUERY_CHUNK):
                count = min(_QUERY_CHUNK, seq.num_new - start)
                rows = slice(seq.first_row + start, seq.first_row + start + count)
                query_pos = torch.arange(computed + start, computed + start + count, device=q_nope.device)
                mask = torch.arange(seq.context_len, device=q_nope.device) <= query_pos.unsqueeze(1)
                attended = F.scaled_dot_product_attention(queries[:, rows].unsqueeze(0), k.unsqueeze(0),
                                                          v.unsqueeze(0), attn_mask=mask, scale=self.scale)
                out[rows] = attended[0].transpose(0, 1)

    def _read_latents(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The cached [latent, k_pe] vectors [len(slots), cache_width] at `slots`, as `dtype`."""
        cache = self.backend.slot_major(self.k_cache)[slots, 0]
        if is_scaled(cache.dtype):
            return dequantize(cache, self.backend.slot_major(self.k_scale)[slots, 0], dtype)
        return cache.to(dtype)


def plan_latent_step(meta: AttentionMetadata, backend: AttentionBackend) -> LatentPlan:
    """Splits a step's sequences between the absorbed form (one new token) and the expanded
    one (several), with the decode rows' own metadata prepared by `backend`."""
    device, size = meta.slot_mapping.device, meta.block_size
    starts = list(itertools.accumulate(meta.query_lens, initial=0))
    decodes = [i for i, n in enumerate(meta.query_lens) if n == 1]
    expanded, slots, offset = [], [], 0
    for i, (new, context) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if new == 1:
            continue
        expanded.append(ExpandedSequence(starts[i], new, context, offset))
        positions = torch.arange(context, device=device)
        slots.append(meta.block_tables[i, positions // size].long() * size + positions % size)
        offset += context
    context_slots = torch.cat(slots) if slots else torch.empty(0, dtype=torch.long, device=device)
    if not decodes:
        return LatentPlan(None, None, expanded, context_slots)
    index = torch.tensor(decodes, device=device)
    rows = torch.tensor([starts[i] for i in decodes], device=device)
    decode_meta = AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows], query_start_loc=torch.arange(len(decodes) + 1, dtype=torch.int32,
                                                                           device=device),
        seq_lens=meta.seq_lens[index], block_tables=meta.block_tables[index], positions=meta.positions[rows],
        query_lens=[1] * len(decodes), context_lens=[meta.context_lens[i] for i in decodes], block_size=size)
    backend.prepare(decode_meta)
    return LatentPlan(rows, decode_meta, expanded, context_slots)


def use_absorbed_attention_only(model: nn.Module) -> None:
    """Makes every latent layer of `model` attend in the absorbed form alone (see the module
    docstring): the engine's `batch_invariant=True`."""
    for module in model.modules():
        if isinstance(module, MLAAttention):
            module.expand_prefill = False
