"""The fan-out of OpenAI batch lines onto a loaded `LLM`, written once for both runs of batch
requests: a batch file's (`engine.entrypoints.openai.batch`, what `python -m engine.run_batch`
runs) and a Dagster asset's request tables (`dagster_llm.core.openai_batch`), so that a line
gets the same answer from either.

Lines of one task run together (`line_task`: the chat and completion lines on a generating
model, the embedding lines on an embedding one): each body becomes its engine inputs or its
error (`engine.entrypoints.openai.serving`), the engine checks every prompt before any runs (a
line with a refused prompt gets that prompt's error and none of its prompts run), the prompts
of the other lines run in one engine call, and a line is answered once all its prompts are
done. `run_lines` hands each line's answer over as it comes; what to do with it (an output
line, a table row) is the caller's.
"""

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.entrypoints.inputs import UseTqdm
from engine.entrypoints.openai.protocol import EMBEDDINGS_URL, BatchLine, EmbeddingRequest, GenerationRequest, LineError
from engine.entrypoints.openai.serving import (
    embedding_request, embedding_response_body, generation_request, generation_response_body,
    model_sampling_defaults, prompt_error,
)

if TYPE_CHECKING:
    from engine.entrypoints.llm import LLM

_Request = GenerationRequest | EmbeddingRequest


def line_task(line: BatchLine) -> str:
    """The `LLM.task` a line runs on: "embed" for /v1/embeddings, "generate" for chat and completions."""
    return "embed" if line.url == EMBEDDINGS_URL else "generate"


@dataclass(frozen=True)
class LineResult:
    """A line that is done: its index among the lines run, and its response body or its
    error (exactly one of the two is set)."""

    index: int
    body: dict[str, Any] | None = None
    error: LineError | None = None


def run_lines(llm: "LLM", lines: Sequence[BatchLine], model: str, *, use_tqdm: UseTqdm = True
              ) -> Iterator[LineResult]:
    """Runs `lines`, all of the task `llm` does (`line_task(line) == llm.task`: a caller
    refuses the others first, in its own words), answering as `model`: first the error of
    each line whose body is refused, then that of each line with a prompt the engine
    refuses, then each other line's response body as its last prompt finishes. Nothing
    runs until the iterator is read."""
    kind = _KINDS[llm.task](llm, model, use_tqdm)
    requests = [kind.request(line) for line in lines]
    pending = []
    for index, (line, request) in enumerate(zip(lines, requests)):
        if isinstance(request, LineError):
            yield LineResult(index, error=request)
        else:
            pending.append(_Pending(index, line, request, [None] * len(request.prompts), len(request.prompts)))
    prompts = [_Prompt(p, i) for p in pending for i in range(len(p.request.prompts))]
    refused: set[int] = set()  # the indices of the refused lines
    for prompt, problem in zip(prompts, kind.check(prompts) if prompts else []):
        if problem is not None and prompt.pending.index not in refused:
            refused.add(prompt.pending.index)
            line, request = prompt.pending.line, prompt.pending.request
            yield LineResult(prompt.pending.index,
                             error=prompt_error(line.url, prompt.index, len(request.prompts), problem, line.body))
    prompts = [prompt for prompt in prompts if prompt.pending.index not in refused]
    for position, output in kind.run(prompts) if prompts else []:
        done = prompts[position].pending
        done.outputs[prompts[position].index] = output
        done.waiting -= 1
        if done.waiting == 0:
            yield LineResult(done.index, body=kind.respond(done.request, done.outputs))


@dataclass
class _Pending:
    """A line whose prompts run: its outputs, one per prompt, as they finish."""

    index: int
    line: BatchLine
    request: _Request
    outputs: list[Any]
    waiting: int


@dataclass(frozen=True)
class _Prompt:
    """One prompt of a pending line: the unit the engine runs."""

    pending: _Pending
    index: int

    @property
    def prompt(self) -> Any:
        return self.pending.request.prompts[self.index]


@dataclass(frozen=True)
class _Kind:
    """How the lines of one task run on a loaded model: a line's engine inputs (or its
    error), the engine's problem with each prompt, the run of the prompts ((position, output)
    as they finish), and the response body of a line's outputs."""

    request: Callable[[BatchLine], _Request | LineError]
    check: Callable[[list[_Prompt]], list[str | None]]
    run: Callable[[list[_Prompt]], Iterable[tuple[int, Any]]]
    respond: Callable[[Any, list[Any]], dict[str, Any]]


def _generation(llm: "LLM", model: str, use_tqdm: UseTqdm) -> _Kind:
    """Chat and completion lines: their prompts and sampling, each line's priority."""
    tokenizer, defaults = llm.get_tokenizer(), model_sampling_defaults(llm)

    def inputs(prompts: list[_Prompt]) -> dict[str, Any]:
        return {"prompts": [p.prompt for p in prompts],
                "sampling_params": [p.pending.request.sampling_params for p in prompts],
                "priority": [p.pending.request.priority for p in prompts]}

    return _Kind(
        request=lambda line: generation_request(line.url, line.body, tokenizer, defaults,
                                                llm.structured_output_problem),
        check=lambda prompts: llm.validate(**inputs(prompts)),
        run=lambda prompts: llm.generate_as_completed(**inputs(prompts), use_tqdm=use_tqdm),
        respond=lambda request, outputs: generation_response_body(request, outputs, model, tokenizer,
                                                                  llm.tool_call_ids))


def _embedding(llm: "LLM", model: str, use_tqdm: UseTqdm) -> _Kind:
    """Embedding lines: their inputs, checked against the model's width where they give dimensions."""
    return _Kind(
        request=lambda line: embedding_request(line.body, llm.hidden_size),
        check=lambda prompts: llm.validate_pooling([p.prompt for p in prompts]),
        run=lambda prompts: llm.embed_as_completed([p.prompt for p in prompts], use_tqdm=use_tqdm),
        respond=lambda request, outputs: embedding_response_body(request, outputs, model))


_KINDS: dict[str, Callable[["LLM", str, UseTqdm], _Kind]] = {"generate": _generation, "embed": _embedding}
