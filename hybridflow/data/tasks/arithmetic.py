"""Built-in task: integer arithmetic expressions, with worked solutions for SFT.

Rows follow verl's schema; the ground truth is the value as a string, e.g. '42'.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = 'Compute the value. Give the final answer after "####".'
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass
class ArithmeticSpec:
    min_operands: int = 2
    max_operands: int = 2
    max_digits: int = 2
    operators: str = "+-"
    instruction: str = INSTRUCTION
    stop_early_fraction: float = 0.0
    """Fraction of worked solutions that stop after the first step and answer with its value, as a
    flawed teacher would: SFT data that is often wrong in one systematic way, which only a reward can
    correct (the problems and their ground truths are unchanged)."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_operands <= self.max_operands:
            raise ValueError("need 2 <= min_operands <= max_operands")
        if not self.operators or set(self.operators) - set(_APPLY):
            raise ValueError(f"operators must be a non-empty subset of {''.join(_APPLY)}")
        if self.max_digits < 1:
            raise ValueError("max_digits must be >= 1")
        if not 0.0 <= self.stop_early_fraction <= 1.0:
            raise ValueError(f"stop_early_fraction must be in [0, 1], got {self.stop_early_fraction}")


def solve_steps(numbers: list[int], ops: list[str]) -> tuple[int, list[str]]:
    """Evaluate with the usual precedence (* before + and -), one written step per operation."""
    nums, ops = list(numbers), list(ops)
    steps = []
    while ops:
        i = ops.index("*") if "*" in ops else 0
        a, b = nums[i], nums[i + 1]
        value = _APPLY[ops[i]](a, b)
        steps.append(f"{a} {ops[i]} {b} = {value}")
        nums[i : i + 2] = [value]
        del ops[i]
    return nums[0], steps


def make_problem(rng: random.Random, spec: ArithmeticSpec) -> tuple[str, int, list[str]]:
    """(expression, value, the worked solution's steps)."""
    count = rng.randint(spec.min_operands, spec.max_operands)
    numbers = [rng.randint(0, 10**spec.max_digits - 1) for _ in range(count)]
    ops = [rng.choice(spec.operators) for _ in range(count - 1)]
    expression = " ".join(x for pair in zip(map(str, numbers), ops + [""]) for x in pair).strip()
    value, steps = solve_steps(numbers, ops)
    return expression, value, steps


def written_solution(steps: list[str], stop_early: bool) -> str:
    """'47 + 83 = 130\n130 - 20 = 110\n#### 110'; stopping early, '47 + 83 = 130\n#### 130'."""
    shown = steps[:1] if stop_early else steps
    return "\n".join(shown) + f"\n#### {shown[-1].rsplit(' = ', 1)[1]}"


def make_rows(
    count: int, *, seed: int, split: str, spec: ArithmeticSpec, exclude: set[str] = frozenset()
) -> list[dict]:
    rng = random.Random(f"arithmetic-{seed}-{split}")
    flaw_rng = random.Random(f"arithmetic-flaw-{seed}-{split}")  # its own stream: problems stay the same
    rows, seen, attempts = [], set(exclude), 0
    while len(rows) < count:
        attempts += 1
        if attempts > 100 * count + 10_000:
            raise ValueError(
                f"could not find {count} distinct {split} problems with these options; ask for fewer"
            )
        expression, value, steps = make_problem(rng, spec)
        if expression in seen:
            continue
        seen.add(expression)
        stop_early = (
            len(steps) > 1 and spec.stop_early_fraction > 0 and flaw_rng.random() < spec.stop_early_fraction
        )
        rows.append(
            {
                "data_source": "arithmetic",
                "prompt": [{"role": "user", "content": f"{expression} = ?\n{spec.instruction}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(value)},
                "extra_info": {
                    "split": split,
                    "index": len(rows),
                    "expression": expression,
                    "solution": written_solution(steps, stop_early),
                },
            }
        )
    return rows
