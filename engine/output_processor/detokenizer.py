"""Detokenization: a completion's text, grown token by token where a request needs it
while it runs (stop strings), else decoded once when it finishes.

Both give the same text. Decoding each new token on its own breaks multi-byte characters
split across tokens and drops the spaces that some tokenizers attach to a word's first
piece. Instead each step decodes a short window (`prefix_offset` to the end) and emits
only what the window adds beyond its already-emitted prefix; a window ending in U+FFFD
(half of a character) waits for the next token. A completion that needs no text before it
ends skips that per-token work (two decodes and a few Python operations, the largest share
of the engine's host work per decode step at hundreds of sequences): its tokens are
decoded when it finishes, with its request's others and the step's other finishers, in
one call of the tokenizer's Rust batch decode (`finish_texts`).
"""

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded with the first output tokens, so that a leading space or a word
# joined across the prompt boundary comes out as in a full decode.
_PROMPT_CONTEXT_TOKENS = 5
_HALF_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text: one delta per token (`add_token`), or
    all at once when the completion ends (`finish_texts`).

    `text` holds the text of the tokens added so far; a completion's final text is set by
    `finish_texts`, which catches up with the tokens it was not given one by one.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        token_texts: dict[int, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # Texts of single tokens decoded with these settings, shared by the detokenizers
        # that have the same settings: the prefix window is usually one token.
        self.token_texts = {} if token_texts is None else token_texts
        # A fast tokenizer's own (Rust) decode, where transformers' wrapper would add no
        # clean-up: the same text at a third of the cost (the wrapper's argument handling
        # dominated a 256-sequence decode step).
        self._backend = None
        if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.num_context_tokens = len(self.ids)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.finished = False

    @property
    def num_tokens_added(self) -> int:
        """How many output tokens the text covers."""
        return len(self.ids) - self.num_context_tokens

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Appends one token and returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        if self.read_offset - self.prefix_offset == 1:
            prefix_id = self.ids[self.prefix_offset]
            prefix_text = self.token_texts.get(prefix_id)
            if prefix_text is None:
                prefix_text = self.token_texts[prefix_id] = self._decode([prefix_id])
        else:
            prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset :])
        if len(window_text) <= len(prefix_text) or window_text.endswith(_HALF_CHARACTER):
            return ""
        delta = window_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Adds, one by one, the output tokens not added yet."""
        for token_id in output_token_ids[self.num_tokens_added :]:
            self.add_token(token_id)


def finish_texts(completions: list[tuple[IncrementalDetokenizer, list[int]]]) -> None:
    """Sets the final text of finished completions, given each one's detokenizer and output
    token ids, as `add_token` over every token would have made it.

    A detokenizer that was given no token yet, with a fast tokenizer, takes the text of
    its output from one batched decode of its context with and without the output: the
    per-token deltas join into exactly that wherever the context's text starts the full
    text and no half character (U+FFFD) is in the output's, which the per-token rule would
    hold back. Elsewhere, and for a detokenizer that was fed token by token, it catches up.
    """
    pending = [(d, ids) for d, ids in completions if not d.finished]
    batched = [(d, ids) for d, ids in pending if d._backend is not None and not d.num_tokens_added and ids]
    by_backend: dict[tuple[int, bool], list[tuple[IncrementalDetokenizer, list[int]]]] = {}
    for d, ids in batched:
        by_backend.setdefault((id(d._backend), d.skip_special_tokens), []).append((d, ids))
    done: set[int] = set()
    for group in by_backend.values():
        backend, skip = group[0][0]._backend, group[0][0].skip_special_tokens
        contexts = [d.ids for d, _ in group]
        texts = backend.decode_batch(contexts + [d.ids + ids for d, ids in group], skip_special_tokens=skip)
        for (d, ids), context_text, full_text in zip(group, texts, texts[len(group) :]):
            output_text = full_text[len(context_text) :]
            if full_text.startswith(context_text) and _HALF_CHARACTER not in output_text:
                d.ids += ids
                d.text = output_text
                done.add(id(d))
    for d, ids in pending:
        if id(d) not in done:
            d.catch_up(ids)
        d.finished = True
