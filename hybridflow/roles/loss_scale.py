"""Dynamic loss scaling for float16 compute (actor.compute_dtype=float16). float16 gradients flush
to zero below 2^-24 (about 6e-8), where bfloat16's range is float32's: an RL loss divided by a
mini-batch's tens of thousands of tokens puts many activation gradients there. The loss is
multiplied by `scale` before backward and the gradients divided by it before the step; a mini-batch
whose gradients overflow is taken again at half the scale (no data skipped: a step costs a whole
generation in RL), and GROWTH_INTERVAL updates in a row without overflow double it. bfloat16 and
float32 need none: the scale stays 1."""

from __future__ import annotations

import torch

INITIAL_SCALE = 2.0**16
GROWTH_INTERVAL = 200
MIN_SCALE = 1.0  # past it a non-finite gradient is the model's, not the scale's


class GradientOverflow(Exception):
    """The scaled gradients overflowed and the scale was halved: run the mini-batch again."""


class LossScale:
    def __init__(self, compute_dtype: str) -> None:
        """Enabled when the forward runs under float16 autocast (never for 'auto', which is bfloat16
        on CUDA and float32 elsewhere)."""
        self.enabled = compute_dtype == "float16"
        self.scale = INITIAL_SCALE if self.enabled else 1.0
        self.good_updates = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def unscale(self, parameters) -> None:
        """The gradients back to the loss's own size (in place, before the norm and the step)."""
        if self.enabled:
            for p in parameters:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scale)

    def overflowed(self) -> bool:
        """After a non-finite gradient norm: True when the scale was to blame and is now halved (the
        caller runs the mini-batch again); False when it cannot go lower (a real non-finite loss)."""
        if not self.enabled or self.scale <= MIN_SCALE:
            return False
        self.scale /= 2
        self.good_updates = 0
        return True

    def stepped(self) -> None:
        if self.enabled:
            self.good_updates += 1
            if self.good_updates >= GROWTH_INTERVAL:
                self.scale *= 2
                self.good_updates = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_updates": self.good_updates}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_updates = state["scale"], state["good_updates"]
