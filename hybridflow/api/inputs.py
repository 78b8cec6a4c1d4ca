"""Live Python objects -> what the config names: a transformers model (and tokenizer) becomes an HF
directory, a `datasets.Dataset` or a list of rows a jsonl file, all under the run's `inputs/`
folder; a TRL-style reward function becomes verl's batched signature."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hybridflow.api.trl_rewards import ROW_KEY
from hybridflow.errors import UserError

INPUTS = "inputs"
VERL_FIRST_PARAMETERS = ("data_source", "data_sources", "data_source_list")


def is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def is_verl_reward(fn: Callable) -> bool:
    """verl's compute_score(data_source, solution_str, ground_truth, extra_info) or its batched form."""
    params = list(inspect.signature(fn).parameters)
    return bool(params) and params[0] in VERL_FIRST_PARAMETERS


def dataset_rows(dataset: Any, name: str) -> list[dict]:
    """Rows of a `datasets.Dataset`, a list of dicts, or data files (path or list of paths)."""
    if is_path(dataset) or (isinstance(dataset, Sequence) and dataset and all(is_path(d) for d in dataset)):
        from hybridflow.data.files import read_rows

        files = [dataset] if is_path(dataset) else list(dataset)
        return [row for f in files for row in read_rows(str(f))]
    if hasattr(dataset, "to_list"):  # datasets.Dataset
        rows = dataset.to_list()
    elif isinstance(dataset, Sequence) and not isinstance(dataset, (str, bytes)):
        rows = list(dataset)
    else:
        raise UserError(
            f"{name}: expected a datasets.Dataset, a list of dicts or data file path(s), got {type(dataset).__name__}"
        )
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise UserError(f"{name}: row {i} is a {type(row).__name__}, not a dict of columns")
    if not rows:
        raise UserError(f"{name}: the dataset has no rows")
    return rows


def with_rows_kept(rows: list[dict]) -> list[dict]:
    """Each row carrying itself in extra_info["row"], for a TRL-style reward function (which takes
    every column)."""
    out = []
    for row in rows:
        extra = row.get("extra_info")
        out.append({**row, "extra_info": {**(extra if isinstance(extra, dict) else {}), ROW_KEY: row}})
    return out


def write_model(model: Any, tokenizer: Any, directory: Path) -> None:
    """A live transformers model (with its tokenizer) as an HF directory; or, for a model path with a
    live tokenizer, that directory's files linked beside the tokenizer's."""
    directory.mkdir(parents=True, exist_ok=True)
    if is_path(model):
        source = Path(model)
        if not source.is_dir():
            raise UserError(f"a live tokenizer needs the model as a directory or a live model, got {model}")
        for f in source.iterdir():
            if f.is_file() and not (directory / f.name).exists():
                (directory / f.name).symlink_to(f.resolve())
    else:
        if not hasattr(model, "save_pretrained"):
            raise UserError(
                f"actor_model: expected a transformers model or a path, got {type(model).__name__}"
            )
        model.save_pretrained(directory, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        target = directory / f
        if target.is_symlink():  # the tokenizer given here replaces the directory's own
            target.unlink()
    tokenizer.save_pretrained(directory)
