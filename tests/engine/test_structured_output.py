"""Structured outputs: the constraint API, the token mask against a brute-force oracle,
and constrained generation on random and real models (mixed batches, n > 1, seeds,
preemption, prefix caching, LoRA)."""

import json
import os
import re

import jsonschema
import pydantic
import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from engine.structured_output.manager import StructuredOutputManager, grammar_bitmask
from tests.lora_adapters import build_lora_adapter

# -- the parameters ------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({}, "got none"),
    ({"regex": "a+", "choice": ["a"]}, "got regex, choice"),
    ({"json": "{not json"}, "json: is not valid JSON"),
    ({"json": 5}, "a JSON schema is an object, got int"),
    ({"choice": []}, "choice: must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice: must be a non-empty list"),
    ({"regex": ""}, "regex: must be a non-empty string"),
    ({"json_object": "yes"}, "json_object: must be True"),
])
def test_params_take_exactly_one_valid_constraint(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


def test_a_pydantic_model_is_its_schema_with_the_fields_in_declared_order():
    class Ticket(pydantic.BaseModel):
        urgency: int
        category: str

    params = StructuredOutputsParams(json=Ticket)
    assert params.kind == "json"
    assert list(json.loads(params.spec)["properties"]) == ["urgency", "category"]
    assert StructuredOutputsParams(json=json.dumps(Ticket.model_json_schema())).spec == params.spec


def test_sampling_params_refuse_a_constraint_of_the_wrong_type():
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})


# -- the mask against an oracle --------------------------------------------------------------


def allowed_by_oracle(tokenizer, vocab: int, stop_ids: set[int], viable, complete: bool) -> set[int]:
    """The tokens a grammar allows next, found by brute force over the vocabulary: a
    normal token when the text so far plus its text is still a prefix of the language
    (`viable`), a stop token when the text so far is a whole sentence (`complete`)."""
    special = set(tokenizer.all_special_ids)
    allowed = set()
    for token in range(vocab):
        if token in special or token >= len(tokenizer):
            if token in stop_ids and complete:
                allowed.add(token)
            continue
        text = tokenizer.decode([token])
        if text and "\ufffd" not in text and viable(text):
            allowed.add(token)
    return allowed


def allowed_by_mask(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    bits = (bitmask[row].unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab].nonzero().flatten().tolist())


CHOICES = ["apple pie", "apricot", "banana split", "ban"]


def choice_viable(prefix: str):
    return lambda text: any(c.startswith(prefix + text) for c in CHOICES)


def code_viable(prefix: str):
    """Prefixes of the regex [0-9]{3}-[A-Z]{2}."""
    pattern = "ddd-AA"
    classes = {"d": str.isdigit, "-": lambda c: c == "-", "A": lambda c: c.isascii() and c.isupper()}

    def viable(text: str) -> bool:
        whole = prefix + text
        return len(whole) <= len(pattern) and all(classes[p](c) for p, c in zip(pattern, whole))
    return viable


@pytest.mark.parametrize("params, prefix, viable, complete", [
    (StructuredOutputsParams(choice=CHOICES), "", choice_viable(""), False),
    (StructuredOutputsParams(choice=CHOICES), "ap", choice_viable("ap"), False),
    (StructuredOutputsParams(choice=CHOICES), "ban", choice_viable("ban"), True),
    (StructuredOutputsParams(choice=CHOICES), "apricot", choice_viable("apricot"), True),
    (StructuredOutputsParams(regex=r"[0-9]{3}-[A-Z]{2}"), "", code_viable(""), False),
    (StructuredOutputsParams(regex=r"[0-9]{3}-[A-Z]{2}"), "12", code_viable("12"), False),
    (StructuredOutputsParams(regex=r"[0-9]{3}-[A-Z]{2}"), "123-AB", code_viable("123-AB"), True),
], ids=["choice-start", "choice-ap", "choice-ban", "choice-done", "regex-start", "regex-12", "regex-done"])
def test_the_mask_allows_exactly_what_the_grammar_allows(tiny_models, params, prefix, viable, complete):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    vocab, stop_ids = 320, {tokenizer.eos_token_id}
    manager = StructuredOutputManager(tokenizer, vocab, sorted(stop_ids))
    grammar = manager.grammar(params)
    for char in prefix:  # one character at a time: every character is a token of this vocabulary
        assert grammar.accept(tokenizer.convert_tokens_to_ids(tokenizer.tokenize(char))[0])
    step = grammar_bitmask([None, grammar, None])
    expected = allowed_by_oracle(tokenizer, vocab, stop_ids, viable, complete)
    assert expected, "a state with nothing allowed tests nothing"
    assert allowed_by_mask(step.bitmask, 1, vocab) == expected
    logits = torch.randn(3, vocab)
    masked = logits.clone()
    step.apply(masked)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]]), "unconstrained rows are untouched"
    forbidden = sorted(set(range(vocab)) - expected)
    assert torch.isinf(masked[1, forbidden]).all() and torch.equal(masked[1, sorted(expected)], logits[1, sorted(expected)])


def test_each_constraint_compiles_once(tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["llama"])
    manager = StructuredOutputManager(tokenizer, 320, [tokenizer.eos_token_id])
    calls = []
    compile_ = manager.backend._compile
    manager.backend._compile = lambda *key: calls.append(key) or compile_(*key)
    for _ in range(3):
        assert manager.problem(StructuredOutputsParams(json={"type": "integer"})) is None
        assert "Unsupported type" in manager.problem(StructuredOutputsParams(json={"type": "wat"}))
    assert len(calls) == 2


# -- constrained generation on a random model ------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 20},
        "good": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["id"]},
    },
    "required": ["kind", "age", "good", "tags", "owner"],
}
SUM_EBNF = 'root ::= "(" [0-9] ("+" [0-9])* ")"'
SUM_LARK = 'start: "(" DIGIT ("+" DIGIT)* ")"\nDIGIT: /[0-9]/'


def constraint_checks() -> list[tuple[StructuredOutputsParams, "callable"]]:
    """Constraints whose sentences are short and a check of a finished output against each."""
    sum_expr = re.compile(r"\([0-9](\+[0-9])*\)")
    return [
        (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
         lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None),
        (StructuredOutputsParams(regex=r"[0-9]{3}-[A-Z]{2}"), lambda text: re.fullmatch(r"[0-9]{3}-[A-Z]{2}", text)),
        (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
        (StructuredOutputsParams(grammar=SUM_EBNF), lambda text: sum_expr.fullmatch(text)),
        (StructuredOutputsParams(grammar=SUM_LARK), lambda text: sum_expr.fullmatch(text)),
    ]


# A shared start of every prompt, several KV blocks long, for prefix-cache hits.
PREAMBLE = "Continuous batching schedules requests at the granularity of iterations. " * 3


def constrained_batch(seed_base: int = 0) -> tuple[list[str], list[SamplingParams], list]:
    """A batch that mixes every constraint, greedy and seeded (n = 2), with unconstrained rows."""
    prompts, params, checks = [], [], []
    for i, (constraint, check) in enumerate(constraint_checks()):
        for sampling in (dict(temperature=0), dict(temperature=1.0, seed=seed_base + i, n=2)):
            prompts.append(f"{PREAMBLE}Numbers: {i} {i + 1}")
            params.append(SamplingParams(max_tokens=96, structured_outputs=constraint, **sampling))
            checks.append(check)
        prompts.append(f"The quick brown fox {i}")
        params.append(SamplingParams(temperature=0, max_tokens=12))
        checks.append(None)
    return prompts, params, checks


def assert_outputs_match(outputs, checks) -> int:
    """Every constrained completion that stopped satisfies its check; returns how many stopped."""
    stopped = 0
    for output, check in zip(outputs, checks):
        for completion in output.outputs:
            if check is None:
                continue
            assert completion.finish_reason in ("stop", "length")
            if completion.finish_reason == "stop":
                stopped += 1
                assert check(completion.text), completion.text
    return stopped


@pytest.mark.parametrize("family", ["llama", "gemma3", "phi3", "mixtral"])
def test_a_random_model_only_writes_what_the_constraints_allow(tiny_models, family):
    """A random model wanders everywhere the grammar lets it: every finished output is
    valid, in a batch with unconstrained rows, and the unconstrained rows are what they
    would be alone."""
    prompts, params, checks = constrained_batch()
    with LLM(str(tiny_models[family]), dtype="float32") as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        alone = llm.generate(prompts[2], params[2], use_tqdm=False)[0]
    assert assert_outputs_match(outputs, checks) >= 12
    assert outputs[2].outputs[0].token_ids == alone.outputs[0].token_ids
    assert {o.outputs[0].text for o, c in zip(outputs, checks) if c} != {""}


def test_constrained_outputs_do_not_change_under_preemption_and_prefix_hits(tiny_models):
    """The grammar's state follows the tokens kept through a preemption by recompute; the
    same batch with a cache of a few blocks (preempting) and with prefix caching gives
    the same completions token for token."""
    prompts, params, checks = constrained_batch()
    runs = []
    for settings in ({"enable_prefix_caching": False}, {"kv_cache_memory": 10 * 16 * 1024, "max_num_batched_tokens": 64}):
        with LLM(str(tiny_models["llama"]), dtype="float32", **settings) as llm:
            runs.append(llm.generate(prompts + prompts, params + params, use_tqdm=False))
            if "kv_cache_memory" in settings:
                assert llm.llm_engine.scheduler.num_preemptions > 0
                assert llm.llm_engine.stats.num_cached_prompt_tokens > 0
    tokens = [[[c.token_ids for c in o.outputs] for o in run] for run in runs]
    assert tokens[0] == tokens[1]
    assert_outputs_match(runs[1], checks + checks)


def test_constraints_hold_with_lora_adapters(tiny_models, tmp_path):
    base = tiny_models["llama"]
    adapters = [LoRARequest(f"a{i}", i + 1, str(build_lora_adapter(base, tmp_path / f"a{i}", seed=i, rank=4, alpha=8,
                                                                    target_modules=["q_proj", "v_proj"])))
                for i in range(2)]
    prompts, params, checks = constrained_batch()
    requests = [adapters[i % 2] if i % 3 else None for i in range(len(prompts))]
    with LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8) as llm:
        outputs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        alone = llm.generate(prompts[0], params[0], lora_request=requests[0], use_tqdm=False)[0]
    assert assert_outputs_match(outputs, checks) >= 12
    assert outputs[0].outputs[0].token_ids == alone.outputs[0].token_ids


