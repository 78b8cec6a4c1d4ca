"""Tool calls out of a completion's text, in the format the model's chat template taught it: Hermes
`<tool_call>{json}</tool_call>` (Qwen2.5, Qwen3, Hermes, SmolLM3), Mistral `[TOOL_CALLS][...]`, or
Llama 3.1's bare JSON object. A block that does not parse stays in the content, never dropped."""

from __future__ import annotations

import json
import re
import secrets

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def tool_format(chat_template: str | None) -> str | None:
    """'hermes', 'mistral', 'llama3' or None (the template does not render tools)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|eot_id|>" in t and "parameters" in t and "tools" in t:
        return "llama3"
    return None


def _call(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
    }


def parse_tool_calls(text: str, fmt: str | None) -> tuple[str | None, list[dict]]:
    """(content without the calls, or None when nothing else is left; the calls)."""
    calls: list[dict] = []
    if fmt == "hermes":

        def take(m: re.Match) -> str:
            try:
                call = _call(json.loads(m.group(1)))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return m.group(0)
            calls.append(call)
            return ""

        text = _HERMES.sub(take, text)
    elif fmt in ("mistral", "llama3"):
        head, marker, tail = text.partition("[TOOL_CALLS]") if fmt == "mistral" else ("", "", text)
        body = tail.strip().removeprefix("<|python_tag|>")
        try:
            parsed = json.loads(body) if body.startswith(("[", "{")) else None
        except json.JSONDecodeError:
            parsed = None
        found = [_call(o) for o in (parsed if isinstance(parsed, list) else [parsed])] if parsed else []
        if found and all(found):
            calls, text = found, head
    content = text.strip()
    return (content or None) if calls else text, calls
