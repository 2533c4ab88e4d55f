"""Host work per decode step: what a step costs beyond its compute, with asynchronous
scheduling off and on.

The model is a 1-layer llama with hidden size 64 and a 512-token vocabulary (built here,
random weights), so that a step's compute is small and the engine's own work shows: 256
sequences of 16 prompt tokens x 128 new tokens, greedy, EOS ignored, on the CPU. A decode
step's wall time is taken inside `LLMEngine.step` (the median over the steps where all 256
sequences decode); the compute is the time spent inside those same steps' device work
(forward pass, logits, sampling: on a CPU it runs as it is called).
Host milliseconds per step = step - compute. The two modes run in one process,
alternating, best round of each.

    .venv/bin/python benchmarks/host_overhead.py
    .venv/bin/python benchmarks/host_overhead.py --rounds 5 --seqs 128
"""

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import LLM, SamplingParams  # noqa: E402
from engine.hardware import detect_cpu  # noqa: E402

PROMPT_TOKENS = 16
VOCAB = 512


def build_model(folder: Path) -> Path:
    """The random 1-layer llama and a byte-level BPE tokenizer of VOCAB tokens."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(3000)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([" ".join(words[i : i + 50]) for i in range(0, len(words), 50)] * 5, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@dataclass
class Round:
    """Medians over a generation's full decode steps: the step, and the device work inside it."""

    step_ms: float
    compute_ms: float
    tokens: list[list[int]]

    @property
    def host_ms(self) -> float:
        return self.step_ms - self.compute_ms


class StepTimer:
    """Times each `LLMEngine.step` and, inside it, the device work: the forward pass
    (`Worker.execute_model`), the logits (`Worker.logits`) and the sampling
    (`Sampler.sample`). On a CPU that work runs as it is called, so the time inside those
    calls is the step's compute, measured in the step it belongs to: host = step - compute
    cannot come out negative, as a compute time taken apart from the steps (at another
    moment, on a machine whose load changed) could."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.llm_engine
        runner = self.engine.model_runner
        self.targets = [(self.engine, "step", self._step), (runner.workers.local, "execute_model", self._compute),
                        (runner.workers.local, "logits", self._compute), (runner.sampler, "sample", self._compute),
                        (runner, "launch_forward", self._launch)]
        self.steps: list[tuple[float, float, bool]] = []  # (step s, compute s, launched a full decode step)
        self._compute_s = 0.0
        self._full_decode = False
        self.num_seqs = 0

    def _step(self, step):
        def timed():
            self._compute_s, self._full_decode = 0.0, False
            start = time.perf_counter()
            finished = step()
            self.steps.append((time.perf_counter() - start, self._compute_s, self._full_decode))
            return finished
        return timed

    def _compute(self, work):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = work(*args, **kwargs)
            self._compute_s += time.perf_counter() - start
            return result
        return timed

    def _launch(self, launch_forward):
        def recorded(batch):
            launched = launch_forward(batch)
            inputs = launched.inputs
            self._full_decode = inputs.attention.is_decode and inputs.num_tokens == self.num_seqs
            return launched
        return recorded

    def __enter__(self) -> "StepTimer":
        for owner, name, wrap in self.targets:
            setattr(owner, name, wrap(getattr(owner, name)))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, _ in self.targets:
            delattr(owner, name)


def measure(llm: LLM, prompts: list[dict], params: SamplingParams, num_seqs: int) -> Round:
    """One generation: the median full decode step (the steps that launch all `num_seqs`
    sequences' decode, less the first and last two) and the median compute inside them."""
    with StepTimer(llm) as timer:
        timer.num_seqs = num_seqs
        outputs = llm.generate(prompts, params, use_tqdm=False)
    full = [(step, compute) for step, compute, full in timer.steps if full][2:-2]
    step_ms = statistics.median(step for step, _ in full) * 1e3
    compute_ms = statistics.median(compute for _, compute in full) * 1e3
    if compute_ms > step_ms:
        sys.exit(f"the compute measured ({compute_ms:.2f} ms) exceeds the step ({step_ms:.2f} ms): not reported")
    return Round(step_ms, compute_ms, [o.outputs[0].token_ids for o in outputs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="PyTorch threads (default: all cores)")
    args = parser.parse_args()
    print(f"CPU: {detect_cpu().describe()}; {torch.get_num_threads()} threads")
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(3, VOCAB) for _ in range(PROMPT_TOKENS)]} for _ in range(args.seqs)]
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp))
        llms = {mode: LLM(str(folder), device="cpu", max_num_seqs=args.seqs, async_scheduling=mode, num_threads=args.threads)
                for mode in (False, True)}
        for llm in llms.values():
            llm.generate(prompts[:8], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        best: dict[bool, Round] = {}
        for index in range(args.rounds):
            for mode in ((False, True) if index % 2 == 0 else (True, False)):
                result = measure(llms[mode], prompts, params, args.seqs)
                if mode not in best or result.host_ms < best[mode].host_ms:
                    best[mode] = result
        for llm in llms.values():
            llm.close()
    same = best[False].tokens == best[True].tokens
    print(f"{args.seqs} sequences x {args.new_tokens} new tokens, best of {args.rounds} rounds "
          f"(outputs identical in both modes: {same})")
    print(f"{'mode':<24}{'step ms':>10}{'compute ms':>12}{'host ms':>10}{'host us/seq':>13}")
    for mode, label in ((False, "synchronous"), (True, "asynchronous scheduling")):
        r = best[mode]
        print(f"{label:<24}{r.step_ms:>10.2f}{r.compute_ms:>12.2f}{r.host_ms:>10.2f}"
              f"{r.host_ms * 1e3 / args.seqs:>13.1f}")
    if not same:
        sys.exit("outputs differ between the modes")


if __name__ == "__main__":
    main()
