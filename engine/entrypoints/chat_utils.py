"""Conversations: checking chat messages and rendering them to an engine prompt with the
model's chat template (what `LLM.chat` and the Dagster prompts share)."""

from collections.abc import Collection
from typing import Any


# OpenAI's image content parts, as vLLM's chat accepts them ("image" is transformers' own form);
# each holds its image under its type's key: a URL dict or string for "image_url" (data: and
# file:// URIs, local paths), a PIL image for "image_pil", any of those for "image".
IMAGE_PARTS = ("image_url", "image_pil", "image")
# Audio content parts, each holding its clip under its type's key: OpenAI's "input_audio"
# ({"data": base64, "format": one of INPUT_AUDIO_FORMATS}), vLLM's "audio_url" (a URL dict or
# string: data: and file:// URIs, local paths) and transformers' "audio" (any form `read_audio` takes).
AUDIO_PARTS = ("input_audio", "audio_url", "audio")
INPUT_AUDIO_FORMATS = ("wav", "mp3")
# Video content parts: vLLM's "video_url" (a URL dict or string: data: and file:// URIs, local
# paths) and transformers' "video" (any form `read_video` takes: a file, frames).
VIDEO_PARTS = ("video_url", "video")
# The content parts of each modality, under the name chat templates read ({"type": "audio"})
# and `multi_modal_data` keys.
MEDIA_PARTS = {"image": IMAGE_PARTS, "audio": AUDIO_PARTS, "video": VIDEO_PARTS}
# How a conversation gets a model that reads a modality its model does not.
READERS = {"image": "load a vision-language model",
           "audio": "load an audio-language model",
           "video": "load Qwen2-VL or Qwen2.5-VL, or pass frames sampled from it as images"}


def chat_messages_problem(messages: object) -> str | None:
    """Why `messages` is not a conversation a chat template can render (a list of
    {"role": str, "content": str or a list of text, image and audio parts} with valid
    Unicode), or None. Images and audio are decoded later, with the row's other checks.

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


def unread_parts_problem(messages: list[dict[str, Any]], reads: Collection[str]) -> str | None:
    """Why a model that reads only the modalities `reads` (none: text only) cannot take the
    conversation (it holds an image or audio part of another), or None."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message["content"] if isinstance(message["content"], list) else []):
            modality = _modality(part["type"])
            if modality is not None and modality not in reads:
                what = "an image" if modality == "image" else modality
                model = "text only" if modality == "image" and not reads else f"no {modality}"
                return (f"message {i}: content part {j} is {what} ({part['type']!r}), but the model reads {model}: "
                        f"drop the {modality}, or {READERS[modality]}")
    return None


def text_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every content as a string (text parts joined by newlines),
    for templates that render strings; other keys are kept. Assumes `chat_messages_problem`
    found nothing."""
    return [{**m, "content": _joined(m["content"])} if isinstance(m["content"], list) else m for m in messages]


def chat_items(messages: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The conversation's images, audio clips and videos in order, per modality that it holds, as
    `multi_modal_data` takes them: as given (a URL, path, bytes, PIL image, (waveform, rate), frames),
    an input_audio part as a base64 data: URI."""
    items: dict[str, list[Any]] = {}
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else []:
            if (modality := _modality(part["type"])) is not None:
                items.setdefault(modality, []).append(_part_item(part))
    return items


def chat_images(messages: list[dict[str, Any]]) -> list[Any]:
    """The conversation's images in order, as given (a URL, path, bytes or PIL image)."""
    return chat_items(messages).get("image", [])


def multimodal_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as a multimodal chat template reads it: content lists of
    {"type": "text", "text": ...}, {"type": "image"}, {"type": "audio"} and {"type": "video"} parts (the
    template writes the model's placeholder for each)."""
    def part(p: dict[str, Any]) -> dict[str, Any]:
        modality = _modality(p["type"])
        return p if modality is None else {"type": modality}

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
    with image or audio parts the template writes each item's placeholder, and the prompt
    carries the items as given ({"multi_modal_data": {"image": [...], "audio": [...]}}, decoded
    when the row is checked); with `tools` it carries them too ({"tools": [...]}), for the tool parser to
    read the calls by (qwen3_coder converts each parameter by its schema), and a
    `tool_choice` mode other than "auto" ({"tool_choice": "none"}, "required", "function"),
    under which the engine's tool parser leaves the calls to the entry point
    (`RequestTools`).

    The text is tokenized without adding special tokens, because the template already
    holds any BOS token: a second one would change the output. Assumes
    `chat_messages_problem(messages)` found nothing.
    """
    items = chat_items(messages)
    messages = [_with_both_reasoning_keys(m) for m in messages]
    rendered = multimodal_messages(messages) if items else text_messages(messages)
    text = tokenizer.apply_chat_template(rendered, tokenize=False, chat_template=chat_template,
                                         tools=tools, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    prompt = {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}
    if items:
        prompt["multi_modal_data"] = items
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
    """Why message `index`'s content parts are not text, image and audio parts, each with
    its value, or None."""
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if _modality(kind) is not None:
            if (problem := _media_part_problem(part, kind)) is not None:
                return f"message {index}: content part {j} ({kind!r}) {problem}"
        elif kind != "text" or not isinstance(part.get("text"), str):
            return (f"message {index}: content part {j} is {kind!r}: content parts are text "
                    "({'type': 'text', 'text': str}), images ('image_url', 'image_pil', 'image'), audio "
                    "('input_audio', 'audio_url', 'audio') or videos ('video_url', 'video')")
    return None


def _media_part_problem(part: dict[str, Any], kind: str) -> str | None:
    """Why an image or audio part holds no item, as "has no ...: give ...", or None."""
    value = part.get(kind)  # each part's key is its type
    if kind == "input_audio":
        if not (isinstance(value, dict) and isinstance(value.get("data"), str)
                and value.get("format") in INPUT_AUDIO_FORMATS):
            return ("has no audio: give {'type': 'input_audio', 'input_audio': {'data': <base64>, 'format': "
                    f"{' or '.join(map(repr, INPUT_AUDIO_FORMATS))}}}")
        return None
    if value is None or (isinstance(value, dict) and not isinstance(value.get("url"), str)):
        noun = _modality(kind)
        url = " with {'url': 'data:...' or 'file://...'}" if kind.endswith("_url") else ""
        return f"has no {noun}: give {{'type': {kind!r}, {kind!r}: ...}}{url}"
    return None


def _modality(kind: object) -> str | None:
    """The modality of a content part's type ("image", "audio", "video"), None for text and others."""
    return next((modality for modality, parts in MEDIA_PARTS.items() if kind in parts), None)


def _part_item(part: dict[str, Any]) -> Any:
    """An image or audio part's item as `multi_modal_data` takes it."""
    value = part[part["type"]]
    if part["type"] == "input_audio":
        return f"data:audio/{value['format']};base64,{value['data']}"
    return value["url"] if isinstance(value, dict) else value


def _joined(parts: list[dict[str, Any]]) -> str:
    return "\n".join(part["text"] for part in parts if part["type"] == "text")
