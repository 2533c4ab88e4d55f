"""`build_generation_asset`: a prompt table in, a generation table out, per partition.

The asset body is glue: run config and resources in, `dagster_llm.core` does the work and
writes through the IO manager's table store, and each committed partition becomes a
materialization with its checks.
"""

import inspect
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pandas as pd
from pydantic import ValidationError

import engine
from dagster_llm.core.checks import DESCRIPTIONS, PARSE_RATE, PARSE_RATE_DESCRIPTION, evaluate
from dagster_llm.core.generation import GenerationRun, PartitionInput, PartitionResult, RunOptions
from dagster_llm.core.prompts import (
    ModelMedia, PartitionSettings, PromptTableError, check_columns, read_rows, to_dataframe, tools_problem,
)
from dagster_llm.core.sampling import BeamSearchConfig, SamplingConfig, used_values
from dagster_llm.core.schema import ToolArguments, tool_columns_problem
from dagster_llm.core.structured import OutputSpecError, StructuredOutput
from dagster_llm.core.watch import ParentWatch
from dagster_llm.metadata import PartitionFacts, column_schema, partition_metadata, upstream_data_version
from dagster_llm.partitions import (
    PartitionChoice, RowShard, beam_choice, output_choice, sharded_partitions, upstream_partition,
)
from dagster_llm.resource import LLMResource
from dagster_llm.run_config import GenerationRunConfig
from dagster_llm.steps import PartitionedStep, table_asset
from dagster_llm.spec import GenerationSpec
from engine.entrypoints.tool_choice import ToolChoice, ToolChoiceError, resolve_tool_choice


def build_generation_asset(name: str, upstream: str | dg.AssetKey | dg.AssetsDefinition, *,
                           partitions_def: dg.PartitionsDefinition | None = None,
                           **options: Any) -> dg.AssetsDefinition:
    """Builds an asset that runs the LLM over an upstream prompt table.

    The upstream asset gives a pandas DataFrame or pyarrow Table per partition (a
    `{partition_key: table}` dict for a range) with an id column and a prompt column:
    text, or chat messages ([{"role", "content"}, ...]) rendered with the model's chat
    template (`chat=True` also wraps plain text as one user message). Optional columns
    named like `SamplingConfig` fields override the partition's sampling for their row;
    `image_column` names a column of each row's images for a vision-language model,
    `audio_column` one of each row's audio clips for a model that reads audio.

    The generation table goes through the IO manager (`ParquetIOManager`: one Parquet file
    per partition), so downstream assets take it as an input. With that IO manager, rows
    are saved in shards as they finish, each partition of a range commits (file,
    materialization, checks) as soon as its rows are done, and a rerun after a crash
    generates only the rows that are missing (`resumed_rows` in the metadata). A
    partition's data version digests its rows (id, prompt, the sampling used, adapter and
    its fingerprint, the sha256 of each image and clip), the model's files (weights, config,
    tokenizer, chat template, generation_config.json), every engine setting that can change a
    row as the engine resolved it (dtype, quantization, KV cache dtype, max_model_len, the reasoning and
    tool-call parsers...) and the code version. When it changes,
    a reproducible row (greedy, seeded or beam search) whose row digest matches a
    committed row of the asset is reused rather than generated (`reused_rows`;
    `reuse_rows=False` turns this off), so adding rows or editing one generates just those.

    A row that cannot run (null or bad prompt, bad override, unknown or broken adapter,
    unreadable image or clip, repeated id, too long) gets its `error` and the others run. A
    reasoning model's reasoning goes to the `reasoning` column and its tool calls (with
    `tools`) to `tool_calls`; `generated_text` is the answer. The asset carries five checks
    per partition (error rows, empty generations, truncation rate, unique ids, reasoning
    that never ended; a sixth, `parse_rate`, with a structured output: one typed column per
    top-level field of `output_schema`, or a `choice` column), claims a slot of `pool`, and
    holds a lock per partition so that two runs never write one partition at once.

    Args:
        name: The asset's name.
        upstream: The prompt table asset (its partitions_def is reused when it has one).
        partitions_def: The asset's partitions (default: the upstream asset's).
    {options}

    Raises:
        DagsterInvalidDefinitionError: an unknown option or a bad value, naming each.

    Examples:
        .. code-block:: python

            import dagster as dg
            import pandas as pd
            from dagster_llm import LLMResource, ParquetIOManager, SamplingConfig, build_generation_asset

            days = dg.DailyPartitionsDefinition(start_date="2024-06-01")

            @dg.asset(partitions_def=days, backfill_policy=dg.BackfillPolicy.single_run())
            def questions(context: dg.AssetExecutionContext) -> pd.DataFrame: ...

            answers = build_generation_asset(
                "answers", upstream=questions, chat=True,
                sampling=SamplingConfig(temperature=0, max_tokens=64),
            )

            @dg.asset(partitions_def=days)
            def answer_lengths(answers: pd.DataFrame) -> pd.DataFrame:
                return answers.assign(chars=answers["generated_text"].str.len())

            defs = dg.Definitions(
                assets=[questions, answers, answer_lengths],
                resources={"llm": LLMResource(), "io_manager": ParquetIOManager()},
            )
    """
    if partitions_def is None and isinstance(upstream, dg.AssetsDefinition):
        partitions_def = upstream.partitions_def
    try:
        spec = GenerationSpec(name=name, upstream=upstream, **options)
    except ValidationError as exc:
        raise dg.DagsterInvalidDefinitionError(f"{name}: " + "; ".join(_option_problems(exc))) from None
    return generation_asset(spec.with_files_from(Path.cwd()), partitions_def)


