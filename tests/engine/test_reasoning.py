"""Reasoning sections: the phase a prompt starts in, the closing marker found as tokens
arrive (by id, or by text across tokens), the split of a finished completion, the parser a
tokenizer implies, and on tiny Qwen3- and DeepSeek-R1-style models with their own chat
templates: a JSON schema that holds on the answer while the reasoning stays free text."""

import json
import logging

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.output_processor.detokenizer import IncrementalDetokenizer
from engine.reasoning import Phase, ReasoningSplit, detect_reasoning_parser, reasoning_parser
from engine.structured_output.manager import grammar_bitmask
from tests.reasoning_models import build_reasoning_model

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["spam", "ham"]},
                                           "sure": {"type": "boolean"}},
          "required": ["label", "sure"], "additionalProperties": False}
QUESTION = [{"role": "user", "content": "Is this spam? Win a free cruise now!"}]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    return build_reasoning_model(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def r1_folder(tmp_path_factory):
    return build_reasoning_model(tmp_path_factory.mktemp("r1"), "deepseek_r1")


@pytest.fixture(scope="module")
def split_markers_folder(tmp_path_factory):
    return build_reasoning_model(tmp_path_factory.mktemp("split"), "qwen3", markers_as_tokens=False)


def prompt_ids(tokenizer, **template_kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return tokenizer(text, add_special_tokens=False).input_ids


# -- the parser on its own ----------------------------------------------------------------


def test_the_prompt_decides_the_first_phase(qwen3_folder, r1_folder):
    qwen = AutoTokenizer.from_pretrained(qwen3_folder)
    parser = reasoning_parser("qwen3", qwen)
    assert parser.initial_phase(prompt_ids(qwen)) is Phase.UNDECIDED  # the model opens <think> itself
    assert parser.initial_phase(prompt_ids(qwen, enable_thinking=False)) is Phase.ANSWER
    r1 = AutoTokenizer.from_pretrained(r1_folder)
    assert reasoning_parser("deepseek_r1", r1).initial_phase(prompt_ids(r1)) is Phase.REASONING
    # R1's distills may reason without opening a section: its parser assumes one is open.
    assert reasoning_parser("deepseek_r1", qwen).initial_phase(prompt_ids(qwen)) is Phase.REASONING


def feed(parser, tokenizer, prompt: list[int], output_text: str) -> tuple[object, list[int], str]:
    """Runs a tracker over the tokens of `output_text` as the engine does; returns it, the
    ids and the grown text."""
    tracker = parser.tracker(prompt)
    ids = tokenizer(output_text, add_special_tokens=False).input_ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    for count, token in enumerate(ids, start=1):
        if tracker.needs_text:
            detokenizer.add_token(token)
        tracker.advance(token, count, detokenizer.text)
    detokenizer.catch_up(ids)
    return tracker, ids, detokenizer.text


@pytest.mark.parametrize("folder_name", ["qwen3_folder", "split_markers_folder"])
def test_reasoning_and_answer_split_by_id_and_by_text(folder_name, request):
    tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue(folder_name))
    parser = reasoning_parser("qwen3", tokenizer)
    assert parser.matches_text is (folder_name == "split_markers_folder")
    output = "<think>\nThe cruise is free: spam.\n</think>\n\n{\"label\": \"spam\"}"
    tracker, ids, text = feed(parser, tokenizer, prompt_ids(tokenizer), output)
    assert tracker.phase is Phase.ANSWER
    if parser.matches_text:
        assert len(tokenizer("</think>", add_special_tokens=False).input_ids) > 1  # the marker spans tokens
    split = parser.split(tracker, text, ids)
    assert (split.reasoning, split.text, split.ended) == ("The cruise is free: spam.", '{"label": "spam"}', True)
    assert tokenizer.decode(ids[: split.num_reasoning_tokens]).endswith("</think>")
    assert tokenizer.decode(ids[split.num_reasoning_tokens :]).lstrip() == '{"label": "spam"}'


def test_a_completion_without_a_section_is_all_answer_and_one_never_closed_all_reasoning(qwen3_folder):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    qwen = reasoning_parser("qwen3", tokenizer)
    tracker, ids, text = feed(qwen, tokenizer, prompt_ids(tokenizer), "Plain answer.")
    assert qwen.split(tracker, text, ids) == ReasoningSplit(None, "Plain answer.", 0, None)
    tracker, ids, text = feed(qwen, tokenizer, prompt_ids(tokenizer), "<think>\nStill thinking about")
    assert qwen.split(tracker, text, ids) == ReasoningSplit("Still thinking about", "", len(ids), False)
    r1 = reasoning_parser("deepseek_r1", tokenizer)  # opened by the template: only the closing tag comes
    tracker, ids, text = feed(r1, tokenizer, prompt_ids(tokenizer), "Free cruise.\n</think>\n\nspam")
    split = r1.split(tracker, text, ids)
    assert (split.reasoning, split.text) == ("Free cruise.", "spam")


def test_the_grammar_waits_for_the_answer(qwen3_folder):
    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    parser = reasoning_parser("qwen3", tokenizer)
    grammar = type("Grammar", (), {"also_allowed": None})()
    undecided = parser.tracker(prompt_ids(tokenizer))
    assert undecided.first_grammar(grammar) is grammar and grammar.also_allowed == parser.start_id
    assert undecided.advance(parser.start_id, 1, "") is True  # <think>: the model reasons
    assert undecided.next_grammar(grammar) is None and grammar.also_allowed is None
    assert undecided.advance(5, 2, "") is True and undecided.next_grammar(None) is None
    assert undecided.advance(parser.end_ids[0], 3, "") is True and undecided.next_grammar(None) is grammar
    assert undecided.advance(6, 4, "") is False and undecided.end_index == 3
    answering = parser.tracker(prompt_ids(tokenizer))
    answering.first_grammar(grammar)
    assert answering.advance(7, 1, "") is False  # the answer's first token: the grammar's
    assert answering.next_grammar(grammar) is grammar and grammar.also_allowed is None


@pytest.mark.parametrize("token", [5, 31, 63, 319])
def test_the_opening_marker_joins_the_grammar_bitmask(token):
    class Backend:
        def allocate_bitmask(self, rows):
            return torch.zeros(rows, 10, dtype=torch.int32)

        def fill_bitmask(self, grammars, bitmask, rows):
            bitmask[rows, 0] = 1  # token 0 only

    grammar = type("Grammar", (), {"backend": Backend(), "also_allowed": token})()
    mask = grammar_bitmask([None, grammar], torch.device("cpu"))
    bits = mask.bitmask[1].numpy().view("uint32")
    allowed = [w * 32 + b for w in range(10) for b in range(32) if bits[w] >> b & 1]
    assert allowed == sorted({0, token})
    assert not mask.bitmask[0].any()


def test_the_tokenizer_implies_the_parser(qwen3_folder, r1_folder, split_markers_folder, tiny_models):
    assert detect_reasoning_parser(AutoTokenizer.from_pretrained(qwen3_folder))[0] == "qwen3"
    assert detect_reasoning_parser(AutoTokenizer.from_pretrained(r1_folder))[0] == "deepseek_r1"
    assert detect_reasoning_parser(AutoTokenizer.from_pretrained(split_markers_folder)) is None  # no marker tokens
    assert detect_reasoning_parser(AutoTokenizer.from_pretrained(tiny_models["qwen3"])) is None
    known = r"\[.deepseek_r1., .deepseek_v3., .deepseek_v31., .kimi_k2., .mistral., .openai_gptoss., .qwen3.\]"
    with pytest.raises(ValueError, match=r"reasoning_parser=.nope. is not one of " + known):
        reasoning_parser("nope", AutoTokenizer.from_pretrained(qwen3_folder))


def test_an_unknown_parser_setting_fails_before_the_model_loads():
    with pytest.raises(ValueError, match="reasoning_parser must be 'auto', None or one of"):
        LLM("nowhere", reasoning_parser="qwen")


# -- on a model --------------------------------------------------------------------------


def thinking_params(tokenizer, seed: int, schema: bool = True) -> SamplingParams:
    """Seeded sampling that favours opening a section and closing it after some tokens:
    the random model's stand-in for a reasoning model's habits."""
    think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=128, logit_bias={think: 3.0, end: 2.5},
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
                          if schema else None)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_thinking_on_and_a_json_schema(qwen3_folder, async_scheduling, caplog):
    with caplog.at_level(logging.INFO, logger="engine.output_processor.processor"):
        llm = LLM(qwen3_folder, dtype="float32", async_scheduling=async_scheduling)
    assert "reasoning_parser='qwen3'" in caplog.text
    with llm:
        tokenizer = llm.get_tokenizer()
        params = [thinking_params(tokenizer, seed) for seed in range(12)]
        outputs = [out.outputs[0] for out in llm.chat([QUESTION] * 12, params, use_tqdm=False)]
        end_id = tokenizer.convert_tokens_to_ids("</think>")
        answered = [o for o in outputs if o.finish_reason == "stop" and o.reasoning_ended]
        assert len(answered) >= 4, [(o.finish_reason, o.reasoning_ended) for o in outputs]
        for out in answered:
            assert out.reasoning  # free text, made of any tokens: the grammar waited
            assert out.token_ids[out.num_reasoning_tokens - 1] == end_id
            assert out.token_ids.count(end_id) == 1  # the grammar forbids it in the answer
            jsonschema.validate(json.loads(out.text), SCHEMA)
        for out in outputs:  # EOS or max_tokens inside the reasoning: no answer, flagged
            assert out.reasoning_ended or out.text == ""
        off = llm.chat([QUESTION] * 4, [thinking_params(tokenizer, seed) for seed in range(4)], use_tqdm=False,
                       chat_template_kwargs={"enable_thinking": False})
        for out in (o.outputs[0] for o in off):
            assert out.reasoning is None and out.reasoning_ended is None and out.num_reasoning_tokens == 0
            jsonschema.validate(json.loads(out.text), SCHEMA)


