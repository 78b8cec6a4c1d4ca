"""Turn dataset rows (verl schema or plain question/answer rows) into tokenized Prompts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridflow.batch import Prompt
from hybridflow.config.schema import DataConfig
from hybridflow.data.files import read_rows
from hybridflow.errors import UserError

log = logging.getLogger(__name__)


def _check_unicode(text: str, where: str, key: str) -> None:
    # JSON can spell a lone surrogate ("\ud800"); no tokenizer can encode it
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"{where}: '{key}' is not valid Unicode text ({e.reason} at character {e.start})"
        ) from None


def check_prompt(value: Any, where: str, key: str) -> list[dict[str, str]] | str:
    """Validate a prompt cell: a non-empty string or a list of {role, content} messages."""
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{where}: '{key}' is an empty string")
        _check_unicode(value, where, key)
        return value
    if hasattr(value, "tolist"):  # numpy arrays from parquet object columns
        value = value.tolist()
    if (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    ):
        for m in value:
            _check_unicode(m["content"], where, key)
        return [{"role": m["role"], "content": m["content"]} for m in value]
    raise UserError(
        f"{where}: '{key}' must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
    )


MAX_NESTING = 100


def _depth(value: Any, limit: int = MAX_NESTING + 1) -> int:
    """How deeply lists and dicts nest in `value`, counted up to `limit` (iteratively: a value
    nested 100,000 deep must not overflow the stack here either)."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth >= limit:
            return depth
        if isinstance(item, dict):
            stack += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, (list, tuple)):
            stack += [(v, depth + 1) for v in item]
    return deepest


def _checked_content(row: dict, config: DataConfig, where: str, truth_sources: frozenset[str]):
    """The row's prompt, checked; a UserError naming the row and the reason otherwise."""
    if config.prompt_key not in row:
        keys = ", ".join(sorted(row)) or "none"
        raise UserError(f"{where} has no '{config.prompt_key}' key (keys: {keys}); set data.prompt_key")
    content = check_prompt(row[config.prompt_key], where, config.prompt_key)
    for key, value in row.items():
        if _depth(value) > MAX_NESTING:  # it could not be sent to a reward worker (pickle recursion)
            raise UserError(f"{where}: '{key}' is nested more than {MAX_NESTING} levels deep")
    source = str(row.get("data_source") or config.data_source or "unknown")
    if source in truth_sources and _ground_truth(row, config.answer_key) is None:
        raise UserError(
            f"{where}: no ground truth (reward_model.ground_truth, or the column data.answer_key names); the "
            "built-in scorers need one"
        )
    return content


def warn_bad_rows(source, bad: list[str], rows: int) -> None:
    if bad:
        shown = "; ".join(bad[:20]) + (f"; ... and {len(bad) - 20} more" if len(bad) > 20 else "")
        log.warning("%s: skipped %d bad rows of %d (data.on_bad_row=skip): %s", source, len(bad), rows, shown)


def _ground_truth(row: dict, answer_key: str | None) -> Any:
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    if answer_key is not None:
        return row.get(answer_key)
    return None


def render_prompt(
    prompt: list[dict[str, str]] | str,
    tokenizer,
    *,
    chat: bool,
    system_prompt: str | None,
    template_kwargs: dict | None = None,
) -> str:
    """The text the model sees: the tokenizer's own chat template, or the raw string."""
    if not chat:
        if isinstance(prompt, str):
            return prompt
        return "\n".join(m["content"] for m in prompt)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    if tokenizer.chat_template is None:
        raise UserError("the tokenizer has no chat template; set data.apply_chat_template=false")
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )


