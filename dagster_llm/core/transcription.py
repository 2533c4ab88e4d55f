"""A transcription run, free of Dagster: rows of audio clips of one or more partitions in,
each partition's transcript table and stats out as soon as its last row is transcribed.

A row is one clip (a cell of the audio column: bytes, a path or URI, Hugging Face's audio
struct), read and checked before any work, then cut into the model's windows as
`LLM.transcribe` cuts it; every window of every row runs in one engine call, and a row is
done when its last window is (its text is its windows' texts joined in order). Finished rows
are saved in shards as the run goes: a rerun of a partition with the same data version takes
them and transcribes only the rest, and a row of the same digest (its clip's content, the
language, task, prompt and sampling, the model) committed anywhere in the asset is reused.
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from dagster_llm.core.checks import CheckOutcome
from dagster_llm.core.generation import digest
from dagster_llm.core.media import RowItems
from dagster_llm.core.partition_run import (
    CommittedPartition, OpenPartition, PartitionCounts, PartitionRows, PartitionRun, PendingRow, Shards,
)
from dagster_llm.core.progress import StepHook
from dagster_llm.core.prompts import missing_cell, storable_text

if TYPE_CHECKING:
    from dagster_llm.core.engine_surface import (
        LLM, ClipWindows, RequestOutput, SamplingParams, TranscriptionOutput, TranscriptionPlan,
    )

COLUMNS = {
    "id": ("The row's id, from the upstream table (as text).", pa.string()),
    "text": ("The transcript (or English translation): the clip's windows' texts joined in order; null when the "
             "row could not run.", pa.string()),
    "language": ("The language the clip was transcribed in: the asset's, or the one detected on its first "
                 "window.", pa.string()),
    "duration_s": ("The clip's length in seconds.", pa.float64()),
    "windows": ("How many windows of the model's length the clip was cut into.", pa.int32()),
    "completion_tokens": ("Tokens generated over all the clip's windows.", pa.int32()),
    "audio_digest": ("sha256 (hex) of the clip as read from the audio column (a decoded struct: of its float32 "
                     "samples and rate).", pa.string()),
    "model": ("The model id.", pa.string()),
    "error": ("Why the row was not transcribed; null otherwise.", pa.string()),
}
SCHEMA = pa.schema([pa.field(name, kind) for name, (_, kind) in COLUMNS.items()])
CHECKS = {
    "no_error_rows": "Every row was transcribed (no `error`).",
    "no_empty_text": "No transcribed row's text is empty or blank.",
    "unique_ids": "Ids are unique within the partition.",
}


@dataclass
class ClipRow:
    """One row to transcribe: its position in the partition, its id, its clip as read from
    the column (`audio`, as the engine takes it) and its digest, its windows once the engine
    read it, or why it cannot run."""

    position: int
    id: str | None
    audio: object = None
    audio_digest: str | None = None
    clip: "ClipWindows | None" = None
    error: str | None = None


@dataclass(frozen=True)
class TranscriptionOptions:
    """What a run transcribes with (`language` None: detected per clip) and how it saves."""

    model_id: str
    code_version: str
    language: str | None = None
    task: str = "transcribe"
    prompt: str | None = None
    max_tokens: int | None = None
    resume: bool = True
    reuse_rows: bool = True
    shard_rows: int = 64
    shard_interval_s: float = 30.0

    def params(self) -> "SamplingParams":
        """Greedy decoding up to `max_tokens` (None: the model's context): a row is reproducible."""
        from dagster_llm.core.engine_surface import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=self.max_tokens)


@dataclass(frozen=True)
class ClipPartition(PartitionRows[ClipRow]):
    """One partition to transcribe, and its storage (None: the caller stores the table)."""


@dataclass
class TranscriptionStats(PartitionCounts):
    """What one partition's table holds and what this run did for it: rows resumed (for its
    data version, by an earlier run), reused (committed rows of the same digest) and
    transcribed, their windows and seconds of audio, the tokens generated, and the engine's
    audio encoder runs in this run until the partition committed (a resumed or reused row
    runs none)."""

    resumed_rows: int = 0
    reused_rows: int = 0
    transcribed_rows: int = 0
    windows: int = 0
    audio_seconds: float = 0.0
    completion_tokens: int = 0
    audio_encoder_runs: int = 0


@dataclass
class TranscriptionResult(CommittedPartition[TranscriptionStats]):
    """A committed partition: its table (data version in the schema metadata) and stats."""


@dataclass
class _Windows:
    """The windows of a row in flight: its clip's place in the run's plan, its language, and
    each window's output as it finishes."""

    pending: PendingRow[ClipRow]
    clip: int
    language: str
    outputs: dict[int, "RequestOutput"]


