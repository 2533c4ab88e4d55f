"""The engine's side of structured outputs: checks constraints, hands out grammars and
builds each step's token bitmask for the constrained rows."""

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from engine.structured_output.backend_types import (
    GrammarCompileError, StructuredOutputBackend, StructuredOutputGrammar,
)
from engine.structured_output.params import StructuredOutputsParams


@dataclass
class GrammarBitmask:
    """The step's constraints: `bitmask` [sampled rows, ceil(vocab / 32)] (int32, on the
    host), filled only at `rows`, the rows whose completion has a grammar."""

    backend: StructuredOutputBackend
    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> None:
        """Sets the forbidden tokens' logits to -inf, in place."""
        self.backend.apply_bitmask(logits, self.bitmask, self.rows)


class StructuredOutputManager:
    """Compiles each request's constraint with the grammar backend (once per distinct
    constraint) and makes a matcher per completion. The backend (xgrammar, and its
    tokenizer tables) is loaded at the first constrained request, so an engine that
    never sees one neither pays for it nor needs it installed."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self._backend: StructuredOutputBackend | None = None

    @property
    def backend(self) -> StructuredOutputBackend:
        if self._backend is None:
            from engine.structured_output.backend_xgrammar import XgrammarBackend

            self._backend = XgrammarBackend(self.tokenizer, self.vocab_size, self.stop_token_ids)
        return self._backend

    def problem(self, params: StructuredOutputsParams) -> str | None:
        """Why these constraints cannot run (the backend's reason), or None. Compiles them,
        so the requests that use them start without waiting for a compile."""
        try:
            self.backend.compile(params)
        except GrammarCompileError as exc:
            return f"the {params.kind} constraint does not compile: {exc}"
        return None

    def grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A new matcher for one completion of a request with these constraints."""
        return self.backend.matcher(params)


def grammar_bitmask(grammars: list[StructuredOutputGrammar | None]) -> GrammarBitmask | None:
    """The bitmask of a step whose sampled rows have these grammars (None: unconstrained),
    or None when no row is constrained."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return None
    backend = grammars[rows[0]].backend
    bitmask = backend.allocate_bitmask(len(grammars))
    backend.fill_bitmask([grammars[row] for row in rows], bitmask, rows)
    return GrammarBitmask(backend, bitmask, rows)
