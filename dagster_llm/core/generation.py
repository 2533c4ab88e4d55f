"""A generation run, free of Dagster: prompt rows of one or more partitions in, each
partition's committed table and stats out as soon as its last row finishes.

Finished rows are saved in shards as the run goes; a partition whose rows were already
generated for its data version (committed, or in shards of an interrupted run) resumes
them, and a row whose result is reproducible (greedy, seeded or beam search) and whose
digest matches a committed row of the asset, of any partition and data version, reuses
that row: only what is missing is generated.
"""

import array
import collections
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from dagster_llm.core.engine_surface import (
    BeamSearchOutput, CompletionOutput, LoRARequest, RequestOutput, ToolChoice, apply_tool_choice, grammar_problem,
)
from dagster_llm.core.partition_run import (
    CommittedPartition, OpenPartition, PartitionCounts, PartitionRows, PartitionRun, PendingRow, Shards,
)
from dagster_llm.core.progress import GenerationProgress, WorkCounters, speculation_summary
from dagster_llm.core.prompts import PromptRow
from dagster_llm.core.sampling import used_values
from dagster_llm.core.schema import ToolArguments, generation_schema, records_table, result_record
from dagster_llm.core.structured import OutputSpecError, StructuredOutput

if TYPE_CHECKING:
    from dagster_llm.core.engine_surface import LLM


@dataclass(frozen=True)
class RunOptions:
    """How a run generates, saves and reports. `row_settings` is the part of the code
    version that every row's result depends on (None: all of it): what a row resolves for
    itself (its sampling, adapter, beam search, output) enters its digest as resolved.
    `resume` False regenerates every row; `reuse_rows` False only stops reusing rows of
    other data versions."""

    model_id: str
    code_version: str
    row_settings: str | None = None
    resume: bool = True
    reuse_rows: bool = True
    shard_rows: int = 64
    shard_interval_s: float = 30.0
    progress_interval_s: float = 5.0


@dataclass(frozen=True)
class PartitionInput(PartitionRows[PromptRow]):
    """One partition to generate: its prompt rows, its storage (None: nothing is saved until
    the caller stores the table), what its completions must be (None: free text), whether
    its prompt table has image or audio columns (`media`: their modalities; its table then
    records each row's digests of those),
    the argument columns of its one declared tool (None: none) and its tool choice (a forced
    one's calls are read from what its grammar made)."""

    output: StructuredOutput | None = None
    media: tuple[str, ...] = ()
    tool: ToolArguments | None = None
    tool_choice: ToolChoice = ToolChoice()


@dataclass
class PartitionStats(PartitionCounts):
    """What one partition's table holds and what this run did for it: rows resumed (of its
    data version, from an interrupted run or its committed table), reused (committed rows of
    another data version or partition with the same row digest) and generated. `error_rows`
    counts every row with an error, including generated rows whose structured output did not parse;
    `reasoning_tokens` sums the rows' reasoning tokens, `tool_call_rows` counts the rows that
    made a tool call. `speculation`: the run's speculative decoding until the partition
    committed (`speculation_summary`; None without it)."""

    resumed_rows: int = 0
    reused_rows: int = 0
    generated_rows: int = 0
    generated_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    tool_call_rows: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    adapter_fingerprints: dict[str, str] = field(default_factory=dict)
    speculation: dict[str, float | int] | None = None


@dataclass
class PartitionResult(CommittedPartition[PartitionStats]):
    """A committed partition: its table (data version in the schema metadata) and stats."""


@dataclass
class _Partition(OpenPartition[PartitionInput]):
    """A partition while it generates: besides what every run keeps (`OpenPartition`), the
    tokens resumed and reused."""

    resumed_tokens: int = 0
    reused_tokens: int = 0


