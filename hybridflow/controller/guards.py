"""Default-on checks against training that runs to the end on wrong numbers. Each names what
disagreed and how to turn it off (trainer.guards.*):

- at an on-policy step the rollout engine's token probabilities and the trainer's agree within
  `max_probs_gap` (mean |p_rollout - p_trainer|): a sync that did not happen, another tokenizer or
  chat template on one side, or a numerics bug shows here first (an asynchronous run: over the
  tokens the training policy sampled itself; older policies' tokens differ by design);
- where the old log-probs are recomputed, the first mini-batch's ppo_kl is ~0 (the policy has not
  moved yet): `max_first_ppo_kl`;
- the rollout/trainer gap growing step after step (weights drifting apart slowly) is warned about
  once, with the step where it began;
- the weight-sync check (parallel/weight_check.py) after every sync;
- with rollout.exact_logprobs, a gap of exactly 0 on the tokens the training policy sampled (always on:
  it is what the setting promises).
"""

from __future__ import annotations

import logging
import statistics

from hybridflow.errors import UserError

log = logging.getLogger(__name__)
BASELINE_STEPS = 5
GROWTH = 3.0  # the gap this many times its first steps' median (and above NOISE) is growing
NOISE = 1e-3


class GuardTripped(UserError):
    """A check of the numbers failed: the run stops with one line (exit 2)."""


class TrainingGuards:
    def __init__(self, config, *, exact: bool = False) -> None:
        self.config = config
        self.exact = exact  # rollout.exact_logprobs: the gap must be 0
        self.gaps: list[tuple[int, float]] = []  # (step, mean gap)
        self.growth_from: int | None = None
        self.warned = False

    def check(self, step: int, metrics: dict[str, float]) -> None:
        g = self.config
        gap = metrics.get("training/rollout_probs_diff_mean")
        if metrics.get("async/staleness_max", 0.0) > 0:  # older policies' tokens: their drift is no bug
            gap = metrics.get("training/rollout_probs_diff_fresh_mean")  # None: every token was older
        if gap is not None and g.max_probs_gap > 0 and gap > g.max_probs_gap:
            raise GuardTripped(
                f"step {step}: the rollout engine's token probabilities differ from the trainer's by {gap:.4f} "
                f"on average (max {metrics.get('training/rollout_probs_diff_max', float('nan')):.3f}), above "
                f"trainer.guards.max_probs_gap={g.max_probs_gap:g}: the two sides are not running the same "
                "policy (weights not synced, another tokenizer or chat template, a numerics bug). "
                "trainer.guards.max_probs_gap=0 turns this check off"
            )
        if self.exact:
            self._check_exact(step, metrics)
        first_kl = metrics.get("training/first_minibatch_ppo_kl")
        if first_kl is not None and g.max_first_ppo_kl > 0 and abs(first_kl) > g.max_first_ppo_kl:
            raise GuardTripped(
                f"step {step}: the first mini-batch's ppo_kl is {first_kl:.4g}, above "
                f"trainer.guards.max_first_ppo_kl={g.max_first_ppo_kl:g}, before any update of this step: the "
                "recomputed old log-probs and the update's disagree (micro-batching, dtype or padding bug). "
                "trainer.guards.max_first_ppo_kl=0 turns this check off"
            )
        if gap is not None and g.gap_growth_warning:
            self._watch_growth(step, gap)

    @staticmethod
    def _check_exact(step: int, metrics: dict[str, float]) -> None:
        key = "training/rollout_probs_diff_max"
        if metrics.get("async/staleness_max", 0.0) > 0:  # the training policy's own tokens
            key = "training/rollout_probs_diff_fresh_max"
        top = metrics.get(key)
        if top is not None and top != 0:
            raise GuardTripped(
                f"step {step}: rollout.exact_logprobs=true, and the engine's token probabilities differ from the "
                f"trainer's by up to {top:.3g} ({key}) on tokens of the same weights: a computation outside the "
                "exact kernels ran on one side (please report it with the model); rollout.exact_logprobs=false "
                "trains with the gap measured and the old log-probs recomputed"
            )

    def _watch_growth(self, step: int, gap: float) -> None:
        self.gaps.append((step, gap))
        if len(self.gaps) <= BASELINE_STEPS or self.warned:
            return
        base = statistics.median(v for _, v in self.gaps[:BASELINE_STEPS])
        high = gap > max(GROWTH * base, NOISE)
        if not high:
            self.growth_from = None
            return
        self.growth_from = self.growth_from or step
        recent = [v for s, v in self.gaps if s >= self.growth_from]
        if len(recent) >= 3 and recent == sorted(recent):  # three steps up in a row, all high
            self.warned = True
            log.warning(
                "the rollout/trainer probability gap has grown from %.2g (the first %d steps' median) to %.2g "
                "since step %d: the engine's policy is drifting from the trainer's",
                base, BASELINE_STEPS, gap, self.growth_from,
            )  # fmt: skip
