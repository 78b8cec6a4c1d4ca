"""Format rewards: a required structure, composable with any correctness scorer."""

from __future__ import annotations

import re

THINK_THEN_ANSWER = re.compile(r"^\s*<think>.+?</think>\s*\S", re.DOTALL)


def score(solution_str: str, pattern: str = "think") -> float:
    """1.0 when the response has the structure: 'think' = <think>...</think> followed by an answer,
    anything else is a regular expression that must match from the start (re.DOTALL)."""
    regex = THINK_THEN_ANSWER if pattern == "think" else re.compile(pattern, re.DOTALL)
    return 1.0 if regex.match(solution_str) else 0.0
