"""Reasoning sections (vLLM's reasoning parsers): where a completion's thinking ends and
its answer starts, found as tokens arrive, and the two texts apart when it finishes.

A reasoning model writes its thinking between two markers (`<think>` ... `</think>` for
Qwen3 and DeepSeek-R1). The model's template may open the section in the prompt (R1's
and Qwen3's thinking templates end the generation prompt with `<think>`, or close it at
once when thinking is off), or leave the model to open it. Each completion's
`ReasoningTracker` follows it through three phases:

- `UNDECIDED`: the prompt neither opened nor closed a section and the model may open one:
  its first token decides (the opening marker, or the answer's first token);
- `REASONING`: until the closing marker; a structured output's grammar waits meanwhile,
  so a JSON schema constrains the answer only and leaves the thinking free;
- `ANSWER`: the grammar, if any, applies from here.

A marker that is one token, or holds a special token (gpt-oss's harmony headers, such as
`<|channel|>final<|message|>`, whose special tokens a decoded text leaves out), is matched
as its sequence of ids; any other by its text, detokenized as the tokens arrive.
"""

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens read to find whether the template opened or closed a section at its end.
_PROMPT_TAIL_TOKENS = 16


class Phase(enum.Enum):
    UNDECIDED = "undecided"
    REASONING = "reasoning"
    ANSWER = "answer"


