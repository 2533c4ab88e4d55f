"""Reasoning sections (vLLM's reasoning parsers): where a completion's thinking ends and
its answer starts, found as tokens arrive, and the two texts apart when it finishes.

A reasoning model writes its thinking between two markers (`<think>` ... `</think>` for
Qwen3 and DeepSeek-R1). The model's template may open the section in the prompt (R1's
and Qwen3's thinking templates end the generation prompt with `<think>`, or close it at
once when thinking is off), or leave the model to open it. Each completion's
`ReasoningTracker` follows it through three phases:

- `UNDECIDED`: the prompt neither opened nor closed a section and the model may open one:
  its first token that is not whitespace decides (the opening marker, or the answer's
  first token);
- `REASONING`: until the closing marker, or one of the format's other ends (a tool-call
  section that starts without the section being closed); a structured output's grammar
  waits meanwhile, so a JSON schema constrains the answer only and leaves the thinking free;
- `ANSWER`: the grammar, if any, applies from here.

A marker that is one token, or holds a special token (gpt-oss's harmony headers, such as
`<|channel|>final`, whose special tokens a decoded text leaves out), is matched as its
sequence of ids; any other by its text, detokenized as the tokens arrive.
"""

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens read to find whether the template opened or closed a section at its end.
_PROMPT_TAIL_TOKENS = 16
# Tokens a header that a closing marker opens may hold before its end (vLLM's gpt-oss
# parser allows as many between `<|channel|>final` and `<|message|>`).
_HEADER_TOKENS = 20


