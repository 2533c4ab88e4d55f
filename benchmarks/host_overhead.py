"""Host work per decode step: what a step costs beyond its compute, with asynchronous
scheduling off and on.

The model is a 1-layer llama with hidden size 64 and a 512-token vocabulary (built here,
random weights), so that a step's compute is small and the engine's own work shows: 256
sequences of 16 prompt tokens x 128 new tokens, greedy, EOS ignored, on the CPU. A decode
step's wall time is taken inside `LLMEngine.step` (the median over the steps where all 256
sequences decode); the bare compute is the same step's forward pass, logits and argmax
with its inputs ready, timed alone. Host milliseconds per step = step - bare compute. The
two modes run in one process, alternating, best round of each.

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
from engine.worker.input_batch import StepInputs  # noqa: E402

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
    step_ms: float
    compute_ms: float
    tokens: list[list[int]]

    @property
    def host_ms(self) -> float:
        return self.step_ms - self.compute_ms


def measure(llm: LLM, prompts: list[dict], params: SamplingParams, num_seqs: int) -> Round:
    """One generation: the median decode step, and the bare compute of one such step."""
    engine = llm.llm_engine
    runner = engine.model_runner
    step_times: list[float] = []
    decode_inputs: list[StepInputs] = []
    step, launch = engine.step, runner.launch_forward

    def timed_step():
        start = time.perf_counter()
        finished = step()
        step_times.append(time.perf_counter() - start)
        return finished

    def recorded_launch(batch):
        launched = launch(batch)
        decode_inputs.append(launched.inputs)
        return launched

    engine.step, runner.launch_forward = timed_step, recorded_launch
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del engine.step, runner.launch_forward
    full = [i for i, inputs in enumerate(decode_inputs) if inputs.attention.is_decode and inputs.num_tokens == num_seqs]
    # The steps whose launched batch is a full decode step (async: the step that launches it).
    steps = [step_times[i] for i in full[2:-2]]
    return Round(statistics.median(steps) * 1e3, bare_compute(runner, decode_inputs[full[len(full) // 2]]),
                 [o.outputs[0].token_ids for o in outputs])


@torch.inference_mode()
def bare_compute(runner, inputs: StepInputs, repeats: int = 50) -> float:
    """Milliseconds of one decode step's forward pass, logits and argmax, inputs ready."""
    rows = torch.tensor(inputs.sample_rows)
    runner.kv_cache.backend.prepare(inputs.attention)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.attention)
        runner.model.compute_logits(hidden[rows]).argmax(dim=-1).tolist()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


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
