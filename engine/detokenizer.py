"""Incremental detokenization: text grows token by token without splitting characters."""

from transformers import PreTrainedTokenizerBase

# Prompt tokens decoded with the first output tokens, so that a leading space or a word
# joined across the prompt boundary comes out as in a full decode.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one delta per token.

    Decoding each new token on its own breaks multi-byte characters split across tokens
    and drops the spaces that some tokenizers attach to a word's first piece. Instead each
    step decodes a short window (`prefix_offset` to the end) and emits only what the
    window adds beyond its already-emitted prefix; a window ending in U+FFFD (half of a
    character) waits for the next token.
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
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

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
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        delta = window_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta
