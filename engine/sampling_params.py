"""Per-request sampling settings, validated on construction (vLLM's `SamplingParams`)."""

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    Args:
        temperature: Softmax temperature; 0 means greedy decoding.
        top_p: Keep the smallest set of tokens whose probability adds up to `top_p` (1 = off).
        top_k: Keep the `top_k` most likely tokens (0 or -1 = off).
        seed: Seed of this request's own random generator, so that its samples do not
            depend on the engine's seed.
        max_tokens: Most tokens to generate (vLLM's default is 16).
        stop: Strings that end the generation; the stop string is not part of the text.
        stop_token_ids: Token ids that end the generation besides the EOS token.
        ignore_eos: Keep generating past the EOS token (benchmarks).

    Raises:
        ValueError: naming the field and its allowed range, on any invalid value.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        problems = self.problems()
        if problems:
            raise ValueError("Invalid SamplingParams: " + "; ".join(problems))

    def problems(self) -> list[str]:
        """Every invalid field, as `field: reason` strings (empty when all are valid)."""
        found = []
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            found.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            found.append(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            found.append(f"top_k must be -1, 0 (both off) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            found.append(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            found.append(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            found.append(f"stop must hold non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            found.append(f"stop_token_ids must hold non-negative integers, got {self.stop_token_ids!r}")
        return found

    @property
    def greedy(self) -> bool:
        """Whether this request takes the most likely token at every step."""
        return self.temperature == 0 or self.top_k == 1
