"""Preference examples: DPO pairs (prompt, chosen, rejected) and KTO completions (prompt,
completion, desirable?). Prompts are rendered as the RL trainer renders them; each response ends
with the end-of-sequence token."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from hybridflow.config.schema import Config
from hybridflow.data.files import read_rows
from hybridflow.data.prompts import check_prompt, render_prompt
from hybridflow.errors import UserError
from hybridflow.offline.sft_data import field_at

log = logging.getLogger(__name__)


@dataclass
class Pair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    ref_chosen: float | None = None  # the reference's summed log-probs, when computed up front
    ref_rejected: float | None = None


@dataclass
class Completion:
    prompt: list[int]
    completion: list[int]
    desirable: bool


def _response(value: Any, where: str, key: str) -> str:
    """A response cell: a string, or messages whose last (assistant) turn is the response."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content")
    if not isinstance(value, str) or not value:
        raise UserError(f"{where}: '{key}' must be a non-empty string or messages ending in the response")
    return value


def _desirable(value: Any, where: str, key: str) -> bool:
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise UserError(f"{where}: '{key}' must be true/false (desirable or not), got {value!r}")


class _Tokenize:
    def __init__(self, tokenizer, config: Config) -> None:
        self.tokenizer, self.data = tokenizer, config.data

    def prompt(self, row: dict, key: str, where: str) -> list[int]:
        text = render_prompt(
            check_prompt(field_at(row, key, where), where, key), self.tokenizer,
            chat=self.data.apply_chat_template, system_prompt=self.data.system_prompt,
        )  # fmt: skip
        return self.tokenizer(text, add_special_tokens=not self.data.apply_chat_template)["input_ids"]

    def response(self, row: dict, key: str, where: str) -> list[int]:
        text = _response(field_at(row, key, where), where, key)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]


def _load(files: list[str], make, max_tokens: int, what: str) -> list:
    if not files:
        raise UserError("no data files given (set data.train_files)")
    out, dropped = [], 0
    for path in files:
        for i, row in enumerate(read_rows(path)):
            example, length = make(row, f"{path}: row {i}")
            if length > max_tokens:
                dropped += 1
                continue
            out.append(example)
    if dropped:
        log.warning("dropped %d %s longer than preference.max_tokens=%d", dropped, what, max_tokens)
    if not out:
        raise UserError(
            f"{', '.join(files)}: no {what} left ({dropped} over preference.max_tokens={max_tokens})"
        )
    return out


def implicit_prompt(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
    """(prompt, chosen, rejected) of a pair whose prompt is the start both responses share (TRL's
    implicit-prompt format): the longest common run of messages, or of characters for strings."""
    chosen, rejected = (v.tolist() if hasattr(v, "tolist") else v for v in (chosen, rejected))
    if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
        raise UserError(f"{where}: 'chosen' and 'rejected' must both be strings or both messages")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if isinstance(chosen, str) and shared and chosen[shared - 1] == " ":
        shared -= 1  # the space before the responses belongs to them (as TRL splits)
    if shared == 0:
        raise UserError(
            f"{where}: no 'prompt' column, and 'chosen' and 'rejected' share no start to take as one"
        )
    prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(prompt, list) and any(
        len(r) != 1 or r[0].get("role") != "assistant" for r in (chosen, rejected)
    ):
        raise UserError(
            f"{where}: after the shared turns, 'chosen' and 'rejected' must each be one assistant turn"
        )
    return prompt, chosen, rejected


def load_pairs(files: list[str], tokenizer, config: Config) -> list[Pair]:
    p, t = config.preference, _Tokenize(tokenizer, config)

    def make(row: dict, where: str):
        if (
            p.prompt_key not in row
            and p.prompt_key == "prompt"
            and p.chosen_key in row
            and p.rejected_key in row
        ):
            prompt, chosen, rejected = implicit_prompt(row[p.chosen_key], row[p.rejected_key], where)
            row = {p.prompt_key: prompt, p.chosen_key: chosen, p.rejected_key: rejected}
        pair = Pair(t.prompt(row, p.prompt_key, where), t.response(row, p.chosen_key, where),
                    t.response(row, p.rejected_key, where))  # fmt: skip
        return pair, len(pair.prompt) + max(len(pair.chosen), len(pair.rejected))

    return _load(files, make, p.max_tokens, "pairs")


def load_completions(files: list[str], tokenizer, config: Config) -> list[Completion]:
    p, t = config.preference, _Tokenize(tokenizer, config)

    def make(row: dict, where: str):
        item = Completion(t.prompt(row, p.prompt_key, where), t.response(row, p.completion_key, where),
                          _desirable(field_at(row, p.label_key, where), where, p.label_key))  # fmt: skip
        return item, len(item.prompt) + len(item.completion)

    items = _load(files, make, p.max_tokens, "completions")
    if len(items) > 1 and len({i.desirable for i in items}) < 2:
        log.warning("every KTO completion has the same label; KTO learns from both kinds")
    return items