def test_scheduling_modes_give_the_same_split(qwen3_folder):
    results = []
    for async_scheduling in (False, True):
        with LLM(qwen3_folder, dtype="float32", async_scheduling=async_scheduling) as llm:
            params = [thinking_params(llm.get_tokenizer(), seed) for seed in range(6)]
            results.append([(o.outputs[0].reasoning, o.outputs[0].text, o.outputs[0].token_ids)
                            for o in llm.chat([QUESTION] * 6, params, use_tqdm=False)])
    assert results[0] == results[1]


def test_r1_opens_the_section_in_the_prompt_and_truncated_reasoning_is_flagged(r1_folder):
    with LLM(r1_folder, dtype="float32") as llm:
        tokenizer = llm.get_tokenizer()
        think, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
        closing = SamplingParams(temperature=1.0, seed=3, max_tokens=64, logit_bias={end: 4.0},
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
        never = SamplingParams(temperature=0, max_tokens=8, logit_bias={end: -100.0})
        out_closing, out_never = (o.outputs[0] for o in llm.chat([QUESTION, QUESTION], [closing, never],
                                                                 use_tqdm=False))
    assert out_closing.reasoning_ended and think not in out_closing.token_ids[:1]
    jsonschema.validate(json.loads(out_closing.text), SCHEMA)
    assert (out_never.reasoning_ended, out_never.text, out_never.num_reasoning_tokens) == (False, "", 8)
    assert out_never.reasoning == tokenizer.decode(out_never.token_ids).strip()


def test_reasoning_parser_none_leaves_the_text_whole(qwen3_folder):
    with LLM(qwen3_folder, dtype="float32", reasoning_parser=None) as llm:
        params = thinking_params(llm.get_tokenizer(), seed=0, schema=False)
        out = llm.chat(QUESTION, params, use_tqdm=False)[0].outputs[0]
    assert out.reasoning is None and "</think>" in out.text


# -- tool calls through the engine ---------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_call_after_the_reasoning_is_parsed_into_tool_calls(qwen3_folder):
    """The template lists the tool; a regex stands in for a model that calls it (after
    thinking, with reasoning on); the engine's hermes parser, implied by the tokenizer,
    returns the call in OpenAI's shape and keeps the text before it."""
    call = r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'
    broken = r'<tool_call>\n\{"name": "get_weather", "arguments": \[\]\}\n</tool_call>'
    with LLM(qwen3_folder, dtype="float32") as llm:
        think, end = llm.get_tokenizer().convert_tokens_to_ids(["<think>", "</think>"])
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=200, logit_bias={think: 3.0, end: 2.5},
                                 structured_outputs=StructuredOutputsParams(regex=regex))
                  for seed, regex in enumerate([call, call, broken])]
        prompt = llm.get_tokenizer().apply_chat_template(QUESTION, tools=[WEATHER_TOOL], tokenize=False,
                                                        add_generation_prompt=True)
        assert '"name": "get_weather"' in prompt
        outputs = [o.outputs[0] for o in llm.chat([QUESTION] * 3, params, tools=[WEATHER_TOOL], use_tqdm=False)]
    for out in outputs[:2]:
        if out.reasoning_ended is False:
            continue  # the reasoning ran out of tokens: nothing to parse
        assert out.tool_call_error is None and out.text == "Checking."
        [tool_call] = out.tool_calls
        assert (tool_call.type, tool_call.function.name) == ("function", "get_weather")
        assert json.loads(tool_call.function.arguments)["city"] in ("Paris", "Oslo")
        assert tool_call.id.startswith("call_")
    assert any(out.tool_calls for out in outputs[:2])
    broken_out = outputs[2]
    if broken_out.reasoning_ended is not False and broken_out.finish_reason == "stop":
        # a row error, not an exception: the named call is kept with its arguments as written
        [kept] = broken_out.tool_calls
        assert (kept.function.name, kept.function.arguments) == ("get_weather", "[]")
        assert "arguments are not a JSON object" in broken_out.tool_call_error
    elif broken_out.reasoning_ended is not False:  # cut before its JSON closed: the text kept
        assert broken_out.tool_calls is None and broken_out.text.startswith("<tool_call>")
        assert "not valid JSON" in broken_out.tool_call_error


