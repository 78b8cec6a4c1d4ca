"""Progress bars: the trainer's bar over steps, and transient bars under it for the long phases
(generation, the actor update). Drawn only on a terminal: logs, pipes and Ray workers get none."""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int | None, desc: str, *, enabled: bool, inner: bool = False, initial: int = 0,
        unit: str = "it") -> tqdm:  # fmt: skip
    """`inner`: a bar that disappears when done, below the step bar."""
    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        unit=unit,
        leave=not inner,
        dynamic_ncols=True,
        disable=not (enabled and sys.stderr.isatty()),
    )
