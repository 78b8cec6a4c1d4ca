"""Built-in tools and environments, named in `rollout.agent.tools` / `rollout.agent.environment`."""

from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.Div: operator.truediv, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _value(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("powers are limited to exponents of 64 and bases of 10**6")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly (integers stay exact, however large).

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12345 * 678) - 9"
    """
    if len(expression) > 500:
        raise ValueError("the expression is longer than 500 characters")
    value = _value(ast.parse(expression.strip(), mode="eval").body)
    return str(value)


class GuessNumber:
    """Guess the number (the sample's ground truth) from 1 to `high`; the environment answers
    'higher' or 'lower'. Reward 1 for the right guess; the last number in a turn is its guess."""

    def __init__(self, high: int = 100) -> None:
        self.high = high

    def reset(self, sample) -> str | None:
        self.secret = int(sample.ground_truth)
        return None  # the prompt states the game

    def step(self, action: str) -> tuple[str | None, float, bool]:
        digits = "".join(c if c.isdigit() else " " for c in action).split()
        if not digits:
            return f"Answer with a number from 1 to {self.high}.", 0.0, False
        guess = int(digits[-1])
        if guess == self.secret:
            return None, 1.0, True
        return ("Higher." if guess < self.secret else "Lower."), 0.0, False


TOOLS = {"calculator": calculator, "python": None}
"""`python` is made per run (agents/code_tool.py): its sandbox limits come from the config."""
ENVIRONMENTS = {"guess_number": GuessNumber}