# -- gpt-oss's harmony channels ------------------------------------------------------------

HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def harmony_tokenizer(tmp_path_factory, tiny_models):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    tokenizer.add_special_tokens({"additional_special_tokens": HARMONY_SPECIALS})
    tokenizer.chat_template = ("{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
                               "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
                               "{# the final answer is <|channel|>final<|message|>... #}")
    return tokenizer


FINAL = "<|channel|>final<|message|>"


COMMENTARY = "<|channel|>commentary"
CALL_ARGUMENTS = '<|message|>{"city": "Paris"}<|call|>'


def test_a_parser_forced_on_another_familys_tokenizer_blames_the_tokenizer(tiny_models):
    """openai_gptoss matches harmony's markers by their special tokens: on a tokenizer without
    them (at load, before the weights) the error says which of them the model's tokenizer
    lacks and what to do, not that the format is ill-defined. The `<think>` and `[THINK]`
    formats and every tool-call parser read their markers as text on such a tokenizer (a
    model may write them so) and never refuse it."""
    from engine.tool_parsers import TOOL_CALL_PARSERS, ToolCallResult, tool_parser

    plain = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    fix = ("(it is not a gpt-oss tokenizer): use a gpt-oss model with its own tokenizer, or another reasoning_parser "
           "that fits this model ('auto' picks it from the tokenizer), or None")
    with pytest.raises(ValueError) as error:
        LLM(str(tiny_models["qwen3"]), reasoning_parser="openai_gptoss")
    assert str(error.value) == ("reasoning_parser='openai_gptoss' reads gpt-oss's harmony output, and this model's "
                                "tokenizer lacks harmony's special tokens <|start|>, <|end|>, <|channel|>, "
                                f"<|message|> {fix}")
    half = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    half.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|message|>"]})
    with pytest.raises(ValueError, match=r"lacks harmony's special tokens <\|start\|>, <\|end\|> \(it is not"):
        reasoning_parser("openai_gptoss", half)
    for name in ("qwen3", "deepseek_r1", "mistral"):
        assert reasoning_parser(name, plain).matches_text, name
    ids = plain("It is sunny.", add_special_tokens=False).input_ids
    for name in TOOL_CALL_PARSERS:
        assert tool_parser(name, plain).parse("It is sunny.", ids) == ToolCallResult("It is sunny.", None, None), name


