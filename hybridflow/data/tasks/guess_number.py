"""Built-in task: guess the number, played against the `guess_number` environment (higher / lower).
The ground truth is the secret number; the environment rewards the right guess."""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = (
    "I am thinking of a whole number from 1 to {high}. Guess it: after each guess I say Higher or "
    "Lower. Reply with just your guess."
)


@dataclass
class GuessNumberSpec:
    high: int = 100
    instruction: str = INSTRUCTION

    def __post_init__(self) -> None:
        if self.high < 2:
            raise ValueError("high must be >= 2")


def make_rows(
    count: int, *, seed: int, split: str, spec: GuessNumberSpec, exclude: set[str] = frozenset()
) -> list[dict]:
    """`count` games; a secret may repeat (there are only `high`), each row is its own game."""
    rng = random.Random(f"guess-number-{seed}-{split}")
    rows = []
    for i in range(count):
        secret = rng.randint(1, spec.high)
        rows.append(
            {
                "data_source": "guess_number",
                "prompt": [{"role": "user", "content": spec.instruction.format(high=spec.high)}],
                "ability": "game",
                "reward_model": {"style": "environment", "ground_truth": str(secret)},
                "extra_info": {"split": split, "index": i, "game": f"{split}-{i}"},
            }
        )
    return rows
