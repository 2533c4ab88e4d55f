"""Runs the model for one scheduled step: launches the forward pass on every rank, then
samples; what a step sampled is read back separately, so that the engine can queue the
next step's forward before it waits for this one's tokens."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.attention.layer import CrossInputs
from engine.config import EngineConfig, ModelConfig
from engine.core.sched_output import ScheduledBatch
from engine.core.sequence import Sequence, SequenceStatus
from engine.distributed.plan import ReplicaPlan
from engine.layers.pooler import Pooler
from engine.lora.manager import LoRAManager
from engine.multimodal.inputs import MultiModalEmbeds, MultiModalFeature, encoder_inputs_on
from engine.sample.rejection_sampler import sampling_rows
from engine.sample.sampler import SampledToken, Sampler, SamplerOutput, token_logprobs
from engine.worker.device_queue import Pending, launch
from engine.worker.input_batch import CrossRows, ImageRows, InputBatch, KeptRows, PromptRows, StepInputs, upload
from engine.worker.kv_cache import KVCache
from engine.worker.sampling_metadata import SamplingMetadataBuilder
from engine.worker.worker import ModelInputs
from engine.worker.worker_group import WorkerGroup

if TYPE_CHECKING:
    from engine.worker.cuda_graphs import CUDAGraphRunner
    from engine.worker.draft_model_runner import DraftModelRunner


@dataclass
class StepOutput:
    """What one step produced, read back on the host: the token each of `seqs` sampled
    (with its logprobs when any row asked), prompt logprobs by position, the output
    vector of each pooling prompt the step finished, and the proposals each speculating
    sequence's rows verified (its rows follow each other in `seqs`)."""

    seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[SampledToken] | None
    prompt_logprobs: dict[Sequence, list[tuple[int, SampledToken]]]
    pooled: dict[Sequence, list[float]] = field(default_factory=dict)
    spec_token_ids: dict[Sequence, list[int]] = field(default_factory=dict)


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device: its inputs, its forward pass (the
    hidden states, until it samples) and then its sampling, whose result is what it
    sampled and the prompt logprobs, copied to the host."""

    inputs: StepInputs
    forward: Pending[torch.Tensor]
    sample_seqs: list[Sequence] = field(default_factory=list)
    sampling: Pending["SampledStep"] | None = None


@dataclass
class SampledStep:
    """A step's results on their way to the host: what it sampled, its prompt logprobs,
    and its finished pooling prompts with their output vectors (one row each)."""

    sampled: SamplerOutput | None = None
    prompt: list[tuple[PromptRows, SamplerOutput]] = field(default_factory=list)
    pooled_seqs: list[Sequence] = field(default_factory=list)
    pooled: torch.Tensor | None = None


class ModelRunner:
    """The model, its paged KV cache and the sampler: rank 0 of the model's ranks (with
    tensor_parallel_size 1, all of it).

    Each step's tokens run as one flat batch of rows ([tokens, hidden]); only the rows
    whose final hidden states are read (a sequence's last token once its prompt is fully
    computed, prompt-logprob and pooled rows) go through the last layer's MLP, and of
    those the ones whose logits are needed through the language-model head and the
    sampler. Sampling and everything after it happen here only; the other ranks run the
    forward passes and their slices of the logits.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, replica: ReplicaPlan,
                 draft_config: ModelConfig | None = None) -> None:
        """`config` is resolved (`EngineConfig.resolve`); `replica` places the ranks (one
        without tensor parallelism), rank 0 on `model_config.device`; `draft_config`: a
        draft model's (`resolve_draft_config`), loaded on rank 0."""
        self.config = config
        self.model_config = model_config
        self.device = model_config.device
        self.block_size = config.block_size
        self.attention_backend = config.attention_backend
        self.workers = WorkerGroup(config, model_config, replica, draft_config)
        self.sampler = Sampler(torch.Generator(self.device).manual_seed(config.seed))
        self.sampling_metadata = SamplingMetadataBuilder(model_config.hf_config.vocab_size,
                                                         model_config.eos_token_ids, self.device)
        self.input_batch = InputBatch(config.max_num_seqs, model_config.max_model_len, self.block_size, self.device,
                                      uses_mrope=getattr(self.model, "uses_mrope", False),
                                      max_cross_rows=getattr(self.model, "max_cross_rows", 0))
        # Encoder outputs [rows, hidden] by image identifier, as the scheduler's encoder cache holds them.
        self.encoder_outputs: dict[str, torch.Tensor] = {}
        self.pooler = (Pooler(model_config.pooler, getattr(self.model, "score", None))
                       if model_config.pooler is not None else None)

    @property
    def model(self) -> nn.Module:
        """Rank 0's model (with tensor parallelism, its share)."""
        return self.workers.local.model

    @property
    def kv_cache(self) -> KVCache:
        """Rank 0's KV cache (every rank holds as many blocks)."""
        return self.workers.local.kv_cache

    @property
    def lora_manager(self) -> LoRAManager | None:
        return self.workers.local.lora_manager

    @property
    def draft(self) -> "DraftModelRunner | None":
        """The draft model (speculative decoding's "draft_model" method), on rank 0."""
        return self.workers.local.draft

    @property
    def cuda_graphs(self) -> "CUDAGraphRunner | None":
        return self.workers.local.cuda_graphs

    def release(self) -> None:
        """Drops the model and the KV cache so that their memory can be returned, and
        stops the other ranks."""
        self.encoder_outputs.clear()
        self.workers.release()

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def launch_forward(self, batch: ScheduledBatch) -> LaunchedStep:
        """Queues the step's forward pass. Rows of the sequences that left the running set
        are freed first."""
        self.input_batch.release(batch.released)
        self.input_batch.rewind_tables(batch.rewritten_tables)
        for identifier in batch.freed_encoder_outputs:
            del self.encoder_outputs[identifier]
        lora_slots = self._activate_adapters(batch.seqs)
        if batch.spec_token_ids and self.draft is not None:
            self.input_batch.sync_rows(list(batch.spec_token_ids))
            self.draft.propose(batch, self.input_batch)
        inputs = self.input_batch.prepare(batch, lora_slots)
        inputs.kept = self._kept_rows(inputs)

        def forward() -> torch.Tensor:
            self.input_batch.fill_pending(inputs)
            self._encode(batch.encoder_inputs)
            return self.workers.execute_model(ModelInputs(
                inputs.input_ids, inputs.attention, batch.block_copies, inputs.lora_ranges, inputs.kept.index,
                self._multimodal_embeds(inputs.image_rows), inputs.rope_positions, self._cross_inputs(inputs.cross)))

        return LaunchedStep(inputs, launch(forward, self.device))

    def _encode(self, features: list[MultiModalFeature]) -> None:
        """Runs the vision encoder on each image the step encodes (once each: the scheduler
        schedules an image only when its output is not held), its floating-point inputs in
        the model's dtype, together where the family batches them; the inputs are dropped
        once encoded."""
        if not features:
            return
        inputs = [encoder_inputs_on(feature.data, self.device, self.model_config.dtype) for feature in features]
        for feature, output in zip(features, self.model.embed_images(inputs)):
            feature.data = None
            self.encoder_outputs[feature.identifier] = output

    def _multimodal_embeds(self, image_rows: list[ImageRows]) -> MultiModalEmbeds | None:
        """The encoder output rows the step's image tokens read, with their step rows."""
        if not image_rows:
            return None
        rows = [row for part in image_rows for row in part.rows]
        embeds = [self.encoder_outputs[part.feature.identifier][part.first : part.last] for part in image_rows]
        return MultiModalEmbeds(upload(rows, torch.long, self.device), torch.cat(embeds))

    def _cross_inputs(self, rows: CrossRows | None) -> CrossInputs | None:
        """An encoder-decoder model's cross-attention inputs, with the encoder outputs the step
        writes into cross blocks (computed by `_encode` before, or held in the encoder cache)."""
        if rows is None:
            return None
        if not rows.written:
            return CrossInputs(rows.meta)
        states = torch.cat([self.encoder_outputs[feature.identifier] for feature in rows.written])
        return CrossInputs(rows.meta, states, rows.writes)

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
        seqs, rows, offsets = inputs.sample_seqs, inputs.sample_rows, inputs.sample_offsets
        if any(seq.status is SequenceStatus.FINISHED for seq in seqs):
            live = [i for i, seq in enumerate(seqs) if not seq.is_finished]
            seqs, rows = [seqs[i] for i in live], [rows[i] for i in live]
            offsets = [offsets[i] for i in live] if offsets is not None else None
        meta = self.sampling_metadata.build(sampling_rows(seqs, offsets, inputs.spec_token_ids)) if seqs else None
        # One pass through the language-model head: the sampling rows, then each
        # sequence's prompt rows that need logprobs.
        logit_rows = inputs.kept.positions(
            rows + [row for p in inputs.prompt_rows for row in range(p.first_row, p.first_row + p.count)])
        rows_t = upload(logit_rows, torch.long, self.device)
        # A speculating sequence's rows all write its slot: with speculation every input
        # token comes from the host (no asynchronous scheduling), none from the slot.
        slots_t = upload(self.input_batch.slots(seqs), torch.long, self.device)
        for seq in seqs:
            seq.num_pending_tokens = 1
        non_blocking = self.device.type == "cuda"

        def sample() -> SampledStep:
            hidden = step.forward.result()
            result = self._pool(hidden, inputs, non_blocking) if inputs.pool_rows else SampledStep()
            if not logit_rows:
                return result
            logits = self.workers.logits(rows_t, logit_rows)
            first = len(rows)
            for prompt_rows in inputs.prompt_rows:
                part = logits[first : first + prompt_rows.count]
                result.prompt.append((prompt_rows, self._prompt_logprobs(prompt_rows, part).to_host(non_blocking)))
                first += prompt_rows.count
            if meta is not None:
                sampled = self.sampler.sample(logits[: len(rows)], meta)
                self.input_batch.last_token_ids[slots_t] = sampled.token_ids
                result.sampled = sampled.to_host(non_blocking)
            return result

        step.sample_seqs = seqs
        step.sampling = launch(sample, self.device, read_back=True)

    def collect(self, step: LaunchedStep) -> StepOutput:
        """Waits for the step's sampled tokens and reads them on the host."""
        result = step.sampling.result()
        sampled, prompt = result.sampled, result.prompt
        step.forward = step.sampling = None  # the hidden states go
        output = StepOutput(step.sample_seqs, [], None, {}, spec_token_ids=step.inputs.spec_token_ids)
        if result.pooled is not None:
            output.pooled = dict(zip(result.pooled_seqs, result.pooled.tolist()))
        if sampled is not None and sampled.logprobs is not None:
            output.logprobs = sampled.entries()
            output.token_ids = [entry.token_id for entry in output.logprobs]
        elif sampled is not None:
            output.token_ids = sampled.token_ids.tolist()
        for rows, logprobs in prompt:
            output.prompt_logprobs[rows.seq] = [(rows.first_position + 1 + i, entry)
                                                for i, entry in enumerate(logprobs.entries())]
        return output

    def _kept_rows(self, inputs: StepInputs) -> KeptRows:
        """The rows whose final hidden states the step reads; all of them where adapters
        run (their deltas are laid out over every row of the step)."""
        if inputs.lora_ranges or (len(inputs.sample_rows) == inputs.num_tokens and not inputs.pool_rows):
            return KeptRows()  # with adapters, or when every row samples (a decode step)
        wanted = list(inputs.sample_rows)
        for p in inputs.prompt_rows:
            wanted += range(p.first_row, p.first_row + p.count)
        for p in inputs.pool_rows:
            wanted += self.pooler.rows_read(p.first_row, p.count, p.first_position, p.last)
        return KeptRows.of(wanted, inputs.num_tokens, self.device)

    def _pool(self, hidden: torch.Tensor, inputs: StepInputs, non_blocking: bool) -> SampledStep:
        """Adds each pooling sequence's rows to its pooled state, and pools those whose
        prompt the step finished into their output vectors."""
        pooler, finished, vectors = self.pooler, [], []
        for rows in inputs.pool_rows:
            seq, row = rows.seq, self.input_batch.rows[rows.seq]
            part = hidden[inputs.kept.span(rows.first_row, rows.count)]
            row.pooling_state = pooler.update(row.pooling_state, part, rows.first_position)
            if rows.last:
                finished.append(seq)
                vectors.append(pooler.vector(row.pooling_state, part, seq.num_prompt_tokens))
                row.pooling_state = None
        if not finished:
            return SampledStep()
        normalize = [pooler.config.normalize if s.pooling.params.normalize is None else s.pooling.params.normalize
                     for s in finished]
        return SampledStep(pooled_seqs=finished, pooled=pooler.finish(vectors, normalize).to("cpu", non_blocking=non_blocking))

    def _activate_adapters(self, seqs: list[Sequence]) -> dict[int, int]:
        """Puts the step's LoRA adapters into device slots: slot by adapter id."""
        requests = [s.lora_request for s in seqs if s.lora_request is not None]
        if not requests:
            return {}
        return self.workers.activate_adapters(requests)

    def _prompt_logprobs(self, rows: PromptRows, logits: torch.Tensor) -> SamplerOutput:
        """The logprobs of the prompt tokens that follow each of the sequence's rows, from
        those rows' logits."""
        seq, start, count = rows.seq, rows.first_position, rows.count
        targets = upload(seq.token_ids[start + 1 : start + 1 + count], torch.long, self.device)
        return SamplerOutput(targets, token_logprobs(logits, targets, [seq.sampling_params.prompt_logprobs] * count))