@pytest.mark.parametrize("output, answer_head", [
    ("<|channel|>analysis<|message|>Needs the weather.<|end|><|start|>assistant" + COMMENTARY
     + " to=functions.get_weather <|constrain|>json" + CALL_ARGUMENTS, COMMENTARY + " to=functions.get_weather"),
    ("<|channel|>analysis<|message|>Needs the weather.<|end|><|start|>assistant to=functions.get_weather"
     + COMMENTARY + " json" + CALL_ARGUMENTS, " to=functions.get_weather" + COMMENTARY),
])
def test_harmony_tool_calls_end_the_analysis_on_the_commentary_channel(harmony_tokenizer, output, answer_head):
    """A call goes on the commentary channel, the recipient in the channel's header or in the
    role's: the analysis ends there, the answer holds the call's message from its recipient on
    (in its tokens, from `answer_start`), and the `openai` tool parser, which the tokenizer
    implies, reads the call from them."""
    from engine.tool_parsers import detect_tool_parser, tool_parser

    parser = reasoning_parser("openai_gptoss", harmony_tokenizer)
    tracker, ids, text = feed(parser, harmony_tokenizer, prompt_ids(harmony_tokenizer), output)
    split = parser.split(tracker, text, ids)
    assert (split.reasoning, split.ended, split.num_reasoning_tokens) == (
        "Needs the weather.", True, len(harmony_tokenizer(output.partition(COMMENTARY)[0] + COMMENTARY).input_ids))
    answer_ids = ids[split.answer_start:]
    assert harmony_tokenizer.decode(answer_ids, skip_special_tokens=False).startswith(answer_head)
    assert detect_tool_parser(harmony_tokenizer) == "openai"
    result = tool_parser("openai", harmony_tokenizer).parse(split.text, answer_ids)
    assert result.error is None and result.content == ""
    [call] = result.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("output, reasoning, answer", [
    ("<|channel|>analysis<|message|>The user wants a label.<|end|><|start|>assistant" + FINAL + "spam<|return|>",
     "The user wants a label.", "spam"),
    (FINAL + "ham<|return|>", "", "ham"),
    ("<|channel|>analysis<|message|>Still weighing it", "Still weighing it", None),
    # Two analysis messages: their texts joined by a line break (as vLLM joins them), no header between.
    ("<|channel|>analysis<|message|>First thought.<|end|><|start|>assistant<|channel|>analysis<|message|>Second."
     "<|end|><|start|>assistant" + FINAL + "spam<|return|>", "First thought.\nSecond.", "spam"),
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two", "One.\nTwo",
     None),
])
def test_harmony_channels_split_by_their_special_tokens(harmony_tokenizer, output, reasoning, answer):
    """The markers hold special tokens that a decoded text leaves out: they are matched as id
    sequences, and the analysis message's end and the next header are in neither part."""
    assert detect_reasoning_parser(harmony_tokenizer)[0] == "openai_gptoss"
    parser = reasoning_parser("openai_gptoss", harmony_tokenizer)
    channel, message = harmony_tokenizer.convert_tokens_to_ids(["<|channel|>", "<|message|>"])
    assert not parser.matches_text and (parser.end_ids[0], parser.header_end_ids) == (channel, (message,))
    prompt = prompt_ids(harmony_tokenizer)
    assert parser.initial_phase(prompt) is Phase.REASONING  # the model always opens with a channel
    tracker, ids, text = feed(parser, harmony_tokenizer, prompt, output)
    split = parser.split(tracker, text, ids)
    if answer is None:
        assert split == ReasoningSplit(reasoning, "", len(ids), False)
    else:
        head = output.partition(FINAL)[0] + FINAL
        assert split == ReasoningSplit(reasoning, answer, len(harmony_tokenizer(head).input_ids), True)


