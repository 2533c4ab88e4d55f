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
    logits' device), filled only at `rows`, the rows whose completion has a grammar, as
    the device's kernel takes them: a host list on a CPU, a tensor on the device elsewhere
    (a list would be copied there when the mask is applied, waiting for the device)."""

    backend: StructuredOutputBackend
    bitmask: torch.Tensor
    rows: list[int] | torch.Tensor

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


def grammar_bitmask(grammars: list[StructuredOutputGrammar | None],
                    device: torch.device = torch.device("cpu"),
                    ahead: list[list[int]] | None = None) -> GrammarBitmask | None:
    """The bitmask of a step whose sampled rows have these grammars (None: unconstrained),
    on `device`, or None when no row is constrained. Filled on the host; to a GPU it goes
    through pinned memory without waiting for the work queued there. `ahead[i]`: tokens
    that row i's grammar takes before its row is filled, and gives back after (a
    speculating sequence's proposals before the row; the grammar allows them all)."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return None
    backend = grammars[rows[0]].backend
    bitmask = backend.allocate_bitmask(len(grammars))
    later = [row for row in rows if ahead and ahead[row]]
    now = [row for row in rows if not (ahead and ahead[row])] if later else rows
    if now:
        backend.fill_bitmask([grammars[row] for row in now], bitmask, now)
    for row in later:
        grammar = grammars[row]
        for token in ahead[row]:
            grammar.accept(token)
        backend.fill_bitmask([grammar], bitmask, [row])
        grammar.rollback(len(ahead[row]))
    for row in rows:
        if (token := grammars[row].also_allowed) is not None:
            _allow(bitmask, row, token)
    if device.type == "cpu":
        return GrammarBitmask(backend, bitmask, rows)
    indices = torch.tensor(rows, dtype=torch.int32).pin_memory().to(device, non_blocking=True)
    return GrammarBitmask(backend, bitmask.pin_memory().to(device, non_blocking=True), indices)


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    """Sets the token's bit in an int32 bitmask row (bit 31 is the sign bit)."""
    word, bit = divmod(token, 32)
    value = (int(bitmask[row, word]) & 0xFFFFFFFF) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value
