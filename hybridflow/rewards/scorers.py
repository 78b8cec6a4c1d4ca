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

from hybridflow.rewards import code as code_rewards
from hybridflow.rewards import format as format_rewards
from hybridflow.rewards import math as math_rewards
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


_GSM8K_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
_GSM8K_CLIP_CHARS = 300


def gsm8k(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    *,
    guards: bool = False,
) -> dict:
    """verl's GSM8K scorer exactly (verl/utils/reward_score/gsm8k.py): only the last 300 characters
    are read; strict takes the last '#### <digits . ,>' with ',' and '$' removed, flexible the last
    run of digits, '.' and ',' that is not '' or '.' (nothing removed). The answer must equal the
    ground truth as a string: '18.' or '18.00' against '18' scores `format_score`, as in verl. (One
    departure: a ground truth that is not a string is compared as str(), where verl would never
    match.) Guards (off by default, so scores equal verl's): several numbers after '####' earn
    nothing. `gsm8k_lenient` compares numbers instead."""
    if guards and "####" in solution_str and len(_NUMBER.findall(solution_str.rsplit("####", 1)[1])) > 1:
        return {"score": 0.0, "pred": None}
    tail = solution_str[-_GSM8K_CLIP_CHARS:]
    pred = None
    if method == "strict":
        matches = _GSM8K_STRICT.findall(tail)
        pred = matches[-1].replace(",", "").replace("$", "") if matches else None
    else:
        for candidate in reversed(_GSM8K_FLEXIBLE.findall(tail)):
            if candidate not in ("", "."):
                pred = candidate
                break
    if pred is None:
        return {"score": 0.0, "pred": None}
    truth = ground_truth if isinstance(ground_truth, str) else str(ground_truth)
    return {"score": float(score if pred == truth else format_score), "pred": pred}


def gsm8k_lenient(solution_str: str, ground_truth: str, *, guards: bool = False) -> dict:
    """GSM8K compared as numbers: the last '#### <number>' of the whole response, else its last
    number; '$', ',' and a final '.' dropped, so '18.', '18.00' and '$18' all equal 18 (data_source
    gsm8k_lenient; not verl's)."""
    if guards and "####" in solution_str and len(_NUMBER.findall(solution_str.rsplit("####", 1)[1])) > 1:
        return {"score": 0.0, "pred": None}
    tail = solution_str.rsplit("####", 1)[1] if "####" in solution_str else solution_str
    numbers = _NUMBER.findall(tail.replace("$", ""))
    pred = _clean_number(numbers[0] if "####" in solution_str else numbers[-1]) if numbers else None
    return {"score": float(_numbers_equal(pred, ground_truth)), "pred": pred}


def gsm8k_math_verify(solution_str: str, ground_truth: str, *, guards: bool = False) -> dict:
    """GSM8K checked leniently with math-verify, to tell a right answer in the wrong format from a
    wrong one (data_source gsm8k_math_verify; not verl's): the answer after the last '####', else the
    last \\boxed{}, else the response's last number; math-verify compares it with the reference
    ('18.00', '$18', '\\frac{36}{2}' all equal 18), the number comparison where it cannot parse."""
    if guards and "####" in solution_str and len(_NUMBER.findall(solution_str.rsplit("####", 1)[1])) > 1:
        return {"score": 0.0, "pred": None}
    if "####" in solution_str:
        pred = solution_str.rsplit("####", 1)[1].strip().split("\n")[0].strip()
    else:
        pred = last_boxed(solution_str)
        if pred is None:
            numbers = _NUMBER.findall(solution_str)
            pred = numbers[-1] if numbers else None
    if not pred:
        return {"score": 0.0, "pred": None}
    if _NUMBER.fullmatch(_clean_number(pred)):
        pred = _clean_number(pred)  # '$1,080.' -> '1080'
    verdict = math_rewards.verify(str(ground_truth).replace(",", ""), pred)
    if verdict is None:
        verdict = _numbers_equal(_clean_number(pred), ground_truth)
    return {"score": float(verdict), "pred": pred}


_CLAUSE_END = re.compile(r"\.\s|,\s|;|!|\?")
_ANSWER_SEPARATOR = re.compile(r"=|\bequals\b|\bis\b|:|\banswer\b", flags=re.IGNORECASE)