# -- what ends a section besides its closing marker, and where it starts ------------------

QWEN3_THINKING_PROMPT = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\n"
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("prompt, output", [
    (QWEN3_THINKING_PROMPT, "The user wants the weather.\n\n" + HERMES_CALL),  # Qwen3.5, Qwen3-Thinking-2507
    (QWEN3_THINKING_PROMPT.removesuffix("<think>\n"), "<think>\nThe user wants the weather.\n" + HERMES_CALL),
])
def test_a_qwen3_call_without_closing_the_thinking_ends_it(prompt, output):
    """Qwen3-family models may go from their thinking straight into `<tool_call>`: the
    call ends the reasoning (as vLLM's qwen3 parser does), the answer starts at it, and the
    hermes parser reads the call (it used to stay inside the reasoning, never parsed)."""
    from tests.parser_conformance import observed, run

    got = observed(run(output, "qwen3", reasoning="qwen3", tools="hermes", prompt=prompt))
    assert {name: got[name] for name in ("reasoning", "content", "tool_calls", "reasoning_ended", "error")} == {
        "reasoning": "The user wants the weather.", "content": None,
                   "tool_calls": [("get_weather", {"city": "Paris"})], "reasoning_ended": True, "error": None}


def test_the_grammar_is_released_after_a_call_that_ends_the_thinking(qwen3_folder):
    """The grammar waits through the thinking and applies from the token after `<tool_call>`
    (as vLLM's, which never sees the token that ends the reasoning); the split's answer
    starts at `<tool_call>`."""
    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    parser = reasoning_parser("qwen3", tokenizer)
    grammar = type("Grammar", (), {"also_allowed": None})()
    prompt = prompt_ids(tokenizer)
    tracker = parser.tracker(prompt)
    applied = tracker.first_grammar(grammar)
    assert applied is grammar  # undecided: the grammar, <think> also allowed
    ids = tokenizer("<think>Needs a call." + HERMES_CALL, add_special_tokens=False).input_ids
    call_at = ids.index(tokenizer.convert_tokens_to_ids("<tool_call>"))
    for count, token in enumerate(ids[: call_at + 2], start=1):
        reasons = tracker.advance(token, count, "")
        applied = tracker.next_grammar(applied)  # as the engine does after each token
        assert reasons is (count <= call_at + 1)  # <think> ... <tool_call>: no grammar sees them
        assert applied is (grammar if count > call_at else None)
    split = parser.split(tracker, tokenizer.decode(ids), ids)
    assert (split.reasoning, split.text, split.ended) == ("Needs a call.", HERMES_CALL, True)


