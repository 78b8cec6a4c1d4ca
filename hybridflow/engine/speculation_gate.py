"""Whether the engine's next decode run speculates, from what speculating and not have measured in
this engine. A speculative step checks every running sequence's draft in one forward but ends with a
host round trip; a plain run takes up to `decode_steps` steps per look. Which advances the running
sequences faster depends on the device, the batch, the model and how often drafts are right (on an
H100 with a 1.5B model at temperature 1, 45% kept drafts made speculation 0.87-0.94x: docs/benchmarks.md),
so the gate measures both as the engine runs: the tokens a running sequence gains per second, a moving
average for each kind, and takes the faster; the other one of every `explore_every` runs keeps its
measure current (acceptance rises as a run's history grows)."""

from __future__ import annotations


class SpeculationGate:
    def __init__(self, explore_every: int = 16, smoothing: float = 0.25) -> None:
        if explore_every < 2 or not 0 < smoothing <= 1:
            raise ValueError("SpeculationGate: explore_every >= 2 and 0 < smoothing <= 1")
        self.explore_every, self.smoothing = explore_every, smoothing
        self.rate: dict[bool, float | None] = {True: None, False: None}  # speculative? -> tokens/s/sequence
        self._last: bool | None = None  # the kind chosen last, and how many times in a row
        self._streak = 0

    def speculate(self) -> bool:
        """Speculate in the next run? An unmeasured kind first (speculation before plain), then the
        faster, and the slower once after `explore_every - 1` of the faster in a row."""
        if self.rate[True] is None:
            choice = True
        elif self.rate[False] is None:
            choice = False
        else:
            choice = self.rate[True] >= self.rate[False]
            if self._last == choice and self._streak >= self.explore_every - 1:
                choice = not choice
        self._streak = self._streak + 1 if choice == self._last else 1
        self._last = choice
        return choice

    def observe(self, speculative: bool, seconds: float, tokens: int, sequences: int) -> None:
        """One run of that kind took `seconds` and gained `tokens` over `sequences` running sequences."""
        if sequences <= 0 or seconds <= 0:
            return
        rate = tokens / (seconds * sequences)
        before = self.rate[speculative]
        self.rate[speculative] = rate if before is None else before + self.smoothing * (rate - before)
