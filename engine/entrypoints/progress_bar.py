"""The progress bar of `LLM.generate`: prompts done, with estimated token rates."""

import time
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from engine.outputs import RequestOutput


class ProgressBar:
    """Prompts done, with estimated input and output tokens per second.

    `use_tqdm` is True (a tqdm bar), False (nothing) or a tqdm-like factory, as in vLLM.
    """

    def __init__(self, use_tqdm: bool | Callable[..., Any], total: int) -> None:
        self.bar = None
        if use_tqdm:
            factory = tqdm if use_tqdm is True else use_tqdm
            self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True,
                               postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self.started = time.perf_counter()
        self.input_tokens = 0
        self.output_tokens = 0

    def update(self, finished: list[RequestOutput]) -> None:
        """Counts the requests that finished. Called after every step, so that a bar or a
        logger can tick during long decodes."""
        if self.bar is None:
            return
        generated = [r for r in finished if isinstance(r, RequestOutput)]  # beams and pooling: counted as requests
        self.input_tokens += sum(len(r.prompt_token_ids) for r in generated)
        self.output_tokens += sum(len(c.token_ids) for r in generated for c in r.outputs)
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        self.bar.postfix = (f"est. speed input: {self.input_tokens / elapsed:.2f} toks/s, "
                            f"output: {self.output_tokens / elapsed:.2f} toks/s")
        self.bar.update(len(finished))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
