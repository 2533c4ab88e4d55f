"""The throughput suite's workloads: prompts as token ids and new tokens per prompt, EOS ignored.

(a) `chat`: chat prompts x 128 new tokens; (b) `long`: prompts of 100-1,024 tokens x 64-256 new
tokens, lengths drawn from a seeded generator; (c) `shared`: prompts that share a ~600-token
prefix x 32 new tokens (prefix caching's case). `scale` shrinks the prompt counts and the token
counts proportionally for quick runs.

Workloads are built once, with the tokenizer, in the suite's process and handed to each engine's
worker as JSON, so that a worker in another virtualenv (OpenVINO's) needs no tokenizer.
"""

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.prompts import QUESTIONS, chat_prompt_ids

# Varied paragraphs that the `long` and `shared` workloads cut their prompts from.
PARAGRAPHS = [
    ("The harbour town woke slowly. Fishing boats came in before dawn, their decks stacked with crates of "
     "mackerel and crab, and the market hall filled with the smell of salt and diesel. By seven the cafes "
     "had opened their shutters, and the first tourists wandered along the quay taking photographs of the "
     "lighthouse, which had not guided a ship in forty years but was repainted every spring all the same."),
    ("A relational database stores rows in pages on disk. When a query filters on a column with an index, "
     "the planner can walk a B-tree to the matching keys instead of scanning every page. Indexes are not "
     "free, though: every insert and update must maintain them, and an index that no query uses only costs "
     "write throughput and storage. Reading the query plan is the first step in any tuning session."),
    ("Photosynthesis converts light into chemical energy. In the thylakoid membranes of the chloroplast, "
     "chlorophyll absorbs photons and drives the splitting of water, releasing oxygen. The energy captured "
     "is stored in ATP and NADPH, which the Calvin cycle then spends to fix carbon dioxide into sugars. "
     "Almost every food chain on land begins with this process."),
    ("Our quarterly review showed that support tickets about billing fell by a third after the new invoice "
     "layout shipped. Tickets about password resets, on the other hand, rose sharply in March, mostly from "
     "customers whose single sign-on provider changed its certificate. The team proposes a status banner "
     "for such incidents and a self-service page that explains the most common fixes."),
    ("To make a simple tomato sauce, warm olive oil in a heavy pan and soften a chopped onion with a pinch "
     "of salt. Add two cloves of garlic for a minute, then a tin of whole tomatoes crushed by hand. Let it "
     "simmer for twenty minutes, stirring now and then, until it thickens. Finish with torn basil and a "
     "knob of butter, and taste before adding more salt."),
    ("The committee met on Tuesday to discuss the proposed cycle lanes on the high street. Shop owners were "
     "worried about deliveries and parking, while residents pointed to the number of accidents at the "
     "junction near the school. After two hours the members agreed on a six-month trial with loading bays "
     "at both ends, and asked the council to publish traffic counts every month."),
    ("Continuous integration runs the test suite on every change pushed to the repository. A failing build "
     "blocks the merge, which keeps the main branch releasable, but only if the tests are fast and "
     "reliable. Flaky tests erode that trust quickly: engineers learn to click retry instead of reading "
     "the failure. Quarantining them, fixing the cause and tracking the flake rate helps."),
    ("Mountain weather changes faster than most walkers expect. A clear morning can turn to low cloud and "
     "driving rain within an hour, and temperatures on an exposed ridge are often ten degrees lower than "
     "in the valley. Carry a waterproof layer, a map and a compass even on short routes, tell someone "
     "where you are going, and be ready to turn back before the summit."),
    ("The novel follows two sisters who inherit their grandmother's bakery in a small northern town. One "
     "wants to sell it and return to the city; the other wants to keep the ovens burning. Over a single "
     "winter they uncover letters that reveal why their grandmother never left, and the book becomes a "
     "quiet meditation on duty, memory and the smell of bread at four in the morning."),
    ("Vaccines train the immune system by presenting it with a harmless version or a fragment of a "
     "pathogen. B cells learn to produce antibodies that recognise it, and memory cells persist for years, "
     "so that a later infection is met with a fast and strong response. Booster doses remind the immune "
     "system when that memory fades or when the pathogen changes."),
    ("Please find attached the revised contract for the warehouse lease. The main changes concern the "
     "break clause, which now allows either party to end the lease after three years with six months of "
     "notice, and the maintenance schedule for the loading docks. Let us know by Friday whether the terms "
     "are acceptable, so that the signing can take place before the end of the month."),
    ("Large language models predict the next token from the tokens before it. During generation, the keys "
     "and values of earlier tokens are cached so that each new token only attends to them instead of "
     "recomputing the whole sequence. Serving many requests at once, an engine batches their decode steps "
     "together, which turns many small matrix-vector products into fewer large matrix products."),
    ("The old railway line has become a path for walkers and cyclists. It runs for eleven miles through "
     "cuttings full of ferns, over two viaducts and past the ruins of a station whose platform still "
     "carries the town's name in faded paint. In autumn the hedges are heavy with blackberries, and on "
     "weekends families stop at the cafe that opened in the former signal box."),
    ("A balanced diet does not need to be complicated. Fill half the plate with vegetables and fruit, a "
     "quarter with whole grains and a quarter with protein such as beans, fish, eggs or lean meat. Drink "
     "water rather than sugary drinks, and keep salt and processed snacks for occasional treats. Small "
     "habits sustained for months matter more than strict rules kept for a week."),
    ("The spacecraft entered orbit after a seven-month cruise. Engineers on the ground waited twelve "
     "minutes for the signal to confirm the burn, since radio waves needed that long to cross the distance. "
     "Over the following weeks the orbit was lowered step by step by skimming the upper atmosphere, until "
     "the cameras could map the surface at a resolution of a few metres per pixel."),
    ("Learning a new language is mostly about regular exposure. Ten minutes every day beats two hours on "
     "a Sunday. Listen to podcasts made for learners, read short texts slightly above your level, and "
     "speak as early as you can, even with mistakes. Spaced repetition helps vocabulary stick, but "
     "conversation is what turns words you recognise into words you can use."),
]