def clip_rows(ids: Sequence[Any], cells: Sequence[RowItems], column: str) -> list[ClipRow]:
    """The rows of a partition from its ids and its audio column read (`read_column`): a null
    or repeated id, a clip that cannot be read, no clip or several are the row's error."""
    rows, seen = [], set()
    for position, (raw_id, items) in enumerate(zip(ids, cells)):
        row = ClipRow(position, None if missing_cell(raw_id) else storable_text(str(raw_id)))
        if row.id is None:
            row.error = "id: is null: give every row an id"
        elif row.id in seen:
            row.error = f"id: {row.id!r} repeats an earlier row's: give every row its own id"
        elif items.problem is not None:
            row.error = f"{column}: {items.problem}"
        elif len(items.data) != 1:
            row.error = (f"{column}: the row holds {len(items.data)} clips: a transcript is of one clip; give one per "
                         "row (a null cell has none)")
        else:
            row.audio, row.audio_digest = items.data[0], items.digests[0]
        seen.add(row.id)
        rows.append(row)
    return rows


class TranscriptionRun(PartitionRun[ClipPartition, TranscriptionStats]):
    """Transcribes the rows of several partitions in one engine call, committing each
    partition when its rows are done (`PartitionRun`). `check_alive` runs after every
    engine step and before every write, and may raise to stop.

    Raises (when built):
        ValueError: the model does not transcribe, or the options' language, task or prompt
            are not the model's (before any work).
    """

    result_type = TranscriptionResult

    def __init__(self, llm: "LLM", options: TranscriptionOptions, log: Callable[[str], None],
                 check_alive: Callable[[], None] = lambda: None) -> None:
        super().__init__(check_alive, Shards(options.shard_rows, options.shard_interval_s), options.resume)
        self.llm = llm
        self.options = options
        self.log = log
        # Imported here, as each engine name below: the engine's transcription loads its audio
        # decoders and torch, which a code location's definitions do not.
        from dagster_llm.core.engine_surface import plan_transcription

        self.processor = llm.llm_engine.mm_processor
        plan_transcription(self.processor, [], options.language, options.task, options.prompt)  # the settings' check
        self._encoded_before = 0

    def transcribe(self, partitions: Sequence[ClipPartition]) -> Iterator[TranscriptionResult]:
        """Yields each partition's result as it commits; partitions that need no new rows first."""
        parts = self._open(partitions)
        self._encoded_before = self.llm.get_stats().num_audios_encoded
        model = self.llm.output_settings
        for part in parts:
            part.data_version = self._data_version(part, model)
            part.row_digests = self._row_digests(part, model)
            self._resume(part)
        if self.options.resume and self.options.reuse_rows:
            self._reuse(parts)
        todo = self._todo(parts)
        self._read(todo)
        self.log(f"transcribing {len(todo)} clips for {len(parts)} partition(s) "
                 f"({sum(p.resumed_rows for p in parts)} resumed, {sum(p.reused_rows for p in parts)} reused from "
                 f"committed rows of the same digest, {sum(r.error is not None for p in parts for r in p.rows)} "
                 "with errors)")
        yield from self._ready(parts)
        if todo:
            yield from self._run(todo)

    def _read(self, todo: list[PendingRow[ClipRow]]) -> None:
        """Each row's clip read by the engine at the model's rate and cut into the model's
        windows, as `LLM.transcribe` reads and cuts it; a clip the engine refuses is its row's
        error (its partition commits without it)."""
        from dagster_llm.core.engine_surface import ClipWindows, read_audio, split_windows

        window_s = self.processor.transcription_window_s
        for pending in todo:
            try:
                clip = read_audio(pending.row.audio, self.processor.audio_limits)
            except ValueError as exc:
                pending.row.error = str(exc)
                continue
            pending.row.clip = ClipWindows(clip, split_windows(clip.waveform, clip.sample_rate, window_s))

    def _run(self, todo: list[PendingRow[ClipRow]]) -> Iterator[TranscriptionResult]:
        from dagster_llm.core.engine_surface import TranscriptionPlan

        for pending in todo:
            if pending.row.error is not None:
                yield from self._finish(pending.part, pending.row.position,
                                        self._missing_record(pending.part, pending.row))
        ready = [pending for pending in todo if pending.row.error is None]
        plan = TranscriptionPlan(self.processor, [p.row.clip for p in ready], self.options.task, self.options.prompt)
        flights = [_Windows(pending, index, language, {})
                   for index, (pending, language) in enumerate(zip(ready, self._languages(plan)))]
        owners = [(flight, window) for flight in flights for window in range(len(flight.pending.row.clip.windows))]
        finished = self.llm.generate_as_completed(plan.rows([f.language for f in flights]), self.options.params(),
                                                  use_tqdm=self._step_hook)
        for index, output in finished:
            flight, window = owners[index]
            flight.outputs[window] = output
            if len(flight.outputs) == len(flight.pending.row.clip.windows):
                transcript = plan.output(flight.clip, flight.language,
                                         [flight.outputs[w] for w in range(len(flight.outputs))])
                yield from self._finish(flight.pending.part, flight.pending.row.position,
                                        self._record(flight.pending.row, transcript))

    def _languages(self, plan: "TranscriptionPlan") -> list[str]:
        """Each planned clip's language: the options', or detected on its first window."""
        if self.options.language is not None:
            return [self.options.language] * len(plan.clips)
        if not plan.clips:
            return []
        return plan.detected(self.llm.generate(plan.detection_rows(), plan.detection_params(),
                                               use_tqdm=self._step_hook))

    def _step_hook(self, **_: Any) -> StepHook:
        """What `LLM.generate` takes for a progress bar: `check_alive` after every step."""
        return StepHook(self.check_alive)

    def _data_version(self, part: OpenPartition, model: dict) -> str:
        """Digest of the code version, the model's files and resolved output settings, the
        transcription settings, and the rows (ids, clip digests, errors)."""
        rows = [(r.id, r.audio_digest, r.error) for r in part.rows]
        return digest({"code_version": self.options.code_version, "model": model, "rows": rows,
                       "settings": self._settings(), "task": "transcription"})[:24]

    def _row_digests(self, part: OpenPartition, model: dict) -> dict[int, str]:
        """Each readable row's digest: its clip's, the settings and the model's (greedy, so
        every row is reproducible); not its id or partition."""
        shared = digest({"code_version": self.options.code_version, "model": model, "settings": self._settings()})
        return {row.position: digest({"shared": shared, "audio": row.audio_digest})[:32]
                for row in part.rows if row.error is None}

    def _settings(self) -> dict[str, Any]:
        options = self.options
        return {"language": options.language, "task": options.task, "prompt": options.prompt,
                "max_tokens": options.max_tokens}

    def _record(self, row: ClipRow, transcript: "TranscriptionOutput") -> dict[str, Any]:
        return {"id": row.id, "text": transcript.text, "language": transcript.language,
                "duration_s": transcript.duration_s, "windows": len(transcript.windows),
                "completion_tokens": len(transcript.token_ids), "audio_digest": row.audio_digest,
                "model": self.options.model_id, "error": None}

    def _reused_record(self, part: OpenPartition, row: ClipRow, record: dict[str, Any]) -> dict[str, Any]:
        return {**record, "id": row.id, "model": self.options.model_id}

    def _missing_record(self, part: OpenPartition, row: ClipRow) -> dict[str, Any]:
        return {"id": row.id, "text": None, "language": None, "duration_s": None, "windows": None,
                "completion_tokens": None, "audio_digest": row.audio_digest, "model": self.options.model_id,
                "error": row.error}

    def _table(self, part: OpenPartition, records: list[dict[str, Any]]) -> pa.Table:
        return pa.Table.from_pylist(records, schema=SCHEMA)

    def _stats(self, part: OpenPartition, records: list[dict[str, Any]]) -> TranscriptionStats:
        done = [r for r in records if r["error"] is None]
        return TranscriptionStats(
            rows=len(records), error_rows=len(records) - len(done), resumed_rows=part.resumed_rows,
            reused_rows=part.reused_rows, transcribed_rows=len(done) - part.resumed_rows - part.reused_rows,
            windows=sum(r["windows"] for r in done), audio_seconds=round(sum(r["duration_s"] for r in done), 3),
            completion_tokens=sum(r["completion_tokens"] for r in done), elapsed_s=self._elapsed_s(),
            audio_encoder_runs=self.llm.get_stats().num_audios_encoded - self._encoded_before)


def evaluate_transcripts(table: pa.Table) -> dict[str, CheckOutcome]:
    """The transcript checks (`CHECKS`) of one partition's table."""
    error_rows = table.num_rows - table.column("error").null_count
    texts = [t for t, e in zip(table.column("text").to_pylist(), table.column("error").to_pylist()) if e is None]
    empty = sum(1 for t in texts if not (t or "").strip())
    ids = table.column("id").to_pylist()
    repeated = len(ids) - len(set(ids))
    return {
        "no_error_rows": CheckOutcome(error_rows == 0, {"error_rows": error_rows}),
        "no_empty_text": CheckOutcome(empty == 0, {"empty_rows": empty}),
        "unique_ids": CheckOutcome(repeated == 0, {"repeated_ids": repeated}),
    }
