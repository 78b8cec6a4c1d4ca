"""SFT examples: token ids with a loss mask — the assistant turns of chat messages, or the response
of a prompt/response row (rendered with the tokenizer's chat template, as the RL prompts are)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hybridflow.config.schema import Config
from hybridflow.data.files import read_rows
from hybridflow.data.prompts import check_prompt, render_prompt
from hybridflow.errors import UserError

log = logging.getLogger(__name__)


@dataclass
class Example:
    token_ids: list[int]
    loss_mask: list[int]  # 1 where the token is a target (predicted from the tokens before it)


def field_at(row: dict, key: str, where: str) -> Any:
    """row[key], a dotted key reaching into nested fields (extra_info.solution)."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            keys = ", ".join(sorted(row)) or "none"
            raise UserError(f"{where} has no '{key}' (keys: {keys}); name the column in the recipe")
        value = value[part]
    return value


def messages_example(messages: list[dict], tokenizer, where: str) -> Example:
    """Every assistant turn is a target: its span is what the template adds from the generation
    prompt before it to the end of the turn (the end-of-turn token included)."""
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the messages have no assistant turn to learn from")
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=True)
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True)
        before, through = list(_ids(before)), list(_ids(through))
        if through[: len(before)] != before or before[: len(ids)] != ids:
            raise UserError(
                f"{where}: the chat template does not render turns as prefixes of the conversation"
            )
        mask += [0] * (len(before) - len(ids)) + [1] * (len(through) - len(before))
        ids = through
    return Example(ids, mask)


def _ids(rendered) -> list[int]:
    """apply_chat_template's ids (a list, or a BatchEncoding in newer transformers)."""
    return rendered["input_ids"] if hasattr(rendered, "keys") else rendered


def prompt_response_example(
    prompt, response: str, tokenizer, *, chat: bool, system_prompt, where: str
) -> Example:
    """The prompt as the RL trainer renders it, then the response and an end-of-sequence token."""
    if not isinstance(response, str) or not response:
        raise UserError(f"{where}: the response must be a non-empty string")
    text = render_prompt(prompt, tokenizer, chat=chat, system_prompt=system_prompt)
    prompt_ids = tokenizer(text, add_special_tokens=not chat)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids))


def text_example(text: Any, tokenizer, where: str) -> Example:
    """A plain-text row (TRL's language-modeling format): every token after the first is a target."""
    if not isinstance(text, str) or not text:
        raise UserError(f"{where}: 'text' must be a non-empty string")
    ids = tokenizer(text, add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
    return Example(ids, [0] + [1] * (len(ids) - 1))


def row_format(row: dict, s) -> tuple[str, str]:
    """How a row is read: ("messages", key), ("text", "text") or ("prompt", response key). With
    sft.* left at its defaults, TRL's dataset formats are recognised by their columns: `messages`
    (conversational), `prompt` + `completion` (prompt-completion) and `text` (language modeling)."""
    if s.messages_key:
        return "messages", s.messages_key
    if (s.prompt_key, s.response_key) != ("prompt", "response"):
        return "prompt", s.response_key
    if "prompt" not in row and "messages" in row:
        return "messages", "messages"
    if "prompt" not in row and "text" in row:
        return "text", "text"
    if "response" not in row and "completion" in row:
        return "prompt", "completion"
    return "prompt", "response"


def load_examples(files: list[str], tokenizer, config: Config) -> list[Example]:
    s, d = config.sft, config.data
    if not files:
        raise UserError("no data files given (set data.train_files)")
    examples, dropped = [], 0
    for path in files:
        for i, row in enumerate(read_rows(path)):
            where = f"{path}: row {i}"
            kind, key = row_format(row, s)
            if kind == "messages":
                messages = check_prompt(field_at(row, key, where), where, key)
                if isinstance(messages, str):
                    raise UserError(f"{where}: '{key}' must be chat messages, got a string")
                example = messages_example(messages, tokenizer, where)
            elif kind == "text":
                example = text_example(row["text"], tokenizer, where)
            else:
                prompt = check_prompt(field_at(row, s.prompt_key, where), where, s.prompt_key)
                example = prompt_response_example(
                    prompt, field_at(row, key, where), tokenizer,
                    chat=d.apply_chat_template, system_prompt=d.system_prompt, where=where,
                )  # fmt: skip
            if len(example.token_ids) > s.max_tokens:
                dropped += 1
                continue
            examples.append(example)
    if dropped:
        log.warning("dropped %d examples longer than sft.max_tokens=%d", dropped, s.max_tokens)
    if not examples:
        raise UserError(
            f"{', '.join(files)}: no examples left ({dropped} over sft.max_tokens={s.max_tokens})"
        )
    return examples
