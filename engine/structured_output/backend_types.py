"""The contract between the structured-output manager and a grammar backend (vLLM's
`backend_types`): what a backend and a per-completion grammar offer, and the error a
constraint that does not compile raises."""

from typing import Protocol

import torch

from engine.structured_output.params import StructuredOutputsParams


class GrammarCompileError(ValueError):
    """A constraint the backend cannot compile; the message is the backend's reason."""


class StructuredOutputGrammar(Protocol):
    """One completion's matcher: the tokens its constraint still allows."""

    backend: "StructuredOutputBackend"
    # A token allowed besides the grammar's (None: none): a reasoning model's opening
    # marker while its first token decides whether it reasons before the answer.
    also_allowed: int | None

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False when the constraint forbids it."""

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens (speculative decoding's proposals)."""

    @property
    def is_terminated(self) -> bool:
        """Whether the constraint is complete and allows nothing more."""


class StructuredOutputBackend(Protocol):
    """A grammar engine: compiles constraints and fills a step's token bitmask."""

    def compile(self, params: StructuredOutputsParams) -> object:
        """Compiles the constraints (cached); raises `GrammarCompileError` with the reason."""

    def matcher(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """A new grammar for one completion under these constraints."""

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An empty bitmask of `rows` rows."""

    def fill_bitmask(self, grammars: list[StructuredOutputGrammar], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Fills `bitmask` at `rows` with what each grammar allows next."""

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
        """Sets the logits the bitmask forbids to -inf at `rows` (a list on a CPU, a tensor on
        the logits' device elsewhere), in place, without reading the device back."""