@pytest.mark.parametrize("family, prompt", [("deepseek_r1", ""), ("qwen3", "<|im_start|>assistant\n")])
def test_an_output_that_starts_with_whitespace_before_think(family, prompt):
    """DeepSeek-R1's template opens the section; a model that writes `<think>` again after
    a line break keeps it out of the reasoning (it used to stay in). Where the model opens
    the section (Qwen3's hybrid template), a line break first decides nothing."""
    from tests.parser_conformance import run

    parsed = run("\n<think>This is a reasoning section</think>\nThis is the rest", family, reasoning=family,
                 prompt=prompt)
    assert (parsed.reasoning, parsed.text, parsed.reasoning_ended) == (
        "This is a reasoning section", "This is the rest", True)


def test_the_answer_loses_its_leading_line_breaks_not_its_indentation():
    from tests.parser_conformance import run

    parsed = run("<think>Indent it.</think>\n\n    return x\n", "qwen3", reasoning="qwen3")
    assert (parsed.reasoning, parsed.text) == ("Indent it.", "    return x\n")


@pytest.mark.parametrize("header", [" <|constrain|>json", "<|constrain|>json", " json", "<|constrain|>ReplyAction "])
def test_a_harmony_final_header_with_a_constraint_ends_the_analysis(harmony_tokenizer, header):
    """A final-channel header may hold a constraint or a content type between the channel's
    name and `<|message|>` (gpt-oss writes `<|channel|>final <|constrain|>json<|message|>`
    for a JSON answer): the analysis ends there and the answer is the message (it used to
    stay in the reasoning, with `text` empty)."""
    parser = reasoning_parser("openai_gptoss", harmony_tokenizer)
    output = ("<|channel|>analysis<|message|>A JSON label is wanted.<|end|><|start|>assistant<|channel|>final"
              + header + '<|message|>{"label": "spam"}<|return|>')
    tracker, ids, text = feed(parser, harmony_tokenizer, prompt_ids(harmony_tokenizer), output)
    split = parser.split(tracker, text, ids)
    assert (split.reasoning, split.text, split.ended) == ("A JSON label is wanted.", '{"label": "spam"}', True)
    assert split.num_reasoning_tokens == len(harmony_tokenizer(output.partition("<|message|>{")[0] + "<|message|>",
                                                               add_special_tokens=False).input_ids)


# -- Kimi K2 and DeepSeek-V3.1: found by their markers, switched by their templates --------

KIMI_TEMPLATE = ("{% for m in messages %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
                 "{% if thinking is defined and not thinking %}<think></think>{% endif %}{% endif %}"
                 "{# an assistant's calls: <|tool_calls_section_begin|>...<|tool_calls_section_end|> #}")
V31_TEMPLATE = ("{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}{% if add_generation_prompt %}"
                "<｜Assistant｜>{% if thinking is defined and thinking %}<think>{% else %}</think>{% endif %}"
                "{% endif %}{# an assistant's calls: <｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜> #}")
