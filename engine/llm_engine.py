"""The engine loop: requests in, one scheduled step at a time, finished sequences out."""

import gc
import itertools
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.attention.selector import resolve_backend_name
from engine.beam_search import BeamSearchOutput, BeamSearchParams
from engine.config import EngineConfig, ModelConfig
from engine.core.beam_group import BeamGroup
from engine.core.block_manager import BlockManager
from engine.core.encoder_cache_manager import EncoderCacheManager
from engine.core.sched_output import ScheduledBatch
from engine.core.scheduler import Scheduler
from engine.core.sequence import Pooling, Sequence, SequenceStatus, logits_processing
from engine.distributed.plan import ReplicaPlan, check_tensor_parallel, plan_parallelism
from engine.hardware import release_freed_memory
from engine.lora.manager import LoRAManager
from engine.lora.request import LoRARequest
from engine.model_loader.folder import check_model_folder, resolve_model_path
from engine.model_loader.model_config import resolve_model_config
from engine.models import is_encoder_decoder, multimodal_class_for
from engine.multimodal.inputs import ProcessedPrompt
from engine.multimodal.processing import BaseMultiModalProcessor
from engine.output_processor.processor import OutputProcessor, resolve_reasoning_parser, resolve_tool_parser
from engine.outputs import EngineStats, PoolingRequestOutput, RequestOutput, UnfinishedOutput
from engine.pooling_params import PoolingParams
from engine.sample.rejection_sampler import num_accepted
from engine.sample.sampler import SampledToken
from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.structured_output.manager import StructuredOutputManager
from engine.tool_parsers import ToolParser
from engine.tool_parsers.request_tools import RequestTools
from engine.worker.draft_model_runner import resolve_draft_config
from engine.worker.model_runner import LaunchedStep, ModelRunner, StepOutput

logger = logging.getLogger(__name__)