def _option_problems(exc: ValidationError) -> list[str]:
    """pydantic's errors as `option: problem, got value` lines."""
    problems = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"])
        if error["type"] == "extra_forbidden":
            options = ", ".join(name for name in GenerationSpec.model_fields if name not in ("name", "upstream"))
            problems.append(f"{where}: not an option; the options are {options}")
        else:
            problems.append(f"{where}: {error['msg'][0].lower()}{error['msg'][1:]}, got {error['input']!r}")
    return problems


@dataclass(frozen=True)
class _Definition:
    """What a spec resolves to once, at definition time."""

    spec: GenerationSpec
    sampling: PartitionChoice[SamplingConfig]
    adapter: PartitionChoice[str | None]
    beam: PartitionChoice[BeamSearchConfig | None]
    output: PartitionChoice[StructuredOutput | None]
    structured: bool  # some partition has a structured output: the asset has the parse_rate check
    tool: ToolArguments | None  # the argument columns of the one declared tool
    tool_choice: ToolChoice
    lora_requests: dict[str, engine.LoRARequest]
    code_version: str
    row_settings: str  # the part of the code version that every row's digest takes
    partitioned: bool


def generation_asset(spec: GenerationSpec, partitions_def: dg.PartitionsDefinition | None) -> dg.AssetsDefinition:
    """The asset of a spec whose file paths are resolved (`GenerationSpec.with_files_from`)."""
    undeclared = sorted({a for a in [spec.adapter, *spec.adapter_by_partition.values()] if a} - set(spec.adapters))
    if undeclared:
        raise dg.DagsterInvalidDefinitionError(
            f"{spec.name}: adapter(s) {undeclared} are not declared; add them to adapters={{name: folder}}")
    output = output_choice(spec, partitions_def)
    beam = beam_choice(spec, partitions_def, output)
    d = _Definition(
        spec=spec,
        sampling=PartitionChoice(spec.sampling, spec.sampling_by_partition, partitions_def, spec.name,
                                 "sampling_by_partition"),
        adapter=PartitionChoice(spec.adapter, spec.adapter_by_partition, partitions_def, spec.name,
                                "adapter_by_partition"),
        beam=beam,
        output=output, structured=any(o is not None for o in [output.default, *output.by_partition.values()]),
        tool=_tool_arguments(spec, output),
        tool_choice=_tool_choice(spec, output, beam),
        # Ids by sorted name: stable across runs and processes.
        lora_requests={a: engine.LoRARequest(a, i + 1, path) for i, (a, path) in enumerate(sorted(spec.adapters.items()))},
        code_version=f"{spec.code_version}+{spec.settings_digest()[:12]}",
        row_settings=f"{spec.code_version}+{spec.row_settings_digest()[:12]}", partitioned=partitions_def is not None,
    )
    if spec.row_shards is not None:
        partitions_def = sharded_partitions(spec.name, partitions_def, spec.row_shards)

    @table_asset(spec, partitions_def, code_version=d.code_version,
                 default_description=f"LLM completions of {spec.upstream}.{spec.prompt_column}",
                 column_schema=column_schema(output.default, tuple(spec.media_columns), d.tool),
                 input_name="prompts", checks=_checks(d.structured),
                 resource_keys=[spec.resource_key], backfill_policy=_backfill_policy(spec, partitions_def),
                 op_tags=spec.kubernetes.tags() if spec.kubernetes else None)
    def _generate(context: dg.AssetExecutionContext, config: GenerationRunConfig, prompts: object):
        yield from _GenerationStep(d, context, config).execute(prompts)

    return _generate


