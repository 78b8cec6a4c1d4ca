"""The advantage estimators by name, each with what it needs from the rest of the step: a critic's
values (GAE), the reward of a greedy response per prompt (ReMax), or only the scores. The controller,
the worker and the memory planner ask the estimator instead of checking its name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridflow.algorithms import advantages as adv


@dataclass(frozen=True)
class StepInputs:
    token_rewards: torch.Tensor  # [B, T]: the score on the last sampled token, minus any KL penalty
    mask: torch.Tensor  # [B, T]: 1 on the tokens the policy sampled
    group_ids: adv.Groups  # [B]: samples of one prompt share an id
    values: torch.Tensor | None = None  # [B, T]: the critic's, where the estimator needs them
    baselines: torch.Tensor | None = None  # [B]: the greedy response's reward (ReMax)

    @property
    def scores(self) -> torch.Tensor:
        """The sequence total of token rewards [B] (outcome estimators)."""
        return (self.token_rewards * self.mask).sum(-1)


@dataclass(frozen=True)
class Estimator:
    compute: Callable[[StepInputs, object], tuple[torch.Tensor, torch.Tensor]]
    """(inputs, algorithm config: gamma, lam, norm_adv_by_std_in_grpo) -> (advantages, returns) [B, T]."""
    needs_critic: bool = False
    needs_greedy_baseline: bool = False


def _grouped(fn):
    return lambda i, c: fn(i.scores, i.group_ids, i.mask)


ESTIMATORS: dict[str, Estimator] = {
    "gae": Estimator(lambda i, c: adv.gae(i.token_rewards, i.values, i.mask, gamma=c.gamma, lam=c.lam),
                     needs_critic=True),
    "grpo": Estimator(lambda i, c: adv.grpo(i.scores, i.group_ids, i.mask, norm_by_std=c.norm_adv_by_std_in_grpo)),
    "grpo_passk": Estimator(
        lambda i, c: adv.grpo_passk(i.scores, i.group_ids, i.mask, norm_by_std=c.norm_adv_by_std_in_grpo)
    ),
    "rloo": Estimator(_grouped(adv.rloo)),
    "opo": Estimator(_grouped(adv.opo)),
    "gpg": Estimator(_grouped(adv.gpg)),
    "reinforce_plus_plus": Estimator(lambda i, c: adv.reinforce_plus_plus(i.token_rewards, i.mask, gamma=c.gamma)),
    "reinforce_plus_plus_baseline": Estimator(_grouped(adv.reinforce_plus_plus_baseline)),
    "remax": Estimator(lambda i, c: adv.remax(i.token_rewards, i.baselines, i.mask), needs_greedy_baseline=True),
}  # fmt: skip


def estimator(name: str) -> Estimator:
    """The estimator `algorithm.adv_estimator` names."""
    if name not in ESTIMATORS:
        from hybridflow.errors import UserError, closest

        raise UserError(f"config algorithm.adv_estimator={name!r} is unknown{closest(name, ESTIMATORS)}; "
                        f"choose one of {', '.join(ESTIMATORS)}")  # fmt: skip
    return ESTIMATORS[name]