class LLMEngine:
    """The loop: requests in; each step scheduled, launched on the model runner, its sampled
    tokens handed to the output processor; the finished out. Owns the tokenizer, the
    scheduler, the block manager, the model runner and the output processor."""

    def __init__(self, config: EngineConfig, replica: ReplicaPlan | None = None) -> None:
        """`replica` places this engine's ranks when it is one data-parallel replica of
        several; by default the first replica of the plan for `config` on this machine.

        Raises:
            ValueError: a setting that cannot run: a model folder that cannot be used, a
                plan this machine or model cannot hold (`plan_parallelism`,
                `check_tensor_parallel`).
            WorkerError: a tensor-parallel rank failed to start.
        """
        path = resolve_model_path(config.model)
        tokenizer_path = Path(config.tokenizer).expanduser() if config.tokenizer else path
        check_model_folder(path, tokenizer_path)
        spec = config.speculative
        if spec is not None and spec.model is not None:
            check_model_folder(resolve_model_path(spec.model), tokenizer_path)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(tokenizer_path)
        model_config = resolve_model_config(path, config, self.tokenizer.eos_token_id)
        check_tensor_parallel(model_config.hf_config, config.tensor_parallel_size)
        if model_config.multimodal_config is not None and config.tensor_parallel_size > 1:
            raise ValueError(f"{path}: a model that reads images or audio runs on one rank here (its encoder is not "
                             "split): use tensor_parallel_size=1, and data_parallel_size for more devices")
        if is_encoder_decoder(model_config.hf_config.architectures):
            _check_encoder_decoder_settings(path, config)
        if replica is None:
            replica = plan_parallelism(config.tensor_parallel_size, config.data_parallel_size,
                                       model_config.device).replicas[0]
        self.model_config = model_config = replace(model_config, device=replica.placements[0].device)
        backend = resolve_backend_name(config.attention_backend, model_config.device)
        config = config.resolve(model_config, backend)  # every default decided, once
        self.structured_output = StructuredOutputManager(
            self.tokenizer, model_config.hf_config.vocab_size, sorted(model_config.eos_token_ids))
        reasoning = resolve_reasoning_parser(config.reasoning_parser, self.tokenizer)
        tools = resolve_tool_parser(config.tool_call_parser, self.tokenizer)
        self.output_processor = OutputProcessor(
            self.tokenizer, frozenset(model_config.eos_token_ids),
            model_config.pooler.task if model_config.pooler is not None else None, reasoning, tools)
        self.config = config = replace(  # the parsers 'auto' chose, by name: they decide how outputs are split
            config, reasoning_parser=reasoning.format.name if reasoning else None,
            tool_call_parser=tools.name if tools else None)
        draft_config = resolve_draft_config(config, model_config) if spec is not None and spec.model else None
        self.model_runner = ModelRunner(config, model_config, replica, draft_config)
        self.block_manager = BlockManager(
            self.model_runner.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.mm_processor = _multimodal_processor(model_config, self.tokenizer)
        # An image's output must fit the cache alone; a prompt, images included, fits max_model_len.
        # An encoder-decoder model's clips take no prompt positions: the cache holds four, and a
        # step may encode as many (their rows are no step tokens).
        cross_rows = 4 * self.mm_processor.max_item_rows() if self.mm_processor is not None else 0
        encoder_cache = (EncoderCacheManager(max(config.max_num_batched_tokens, config.max_model_len, cross_rows))
                         if self.mm_processor is not None else None)
        self.scheduler = Scheduler(config, self.block_manager, encoder_cache,
                                   encoder_budget=max(config.max_num_batched_tokens, cross_rows))
        self.proposer = ((DraftModelProposer if spec.method == "draft_model" else NgramProposer)(
            spec, config.max_model_len) if spec is not None else None)
        self.stats = EngineStats()
        self._seq_ids = itertools.count()
        self._in_flight: LaunchedStep | None = None  # launched, its tokens not yet read back
        self._finalizer: weakref.finalize | None = None
        if self.model_config.device.type == "cpu":
            self._finalizer = weakref.finalize(self, _free_dropped_engine, self.__dict__)
            self._finalizer.atexit = False

    @property
    def lora_manager(self) -> LoRAManager | None:
        """The adapter caches, when the engine was created with enable_lora=True."""
        return self.model_runner.lora_manager

    @property
    def tool_parser(self) -> ToolParser | None:
        """The tool-call parser the outputs are read by (its call ids are the entry point's)."""
        return self.output_processor.tool_parser

    @property
    def kv_cache_tokens(self) -> int:
        """How many tokens the KV cache holds in all."""
        return self.block_manager.num_blocks * self.config.block_size

    def add_lora(self, lora_request: LoRARequest) -> str:
        """Reads an adapter into host memory and checks it against the model; returns its
        fingerprint (sha256 of its config and weights).

        Raises:
            ValueError: the engine was created without enable_lora, or the adapter cannot
                run (`LoRAError`, naming it, the problem and the fix).
        """
        if self.lora_manager is None:
            raise ValueError("adapters need LLM(enable_lora=True, max_lora_rank=...)")
        return self.lora_manager.check(lora_request).digest

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        beam_search: BeamSearchParams | None = None,
        pooling: PoolingParams | None = None,
        multi_modal: ProcessedPrompt | None = None,
        tools: RequestTools | None = None,
    ) -> Sequence:
        """Queues a validated request (its first completion; the others fork from it).
        With `beam_search` it is a beam search (`sampling_params` is then
        `beam_search.sampling_params()`), whose first beam this sequence is; with
        `pooling`, a prompt to embed or classify, which is only prefilled. `tools`: the
        tools a chat declared, which its completions' calls are read by, and whether the
        tool parser reads them (its tool choice)."""
        seq = self._new_sequence(request_id, prompt, prompt_token_ids, sampling_params, priority, index=0,
                                 lora_request=lora_request, multi_modal=multi_modal)
        if pooling is not None:
            seq.pooling = Pooling(pooling, whole_prompt=self.model_config.pooler.needs_every_row)
            seq.max_num_tokens = seq.num_prompt_tokens
        else:
            self.output_processor.start(seq, parses=beam_search is None, tools=tools)
        seq.logits_processing = logits_processing(sampling_params, self._bad_words_ids(sampling_params.bad_words))
        if beam_search is not None:
            seq.beam = BeamGroup(beam_search, seq, seq.max_num_tokens - seq.num_prompt_tokens,
                                 frozenset(self.model_config.eos_token_ids), beams=[seq])
        self.scheduler.add(seq)
        return seq

    def _new_sequence(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                      params: SamplingParams, priority: int, index: int,
                      lora_request: LoRARequest | None, multi_modal: ProcessedPrompt | None = None) -> Sequence:
        """A new sequence of the request, with its grammar where it has one; one that generates
        tokens is given its output state next (`OutputProcessor.start`)."""
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            priority=priority,
            index=index,
            lora_request=lora_request,
            multi_modal=multi_modal,
        )
        seq.max_num_tokens = seq.num_prompt_tokens + params.max_output_tokens(seq.num_prompt_tokens,
                                                                               self.model_config.max_model_len)
        if params.structured_outputs is not None:
            seq.grammar = self.structured_output.grammar(params.structured_outputs)
        return seq

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokenizations, with and without a leading space (as vLLM does)."""
        found = []
        for word in words:
            for variant in (word, " " + word.lstrip()):
                ids = self.tokenizer(variant, add_special_tokens=False).input_ids
                if ids and ids not in found:
                    found.append(ids)
        return found

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Sequence]:
        """Schedules and launches one step; returns the sequences that finished.

        With asynchronous scheduling a step's tokens are read back during the next step:
        its forward pass is queued first, then the previous step's tokens are appended
        and checked for stops while the device computes, then the step samples. So the
        sequences returned are those the previous step finished. Without it, a step's
        tokens are read back before it returns.
        """
        started = time.perf_counter()
        if self.proposer is not None:
            self.proposer.keep_worthwhile(self.scheduler.running)
        batch = self.scheduler.schedule()
        launched = self._launch_forward(batch) if batch.seqs else None
        if not batch.seqs:
            self.model_runner.release_rows(batch.released)
        finished = self._process(self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        if launched is not None:
            self.model_runner.launch_sampling(launched)
            if self.config.async_scheduling:
                self._in_flight = launched
            else:
                finished += self._process(launched)
        if self.proposer is not None and batch.seqs and batch.num_tokens == len(batch.seqs) + sum(
                map(len, batch.spec_token_ids.values())):  # a decode step: its time is a cost of rows
            self.proposer.step_times.add(batch.num_tokens, time.perf_counter() - started)
        return finished

    def step_requests(self) -> list[Sequence]:
        """Runs `step` and returns the requests it finished, each once (by its first
        completion's sequence), however many of their completions ended in it."""
        return list({seq.group[0] for seq in self.step() if seq.request_finished})

    def _launch_forward(self, batch: ScheduledBatch) -> LaunchedStep:
        """Makes the encoder inputs of the items (images, clips) the step encodes, forks the completions
        whose prompt this step finishes, queues the forward pass and counts its tokens as
        computed."""
        self.stats.num_cached_prompt_tokens += batch.cached_prompt_tokens
        self.stats.num_images_encoded += sum(feature.modality == "image" for feature in batch.encoder_inputs)
        self.stats.num_audios_encoded += sum(feature.modality == "audio" for feature in batch.encoder_inputs)
        self.stats.num_videos_encoded += sum(feature.modality == "video" for feature in batch.encoder_inputs)
        for feature in batch.encoder_inputs:
            feature.data = self.mm_processor.encoder_inputs(feature)
        # A parent forks its completions in the step that computes its prompt's last token.
        prefilling = [(seq, num_new) for seq, num_new in zip(batch.seqs, batch.num_new_tokens)
                      if seq.num_computed_tokens < seq.num_prompt_tokens]
        for seq, num_new in prefilling:
            start = seq.num_computed_tokens
            self.stats.num_prompt_tokens_computed += min(start + num_new, seq.num_prompt_tokens) - start
            if seq.num_pending_children and start + num_new == seq.num_tokens:
                batch.forks += self._fork(seq)
        launched = self.model_runner.launch_forward(batch)
        self.scheduler.update_computed(batch)
        for child, parent in batch.forks:
            child.num_computed_tokens = parent.num_computed_tokens
            child.blocks.num_registered = parent.blocks.num_registered
        self.stats.num_steps += 1
        return launched

    def _process(self, launched: LaunchedStep) -> list[Sequence]:
        """Reads a step's tokens back, hands them to the output processor and retires the
        sequences they end. A sequence finished or aborted since the step was launched takes
        nothing."""
        output = self.model_runner.collect(launched)
        self.output_processor.add_prompt_logprobs(output.prompt_logprobs)
        finished = []
        for seq, vector in output.pooled.items():
            if not seq.is_finished:
                seq.pooling.vector = vector
                self._finish(seq)
                finished.append(seq)
        appended = 0
        for seq, tokens in _tokens_by_sequence(output):
            if seq.is_finished:
                continue
            if seq.beam is not None:
                seq.num_pending_tokens = 0
                if seq.beam.report(seq, tokens[0][1]):
                    finished += self._advance_beams(seq.beam)
                continue
            appended += self._take_tokens(seq, tokens, output.spec_token_ids.get(seq, []))
            if seq.finish_reason is not None:
                self._finish(seq)
                finished.append(seq)
            elif self.proposer is not None:
                self.proposer.propose(seq)
        self.stats.num_generated_tokens += appended
        self.output_processor.finish_texts(finished)
        return finished

    def _finish(self, seq: Sequence) -> None:
        """Retires a sequence its step finished."""
        seq.metrics.finished_time = time.monotonic()
        self.scheduler.finish(seq)

    def _take_tokens(self, seq: Sequence, tokens: list[tuple[int, SampledToken | None]], proposed: list[int]) -> int:
        """Hands what a sequence's rows sampled to the output processor: its one token, or
        with proposals, those the verification keeps (`num_accepted`: the accepted ones and
        the token after them), up to one that ends it. Counts the step's proposals where
        the proposer, the scheduler (their keys and values) and the stats follow them;
        returns the tokens added."""
        if proposed:
            tokens = tokens[: num_accepted(proposed, [token for token, _ in tokens]) + 1]
        taken = self.output_processor.take_tokens(seq, tokens)
        accepted = taken - 1  # the last token taken was sampled after the accepted proposals
        if self.proposer is not None:
            self.proposer.record(seq, len(proposed), accepted)
        if proposed:
            self.scheduler.update_accepted(seq, accepted)
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += len(proposed)
            self.stats.num_accepted_tokens += accepted
        return taken

    def _fork(self, parent: Sequence) -> list[tuple[Sequence, Sequence]]:
        """Creates the parent's other completions, sharing its prompt blocks."""
        forks = []
        for index in range(1, parent.num_pending_children + 1):
            child = self._new_sequence(parent.request_id, parent.prompt, parent.token_ids[: parent.num_prompt_tokens],
                                       parent.sampling_params, parent.priority, index, parent.lora_request,
                                       parent.multi_modal)
            self.output_processor.start(child, parses=True, tools=parent.output.tools)
            child.logits_processing = parent.logits_processing
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.metrics.first_scheduled_time = parent.metrics.first_scheduled_time
            child.group = parent.group
            parent.group.append(child)
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
            forks.append((child, parent))
        parent.num_pending_children = 0
        return forks

    def _advance_beams(self, group: BeamGroup) -> list[Sequence]:
        """Carries out a beam group's choice for the step on the running set: a beam chosen
        once goes on, each further choice of it forks it (sharing its blocks), a beam not
        chosen is retired. Returns the request's first sequence when the search is done."""
        continuations = group.advance()
        next_beams = []
        for beam in group.beams:
            chosen = [c for c in continuations if c.parent is beam]
            next_beams += [(self._fork_beam(beam), c) for c in chosen[1:]]
            if chosen:
                next_beams.append((beam, chosen[0]))
            else:
                self.scheduler.finish(beam)
        for beam, continuation in next_beams:
            self.output_processor.extend_beam(beam, continuation)
        self.stats.num_generated_tokens += len(next_beams)
        group.beams = [beam for beam, _ in next_beams]
        if not group.done:
            return []
        for beam in group.beams:
            self.scheduler.finish(beam)
        group.head.metrics.finished_time = time.monotonic()
        return [group.head]

    def _fork_beam(self, parent: Sequence) -> Sequence:
        """A new beam with the parent's tokens, sharing its blocks when it runs (a parent
        preempted meanwhile recomputes, and so does its fork)."""
        child = self._new_sequence(parent.request_id, parent.prompt, parent.token_ids[: parent.num_prompt_tokens],
                                   parent.sampling_params, parent.priority, 0, parent.lora_request, parent.multi_modal)
        self.output_processor.start(child, parses=False)
        child.token_ids = list(parent.token_ids)
        child.output.logprobs = list(parent.output.logprobs)
        child.beam = parent.beam
        child.metrics = replace(parent.metrics)
        if parent.status is SequenceStatus.RUNNING:
            child.num_computed_tokens = parent.num_computed_tokens
            self.block_manager.fork(parent, child)
            self.scheduler.add_running(child)
        else:
            self.scheduler.add(child)
        return child

    def abort_request(self, request_id: str) -> list[Sequence]:
        """Drops one request's queued and running sequences, returning their blocks."""
        return self.scheduler.abort_seq_group(request_id)

    def unfinished_outputs(self) -> list[UnfinishedOutput]:
        """Tokens generated and max_tokens of every completion still queued or running: what
        a progress estimate needs. Safe to call from another thread (a snapshot)."""
        seqs = list(self.scheduler.running) + list(self.scheduler.waiting)
        return [UnfinishedOutput(seq.num_output_tokens, seq.max_num_tokens - seq.num_prompt_tokens) for seq in seqs]

    def abort_all(self) -> None:
        """Drops every queued and running request, returning their blocks; a step in
        flight is forgotten (its tokens were for requests that no longer exist)."""
        self._in_flight = None
        self.scheduler.abort_all()

    def output(self, seq: Sequence) -> RequestOutput | BeamSearchOutput | PoolingRequestOutput:
        """A finished request's output, given its first sequence (`OutputProcessor.output`)."""
        return self.output_processor.output(seq)

    def release(self) -> None:
        """Frees the model and the KV cache (`LLM.close`, which then collects and trims once:
        the finalizer for an engine dropped without it is detached)."""
        self.abort_all()
        self.model_runner.release()
        if self._finalizer is not None:
            self._finalizer.detach()


def _multimodal_processor(model_config: ModelConfig,
                          tokenizer: PreTrainedTokenizerBase) -> BaseMultiModalProcessor | None:
    """The processor of a vision-language model's prompts with images; None for a text model."""
    whole = model_config.multimodal_config
    if whole is None:
        return None
    return multimodal_class_for(whole.architectures).processor_class(model_config.path, whole, tokenizer)


def _check_encoder_decoder_settings(path: Path, config: EngineConfig) -> None:
    """Refuses the settings an encoder-decoder model (Whisper) does not run with.

    Raises:
        ValueError: enable_lora or speculative decoding, naming the fix.
    """
    if config.enable_lora:
        raise ValueError(f"{path}: LoRA adapters are not supported for encoder-decoder models (Whisper): drop "
                         "enable_lora")
    if config.speculative is not None:
        raise ValueError(f"{path}: speculative decoding is not supported for encoder-decoder models (Whisper): drop "
                         "speculative_config")


def _free_dropped_engine(attributes: dict) -> None:
    """Finalizer of an engine on a CPU: when it is dropped without `LLM.close()`, frees
    the model, the KV cache and the tokenizer, then hands the memory that malloc keeps
    for reuse (`keep_freed_memory`) back to the OS.

    A weak reference's callback runs before the dying object's attributes are freed, so
    it clears them itself; a trim before that would leave resident whatever of theirs
    sat in the heap (weights placed in the free space an earlier LLM left). The callback
    holds the attributes, so none of them may refer back to the engine, or it would never
    be freed (tests/engine/test_memory_release.py checks).
    """
    attributes.clear()
    gc.collect()  # parts held in reference cycles (a no-op when this runs inside a collection)
    release_freed_memory()


def _tokens_by_sequence(output: StepOutput) -> Iterator[tuple[Sequence, list[tuple[int, SampledToken | None]]]]:
    """Each sequence the step sampled for, with the token of each of its rows (and its
    logprobs, where any row asked): one row, or a speculating sequence's rows, which follow
    each other."""
    rows = zip(output.seqs, output.token_ids, output.logprobs or itertools.repeat(None))
    if not output.spec_token_ids:
        return ((seq, [(token, sampled)]) for seq, token, sampled in rows)
    return ((seq, [(token, sampled) for _, token, sampled in group])
            for seq, group in itertools.groupby(rows, key=lambda row: row[0]))
