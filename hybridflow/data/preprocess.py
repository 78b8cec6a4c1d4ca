"""Turn a local copy of GSM8K or MATH (the public parquet/jsonl files) into the native (verl) schema.

The instruction texts are verl's, so scores compare across frameworks.
"""

from __future__ import annotations

import re
from pathlib import Path

from hybridflow.data.files import read_rows, write_rows
from hybridflow.errors import UserError
from hybridflow.rewards.latex import last_boxed

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def _require(row: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise UserError(
            f"{where} has no {', '.join(repr(k) for k in missing)} key (keys: {', '.join(sorted(row))})"
        )


def gsm8k_row(row: dict, index: int, split: str, where: str) -> dict:
    _require(row, ("question", "answer"), where)
    match = _GSM8K_ANSWER.search(row["answer"])
    if match is None:
        raise UserError(f"{where}: answer has no '#### <number>' line")
    solution = match.group(1).replace(",", "")
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": row["question"] + " " + GSM8K_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": solution},
        "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
    }


def math_row(row: dict, index: int, split: str, where: str) -> dict:
    _require(row, ("problem", "solution"), where)
    answer = last_boxed(row["solution"])
    if answer is None:
        raise UserError(f"{where}: solution has no \\boxed{{}} answer")
    return {
        "data_source": "DigitalLearningGmbH/MATH-lighteval",
        "prompt": [{"role": "user", "content": row["problem"] + " " + MATH_INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "level": row.get("level"), "type": row.get("type")},
    }


CONVERTERS = {"gsm8k": gsm8k_row, "math": math_row}


def preprocess(dataset: str, input_path: str, out_path: str, *, split: str = "train") -> Path:
    """Convert one file; `out_path` ends in .parquet or .jsonl."""
    if dataset not in CONVERTERS:
        raise UserError(f"unknown dataset {dataset!r}; choose one of {', '.join(CONVERTERS)}")
    if Path(out_path).exists():
        raise UserError(f"output {out_path} exists; remove it or choose another path")
    convert = CONVERTERS[dataset]
    rows = read_rows(input_path)
    out = [convert(r, i, split, f"{input_path}: row {i}") for i, r in enumerate(rows)]
    if not out:
        raise UserError(f"{input_path} has no rows")
    return write_rows(out, out_path)
