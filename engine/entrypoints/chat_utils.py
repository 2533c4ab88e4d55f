"""Conversations: checking chat messages and rendering them to an engine prompt with the
model's chat template (what `LLM.chat` and the Dagster prompts share)."""

from typing import Any


# OpenAI's image content parts and the key of each one's image, as vLLM's chat accepts them
# ("image" is transformers' own form): the value is a URL dict or string for "image_url"
# (data: and file:// URIs, local paths), a PIL image for "image_pil", any of those for "image".
IMAGE_PARTS = {"image_url": "image_url", "image_pil": "image_pil", "image": "image"}


def chat_messages_problem(messages: object) -> str | None:
    """Why `messages` is not a conversation a chat template can render (a list of
    {"role": str, "content": str or a list of text and image parts} with valid Unicode),
    or None. Images are decoded later, with the row's other checks.

    The problem does not name the field that holds the conversation (the caller does:
    "messages: ...", "prompt: ..."); a message's own problem starts with "message i: "."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        return f"expected a non-empty list of messages ({{'role', 'content'}} dicts), got {got}"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            return f"message {i}: expected a dict with 'role' and 'content', got {message!r:.80}"
        content = message["content"]
        if isinstance(content, list):
            if (problem := _text_parts_problem(content, i)) is not None:
                return problem
            content = _joined(content)
        for field, value in (("role", message["role"]), ("content", content)):
            if not isinstance(value, str):
                return (f"message {i}: {field} must be a string, got {type(value).__name__} "
                        f"({value!r:.40}): convert it upstream")
            if (problem := invalid_unicode_problem(value, f"message {i} {field}")) is not None:
                return problem
    return None


def text_only_problem(messages: list[dict[str, Any]]) -> str | None:
    """Why a text-only model cannot take the conversation (it holds an image part), or None."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message["content"] if isinstance(message["content"], list) else []):
            if part["type"] in IMAGE_PARTS:
                return (f"message {i}: content part {j} is an image ({part['type']!r}), but the model reads text "
                        "only: drop the image, or load a vision-language model")
    return None


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every content as a string (text parts joined by newlines),
    for templates that render strings; other keys are kept. Assumes `chat_messages_problem`
    found nothing."""
    return [{**m, "content": _joined(m["content"])} if isinstance(m["content"], list) else m for m in messages]


def chat_images(messages: list[dict[str, Any]]) -> list[Any]:
    """The conversation's images in order, as given (a URL, path, bytes or PIL image)."""
    images = []
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if part["type"] in IMAGE_PARTS:
                value = part[IMAGE_PARTS[part["type"]]]
                images.append(value["url"] if isinstance(value, dict) else value)
    return images


def multimodal_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as a vision-language chat template reads it: content lists of
    {"type": "text", "text": ...} and {"type": "image"} parts (the template writes the
    model's image placeholder for each)."""
    def part(p: dict[str, Any]) -> dict[str, Any]:
        return {"type": "image"} if p["type"] in IMAGE_PARTS else p

    return [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list) else m
            for m in messages]


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
    tool_choice: str = "auto",
) -> dict[str, Any]:
    """One conversation as an engine prompt, {"prompt": text, "prompt_token_ids": ids},
    rendered with the tokenizer's chat template (or `chat_template`) and vLLM's arguments;
    with image parts the template writes each image's placeholder, and the prompt carries
    the images as given ({"multi_modal_data": {"image": [...]}}, decoded when the row is
    checked); with `tools` it carries them too ({"tools": [...]}), for the tool parser to
    read the calls by (qwen3_coder converts each parameter by its schema), and a
    `tool_choice` mode other than "auto" ({"tool_choice": "none"}, "required", "function"),
    under which the engine's tool parser leaves the calls to the entry point
    (`RequestTools`).

    The text is tokenized without adding special tokens, because the template already
    holds any BOS token: a second one would change the output. Assumes
    `chat_messages_problem(messages)` found nothing.
    """
    images = chat_images(messages)
    messages = [_with_both_reasoning_keys(m) for m in messages]
    rendered = multimodal_messages(messages) if images else text_messages(messages)
    text = tokenizer.apply_chat_template(rendered, tokenize=False, chat_template=chat_template,
                                         tools=tools, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    prompt = {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    if tools:
        prompt["tools"] = tools
    if tool_choice != "auto":
        prompt["tool_choice"] = tool_choice
    return prompt


def _with_both_reasoning_keys(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message fed back with its reasoning under either name, under both:
    current vLLM and our run_batch write `reasoning`, while chat templates (Qwen3's,
    DeepSeek's) read `reasoning_content`, as older vLLM and OpenAI-compatible servers wrote it."""
    reasoning = message.get("reasoning", message.get("reasoning_content"))
    if message.get("role") != "assistant" or reasoning is None:
        return message
    return {**message, "reasoning": reasoning, "reasoning_content": message.get("reasoning_content", reasoning)}


def invalid_unicode_problem(prompt: object, field: str = "prompt") -> str | None:
    """Why the prompt's text (a str, or the "prompt" of a dict) cannot be encoded as UTF-8
    (a lone surrogate), as `<field>: ...`, or None."""
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"{field}: holds a lone surrogate {text[exc.start]!r} at character {exc.start}, which is not "
                "valid Unicode: fix the text's encoding upstream (e.g. decode the source bytes as UTF-8)")
    return None


def _text_parts_problem(parts: list, index: int) -> str | None:
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in IMAGE_PARTS:
            value = part.get(IMAGE_PARTS[kind])
            if value is None or (isinstance(value, dict) and not isinstance(value.get("url"), str)):
                return (f"message {index}: content part {j} ({kind!r}) has no image: give "
                        f"{{'type': {kind!r}, {IMAGE_PARTS[kind]!r}: ...}}"
                        + (" with {'url': 'data:...' or 'file://...'}" if kind == "image_url" else ""))
        elif kind != "text" or not isinstance(part.get("text"), str):
            return (f"message {index}: content part {j} is {kind!r}: content parts are text "
                    "({'type': 'text', 'text': str}) or images ('image_url', 'image_pil')")
    return None


def _joined(parts: list[dict[str, Any]]) -> str:
    return "\n".join(part["text"] for part in parts if part["type"] == "text")
