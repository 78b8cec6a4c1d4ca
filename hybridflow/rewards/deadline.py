"""The deadline of the reward call running in this process, so that work it starts (a sandboxed
program) ends with it: one deadline, not two that disagree."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

_deadline = math.inf


def remaining_s() -> float:
    return _deadline - time.monotonic()


@contextmanager
def scoring_deadline(seconds: float) -> Iterator[None]:
    """Within this block the reward call must end `seconds` from now (<= 0: no deadline)."""
    global _deadline
    before = _deadline
    _deadline = time.monotonic() + seconds if seconds > 0 else math.inf
    try:
        yield
    finally:
        _deadline = before
