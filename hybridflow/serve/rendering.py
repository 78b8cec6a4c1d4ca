"""Chat messages to prompt token ids with the model's own chat template (tools included), as
`apply_chat_template` renders them; OpenAI's shapes adapted where templates expect others."""

from __future__ import annotations

import json

import jinja2

from hybridflow.errors import UserError


def _text(content, i: int) -> str:
    """OpenAI content: a string, or a list of parts of which only text is served."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise UserError(f"messages[{i}].content: only text parts are served, not {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise UserError(f"messages[{i}].content must be a string or a list of text parts")


def _message(message: dict, i: int) -> dict:
    out = dict(message)
    out["content"] = _text(message.get("content"), i)
    calls = []
    given = message.get("tool_calls") or []
    if not isinstance(given, list):
        raise UserError(f"messages[{i}].tool_calls must be a list of tool calls")
    for j, call in enumerate(given):  # templates read arguments as a mapping
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise UserError(f"{where} must be an object with a `function` object")
        function = dict(call["function"])
        if not isinstance(function.get("name"), str):
            raise UserError(f"{where}.function.name must be a string")
        if not isinstance(function.get("arguments", {}), (str, dict)):
            raise UserError(f"{where}.function.arguments must be a JSON string or an object")
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                raise UserError(f"{where}.function.arguments are not JSON") from None
        calls.append({**call, "function": function, **function})
    if calls:
        out["tool_calls"] = calls
    return out


def render_chat(tokenizer, body) -> list[int]:
    if tokenizer.chat_template is None:
        raise UserError("this model's tokenizer has no chat template; use /v1/completions")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=body.tools if body.tool_choice != "none" else None,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=False,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as e:  # the template is a program of the model's: whatever it raises is the request's
        kind = "" if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: "
        raise UserError(f"the chat template refused the messages: {kind}{e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]
