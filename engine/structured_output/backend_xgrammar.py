"""Structured outputs on xgrammar: compiled grammars, one matcher per completion.

xgrammar (vLLM's default backend) compiles a grammar once against the vocabulary into a
pushdown automaton with a per-state cache of allowed tokens, so filling a completion's
token mask costs tens of microseconds. llguidance compiles faster (milliseconds, lazily)
but filled masks about four times slower on our model's vocabulary, and a batch pays
for masks at every step, for compiles once per schema.
"""

import json
import re

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from engine.structured_output.backend_types import GrammarCompileError
from engine.structured_output.params import StructuredOutputsParams

# xgrammar's messages start with a timestamp and its C++ source location.
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class XgrammarBackend:
    """Compiles constraints for one tokenizer and vocabulary, each (kind, spec) once."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self.vocab_size = vocab_size
        self.compiler = xgr.GrammarCompiler(info, max_threads=torch.get_num_threads(), cache_enabled=False)
        self.batch_matcher = xgr.BatchGrammarMatcher(max_threads=torch.get_num_threads())
        self._compiled: dict[tuple[str, str, bool], xgr.CompiledGrammar | GrammarCompileError] = {}

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of these constraints, from the cache after the first time.

        Raises:
            GrammarCompileError: with the backend's reason (remembered, so a bad schema in
                many rows is compiled once).
        """
        key = (params.kind, params.spec, params.disable_any_whitespace)
        if key not in self._compiled:
            try:
                self._compiled[key] = self._compile(*key)
            except RuntimeError as exc:
                self._compiled[key] = GrammarCompileError(_SOURCE_PREFIX.sub("", str(exc)).strip())
        found = self._compiled[key]
        if isinstance(found, GrammarCompileError):
            raise found
        return found

    def _compile(self, kind: str, spec: str, compact: bool) -> xgr.CompiledGrammar:
        if kind == "json":
            return self.compiler.compile_json_schema(spec, any_whitespace=not compact)
        if kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(json.loads(spec)))
        if "::=" in spec:
            return self.compiler.compile_grammar(spec)
        return self.compiler.compile_lark(spec)

    def matcher(self, params: StructuredOutputsParams) -> "Grammar":
        """A fresh matcher for one completion."""
        return Grammar(self, xgr.GrammarMatcher(self.compile(params)))

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """An int32 bitmask [rows, ceil(vocab / 32)] with every token allowed."""
        return xgr.allocate_token_bitmask(rows, self.vocab_size)

    def fill_bitmask(self, grammars: "list[Grammar]", bitmask: torch.Tensor, rows: list[int]) -> None:
        """Writes each grammar's allowed next tokens into `bitmask[rows[i]]`, in parallel."""
        self.batch_matcher.batch_fill_next_token_bitmask([g.matcher for g in grammars], bitmask, indices=rows)

    @staticmethod
    def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | torch.Tensor) -> None:
        """Sets to -inf, in place, the logits of tokens that `bitmask` (on the logits'
        device) forbids in `rows`: xgrammar's CPU kernel takes a list, its GPU one a tensor
        on the device (from a list it would copy one there, waiting for the device)."""
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly the given strings (JSON string escapes are also
    EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class Grammar:
    """Where one completion stands in its grammar: what may come next, and whether it is done."""

    def __init__(self, backend: XgrammarBackend, matcher: xgr.GrammarMatcher) -> None:
        self.backend = backend
        self.matcher = matcher
        self.also_allowed: int | None = None

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; False when the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        """Whether the grammar is complete and its stop token was accepted."""
        return self.matcher.is_terminated()