class GenerationRun(PartitionRun[PartitionInput, PartitionStats]):
    """Generates the rows of several partitions in one engine call, committing each
    partition when its rows are done (`PartitionRun`), and reusing committed rows of the
    same row digest.

    `check_alive` runs after every engine step and before every write; it raises to stop
    the run (for instance when the launching process died), after which nothing more is
    written.
    """

    partition_type = _Partition
    result_type = PartitionResult

    def __init__(self, llm: "LLM", lora_requests: Mapping[str, LoRARequest], options: RunOptions,
                 log: Callable[[str], None], check_alive: Callable[[], None] = lambda: None) -> None:
        super().__init__(check_alive, Shards(options.shard_rows, options.shard_interval_s), options.resume)
        self.llm = llm
        self.lora_requests = lora_requests
        self.options = options
        self.log = log
        self.fingerprints: dict[str, str] = {}
        self._engine_start = llm.get_stats()

    def generate(self, partitions: Sequence[PartitionInput]) -> Iterator[PartitionResult]:
        """Yields each partition's result as it commits; partitions that need no new rows
        first, the others roughly in the given order (their rows are queued in it).

        Raises:
            OutputSpecError: before any work, when the engine cannot compile a partition's
                structured output.
        """
        parts = self._open(partitions)
        self._engine_start = self.llm.get_stats()
        self._check_outputs(parts)
        self._check_rows([row for part in parts for row in part.rows])
        model = self.llm.output_settings
        for part in parts:
            part.data_version = self._data_version(part, model)
            part.row_digests = self._row_digests(part, model)
            self._resume(part)
        self._reuse(parts)
        todo = self._todo(parts)
        self.log(f"generating {len(todo)} rows for {len(parts)} partition(s) "
                 f"({sum(p.resumed_rows for p in parts)} resumed, "
                 f"{sum(p.reused_rows for p in parts)} reused from committed rows of the same digest, "
                 f"{sum(r.error is not None for p in parts for r in p.rows)} with errors)")
        yield from self._ready(parts)
        if todo:
            yield from self._run(todo)

    def _check_outputs(self, parts: list[_Partition]) -> None:
        """Compiles each partition's structured output, or its forced tool choice's grammar
        (a partition's problem, not its rows')."""
        for part in parts:
            where = f"partition {part.key!r}: " if part.key is not None else ""
            output = part.source.output
            if output is not None and (problem := self.llm.structured_output_problem(output.params)):
                raise OutputSpecError(f"{where}{problem}; change the schema (or choices) to what the grammar "
                                      "backend supports; nothing was generated")
            if (problem := grammar_problem(part.source.tool_choice, self.llm.structured_output_problem)) is not None:
                raise OutputSpecError(f"{where}{problem}; nothing was generated")

    def _check_rows(self, rows: list[PromptRow]) -> None:
        """Marks rows the engine cannot take (adapter, length, ids) with their errors."""
        for name in sorted({r.adapter for r in rows if r.adapter is not None and r.error is None}):
            try:
                self.fingerprints[name] = self.llm.add_lora(self.lora_requests[name])
            except ValueError as exc:
                for row in rows:
                    if row.adapter == name:
                        row.fail(f"adapter {name!r}: {exc}")
        ready = [row for row in rows if row.error is None]
        problems = self.llm.validate([r.prompt for r in ready], [r.params for r in ready],
                                     [self._lora(r) for r in ready])
        for row, problem in zip(ready, problems):
            if problem is not None:
                row.fail(problem)
        for beam in {row.beam for row in rows if row.beam is not None and row.error is None}:
            if beam.beam_width > self.llm.max_num_seqs:
                for row in rows:
                    if row.beam == beam:
                        row.fail(f"beam_search: beam_width={beam.beam_width} beams run side by side, but the "
                                 f"resource's max_num_seqs is {self.llm.max_num_seqs}: lower beam_width or raise "
                                 "max_num_seqs")

    def _lora(self, row: PromptRow) -> LoRARequest | None:
        return self.lora_requests[row.adapter] if row.adapter is not None else None

    def _data_version(self, part: _Partition, model: dict) -> str:
        """Digest of everything the partition's table depends on: the code version, the model's
        files and the output settings the engine resolved for them (rows of other settings never
        join the table: a resume on a machine that resolves otherwise regenerates), the rows;
        images and clips by their contents' digests, so that new bytes under the same path are
        a new version."""
        rows = [(r.id, r.prompt_text, used_values(r.params), r.adapter, self.fingerprints.get(r.adapter), r.error,
                 r.beam.model_dump() if r.beam is not None else None, *_media_digests(r))
                for r in part.rows]
        output = part.source.output.describe() if part.source.output is not None else None
        return digest({"code_version": self.options.code_version, "model": model, "rows": rows,
                       "output": output})[:24]

    def _row_digests(self, part: _Partition, model: dict) -> dict[int, str]:
        """The digest of each row whose result is reproducible (greedy, seeded or beam search),
        by position: what its result depends on (its prompt as text and as token ids, the
        sampling it resolved to, adapter and fingerprint, beam search, output, images), the
        model's files and the engine's output settings, the asset's row settings and the table's columns.
        Not the row's id or partition: a row of the same digest anywhere in the asset is
        the same result. Unseeded sampled rows get none: they are never reused."""
        source = part.source
        shared = digest({"settings": self.options.row_settings or self.options.code_version, "model": model,
                         "columns": str(generation_schema(source.output, source.media, source.tool)),
                         "output": source.output.describe() if source.output is not None else None})
        return {row.position: digest({
            "shared": shared, "prompt": row.prompt_text, "tokens": _token_digest(row.prompt["prompt_token_ids"]),
            "sampling": used_values(row.params), "adapter": [row.adapter, self.fingerprints.get(row.adapter)],
            "beam": row.beam.model_dump() if row.beam is not None else None, "images": row.digests.get("image"),
            **{m: row.digests[m] for m in ("audio", "video") if row.digests.get(m)},
        })[:32] for row in part.rows if row.error is None and _reproducible(row)}

    def _reuse(self, parts: list[_Partition]) -> None:
        if self.options.resume and self.options.reuse_rows:
            super()._reuse(parts)

    def _reused_record(self, part: _Partition, row: PromptRow, record: dict[str, Any]) -> dict[str, Any]:
        part.reused_tokens += record["completion_tokens"] or 0
        return {**record, "id": row.id, "model": self.options.model_id}

    def _resume(self, part: _Partition) -> None:
        """Takes the rows already generated for the partition's data version, saying so where
        a committed table of another version is generated again."""
        committed = part.files.committed_version if part.files is not None and self.resume else None
        if committed is not None and committed != part.data_version:
            settings = ", ".join(f"{name} {value}" for name, value in self.llm.output_settings.items())
            self.log(f"partition {part.key!r}: its committed table is of data version {committed}, this run's is "
                     f"{part.data_version} (the prompts, sampling, adapters, model files, code or the engine's "
                     f"output settings changed; this engine: {settings}): its rows are generated again, but for "
                     "those whose digest matches a committed row")
        super()._resume(part)
        part.resumed_tokens = sum(r["completion_tokens"] for r in part.records.values())

    def _run(self, todo: list[PendingRow[PromptRow]]) -> Iterator[PartitionResult]:
        rows = [pending.row for pending in todo]
        counters = WorkCounters(
            rows_total=len(rows),
            prompt_tokens_total=sum(len(r.prompt["prompt_token_ids"]) for r in rows),
            max_output_tokens_total=sum(self._max_tokens(r) for r in rows),
        )
        progress = GenerationProgress(self.log, self.options.progress_interval_s, counters, self.llm.get_stats,
                                      self.check_alive, self.llm.unfinished_outputs)
        with progress:
            for call, finished in self._calls(todo, progress.bar):
                yield from self._take(call, finished, progress)

    def _calls(self, todo: list[PendingRow[PromptRow]], bar: Any
               ) -> Iterator[tuple[list[PendingRow[PromptRow]], Iterator]]:
        """The engine calls that generate `todo`, each with its rows: one for the sampled
        rows, one per distinct beam search (a call takes one BeamSearchParams)."""
        sampled = [pending for pending in todo if pending.row.beam is None]
        if sampled:
            rows = [pending.row for pending in sampled]
            yield sampled, self.llm.generate_as_completed([r.prompt for r in rows], [r.params for r in rows],
                                                          use_tqdm=bar, lora_request=[self._lora(r) for r in rows])
        groups: dict[tuple, list[PendingRow[PromptRow]]] = {}
        for pending in todo:
            row = pending.row
            if row.beam is not None:
                groups.setdefault((row.beam, row.params.max_tokens, row.params.ignore_eos), []).append(pending)
        for group in groups.values():
            rows = [pending.row for pending in group]
            # max_tokens None: up to the context, which the engine caps for each prompt.
            params = rows[0].beam.params(rows[0].params, rows[0].params.max_tokens or self.llm.max_model_len)
            yield group, self.llm.beam_search_as_completed([r.prompt for r in rows], params, use_tqdm=bar,
                                                           lora_request=[self._lora(r) for r in rows])

    def _take(self, call: list[PendingRow[PromptRow]], finished: Iterator, progress: GenerationProgress
              ) -> Iterator[PartitionResult]:
        """Records each finished row of one engine call, committing the partitions it completes."""
        for index, output in finished:
            part, row = call[index].part, call[index].row
            if isinstance(output, BeamSearchOutput):
                output = _best_beam(output)
            apply_tool_choice(output, part.source.tool_choice, self.llm.get_tokenizer(), self.llm.tool_call_ids)
            progress.row_finished(len(output.outputs[0].token_ids), self._max_tokens(row))
            yield from self._finish(part, row.position,
                                    result_record(row, output, self.options.model_id, part.source.tool))

    def _max_tokens(self, row: PromptRow) -> int:
        """The most tokens the row may generate (max_tokens None: what the context leaves)."""
        return row.params.max_output_tokens(len(row.prompt["prompt_token_ids"]), self.llm.max_model_len)

    def _missing_record(self, part: _Partition, row: PromptRow) -> dict[str, Any]:
        return result_record(row, None, self.options.model_id, part.source.tool)

    def _table(self, part: _Partition, records: list[dict[str, Any]]) -> pa.Table:
        return records_table(records, part.source.output, media=part.source.media, tool=part.source.tool)

    def _stats(self, part: _Partition, records: list[dict[str, Any]]) -> PartitionStats:
        """The partition's stats; rows resumed from a table saved before the reasoning and
        tool call columns existed lack them (`.get`)."""
        ran = [r for r in records if r["generated_text"] is not None]  # with or without a parse error
        return PartitionStats(
            rows=len(records),
            error_rows=sum(r["error"] is not None for r in records),
            resumed_rows=part.resumed_rows,
            reused_rows=part.reused_rows,
            generated_rows=len(ran) - part.resumed_rows - part.reused_rows,
            generated_tokens=sum(r["completion_tokens"] for r in ran) - part.resumed_tokens - part.reused_tokens,
            prompt_tokens=sum(r["prompt_tokens"] for r in ran),
            completion_tokens=sum(r["completion_tokens"] for r in ran),
            reasoning_tokens=sum(r.get("reasoning_tokens") or 0 for r in ran),
            tool_call_rows=sum(r.get("tool_calls") is not None for r in ran),
            finish_reasons=dict(collections.Counter(r["finish_reason"] for r in ran)),
            adapter_fingerprints={a: self.fingerprints[a] for a in sorted({r["adapter"] for r in ran} - {None})},
            speculation=speculation_summary(self._engine_start, self.llm.get_stats()),
            elapsed_s=self._elapsed_s(),
        )


