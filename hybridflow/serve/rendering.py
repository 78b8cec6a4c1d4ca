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
    for call in message.get("tool_calls") or []:  # templates read arguments as a mapping
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except json.JSONDecodeError:
                raise UserError(f"messages[{i}].tool_calls: arguments are not JSON") from None
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
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
        raise UserError(f"the chat template refused the messages: {e}") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]