def _tool_arguments(spec: GenerationSpec, output: PartitionChoice[StructuredOutput | None]) -> ToolArguments | None:
    """The argument columns of the spec's one tool (None: no tool, several, or one without
    parameters), its tools checked.

    Raises:
        DagsterInvalidDefinitionError: a tool that is not an OpenAI function tool, or
            argument columns named like the table's columns or a structured output's fields.
    """
    problem = tools_problem(spec.tools)
    if problem is not None:
        raise dg.DagsterInvalidDefinitionError(f"{spec.name}: {problem}")
    try:
        tool = ToolArguments.of(spec.tools)
    except OutputSpecError as exc:
        raise dg.DagsterInvalidDefinitionError(f"{spec.name}: tools[0].function.parameters: {exc}") from None
    problem = tool_columns_problem(tool, [output.default, *output.by_partition.values()]) if tool else None
    if problem is not None:
        raise dg.DagsterInvalidDefinitionError(f"{spec.name}: tools[0]: {problem}")
    return tool


def _tool_choice(spec: GenerationSpec, output: PartitionChoice[StructuredOutput | None],
                 beam: PartitionChoice[BeamSearchConfig | None]) -> ToolChoice:
    """The spec's tool choice, checked against its tools (which `_tool_arguments` checked).

    Raises:
        DagsterInvalidDefinitionError: a choice that does not fit the tools, or a forced one
            beside a structured output or a beam search (a forced call is a grammar of its own).
    """
    try:
        choice = resolve_tool_choice(spec.tool_choice, spec.tools)
    except ToolChoiceError as exc:
        raise dg.DagsterInvalidDefinitionError(f"{spec.name}: {exc}") from None
    clashes = [name for name, choices in (("output_schema/choices", output), ("beam_search", beam))
               if any(value is not None for value in [choices.default, *choices.by_partition.values()])]
    if choice.forced and clashes:
        raise dg.DagsterInvalidDefinitionError(
            f"{spec.name}: tool_choice {choice.described} makes every answer tool calls, by a grammar of their own, "
            f"and {clashes[0]} also applies to some partition: drop one of the two")
    return choice


def _backfill_policy(spec: GenerationSpec, partitions_def: dg.PartitionsDefinition | None
                     ) -> dg.BackfillPolicy | None:
    """One run for a whole backfill, or runs of max_partitions_per_run partitions; row
    shards run one per run unless max_partitions_per_run says otherwise."""
    if partitions_def is None:
        return None
    if spec.max_partitions_per_run is None and spec.row_shards is None:
        return dg.BackfillPolicy.single_run()
    return dg.BackfillPolicy.multi_run(spec.max_partitions_per_run or 1)


def _checks(structured: bool) -> dict[str, str]:
    """The asset's checks by name, with their descriptions; parse_rate where any partition
    has a structured output."""
    return {**DESCRIPTIONS, **({PARSE_RATE: PARSE_RATE_DESCRIPTION} if structured else {})}