WARMUP_TEXT = "Warm-up request {}: count the apples, pears and plums in the basket, then name the colours."


@dataclass
class Workload:
    """One workload: prompts as token ids and the new tokens each prompt gets (EOS ignored).

    `shared_prefix_len` is the number of leading tokens every prompt shares (0 if none);
    `warmup` holds a few short prompts unrelated to the workload's, run before timing.
    """

    name: str
    description: str
    prompts: list[list[int]]
    max_tokens: list[int]
    shared_prefix_len: int = 0
    warmup: list[list[int]] = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.max_tokens)

    def summary(self) -> str:
        """One line: the counts the workload actually has after scaling."""
        lengths = list(map(len, self.prompts))
        return (f"{len(self.prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
                f"(mean {sum(lengths) / len(lengths):.0f}) x {_span(self.max_tokens)} new tokens"
                + (f", shared prefix {self.shared_prefix_len} tokens" if self.shared_prefix_len else ""))

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> "Workload":
        return cls(**json.loads(Path(path).read_text()))


def build_workloads(names: list[str], tokenizer, scale: float = 1.0, seed: int = 0) -> list[Workload]:
    """The workloads named (any of `a`, `b`, `c`), shrunk by `scale`."""
    builders = {"a": chat_workload, "b": long_workload, "c": shared_prefix_workload}
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise ValueError(f"unknown workloads {unknown}; choose from {sorted(builders)}")
    warmup = [tokenizer(WARMUP_TEXT.format(i), add_special_tokens=False).input_ids for i in range(2)]
    workloads = [builders[name](tokenizer, scale, seed) for name in names]
    for workload in workloads:
        workload.warmup = warmup
    return workloads


def chat_workload(tokenizer, scale: float, seed: int) -> Workload:
    """(a) 256 chat prompts x 128 new tokens."""
    count, new_tokens = _scaled(256, scale), _scaled(128, scale)
    return Workload("a", "chat prompts, equal output lengths", chat_prompt_ids(tokenizer, count),
                    [new_tokens] * count)


def long_workload(tokenizer, scale: float, seed: int) -> Workload:
    """(b) 64 prompts of 100-1,024 tokens x 64-256 new tokens, lengths from a seeded generator."""
    rng = random.Random(seed)
    count = _scaled(64, scale)
    prompt_range = (_scaled(100, scale, minimum=4), _scaled(1024, scale, minimum=4))
    output_range = (_scaled(64, scale), _scaled(256, scale))
    prompts, max_tokens = [], []
    for i in range(count):
        order = rng.sample(range(len(PARAGRAPHS)), len(PARAGRAPHS))
        text = f"Document {i + 1}.\n\n" + "\n\n".join(PARAGRAPHS[j] for j in order)
        prompts.append(_token_prefix(tokenizer, text, rng.randint(*prompt_range)))
        max_tokens.append(rng.randint(*output_range))
    return Workload("b", "varied text, varied prompt and output lengths", prompts, max_tokens)


def shared_prefix_workload(tokenizer, scale: float, seed: int) -> Workload:
    """(c) 128 prompts sharing a ~600-token prefix x 32 new tokens."""
    count, new_tokens = _scaled(128, scale), _scaled(32, scale)
    reference = ("Answer the question below using the reference notes.\n\nReference notes:\n\n"
                 + "\n\n".join(PARAGRAPHS))
    prefix = _token_prefix(tokenizer, reference, _scaled(600, scale, minimum=4))
    prompts = []
    for i in range(count):
        question = f"\n\nQuestion {i + 1}: {QUESTIONS[i % len(QUESTIONS)]}\nAnswer:"
        prompts.append(prefix + tokenizer(question, add_special_tokens=False).input_ids)
    return Workload("c", "shared prefix (prefix caching's case)", prompts, [new_tokens] * count,
                    shared_prefix_len=len(prefix))


def _token_prefix(tokenizer, text: str, length: int) -> list[int]:
    """The first `length` token ids of `text`, repeated as often as needed."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < length:
        ids = ids + ids
    return ids[:length]


def _scaled(value: int, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(value * scale))


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"
