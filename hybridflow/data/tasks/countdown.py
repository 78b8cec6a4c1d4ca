"""Built-in task: countdown — combine the given numbers with + - * / to reach the target.

Every instance is solvable by construction. Ground truth: {'target': int, 'numbers': [int, ...]}.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

INSTRUCTION = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number must be used exactly once. Show your reasoning in "
    "<think> </think> tags and give the final equation in <answer> </answer> tags, "
    "for example <answer> (1 + 2) / 3 </answer>."
)


@dataclass
class CountdownSpec:
    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 99
    max_target: int = 100

    def __post_init__(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers:
            raise ValueError("need 2 <= min_numbers <= max_numbers")


def _combine(rng: random.Random, values: list[tuple[Fraction, str]]) -> tuple[Fraction, str]:
    """Randomly fold the values into one expression tree, keeping each intermediate exact."""
    values = list(values)
    while len(values) > 1:
        (a, ea), (b, eb) = values.pop(rng.randrange(len(values))), values.pop(rng.randrange(len(values)))
        choices = [(a + b, f"({ea} + {eb})"), (a - b, f"({ea} - {eb})"), (a * b, f"({ea} * {eb})")]
        if b != 0:
            choices.append((a / b, f"({ea} / {eb})"))
        values.append(rng.choice(choices))
    return values[0]


def make_rows(
    count: int, *, seed: int, split: str, spec: CountdownSpec, exclude: set[str] = frozenset()
) -> list[dict]:
    rng = random.Random(f"countdown-{seed}-{split}")
    rows, seen, attempts = [], set(exclude), 0
    while len(rows) < count:
        attempts += 1
        if attempts > 100 * count + 10_000:
            raise ValueError(
                f"could not find {count} distinct {split} problems with these options; ask for fewer"
            )
        numbers = [
            rng.randint(1, spec.max_number) for _ in range(rng.randint(spec.min_numbers, spec.max_numbers))
        ]
        value, expression = _combine(rng, [(Fraction(n), str(n)) for n in numbers])
        if value.denominator != 1 or not 1 <= value <= spec.max_target:
            continue
        key = f"{sorted(numbers)}->{value}"
        if key in seen:
            continue
        seen.add(key)
        target = int(value)
        rows.append(
            {
                "data_source": "countdown",
                "prompt": [{"role": "user", "content": INSTRUCTION.format(numbers=numbers, target=target)}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": {"target": target, "numbers": numbers}},
                "extra_info": {"split": split, "index": len(rows), "solution": expression[1:-1]},
            }
        )
    return rows