class _GenerationStep(PartitionedStep):
    """One execution of a generation asset: checks, locks, the run, and its events."""

    def __init__(self, definition: _Definition, context: dg.AssetExecutionContext,
                 config: GenerationRunConfig) -> None:
        spec = definition.spec
        super().__init__(context, spec.name, spec.asset_key, spec.io_manager_key, definition.partitioned,
                         definition.code_version)
        self.d = definition
        self.spec = spec
        self.config = config
        self.resource: LLMResource = getattr(context.resources, spec.resource_key)
        self.settings: dict[str | None, PartitionSettings] = {}

    def execute(self, prompts: object) -> Iterator[object]:
        sampling = self._sampling()
        frames = self._frames(prompts)
        if self.d.lora_requests and not self.resource.enable_lora:
            raise dg.Failure(f"{self.spec.name} declares LoRA adapters ({', '.join(sorted(self.d.lora_requests))}), "
                             f"but the resource {self.spec.resource_key!r} has enable_lora=False: set "
                             "LLMResource(enable_lora=True, max_loras=..., max_lora_rank=...)")
        with self.locks():
            llm = self.resource.get_llm()
            parts = self._inputs(frames, sampling, llm)
            run = GenerationRun(llm, self.d.lora_requests, self._options(), self.context.log.info, ParentWatch().check)
            try:
                yield from self.record(run.generate(parts), self._committed)
            except OutputSpecError as exc:
                raise dg.Failure(f"{self.spec.name}: {exc}") from None
        yield from self.outputs()

    def _inputs(self, frames: dict[str | None, pd.DataFrame], sampling: dict[str | None, SamplingConfig],
                llm: "engine.LLM") -> list[PartitionInput]:
        """Each partition's rows with its adapter, structured output and storage."""
        defaults, tokenizer = llm.get_default_sampling_params(), llm.get_tokenizer()
        media = ModelMedia.of(llm, self.spec)
        parts = []
        try:
            for key in self.keys:
                settings = PartitionSettings(key, sampling[key], self.d.adapter.for_partition(key),
                                             self.d.output.for_partition(key), defaults, self.d.beam.for_partition(key),
                                             self.d.tool_choice)
                self.settings[key] = settings
                rows = read_rows(frames[key], settings, self.spec, tokenizer, media)
                store = self.store.partition(self.spec.asset_key.path, key) if self.store else None
                parts.append(PartitionInput(key, rows, store, settings.output, tuple(self.spec.media_columns),
                                            self.d.tool, self.d.tool_choice))
        except PromptTableError as exc:
            raise dg.Failure(f"{self.spec.name}: {exc}; nothing was run") from None
        return parts

    def _sampling(self) -> dict[str | None, SamplingConfig]:
        """Each partition's sampling with the run's overrides; every bad field at once."""
        try:
            return {key: self.config.sampling.apply(self.d.sampling.for_partition(key), self.context.op_def.name)
                    for key in self.keys}
        except ValueError as exc:
            raise dg.Failure(f"{self.spec.name}: invalid run config, nothing was run: {exc}. Fix the value in the "
                             "Launchpad (or --config-json) and launch again.") from None

    def _frames(self, prompts: object) -> dict[str | None, pd.DataFrame]:
        """Each partition's prompt table (a row shard's: its rows of its upstream partition)."""
        sources = {key: upstream_partition(key) for key in self.keys}
        upstream_keys = set(sources.values())
        given = prompts if isinstance(prompts, dict) and len(upstream_keys) > 1 else {upstream_keys.pop(): prompts}
        frames = {}
        try:
            for key in self.keys:
                where = f"of partition {sources[key]!r}" if sources[key] is not None else ""
                frame = to_dataframe(given[sources[key]], self.spec.upstream, where)
                check_columns(frame, self.spec, where)
                if self.spec.row_shards is not None:
                    shard = RowShard.of(key, self.spec.row_shards)
                    frame = frame[frame[self.spec.id_column].map(shard.holds)].reset_index(drop=True)
                frames[key] = frame
        except PromptTableError as exc:
            raise dg.Failure(f"{self.spec.name}: {exc}") from None
        return frames

    def _options(self) -> RunOptions:
        return RunOptions(model_id=self.resource.model_id, code_version=self.d.code_version,
                          row_settings=self.d.row_settings, resume=self.config.resume,
                          reuse_rows=self.spec.reuse_rows, shard_rows=self.spec.shard_rows,
                          progress_interval_s=self.spec.progress_interval_s)

    def _committed(self, result: PartitionResult) -> Iterator[object]:
        """The partition's metadata and check outcomes, recorded (`PartitionedStep.committed`)."""
        metadata = partition_metadata(result, self._facts(result.key))
        output = self.d.output.for_partition(result.key)
        outcomes = evaluate(result.table, self.spec.thresholds(),
                            structured=(output is not None) if self.d.structured else None,
                            allow_duplicate_ids=self.spec.duplicate_ids == "keep")
        return self.committed(result, metadata, outcomes)

    def _facts(self, key: str | None) -> PartitionFacts:
        settings = self.settings[key]
        return PartitionFacts(
            spec=self.spec, output=settings.output, tool=self.d.tool,
            location=self.store.partition(self.spec.asset_key.path, key).location if self.store else None,
            model_id=self.resource.model_id, model_fingerprint=self.resource.get_llm().model_fingerprint,
            output_settings=self.resource.get_llm().output_settings, partitions_in_run=len(self.keys), adapter=settings.adapter,
            sampling_used=used_values(settings.params(settings.sampling)),
            upstream_data_version=upstream_data_version(self.context, self.spec.upstream_key, key),
        )


def _options_doc() -> str:
    """The factory's Args for the spec's options, from their own descriptions."""
    lines = []
    for name, info in GenerationSpec.model_fields.items():
        if name in ("name", "upstream"):
            continue
        default = info.get_default(call_default_factory=True)
        text = f"{name} (default {default!r}): {info.description}"
        lines.append(textwrap.fill(text, 100, initial_indent=" " * 8, subsequent_indent=" " * 12))
    return "\n".join(lines).lstrip()


def _signature() -> inspect.Signature:
    """The factory's signature: name, upstream and partitions_def, then every spec option."""
    own = list(inspect.signature(build_generation_asset).parameters.values())[:3]
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=info.annotation,
                                 default=info.get_default(call_default_factory=True))
               for name, info in GenerationSpec.model_fields.items() if name not in ("name", "upstream")]
    return inspect.Signature([*own, *options], return_annotation=dg.AssetsDefinition)


build_generation_asset.__doc__ = build_generation_asset.__doc__.replace("{options}", _options_doc())
build_generation_asset.__signature__ = _signature()