def rows_to_prompts(
    rows: Sequence[dict],
    tokenizer,
    config: DataConfig,
    *,
    source: str = "dataset",
    index_offset: int = 0,
    truth_sources: frozenset[str] = frozenset(),
    bad_rows: list[str] | None = None,
) -> list[Prompt]:
    """Validate, render and tokenize rows; overlong prompts are filtered (logged) or rejected. A
    malformed row stops with its number and reason, or with data.on_bad_row=skip is recorded in
    `bad_rows` (and logged) and dropped. A row of a data source in `truth_sources` (those the
    built-in scorers grade) without a ground truth is malformed."""
    prompts, overlong, bad = [], 0, [] if bad_rows is None else bad_rows
    for i, row in enumerate(rows):
        where = f"{source}: row {i}"
        try:
            content = _checked_content(row, config, where, truth_sources)
        except UserError as e:
            if config.on_bad_row == "error":
                raise
            bad.append(f"row {i}: {str(e).removeprefix(where).lstrip(': ')}")  # the reason alone
            continue
        text = render_prompt(
            content,
            tokenizer,
            chat=config.apply_chat_template,
            system_prompt=config.system_prompt,
            template_kwargs=config.chat_template_kwargs,
        )
        ids = tokenizer(text, add_special_tokens=not config.apply_chat_template)["input_ids"]
        if len(ids) > config.max_prompt_tokens:
            if config.overlong_prompts == "error":
                raise UserError(
                    f"{where}: prompt has {len(ids)} tokens > data.max_prompt_tokens={config.max_prompt_tokens}"
                )
            if config.overlong_prompts == "filter":
                overlong += 1
                continue
            keep = config.max_prompt_tokens  # verl's truncation: the model sees the cut tokens
            ids = ids[-keep:] if config.overlong_prompts == "truncate_left" else ids[:keep]
            text = tokenizer.decode(ids)
        extra = row.get("extra_info")
        prompts.append(
            Prompt(
                index=index_offset + i,
                token_ids=ids,
                data_source=str(row.get("data_source") or config.data_source or "unknown"),
                ground_truth=_ground_truth(row, config.answer_key),
                extra_info=dict(extra) if isinstance(extra, dict) else {},
                text=text,
                messages=content,
            )
        )
    warn_overlong(source, overlong, len(rows), config.max_prompt_tokens)
    if bad_rows is None:
        warn_bad_rows(source, bad, len(rows))
    if not prompts:
        skipped = f", {len(bad)} bad" if bad else ""
        raise UserError(
            f"{source}: no prompts left ({len(rows)} rows, {overlong} over max_prompt_tokens{skipped})"
        )
    return prompts


def warn_overlong(source, overlong: int, rows: int, max_prompt_tokens: int) -> None:
    if overlong:
        log.warning("%s: filtered %d of %d prompts longer than data.max_prompt_tokens=%d",
                    source, overlong, rows, max_prompt_tokens)  # fmt: skip


def load_prompts(
    files: Sequence[str],
    tokenizer,
    config: DataConfig,
    *,
    cache_root: Path | None = None,
    truth_sources: frozenset[str] = frozenset(),
) -> list[Prompt]:
    """Prompts from several files, in file order; Prompt.index counts rows across all files. With
    `cache_root`, each file is tokenized once and read from CACHE/prompts after (data/packed.py).
    Malformed rows stop the load or, with data.on_bad_row=skip, are reported and dropped."""
    if not files:
        raise UserError(
            "no data files given: set data.train_files, data.task (arithmetic, countdown), or start from a "
            "recipe that names data (e.g. hybridflow train demo_arithmetic_grpo KEY=VALUE ...)"
        )
    prompts: list[Prompt] = []
    offset = 0
    for f in files:
        if cache_root is not None:
            from hybridflow.data.packed import PackedDataset

            packed = PackedDataset.load(f, tokenizer, config, cache_root, truth_sources=truth_sources)
            prompts += packed.prompts(index_offset=offset)
            offset += packed.rows
            continue
        rows, bad = read_file_rows(f, config)
        unreadable = len(bad)  # lines that never became rows
        prompts += rows_to_prompts(rows, tokenizer, config, source=str(f), index_offset=offset,
                                   truth_sources=truth_sources, bad_rows=bad)  # fmt: skip
        warn_bad_rows(f, bad, len(rows) + unreadable)
        offset += len(rows)
    return prompts


def read_file_rows(path, config: DataConfig) -> tuple[list[dict], list[str]]:
    """A file's rows, and (with data.on_bad_row=skip) the lines that could not be read as rows."""
    bad: list[str] = []
    return read_rows(path, bad_lines=bad if config.on_bad_row == "skip" else None), bad