R1_TEMPLATE = ("{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
               "{# content.split('</think>'), calls: <｜tool▁calls▁begin｜> #}")


def _tokenizer_with(tiny_models, special: list[str], template: str):
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["qwen3"])
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("special, template, name, on, off", [
    (["<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"], KIMI_TEMPLATE, "kimi_k2",
     Phase.REASONING, Phase.ANSWER),  # Kimi thinks from its first token unless the switch closed the section
    (["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"], V31_TEMPLATE, "deepseek_v31", Phase.REASONING, Phase.ANSWER),
    (["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"], R1_TEMPLATE, "deepseek_r1", Phase.REASONING, Phase.REASONING),
])
def test_kimi_and_deepseek_v31_are_found_and_their_switch_read_from_the_prompt(tiny_models, special, template, name,
                                                                               on, off):
    """Kimi K2's tokenizer (its call-section markers and `<think>`) implies kimi_k2, and
    DeepSeek's (its call markers, `<think>`, a template with a `thinking` switch) deepseek_v31;
    R1's template, without the switch, still implies deepseek_r1. The switch is read from the
    prompt's end, as vLLM's parsers read the request's `thinking`."""
    tokenizer = _tokenizer_with(tiny_models, special, template)
    assert detect_reasoning_parser(tokenizer)[0] == name
    parser = reasoning_parser(name, tokenizer)
    assert parser.initial_phase(prompt_ids(tokenizer, thinking=True)) is on
    assert parser.initial_phase(prompt_ids(tokenizer, thinking=False)) is off


def test_vllms_deepseek_v3_name_is_deepseek_v31(tiny_models):
    tokenizer = _tokenizer_with(tiny_models, ["<｜tool▁calls▁begin｜>"], V31_TEMPLATE)
    assert reasoning_parser("deepseek_v3", tokenizer).name == "deepseek_v31"


def test_a_kimi_template_without_thinking_implies_no_reasoning(tiny_models):
    """Kimi K2 Instruct's vocabulary may hold `<think>`, but a template that never writes it is
    not a thinking model's: no parser (a section that opens itself would take the answers)."""
    template = KIMI_TEMPLATE.replace("<think></think>", "")
    tokenizer = _tokenizer_with(tiny_models, ["<|im_end|>", "<|tool_calls_section_begin|>"], template)
    assert detect_reasoning_parser(tokenizer) is None


@pytest.mark.parametrize("grammar, want", [
    (None, ("Thinking late.", "Before\n\nAfter", True)),
    (type("Grammar", (), {"also_allowed": None})(), (None, "Before\nThinking late.\nAfter", None)),
])
def test_a_section_opened_after_some_answer_comes_out_unless_a_grammar_held_the_answer(grammar, want):
    """A Magistral model that writes a line before `[THINK]` has its section taken out of the
    answer, which keeps the text on both sides (as vLLM's mistral parser does); under a
    grammar the answer is the grammar's from its first token, and stays whole."""
    from tests.parser_conformance import family_tokenizer

    tokenizer = family_tokenizer("mistral")
    parser = reasoning_parser("mistral", tokenizer)
    tracker = parser.tracker([])
    tracker.first_grammar(grammar)
    ids = tokenizer("Before\n[THINK]Thinking late.[/THINK]\nAfter", add_special_tokens=False).input_ids
    for count, token in enumerate(ids, start=1):
        tracker.advance(token, count, "")
    split = parser.split(tracker, tokenizer.decode(ids, skip_special_tokens=True), ids)
    assert (split.reasoning, split.text, split.ended) == want


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_reasoning_fed_back_under_either_name_reaches_the_template(qwen3_folder, key):
    """vLLM's current responses (and our run_batch) write `reasoning`; Qwen3's template reads
    `reasoning_content`: a conversation fed back with either keeps its reasoning."""
    from engine.entrypoints.chat_utils import render_chat

    tokenizer = AutoTokenizer.from_pretrained(qwen3_folder)
    messages = [*QUESTION, {"role": "assistant", "content": "spam", key: "A free cruise is bait."}]
    prompt = render_chat(tokenizer, messages, add_generation_prompt=False)["prompt"]
    assert "<think>\nA free cruise is bait.\n</think>\n\nspam" in prompt