def _final_answer_numbers(text: str) -> list[str]:
    """The numbers of the final answer: after the last '####' if there is one; else on the last line
    that has a digit, those in the first clause after its last '=' / 'equals' / 'is' / ':' /
    'answer' ('9 + 2 equals 11' -> ['11'], 'is 13. When you add 7 to 6' -> ['13']), or, when nothing
    numeric follows that word, the line's own number when it has just one ('11 is the answer' ->
    ['11'], '0 + 4 = ?' -> none). Reasoning inside <think>...</think> is
    never the answer."""
    text = text.rsplit("</think>", 1)[-1]
    if "####" in text:
        return _NUMBER.findall(text.rsplit("####", 1)[1])
    lines = [line for line in text.splitlines() if any(ch.isdigit() for ch in line)]
    if not lines:
        return []
    last = lines[-1]
    # the answer is the first clause after the word: "is 13. When you add 7 to 6" -> "13"
    after = _NUMBER.findall(_CLAUSE_END.split(_ANSWER_SEPARATOR.split(last)[-1])[0])
    if after:
        return after
    numbers = _NUMBER.findall(last)
    return numbers if len(numbers) == 1 else []


def arithmetic(solution_str: str, ground_truth: str, *, guards: bool = True) -> dict:
    """The final answer (`_final_answer_numbers`) must be the ground truth. Guard: a final answer
    that lists several numbers ('7 or 8') earns nothing; without guards its last number counts."""
    numbers = _final_answer_numbers(solution_str)
    if not numbers or (guards and len(numbers) > 1):
        return {"score": 0.0, "pred": None}
    pred = _clean_number(numbers[-1])
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


def _math(solution_str: str, ground_truth: str, *, guards: bool = True) -> dict:
    return math_rewards.score(solution_str, ground_truth, guards=guards)


def _code(solution_str: str, ground_truth, *, guards: bool = True, **options) -> dict:
    return code_rewards.score(solution_str, ground_truth, **options)


def _countdown(solution_str: str, ground_truth: dict, *, guards: bool = True) -> dict:
    return countdown(solution_str, ground_truth)


# data_source -> (scorer, guards on by default)
SCORERS: dict[str, tuple[Callable[..., dict], bool]] = {
    "openai/gsm8k": (gsm8k, False),
    "gsm8k": (gsm8k, False),
    "gsm8k_lenient": (gsm8k_lenient, False),
    "gsm8k_math_verify": (gsm8k_math_verify, False),
    "arithmetic": (arithmetic, True),
    "countdown": (_countdown, True),
    "math": (_math, True),
    "lighteval/MATH": (_math, True),
    "DigitalLearningGmbH/MATH-lighteval": (_math, True),
    "HuggingFaceH4/MATH-500": (_math, True),
    "code": (_code, True),
}


class UnknownDataSource(KeyError):
    pass


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    guards: bool | None = None,
    max_response_chars: int = 20_000,
    format_pattern: str | None = None,
    format_weight: float = 0.0,
    code_options: dict | None = None,
) -> dict:
    """The built-in scorer for `data_source` -> {'score', 'pred', ...}.

    `guards` (None: the source's default) also withholds the score from responses longer than
    `max_response_chars`. With `format_weight`, score = correctness + format_weight * format(pattern)."""
    if data_source not in SCORERS:
        raise UnknownDataSource(
            f"no reward scorer for data_source {data_source!r}; built-in sources: {', '.join(SCORERS)} "
            "(or set reward.custom_function_path)"
        )
    scorer, default_guards = SCORERS[data_source]
    guards = default_guards if guards is None else guards
    if guards and len(solution_str) > max_response_chars:
        result = {"score": 0.0, "pred": None}
    elif scorer is _code:
        result = scorer(solution_str, ground_truth, guards=guards, **(code_options or {}))
    else:
        result = scorer(solution_str, ground_truth, guards=guards)
    # acc: correctness alone (validation's accuracy): no partial credit for a well-formed wrong answer
    partial_credit = scorer in (gsm8k, _countdown)
    result = {**result, "acc": float(result["score"] == 1.0) if partial_credit else float(result["score"])}
    if format_weight:
        fmt = format_rewards.score(solution_str, format_pattern or "think")
        result = {**result, "score": result["score"] + format_weight * fmt, "format": fmt}
    return result