@dataclass(frozen=True)
class ReasoningFormat:
    """A family's markers. `opens_itself`: the model reasons from its first token even
    when nothing opened a section (DeepSeek-R1's distills often skip `<think>`; gpt-oss
    writes its analysis channel first), so a completion that never closes one is all
    reasoning. `trailer`: what the model writes between its reasoning and the closing
    marker, left out of both (harmony ends the analysis message and starts the next).
    `signature`: the tokens whose presence in a vocabulary and chat template identifies
    the family (default: the two markers). `other_ends`: more closing markers, each holding
    a special token (matched by id), after which the answer is the rest of the output,
    marker included (harmony's commentary channel, whose header the tool parser reads);
    tokens between the trailer and such a marker (harmony's recipient, `to=functions.f`)
    start the answer. `special_tokens`: the tokens of the markers that the model's
    vocabulary must hold as special tokens, so that markers are matched by id (required
    with `other_ends`); `family` and `syntax` name the models that write them and their
    format, for messages ("gpt-oss", "harmony")."""

    name: str
    start: str
    end: str
    opens_itself: bool = False
    trailer: str = ""
    signature: tuple[str, ...] = ()
    other_ends: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    family: str = ""
    syntax: str = ""

    def __post_init__(self) -> None:
        if self.other_ends and not self.special_tokens:
            raise ValueError(f"reasoning format {self.name!r}: other_ends are matched by id, so the format must name "
                             "the special_tokens its markers hold")

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
        self.other_end_ids = tuple(_marker_ids(tokenizer, end) for end in fmt.other_ends)
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
        already cut) and tokens."""
        if not tracker.had_section:
            return ReasoningSplit(None, text, 0, None)
        if tracker.other_end:
            return self._split_at_other_end(tracker, output_token_ids, skip_special_tokens)
        if self.matches_text:
            reasoning, answer, ended = self._split_text(tracker, text)
        else:
            reasoning, answer, ended = self._split_ids(tracker, text, output_token_ids, skip_special_tokens)
        num_tokens = tracker.end_index if tracker.end_index is not None else len(output_token_ids)
        return ReasoningSplit(reasoning.strip(), answer.lstrip(), num_tokens, ended)

    def _split_at_other_end(self, tracker: "ReasoningTracker", ids: list[int],
                            skip_special_tokens: bool) -> ReasoningSplit:
        """A section closed by one of `other_ends`: the reasoning up to the trailer (its last
        occurrence), the answer from the tokens after it, the closing marker included."""
        first = self._opening_length(ids)
        answer_start = tracker.end_index - tracker.end_length
        size = len(self.trailer_ids)
        for at in range(answer_start - size, first - 1, -1):
            if size and tuple(ids[at : at + size]) == self.trailer_ids:
                reasoning, answer_start = ids[first:at], at + size
                break
        else:
            reasoning = ids[first:answer_start]
        return ReasoningSplit(self._decode(reasoning, skip_special_tokens).strip(),
                              self._decode(ids[answer_start:], skip_special_tokens).lstrip(), tracker.end_index,
                              True, answer_start)

    def _split_text(self, tracker: "ReasoningTracker", text: str) -> tuple[str, str, bool]:
        """By text: the reasoning is what precedes the closing marker, the answer what follows."""
        body = text.lstrip().removeprefix(self.format.start) if tracker.opened_by_model else text
        reasoning, marker, answer = body.partition(self.format.end)
        return reasoning, answer, bool(marker)

    def _split_ids(self, tracker: "ReasoningTracker", text: str, ids: list[int],
                   skip_special_tokens: bool) -> tuple[str, str, bool]:
        """By id: the reasoning is the decode of its tokens (without the markers and the
        trailer); the answer is what the text holds after the decode of the tokens up to the
        closing marker (where that decode does not start the text, a tokenizer joining
        pieces across the boundary, the answer's own tokens decoded)."""
        first = self._opening_length(ids)
        if tracker.end_index is None:
            return self._decode(ids[first:], skip_special_tokens), "", False
        last = tracker.end_index - len(self.end_ids)
        if self.trailer_ids and tuple(ids[last - len(self.trailer_ids) : last]) == self.trailer_ids:
            last -= len(self.trailer_ids)
        reasoning = self._decode(ids[first:last], skip_special_tokens)
        head = self._decode(ids[: tracker.end_index], skip_special_tokens)
        answer = (text[len(head):] if text.startswith(head)
                  else self._decode(ids[tracker.end_index :], skip_special_tokens))
        return reasoning, answer, True

    def _opening_length(self, ids: list[int]) -> int:
        """How many of the output's first tokens are the opening marker the model wrote (0: none)."""
        size = len(self.start_ids) if self.start_ids else 0
        return size if size and tuple(ids[:size]) == self.start_ids else 0

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class ReasoningTracker:
    """Where one completion stands: its phase, the grammar held back while it reasons, and
    how many output tokens end with the closing marker once it is found."""

    def __init__(self, parser: ReasoningParser, phase: Phase) -> None:
        self.parser = parser
        self.phase = phase
        self.had_section = phase is Phase.REASONING
        self.opened_by_model = False
        self.end_index: int | None = None
        self.end_length = 0  # the closing marker's tokens, once found
        self.other_end = False  # whether one of the format's other_ends closed it
        self._held_grammar: Any = None  # a StructuredOutputGrammar
        self._searched = 0
        self._recent: list[int] = []  # the last ids, as many as the closing marker has

    @property
    def needs_text(self) -> bool:
        """Whether the completion's text must grow token by token to find the markers."""
        return self.phase is not Phase.ANSWER and self.parser.matches_text

    def first_grammar(self, grammar: Any) -> Any:
        """Takes a new completion's grammar (None: unconstrained); returns the one that
        applies to its first token: none while it reasons; while its first token decides,
        the grammar with the opening marker also allowed (by id; by text the grammar waits
        for the decision); the grammar itself in the answer."""
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
            start = self.parser.format.start
            if self.parser.start_id is not None:
                opened = token_id == self.parser.start_id
            else:  # the first token's text starts the marker (or holds it whole)
                head = text.lstrip()
                opened = bool(head) and (head.startswith(start) or start.startswith(head))
            self.phase = Phase.REASONING if opened else Phase.ANSWER
            self.had_section = self.opened_by_model = opened
            return opened
        end_ids = self.parser.end_ids
        if end_ids is not None:
            options = (end_ids, *self.parser.other_end_ids)
            longest = max(map(len, options))
            self._recent = [*self._recent[1 - longest:], token_id] if longest > 1 else [token_id]
            found = next((ids for ids in options if tuple(self._recent[-len(ids):]) == ids), None)
            ended = found is not None
            if ended:
                self.end_length, self.other_end = len(found), found is not end_ids
        else:
            end = self.parser.format.end
            ended = text.find(end, max(0, self._searched - len(end) + 1)) >= 0
            self._searched = len(text)
        if ended:
            self.phase = Phase.ANSWER
            self.end_index = num_output_tokens
        return True

    def next_grammar(self, grammar: Any) -> Any:
        """The grammar for the tokens after the newest, given the one applied to it: held
        back while the completion reasons, released once it answers."""
        if grammar is not None:
            grammar.also_allowed = None
            if self.phase is Phase.REASONING:
                self._held_grammar = grammar
                return None
            return grammar
        if self.phase is Phase.ANSWER:
            grammar, self._held_grammar = self._held_grammar, None
        return grammar


def _marker_ids(tokenizer: "PreTrainedTokenizerBase", marker: str) -> tuple[int, ...] | None:
    """The marker's ids when it is matched by id: one token, or a sequence holding a special
    token (a model writes such headers always the same way); None: matched by text."""
    ids = tuple(tokenizer(marker, add_special_tokens=False).input_ids)
    return ids if len(ids) == 1 or _special_ids(tokenizer).intersection(ids) else None


def _special_ids(tokenizer: "PreTrainedTokenizerBase") -> set[int]:
    """The ids of the tokenizer's special and added tokens (never split, whatever the text around)."""
    return set(tokenizer.all_special_ids) | {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
