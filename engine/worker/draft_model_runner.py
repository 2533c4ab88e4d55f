"""The draft model of speculative decoding (`speculative_config={"model": folder}`): a
smaller model of the target's vocabulary proposes each speculating sequence's next tokens
at the start of the step that verifies them.

Its paged KV cache is its own but shares the target's block tables: as many blocks, the
same block size, each sequence's draft keys and values in the blocks the scheduler gave
the sequence. The step's slots cover the sequence's last token and all its proposals, so
the draft writes only where the target will. A sequence's draft cache is filled lazily:
the first time it speculates the draft computes all its tokens (a prefill), afterwards
only those it lacks (the step's accepted proposal it did not compute, the token sampled
after them), then one forward pass per further proposal, the rows of every speculating
sequence together. Proposals are the draft's greedy choices, as vLLM's: verification then
samples each row from the target and keeps the proposals its rows sampled, which for a
single proposed token is rejection sampling exactly (greedy rows give the target's greedy
tokens, sampled rows the target's distribution).
"""

import itertools
import logging
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from engine.config import AT_LOAD, EngineConfig, ModelConfig
from engine.core.sched_output import ScheduledBatch
from engine.core.sequence import Sequence
from engine.distributed.communicator import TensorParallelGroup
from engine.kernels.kv_cache_quant import cache_torch_dtype
from engine.model_loader.folder import resolve_model_path
from engine.model_loader.loader import load_model
from engine.model_loader.model_config import resolve_model_config
from engine.sample.sampler import greedy_tokens
from engine.spec_decode.draft_model import DraftState
from engine.worker.input_batch import InputBatch, KeptRows, upload
from engine.worker.kv_cache import KVCache

logger = logging.getLogger(__name__)


def resolve_draft_config(config: EngineConfig, target: ModelConfig) -> ModelConfig:
    """The draft model's facts, resolved and checked before anything loads: in the target's
    dtype, on its first device, quantized with speculative_config's `quantization` where
    given, else as its own checkpoint is, else as the target is quantized at load (int8,
    FP8), else unquantized. `config` is the engine's, resolved.

    Raises:
        ValueError: naming the draft's folder: its vocabulary is not the target's, it
            generates from images, its context is shorter than the target's, or it cannot
            take the quantization.
    """
    spec = config.speculative
    path = resolve_model_path(spec.model)
    settings = replace(config, quantization=spec.quantization, runner="generate", pooling_type=None)
    try:
        draft = resolve_model_config(path, settings, None)
        if spec.quantization is None and draft.quantization is None and config.quantization in AT_LOAD:
            draft = resolve_model_config(path, replace(settings, quantization=config.quantization), None)
    except ValueError as exc:
        raise ValueError(f"speculative_config['model']={str(path)!r}: {exc}") from exc
    vocab = target.hf_config.vocab_size
    if draft.hf_config.vocab_size != vocab:
        raise ValueError(f"speculative_config['model']={str(path)!r}: its vocabulary has "
                         f"{draft.hf_config.vocab_size} tokens, the target's {vocab}; a draft model must share the "
                         f"target's tokenizer")
    if draft.multimodal_config is not None:
        raise ValueError(f"speculative_config['model']={str(path)!r}: a vision-language model; the draft "
                         f"model reads text (give its language model's own folder, or a text model)")
    return draft