def digest(value: object) -> str:
    """sha256 of a JSON-able value, independent of dict order."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _token_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(array.array("q", token_ids).tobytes()).hexdigest()


def _media_digests(row: PromptRow) -> list[list[str] | None]:
    """The row's digests as its data version reads them: its images' (None: no image column,
    or unread), then its clips' and videos' where it has any (a table made before those
    columns keeps its version)."""
    return [row.digests.get("image"), *(row.digests[m] for m in ("audio", "video") if row.digests.get(m))]


def _reproducible(row: PromptRow) -> bool:
    """Whether generating the row again gives the same result: greedy, seeded or beam search."""
    return row.beam is not None or row.params.greedy or row.params.seed is not None



def _best_beam(output: BeamSearchOutput) -> RequestOutput:
    """A beam search's best beam as the completion of a RequestOutput. Its tokens are the
    prompt as the engine ran it (each image's placeholder expanded) and one per logprobs entry."""
    best = output.sequences[0]
    prompt_tokens = len(best.tokens) - len(best.logprobs)
    completion = CompletionOutput(index=0, text=best.text, token_ids=best.tokens[prompt_tokens:],
                                  cumulative_logprob=best.cum_logprob, finish_reason=best.finish_reason,
                                  lora_request=best.lora_request)
    return RequestOutput(request_id="", prompt=None, prompt_token_ids=best.tokens[:prompt_tokens],
                         outputs=[completion], finished=True, lora_request=best.lora_request)
