"""A run whose numbers blew up stops with one line naming the last good checkpoint: a step whose
every update was skipped (non-finite loss or gradient) counts, MAX_BAD_STEPS in a row stop the run;
non-finite logits stop it at once."""

from __future__ import annotations

import logging
from pathlib import Path

from hybridflow.errors import UserError

log = logging.getLogger(__name__)
MAX_BAD_STEPS = 3


class TrainingDiverged(UserError):
    pass


def count_bad_step(
    bad_steps: int, metrics: dict[str, float], *, updates: int, step: int, checkpoint: Path | None
) -> int:
    """The run of steps in a row whose `updates` updates were all skipped, after this step's
    `metrics` (training/nonfinite_steps is set); raises TrainingDiverged at MAX_BAD_STEPS."""
    if metrics.get("actor/skipped_updates", 0) >= updates:
        bad_steps += 1
        log.warning(
            "step %d: loss or gradient was not finite; the update was skipped (%d in a row)", step, bad_steps
        )
        if bad_steps >= MAX_BAD_STEPS:
            where = f"resume from {checkpoint}" if checkpoint else "no checkpoint was saved yet"
            raise TrainingDiverged(
                f"{MAX_BAD_STEPS} steps in a row had a non-finite loss or gradient (lower actor.optim.lr?); {where}"
            )
    else:
        bad_steps = 0
    metrics["training/nonfinite_steps"] = float(bad_steps)
    return bad_steps


def diverged(what: str, *, lr: float, checkpoint: Path | None) -> TrainingDiverged:
    where = f"last good checkpoint: {checkpoint}" if checkpoint else "no checkpoint was saved yet"
    return TrainingDiverged(f"{what}; the weights have blown up (actor.optim.lr={lr:g} too high?); {where}")
