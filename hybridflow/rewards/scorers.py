"""Rule scorers for verifiable rewards, with verl's signature:
`compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict`.

Each built-in returns {'score': float, 'pred': extracted answer or None}; 'pred' feeds maj@N.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from hybridflow.rewards.latex import last_boxed

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")


def _clean_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def _numbers_equal(pred: str | None, truth: Any) -> bool:
    if pred is None:
        return False
    try:
        return Fraction(_clean_number(pred)) == Fraction(_clean_number(str(truth)))
    except (ValueError, ZeroDivisionError):
        return False


def gsm8k(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict:
    """verl-compatible GSM8K: the last 300 characters; strict '#### <number>' (commas and $ stripped)
    or flexible (the last number). Correct: `score`; a parsed but wrong answer: `format_score`; none: 0."""
    tail = solution_str[-300:]
    if method == "strict":
        matches = _GSM8K_STRICT.findall(tail)
        pred = _clean_number(matches[-1]) if matches else None
    else:
        matches = [m for m in _NUMBER.findall(tail) if m not in ("", ".")]
        pred = _clean_number(matches[-1]) if matches else None
    if pred is None:
        return {"score": 0.0, "pred": None}
    return {"score": score if _numbers_equal(pred, ground_truth) else format_score, "pred": pred}


def arithmetic(solution_str: str, ground_truth: str) -> dict:
    """The final answer is the number after the last '####', or else the last number in the response.
    Guard: an answer that lists several numbers earns nothing."""
    if "####" in solution_str:
        answer = solution_str.rsplit("####", 1)[1]
        numbers = _NUMBER.findall(answer)
        if len(numbers) != 1:
            return {"score": 0.0, "pred": None}
        pred = _clean_number(numbers[0])
    else:
        numbers = _NUMBER.findall(solution_str)
        pred = _clean_number(numbers[-1]) if numbers else None
    return {"score": float(_numbers_equal(pred, ground_truth)), "pred": pred}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _eval_expression(node: ast.AST, used: list[int]) -> Fraction:
    """Evaluate + - * / over integer literals exactly, recording each literal; anything else raises."""
    if isinstance(node, ast.Expression):
        return _eval_expression(node.body, used)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_expression(node.left, used), _eval_expression(node.right, used)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        used.append(node.value)
        return Fraction(node.value)
    raise ValueError("not an arithmetic expression")


def countdown(solution_str: str, ground_truth: dict, format_score: float = 0.1) -> dict:
    """The equation in the last <answer>...</answer> must use each given number exactly once and reach
    the target (parsed with `ast`, evaluated exactly, never `eval`). Well-formed but wrong: format_score."""
    answers = re.findall(r"<answer>(.*?)</answer>", solution_str, flags=re.DOTALL)
    if not answers:
        return {"score": 0.0, "pred": None}
    equation = answers[-1].strip().split("=")[0].strip()
    if len(equation) > 200:
        return {"score": 0.0, "pred": None}
    used: list[int] = []
    try:
        value = _eval_expression(ast.parse(equation, mode="eval"), used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return {"score": 0.0, "pred": equation}
    numbers = [int(n) for n in ground_truth["numbers"]]
    if sorted(used) != sorted(numbers):
        return {"score": format_score, "pred": equation}
    return {"score": 1.0 if value == int(ground_truth["target"]) else format_score, "pred": equation}


def _normalize_latex(answer: str) -> str:
    answer = answer.strip().replace(" ", "").replace("\\!", "").replace("\\left", "").replace("\\right", "")
    answer = answer.replace("dfrac", "frac").replace("tfrac", "frac").replace("^\\circ", "").replace("$", "")
    return answer.rstrip(".")


def math_answer(solution_str: str, ground_truth: str) -> dict:
    """The last \\boxed{} answer compared with the ground truth after light LaTeX normalisation,
    or numerically when both parse as numbers."""
    pred = last_boxed(solution_str)
    if pred is None:
        return {"score": 0.0, "pred": None}
    same = _normalize_latex(pred) == _normalize_latex(str(ground_truth)) or _numbers_equal(
        _normalize_latex(pred), _normalize_latex(str(ground_truth))
    )
    return {"score": float(same), "pred": pred}


SCORERS: dict[str, Callable[[str, Any], dict]] = {
    "openai/gsm8k": gsm8k,
    "gsm8k": gsm8k,
    "arithmetic": arithmetic,
    "countdown": countdown,
    "math": math_answer,
    "lighteval/MATH": math_answer,
    "DigitalLearningGmbH/MATH-lighteval": math_answer,
    "HuggingFaceH4/MATH-500": math_answer,
}


class UnknownDataSource(KeyError):
    pass


def compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
) -> dict:
    """The built-in scorer for `data_source`."""
    scorer = SCORERS.get(data_source)
    if scorer is None:
        raise UnknownDataSource(
            f"no reward scorer for data_source {data_source!r}; built-in sources: {', '.join(SCORERS)} "
            "(or set reward.custom_function_path)"
        )
    return scorer(solution_str, ground_truth)
