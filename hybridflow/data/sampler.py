"""Deterministic prompt order with a resumable position."""

from __future__ import annotations

import random

from hybridflow.batch import Prompt
from hybridflow.errors import UserError


class PromptSampler:
    """Yields `prompts_per_step` prompts at a time; each epoch is a seeded permutation.

    The state is (epoch, position), so a resumed run draws exactly the prompts the uninterrupted run
    would have. An incomplete tail of an epoch is dropped (every step has the same size).
    """

    def __init__(
        self,
        prompts: list[Prompt],
        prompts_per_step: int,
        *,
        seed: int,
        shuffle: bool = True,
        setting: str = "data.prompts_per_step",
        what: str = "prompts",
    ) -> None:
        if prompts_per_step > len(prompts):
            raise UserError(
                f"{setting}={prompts_per_step} (verl: data.train_batch_size) exceeds the "
                f"{len(prompts)} training {what}"
            )
        self.prompts = prompts
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._cached_order: tuple[int, list[int]] | None = None

    @property
    def steps_per_epoch(self) -> int:
        return len(self.prompts) // self.prompts_per_step

    def _order(self, epoch: int) -> list[int]:
        """The epoch's permutation, drawn once per epoch (not per step: a million-row dataset's
        shuffle takes ~0.5 s)."""
        if self._cached_order is None or self._cached_order[0] != epoch:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(f"{self.seed}-epoch-{epoch}").shuffle(order)
            self._cached_order = (epoch, order)
        return self._cached_order[1]

    def next(self, count: int | None = None) -> list[Prompt]:
        count = count or self.prompts_per_step
        if self.position + count > len(self.prompts):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)
        picked = [self.prompts[i] for i in order[self.position : self.position + count]]
        self.position += count
        return picked

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