class DraftModelRunner:
    """The draft model and its KV cache (allocated by the worker, as many blocks as the
    target's), on the target's first rank's device."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig,
                 calibrate: Callable[[nn.Module], None] | None = None) -> None:
        """Loads the draft (`model_config`, from `resolve_draft_config`); `config` is the
        engine's, resolved; `calibrate` measures int8's input ranges."""
        self.model_config = model_config
        self.model = load_model(model_config, TensorParallelGroup(),
                                triton_kernels=config.attention_backend == "triton", calibrate=calibrate)
        self.kv_cache = KVCache(self.model, config.attention_backend, config.block_size,
                                cache_torch_dtype(config.kv_cache_dtype), model_config.device)
        self.device = model_config.device
        self.max_tokens = config.max_num_batched_tokens
        draft = model_config.hf_config
        logger.info("speculative decoding: draft model %s (%s, %s), up to %d tokens per step", model_config.path,
                    draft.architectures[0] if getattr(draft, "architectures", None) else draft.model_type,
                    model_config.quantization or model_config.dtype_name, config.speculative.num_speculative_tokens)

    def release(self) -> None:
        self.kv_cache.free()
        del self.model

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch, input_batch: InputBatch) -> None:
        """Replaces the placeholders of the step's speculating sequences
        (`batch.spec_token_ids`) by the draft's tokens; their batch rows must hold their
        block tables (`InputBatch.sync_rows`)."""
        seqs = list(batch.spec_token_ids)
        counts = [len(batch.spec_token_ids[seq]) for seq in seqs]
        states: list[DraftState] = [seq.spec for seq in seqs]
        last = [seq.num_tokens - 1 for seq in seqs]
        slots = upload(input_batch.slots(seqs), torch.long, self.device)
        rounds = [(list(range(len(seqs))), self._catch_up(input_batch, seqs, [s.num_computed for s in states]))]
        for j in range(1, max(counts)):  # then each proposal, to propose the next
            previous, tokens = rounds[-1]
            live = [i for i in previous if counts[i] > j]
            if len(live) < len(previous):
                kept = upload([k for k, i in enumerate(previous) if counts[i] > j], torch.long, self.device)
                tokens, slots = tokens[kept], slots[kept]
            rounds.append((live, self._next_tokens(input_batch, tokens, slots, [last[i] + j for i in live],
                                                   [1] * len(live))))
        drafts: list[list[int]] = [[] for _ in seqs]
        for live, tokens in rounds:
            for i, token in zip(live, tokens.tolist()):
                drafts[i].append(token)
        for seq, state, proposals, end in zip(seqs, states, drafts, last):
            batch.spec_token_ids[seq] = proposals
            state.num_computed = end + len(proposals)  # all but the last proposal's keys and values

    def _catch_up(self, input_batch: InputBatch, seqs: list[Sequence], starts: list[int]) -> torch.Tensor:
        """Each sequence's first proposal: the draft's greedy token once it has computed the
        sequence's tokens from `starts[i]` to its last (the step's first row). A pass takes at
        most the step budget's tokens (`max_num_batched_tokens`, which the activations were
        sized for): a long catch-up goes in pieces, as a chunked prefill."""
        budget = self.max_tokens
        pieces = [(i, first, min(first + budget, seq.num_tokens))
                  for i, (seq, start) in enumerate(zip(seqs, starts))
                  for first in range(start, seq.num_tokens, budget)]
        passes: list[list[tuple[int, int, int]]] = [[]]
        size = 0  # the last pass's tokens
        for piece in pieces:  # a full piece fills a pass: a sequence has at most one piece in each
            if passes[-1] and size + piece[2] - piece[1] > budget:
                passes.append([])
                size = 0
            passes[-1].append(piece)
            size += piece[2] - piece[1]
        first_tokens = torch.empty(len(seqs), dtype=torch.long, device=self.device)
        for pieces in passes:
            ids = upload([t for i, first, end in pieces for t in seqs[i].token_ids[first:end]], torch.long,
                         self.device)
            slots = upload(input_batch.slots([seqs[i] for i, _, _ in pieces]), torch.long, self.device)
            tokens = self._next_tokens(input_batch, ids, slots, [first for _, first, _ in pieces],
                                       [end - first for _, first, end in pieces])
            ending = [k for k, (i, _, end) in enumerate(pieces) if end == seqs[i].num_tokens]
            if len(passes) == 1 and len(ending) == len(seqs):  # the usual step: a token or two each, one pass
                return tokens
            first_tokens[upload([pieces[k][0] for k in ending], torch.long, self.device)] = tokens[
                upload(ending, torch.long, self.device)]
        return first_tokens

    def _next_tokens(self, input_batch: InputBatch, ids: torch.Tensor, slots: torch.Tensor, starts: list[int],
                     nums: list[int]) -> torch.Tensor:
        """The draft's greedy token after each sequence's `nums[i]` new tokens (`ids`, back
        to back; batch row `slots[i]`) from position `starts[i]`, whose keys and values its
        cache takes."""
        meta = input_batch.attention_metadata(slots, starts, nums)
        ends = list(itertools.accumulate(nums))
        kept = KeptRows.of([end - 1 for end in ends], ends[-1], self.device)
        self.kv_cache.backend.prepare(meta)
        logits = self.model.compute_logits(self.model(ids, meta.positions, meta, kept.index))
        return greedy_tokens(logits[:, : self.model_config.hf_config.vocab_size])