def test_seeded_constrained_rows_do_not_depend_on_the_batch(tiny_models):
    prompts, params, _ = constrained_batch()
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        batch = llm.generate(prompts, params, use_tqdm=False)
        for i in (1, 4):
            assert params[i].seed is not None
            alone = llm.generate(prompts[i], params[i], use_tqdm=False)[0]
            assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batch[i].outputs]


def test_an_output_cut_by_max_tokens_finishes_with_length(tiny_models):
    params = SamplingParams(temperature=0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        completion = llm.generate("Numbers: 1", params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(completion.text)


def test_bad_constraints_are_row_problems_found_before_any_work(tiny_models):
    good = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    with LLM(str(tiny_models["llama"]), dtype="float32") as llm:
        with pytest.raises(ValueError) as raised:
            llm.generate(["a", "b", "c", "d"], [
                good,
                SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")),
                SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "wat"})),
                SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["x"])),
            ], use_tqdm=False)
        assert llm.llm_engine.stats.num_steps == 0
    message = str(raised.value)
    assert "3 invalid prompt row(s); nothing was run" in message
    assert "row 1, structured_outputs: the regex constraint does not compile: Regex parsing error" in message
    assert 'row 2, structured_outputs: the json constraint does not compile: Unsupported type "wat"' in message
    assert "row 3, structured_outputs: min_tokens=2 clashes with it" in message


# -- the embedded model ----------------------------------------------------------------------

TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"enum": ["billing", "bug", "feature_request", "account", "other"]},
        "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 80},
        "products": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
        "customer": {"type": "object", "properties": {"plan": {"enum": ["free", "pro", "enterprise"]},
                                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
                     "required": ["plan", "score"]},
    },
    "required": ["category", "urgency", "summary", "products", "customer"],
}

TICKETS = [
    "My invoice was charged twice this month for the Pro plan.",
    "The mobile app crashes when I open the camera uploader.",
    "Please add dark mode to the desktop editor.",
    "I cannot log in to my account since the password reset.",
]


@pytest.mark.cpu_kinds
@pytest.mark.slow
def test_embedded_model_outputs_parse_and_validate():
    """On the real model: JSON schemas (nested objects, enums, arrays, bounded numbers),
    a regex and a choice, greedy and seeded, beside unconstrained rows. On a GPU this is
    the default path: bfloat16, Triton kernels, CUDA graphs. DAGSTER_LLM_TEST_MODEL names
    a model folder where the embedded model's package is not installed."""
    with LLM(os.environ.get("DAGSTER_LLM_TEST_MODEL")) as llm:
        tokenizer = llm.get_tokenizer()
        chat = [tokenizer.apply_chat_template(
            [{"role": "system", "content": "Triage the support ticket as JSON."}, {"role": "user", "content": t}],
            tokenize=False, add_generation_prompt=True) for t in TICKETS]
        constraints = [
            (StructuredOutputsParams(json=TICKET_SCHEMA, disable_any_whitespace=True),
             lambda text: jsonschema.validate(json.loads(text), TICKET_SCHEMA) is None),
            (StructuredOutputsParams(json=TICKET_SCHEMA), lambda text: jsonschema.validate(json.loads(text), TICKET_SCHEMA) is None),
            (StructuredOutputsParams(regex=r"(low|medium|high) priority, [1-5] of 5"),
             lambda text: re.fullmatch(r"(low|medium|high) priority, [1-5] of 5", text)),
            (StructuredOutputsParams(choice=["billing", "bug", "feature request", "account"]),
             lambda text: text in ["billing", "bug", "feature request", "account"]),
        ]
        prompts, params, checks = [], [], []
        for constraint, check in constraints:
            for sampling in (dict(temperature=0), dict(temperature=0.8, seed=11)):
                prompts += chat
                params += [SamplingParams(max_tokens=160, structured_outputs=constraint, **sampling)] * len(chat)
                checks += [check] * len(chat)
        prompts += chat
        params += [SamplingParams(temperature=0, max_tokens=24)] * len(chat)
        checks += [None] * len(chat)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert assert_outputs_match(outputs, checks) >= 24  # of 32 constrained; most stop before max_tokens
    assert not any(o.outputs[0].text.lstrip().startswith("{") for o in outputs[-len(chat):])