class Phase(enum.Enum):
    UNDECIDED = "undecided"
    REASONING = "reasoning"
    ANSWER = "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's markers. `opens_itself`: the model reasons from its first token even
    when nothing opened a section (DeepSeek-R1's distills often skip `<think>`; gpt-oss
    writes its analysis channel first; Kimi K2 may start thinking without `<think>`), so a
    completion that never closes one is all reasoning. `trailer`: what the model writes
    between its reasoning and the closing marker, left out of both (harmony ends the
    analysis message and starts the next). `header_end`: the token that ends the header the
    closing marker opens; the marker then runs to it, whatever the header holds between
    (harmony's `<|channel|>final <|constrain|>json<|message|>`). `signature`: the tokens
    whose presence in a vocabulary and chat template identifies the family (default: the
    two markers). `template_switch`: a chat-template variable that turns the section on
    and off, which the template must mention for the format to be detected (DeepSeek-V3.1's
    `thinking`). `other_ends`: more closing markers after which the answer is the rest of
    the output, marker included (harmony's commentary channel, whose header the tool parser
    reads; Qwen3's `<tool_call>` and Kimi K2's `<|tool_calls_section_begin|>`, a call the
    model starts without closing its section first); each is matched by id where the
    tokenizer holds it as one token or with a special token, and not matched elsewhere.
    Tokens between the trailer and such a marker (harmony's recipient, `to=functions.f`)
    start the answer. `special_tokens`: the tokens of the markers that the model's
    vocabulary must hold as special tokens, so that markers are matched by id; `family`
    and `syntax` name the models that write them and their format, for messages
    ("gpt-oss", "harmony")."""

    name: str
    start: str
    end: str
    opens_itself: bool = False
    trailer: str = ""
    header_end: str = ""
    signature: tuple[str, ...] = ()
    template_switch: str = ""
    other_ends: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    family: str = ""
    syntax: str = ""

    @property
    def tokens(self) -> tuple[str, ...]:
        return self.signature or (self.start, self.end)

    def tokenizer_problem(self, tokenizer: "PreTrainedTokenizerBase") -> str | None:
        """Why the format cannot be read on this tokenizer (it lacks the special tokens the
        format needs: a model of another family), or None."""
        special = _special_ids(tokenizer)
        lacking = [token for token in self.special_tokens
                   if len(ids := tokenizer(token, add_special_tokens=False).input_ids) != 1 or ids[0] not in special]
        if not lacking:
            return None
        return (f"reasoning_parser={self.name!r} reads {self.family}'s {self.syntax} output, and this model's "
                f"tokenizer lacks {self.syntax}'s special tokens {', '.join(lacking)} (it is not a {self.family} "
                f"tokenizer): use a {self.family} model with its own tokenizer, or another reasoning_parser that "
                "fits this model ('auto' picks it from the tokenizer), or None")


@dataclass(frozen=True)
class ReasoningSplit:
    """A finished completion's reasoning (None: it had no section) and answer text, the
    reasoning's tokens (markers included), and whether the section was closed (None:
    no section); `answer_start`, the answer's first output token (None: where the
    reasoning's tokens end)."""

    reasoning: str | None
    text: str
    num_reasoning_tokens: int
    ended: bool | None
    answer_start: int | None = None


class ReasoningParser:
    """One format on one tokenizer: the markers' ids (or texts), a prompt's opening phase,
    and the split of a finished completion."""

    def __init__(self, fmt: ReasoningFormat, tokenizer: "PreTrainedTokenizerBase") -> None:
        if (problem := fmt.tokenizer_problem(tokenizer)) is not None:
            raise ValueError(problem)
        self.format = fmt
        self.tokenizer = tokenizer
        self.start_ids = _marker_ids(tokenizer, fmt.start)
        self.end_ids = _marker_ids(tokenizer, fmt.end)
        self.other_end_ids = tuple(ids for end in fmt.other_ends if (ids := _marker_ids(tokenizer, end)) is not None)
        self.header_end_ids = _marker_ids(tokenizer, fmt.header_end) if fmt.header_end else None
        self.trailer_ids = tuple(tokenizer(fmt.trailer, add_special_tokens=False).input_ids) if fmt.trailer else ()

    @property
    def start_id(self) -> int | None:
        """The opening marker's first id (the token that opens a section), when matched by id."""
        return self.start_ids[0] if self.start_ids else None

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def matches_text(self) -> bool:
        """Whether the closing marker is found in the detokenized text (it is not one
        token), which then has to be grown token by token."""
        return self.end_ids is None

    def is_blank(self, token_id: int) -> bool:
        """Whether the token is whitespace only (it decides nothing before a section opens)."""
        return not self.tokenizer.decode([token_id], skip_special_tokens=False).strip()

    def initial_phase(self, prompt_token_ids: list[int]) -> Phase:
        """The phase a completion of this prompt starts in: reasoning when the prompt ends
        with an opening marker, the answer when it ends with a closing one (a template with
        thinking switched off), else what the format says of a model left to open one."""
        tail = self.tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
        if tail.endswith(self.format.start):
            return Phase.REASONING
        if tail.endswith(self.format.end):
            return Phase.ANSWER
        return Phase.REASONING if self.format.opens_itself else Phase.UNDECIDED

    def tracker(self, prompt_token_ids: list[int]) -> "ReasoningTracker":
        return ReasoningTracker(self, self.initial_phase(prompt_token_ids))

    def split(self, tracker: "ReasoningTracker", text: str, output_token_ids: list[int],
              skip_special_tokens: bool = True) -> ReasoningSplit:
        """The completion's reasoning and answer, given its final text (stop strings
        already cut) and tokens. The reasoning is stripped, and the answer loses the line
        breaks that separate it from the closing marker (not the indentation of its first
        line)."""
        if not tracker.had_section:
            return self._split_late(tracker, text, output_token_ids, skip_special_tokens)
        if self.matches_text:
            body = text.lstrip().removeprefix(self.format.start)
            reasoning, marker, answer = body.partition(self.format.end)
            num_tokens = tracker.end_index if tracker.end_index is not None else len(output_token_ids)
            return ReasoningSplit(reasoning.strip(), _without_leading_lines(answer), num_tokens, bool(marker))
        return self._split_ids(tracker, text, output_token_ids, skip_special_tokens)

    def _split_ids(self, tracker: "ReasoningTracker", text: str, ids: list[int],
                   skip_special_tokens: bool) -> ReasoningSplit:
        """By id: the reasoning is the decode of its tokens, without the markers and the
        trailer; the answer is the text from the closing marker's end (from one of the other
        ends' start, the tokens after the trailer included)."""
        first = self._opening_end(ids)
        marker = tracker.marker_start
        if marker is None:
            return ReasoningSplit(self._reasoning_text(ids[first:], skip_special_tokens), "", len(ids), False)
        size = len(self.trailer_ids)
        stop = marker - size if size and tuple(ids[marker - size : marker]) == self.trailer_ids else marker
        if tracker.end_index is None:  # a closing marker's header never ended
            return ReasoningSplit(self._reasoning_text(ids[first:stop], skip_special_tokens), "", len(ids), False)
        answer_start = None
        if tracker.other_end:
            stop = answer_start = marker
            trailer_at = _last_index(ids, self.trailer_ids, first, marker)
            if trailer_at is not None:
                stop, answer_start = trailer_at, trailer_at + size
        reasoning = self._reasoning_text(ids[first:stop], skip_special_tokens)
        answer = self._text_from(ids, answer_start if tracker.other_end else tracker.end_index, text,
                                 skip_special_tokens)
        return ReasoningSplit(reasoning, _without_leading_lines(answer), tracker.end_index, True, answer_start)

    def _reasoning_text(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The reasoning's tokens as text, stripped. A format with a trailer may write several
        reasoning messages in a row (harmony: `...<|end|><|start|>assistant<|channel|>analysis
        <|message|>...`): their texts, joined by line breaks as vLLM joins them, without the
        headers between them."""
        boundary = (*self.trailer_ids, *(self.start_ids or ()))
        pieces, start = [], 0
        while self.trailer_ids and self.start_ids and (at := _first_index(ids, boundary, start)) is not None:
            pieces.append(ids[start:at])
            start = at + len(boundary)
        pieces.append(ids[start:])
        texts = (self._decode(piece, skip_special_tokens).strip() for piece in pieces)
        return "\n".join(text for text in texts if text)

    def _split_late(self, tracker: "ReasoningTracker", text: str, ids: list[int],
                    skip_special_tokens: bool) -> ReasoningSplit:
        """A completion that no section opened: all answer, unless its model, free of any
        grammar, opened one after writing some answer (a line before `[THINK]`). As vLLM's
        parsers do, that section comes out of the answer, which keeps the text before and
        after it; the tool parser reads the tokens after it. By id only."""
        whole = ReasoningSplit(None, text, 0, None)
        if not tracker.decided_by_model or tracker.constrained or self.start_ids is None:
            return whole
        opened = _first_index(ids, self.start_ids, 0)
        if opened is None or not text.startswith(before := self._decode(ids[:opened], skip_special_tokens)):
            return whole
        first = opened + len(self.start_ids)
        closed = _first_index(ids, self.end_ids, first) if self.end_ids else None
        if closed is None:
            return ReasoningSplit(self._decode(ids[first:], skip_special_tokens).strip(), before,
                                  len(ids) - opened, False, len(ids))
        end = closed + len(self.end_ids)
        after = self._text_from(ids, end, text, skip_special_tokens)
        return ReasoningSplit(self._decode(ids[first:closed], skip_special_tokens).strip(), before + after,
                              end - opened, True, end)

    def _text_from(self, ids: list[int], index: int, text: str, skip_special_tokens: bool) -> str:
        """What the text holds after the decode of the first `index` tokens (where that
        decode does not start the text, a tokenizer joining pieces across the boundary, the
        later tokens decoded)."""
        head = self._decode(ids[:index], skip_special_tokens)
        return text[len(head):] if text.startswith(head) else self._decode(ids[index:], skip_special_tokens)

    def _opening_end(self, ids: list[int]) -> int:
        """Where the opening marker the model wrote, after any whitespace, ends (0: it wrote none)."""
        size = len(self.start_ids) if self.start_ids else 0
        if not size:
            return 0
        at = next((i for i, token in enumerate(ids) if not self.is_blank(token)), len(ids))
        return at + size if tuple(ids[at : at + size]) == self.start_ids else 0

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class ReasoningTracker:
    """Where one completion stands: its phase, the grammar held back while it reasons, and
    how many output tokens end with the closing marker once it is found."""

    def __init__(self, parser: ReasoningParser, phase: Phase) -> None:
        self.parser = parser
        self.phase = phase
        self.had_section = phase is Phase.REASONING
        self.decided_by_model = False  # the model's first token, not the prompt, started the answer
        self.constrained = False  # a grammar constrains the completion
        self.end_index: int | None = None
        self.end_length = 0  # the closing marker's tokens, once found
        self.other_end = False  # whether one of the format's other_ends closed it
        self._header_from: int | None = None  # where a closing marker waiting for its header's end began
        self._held_grammar: Any = None  # a StructuredOutputGrammar
        self._searched = 0
        self._recent: list[int] = []  # the last ids, as many as the longest marker has
        markers = (parser.end_ids or (), parser.header_end_ids or (), *parser.other_end_ids)
        self._window = max(map(len, markers))

    @property
    def needs_text(self) -> bool:
        """Whether the completion's text must grow token by token to find the markers."""
        return self.phase is not Phase.ANSWER and self.parser.matches_text

    @property
    def marker_start(self) -> int | None:
        """The output token where the closing marker begins: found (by id), or still
        waiting for its header's end; None: none yet."""
        return self.end_index - self.end_length if self.end_index is not None else self._header_from

    def first_grammar(self, grammar: Any) -> Any:
        """Takes a new completion's grammar (None: unconstrained); returns the one that
        applies to its first token: none while it reasons; while its first token decides,
        the grammar with the opening marker also allowed (by id; by text the grammar waits
        for the decision); the grammar itself in the answer."""
        self.constrained = grammar is not None
        if grammar is None or self.phase is Phase.ANSWER:
            return grammar
        if self.phase is Phase.UNDECIDED and self.parser.start_id is not None:
            grammar.also_allowed = self.parser.start_id
            return grammar
        self._held_grammar = grammar
        return None

    def advance(self, token_id: int, num_output_tokens: int, text: str) -> bool:
        """Follows the completion past its newest token (its `num_output_tokens`-th;
        `text` is its text so far when `needs_text`). Returns True when the token belongs
        to the reasoning, its markers included, so that a grammar must not see it."""
        if self.phase is Phase.ANSWER:
            return False
        if self.phase is Phase.UNDECIDED:
            return self._decide(token_id, text)
        if self.parser.end_ids is not None:
            ended = self._closes(token_id, num_output_tokens)
        else:
            end = self.parser.format.end
            ended = text.find(end, max(0, self._searched - len(end) + 1)) >= 0
            self._searched = len(text)
        if ended:
            self.phase = Phase.ANSWER
            self.end_index = num_output_tokens
        return True

    def _decide(self, token_id: int, text: str) -> bool:
        """The first token that is not whitespace opens a section or starts the answer."""
        start = self.parser.format.start
        if self.parser.start_id is not None:
            if self.parser.is_blank(token_id):
                return False
            opened = token_id == self.parser.start_id
        else:  # the text's first characters start the marker (or hold it whole)
            head = text.lstrip()
            if not head:
                return False
            opened = head.startswith(start) or start.startswith(head)
        self.phase = Phase.REASONING if opened else Phase.ANSWER
        self.had_section, self.decided_by_model = opened, not opened
        return opened

    def _closes(self, token_id: int, num_output_tokens: int) -> bool:
        """Whether the newest token ends a closing marker (by id): the closing marker, its
        header's end when it opens one, or one of the other ends."""
        parser = self.parser
        self._recent = [*self._recent[1 - self._window:], token_id] if self._window > 1 else [token_id]
        if self._header_from is not None:
            if self._ends_with(parser.header_end_ids):
                self.end_length, self._header_from = num_output_tokens - self._header_from, None
                return True
            if num_output_tokens - self._header_from > _HEADER_TOKENS:
                self._header_from = None  # no header after all: the reasoning goes on
        for ids in (parser.end_ids, *parser.other_end_ids):
            if self._ends_with(ids):
                if ids is parser.end_ids and parser.header_end_ids:
                    self._header_from = num_output_tokens - len(ids)
                    return False
                self.end_length, self.other_end, self._header_from = len(ids), ids is not parser.end_ids, None
                return True
        return False

    def _ends_with(self, ids: tuple[int, ...]) -> bool:
        return tuple(self._recent[-len(ids):]) == ids

    def next_grammar(self, grammar: Any) -> Any:
        """The grammar for the tokens after the newest, given the one applied to it: held
        back while the completion reasons, released once it answers (after the token that
        ended the reasoning: as in vLLM, a grammar never sees a closing marker, nor an
        other end that starts the answer)."""
        if grammar is not None:
            if self.phase is not Phase.UNDECIDED:
                grammar.also_allowed = None
            if self.phase is Phase.REASONING:
                self._held_grammar = grammar
                return None
            return grammar
        if self.phase is Phase.ANSWER:
            grammar, self._held_grammar = self._held_grammar, None
        return grammar


def _without_leading_lines(answer: str) -> str:
    """The answer without the blank lines before its first line (that line's indentation kept)."""
    blank = answer[: len(answer) - len(answer.lstrip())]
    return answer[blank.rfind("\n") + 1 :]


def _first_index(ids: list[int], marker: tuple[int, ...], start: int) -> int | None:
    """Where `marker` first occurs in `ids` from `start`, or None."""
    size = len(marker)
    return next((at for at in range(start, len(ids) - size + 1) if tuple(ids[at : at + size]) == marker), None)


def _last_index(ids: list[int], marker: tuple[int, ...], start: int, stop: int) -> int | None:
    """Where `marker` last occurs wholly within `ids[start:stop]`, or None (an empty marker: None)."""
    size = len(marker)
    if not size:
        return None
    return next((at for at in range(stop - size, start - 1, -1) if tuple(ids[at : at + size]) == marker), None)


def _marker_ids(tokenizer: "PreTrainedTokenizerBase", marker: str) -> tuple[int, ...] | None:
    """The marker's ids when it is matched by id: one token, or a sequence holding a special
    token (a model writes such headers always the same way); None: matched by text."""
    ids = tuple(tokenizer(marker, add_special_tokens=False).input_ids)
    return ids if len(ids) == 1 or _special_ids(tokenizer).intersection(ids) else None


def _special_ids(tokenizer: "PreTrainedTokenizerBase") -> set[int]:
    """The ids of the tokenizer's special and added tokens (never split, whatever the text around)."""
    return set(tokenizer.all_special_ids) | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
